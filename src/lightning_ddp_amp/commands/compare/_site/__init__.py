"""The folder ``lightning-ddp-amp compare`` puts first on each run's ``PYTHONPATH``: it holds only ``sitecustomize``."""
