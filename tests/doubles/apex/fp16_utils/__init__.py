"""TEST DOUBLE of ``apex/fp16_utils/__init__.py`` (see tests/doubles/README.md): only what ``apex.amp`` uses from it."""

from .fp16util import convert_module, convert_network, master_params_to_model_params

__all__ = ["convert_module", "convert_network", "master_params_to_model_params"]
