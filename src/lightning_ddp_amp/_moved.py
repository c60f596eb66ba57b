"""The old paths of the modules that moved into ``launch/``, ``ddp/``, ``amp/`` and ``compare/``.

Each old path is a file of its own that calls :func:`moved`: importing it warns once, naming the new path, and
hands out the moved module itself, so its names are the same objects and patching it patches the real module.
The package never imports an old path; only users' code from before the move does.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make the module ``old`` (being imported) the module ``new``, with a DeprecationWarning naming ``new``."""
    module = importlib.import_module(new)
    warnings.warn(
        f"{old} moved to {new}: import it from there. The old path still works, and will go in a later release.",
        DeprecationWarning,
        stacklevel=3,  # the import statement: warn() skips importlib's own frames
    )
    sys.modules[old] = module  # what the import statement that ran the old file hands out
