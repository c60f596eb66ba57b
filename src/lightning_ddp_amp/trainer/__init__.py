"""The Trainer door: EnvDDPStrategy and AmpPrecision as a Trainer takes them, and the LightningCLI drop-in."""
