"""LightningCLI with this package's drop-in: `trainer.precision: apex-O1` in a YAML config just works.

torchrun --nproc-per-node=2 examples/cli/train.py fit --config examples/cli/amp_o1.yaml
"""

from regression import RegressionData, Regressor

from lightning_ddp_amp.trainer.cli import LightningCLI

if __name__ == "__main__":
    LightningCLI(Regressor, RegressionData, save_config_kwargs={"overwrite": True})
