"""Lightning's own LightningCLI: AmpPrecision goes in `trainer.plugins` (see plugins.yaml).

torchrun --nproc-per-node=2 examples/cli/train_lightning_cli.py fit --config examples/cli/plugins.yaml
"""

from lightning.pytorch.cli import LightningCLI
from regression import RegressionData, Regressor

import lightning_ddp_amp  # noqa: F401  (registers "envddp")

if __name__ == "__main__":
    LightningCLI(Regressor, RegressionData, save_config_kwargs={"overwrite": True})
