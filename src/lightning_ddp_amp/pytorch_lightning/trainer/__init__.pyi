# Generated from ../../trainer/__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""The Trainer door: EnvDDPStrategy and AmpPrecision as a Trainer takes them, and the LightningCLI drop-in."""
