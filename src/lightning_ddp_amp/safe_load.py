"""Reading a checkpoint the user hands the package, without running the code its pickle may name.

``torch.load(weights_only=False)`` unpickles whatever the file says, and unpickling can call any function: a file
passed between teams or downloaded could run code on the machine that reads it. :func:`load_checkpoint` builds only
what classic and Lightning checkpoints hold: tensors, plain values (dicts, lists, numbers, strings, ``OrderedDict``)
and :data:`SAFE_GLOBALS`. A file that needs more is refused with a :class:`~lightning_ddp_amp.errors.CheckpointError`
naming what it needs, unless the caller says the file is trusted.

torch 2.5 and later read through torch's own weights-only unpickler, with :data:`SAFE_GLOBALS` allowed for the call
(``torch.serialization.safe_globals``). torch 2.1 to 2.4 cannot allow a class for one call (2.1 to 2.3 cannot build
one at all), so there the file is read with a pickle whose ``find_class`` allows only the same classes and functions:
torch's own weights-only list and :data:`SAFE_GLOBALS`. The same reader tells, on torch 2.5 and later, a file that
needs more than the allowlist from one that is damaged.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import functools
import pickle
from pathlib import Path
from typing import IO, Any

import torch

from lightning_ddp_amp.errors import CheckpointError

#: Beyond tensors and plain values: what classic checkpoints hold. apex-era scripts often saved their parsed
#: command line, ``{"args": args, ...}``.
SAFE_GLOBALS: tuple[type, ...] = (argparse.Namespace,)


def load_checkpoint(path: str | Path, *, field: str, opt_in: str, trusted: bool = False, mmap: bool = False) -> Any:
    """``torch.load(path, map_location="cpu")`` that runs no code from the file unless ``trusted``.

    Args:
        path: The file the user passed.
        field: How the user named it, for the message: ``"checkpoint"``, ``"--ckpt"``.
        opt_in: How the user says the file is trusted, for the message: ``"pass trusted=True"``.
        trusted: Read it as ``torch.load(weights_only=False)`` does, building whatever it names.
        mmap: Map the file's tensors instead of reading them (``torch.load(mmap=True)``).

    Raises:
        CheckpointError: The file names a class or function beyond the allowlist; nothing of it was built.
        FileNotFoundError, RuntimeError, EOFError, pickle.UnpicklingError, ...: As ``torch.load``, for a file that
            is missing or damaged.
    """
    if trusted:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
    if not hasattr(torch.serialization, "safe_globals"):  # torch 2.1 to 2.4
        try:
            return _restricted_load(path, mmap)
        except _Refused as refused:
            raise _refusal(path, field, opt_in, refused.name) from None
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError:
        try:
            _restricted_load(path, mmap)
        except _Refused as refused:
            raise _refusal(path, field, opt_in, refused.name) from None
        except Exception:  # damaged: torch's own error says how
            pass
        raise


def _refusal(path: str | Path, field: str, opt_in: str, name: str) -> CheckpointError:
    allowed = " or ".join(f"{kind.__module__}.{kind.__qualname__}" for kind in SAFE_GLOBALS)
    return CheckpointError(
        field,
        str(path),
        f"it names {name}, which is not a tensor, a plain value or {allowed}: unpickling it could run any code,"
        " so nothing of it was built",
        f"if you trust where the file comes from, {opt_in}; otherwise ask for a checkpoint of state_dicts and plain"
        " values",
    )


def _restricted_load(path: str | Path, mmap: bool) -> Any:
    return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False, pickle_module=_RestrictedPickle)


class _Refused(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@functools.cache
def _allowed() -> dict[str, Any]:
    # torch's own weights-only allowlist: the rebuild functions, dtypes and storages a tensor is pickled with. Private,
    # and the one list torch keeps of them, the same from 2.1 on.
    allowed = dict(torch._weights_only_unpickler._get_allowed_globals())
    allowed.update({f"{kind.__module__}.{kind.__qualname__}": kind for kind in SAFE_GLOBALS})
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Python's documented way to restrict unpickling: every class and function passes ``find_class``."""

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2, torch.save's, writes Python 2's names (__builtin__.exec); named as pickle.Unpickler reads them.
        module, name = _compat_pickle.NAME_MAPPING.get(
            (module, name), (_compat_pickle.IMPORT_MAPPING.get(module, module), name)
        )
        found = _allowed().get(f"{module}.{name}")
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


class _RestrictedPickle:
    """The ``pickle_module`` ``torch.load`` reads with: its ``Unpickler`` and ``load``, restricted."""

    Unpickler = _RestrictedUnpickler

    @staticmethod
    def load(file: IO[bytes], **kwargs: Any) -> Any:
        return _RestrictedUnpickler(file, **kwargs).load()
