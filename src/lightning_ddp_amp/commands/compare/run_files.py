"""Inside each run of ``lightning-ddp-amp compare``: the files the script writes go into the run's folder, so that the
runs of one comparison never overwrite, or read back, each other's.

* **Loggers**, on either door: a CSV or TensorBoard logger is built again, of the same class and name, writing into
  the run's ``logs/`` (:func:`redirected_logger`); any other logger cannot be pointed elsewhere and is turned off, by
  a logger of the door's kind that writes nothing (the Trainer's in
  :mod:`~lightning_ddp_amp.commands.compare.patching`, Fabric's here: :func:`turned_off_logger`).
* **``fabric.save`` / ``load`` / ``load_raw``**, on every Fabric of the run (:func:`redirect_saves`, shadowed on the
  instance): what the script saves at a path goes to the run's copy of that path (:func:`run_copy`): under
  ``files/`` for a path in the working directory, under ``files-absolute/`` for any other path or a URL. A load reads
  the run's copy where the run saved one, else the script's own path: a checkpoint handed to the script
  (``-- python train.py --resume PATH``) starts every run.

Each change is listed in the run's :class:`~lightning_ddp_amp.commands.compare.recorder.Changes`, as the Trainer's
are. The module imports no Lightning namespace: the door's classes are given.
"""

from __future__ import annotations

import inspect
import os
import posixpath
import re
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from lightning_ddp_amp.commands.compare.recorder import Changes
from lightning_ddp_amp.commands.compare.recording import shadow

#: Under the run's folder: its loggers' folder, and the copies of what the script saves inside the working directory
#: and anywhere else (an absolute path, one that climbs out with ``..``, a URL).
LOGS = "logs"
FILES = "files"
FILES_ABSOLUTE = "files-absolute"
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)


def logs_folder(directory: str) -> str:
    """Where the loggers of the run in ``directory`` write."""
    return os.path.join(directory, LOGS)


# -- loggers ---------------------------------------------------------------------------------------------------------


def redirected_logger(
    logger: Any, logs: str, changes: Changes, kinds: tuple[type[Any], ...], turned_off: Callable[[], Any]
) -> Any:
    """``logger`` writing into ``logs``, the change listed in ``changes``.

    Args:
        logger: One of the script's loggers.
        logs: The run's logs folder (:func:`logs_folder`).
        changes: Where the change is listed: ``replaced`` for a logger built again, ``turned_off`` for one turned off.
        kinds: The door's CSV and TensorBoard logger classes: a logger of one of them is built again in ``logs``.
        turned_off: Builds the door's logger that writes nothing, in place of any other.
    """
    rebuilt = _rebuilt(logger, logs, kinds)
    if rebuilt is not None:
        changes.replaced.append(f"{type(logger).__name__} writes to {logs!r}")
        return rebuilt
    changes.turned_off.append(type(logger).__name__)
    return turned_off()


def _rebuilt(logger: Any, logs: str, kinds: tuple[type[Any], ...]) -> Any | None:
    """A logger of ``kinds``, built again of the same class and name writing into ``logs``; None for a logger of
    another kind, or a subclass whose constructor takes other arguments.

    Its folder is the constructor's ``root_dir`` on Fabric's loggers and ``save_dir`` on ``lightning.pytorch``'s (which
    subclass Fabric's, so a Fabric script may pass either).
    """
    if not isinstance(logger, kinds):
        return None
    folder = "root_dir" if "root_dir" in inspect.signature(type(logger)).parameters else "save_dir"
    try:
        return type(logger)(**{folder: logs}, name=logger.name)
    except TypeError:
        return None


def redirect_fabric_loggers(given: dict[str, Any], loggers: Any, directory: str, changes: Changes) -> None:
    """Point the ``loggers`` argument of ``Fabric(...)`` (one logger or a list) into the run's logs folder.

    Args:
        given: The arguments the script passed to ``Fabric(...)``, by name; ``loggers`` is set in place.
        loggers: The loggers module of Fabric's namespace (``lightning.fabric.loggers`` or ``lightning_fabric.loggers``).
        directory: The run's folder.
        changes: Where the changes are listed.
    """
    script_loggers = given.get("loggers")
    if script_loggers is None:
        return
    logs = logs_folder(directory)
    listed = list(script_loggers) if isinstance(script_loggers, (list, tuple)) else [script_loggers]
    kinds = (loggers.CSVLogger, loggers.TensorBoardLogger)
    given["loggers"] = [
        redirected_logger(each, logs, changes, kinds, lambda: turned_off_logger(loggers.Logger, logs))
        for each in listed
    ]


class _Swallowed:
    """A turned-off logger's ``experiment``: any attribute, item or call of it is itself again, so a script's
    ``fabric.logger.experiment.log(...)`` runs and does nothing."""

    def __getattr__(self, name: str) -> _Swallowed:
        return self

    def __getitem__(self, key: Any) -> _Swallowed:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Swallowed:
        return self


class _TurnedOff:
    """What a turned-off Fabric logger does: nothing. Its folders are the run's logs folder, where a script that
    writes beside its logger (``fabric.logger.log_dir``) then writes."""

    def __init__(self, logs: str) -> None:
        self._logs = logs

    @property
    def name(self) -> str:
        return "turned_off"

    @property
    def version(self) -> int:
        return 0

    @property
    def root_dir(self) -> str:
        return self._logs

    @property
    def log_dir(self) -> str:
        return self._logs

    @property
    def experiment(self) -> _Swallowed:
        return _Swallowed()

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def turned_off_logger(logger_base: type[Any], logs: str) -> Any:
    """A logger of Fabric's ``logger_base`` (its ``Logger``) that writes nothing, its folders ``logs``."""
    return type("TurnedOffLogger", (_TurnedOff, logger_base), {})(logs)


# -- fabric.save / load / load_raw -----------------------------------------------------------------------------------


def run_copy(path: str | os.PathLike[str], directory: str) -> str | None:
    """Where the run in ``directory`` keeps what the script saves at ``path``; None for a path already in the run's
    folder.

    A path inside the working directory goes to ``files/<its path relative to the working directory>``; any other
    (absolute outside it, or climbing out with ``..``) to ``files-absolute/<its absolute path without the root>``; a
    URL ``scheme://rest`` to ``files-absolute/<scheme>/<rest>``.
    """
    text = os.fspath(path)
    url = _URL.fullmatch(text)
    if url is not None:
        scheme, rest = url.groups()
        return os.path.join(directory, FILES_ABSOLUTE, scheme, *_inside(rest))
    absolute = os.path.abspath(text)
    if _within(absolute, os.path.abspath(directory)):
        return None
    working = os.getcwd()
    if _within(absolute, working):
        return os.path.join(directory, FILES, os.path.relpath(absolute, working))
    return os.path.join(directory, FILES_ABSOLUTE, *PurePath(absolute).parts[1:])


def _within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _inside(rest: str) -> list[str]:
    """The parts of a URL's path, without any ``..`` that would climb out of the folder they are put in."""
    return [part for part in posixpath.normpath(f"/{rest}").split("/") if part]


def redirect_saves(fabric: Any, directory: str, changes: Changes) -> None:
    """Shadow ``fabric.save``, ``load`` and ``load_raw`` on this one Fabric: saves go to the run's copy of their path
    (:func:`run_copy`), its folders made; loads read the run's copy where the run saved one, else the path as given.

    The rule is listed in ``changes`` now, so that rank 0 says it with the other changes at the first setup; rank 0
    also lists each path saved, at its first save, for the record.

    Args:
        fabric: A Fabric of the run, just built.
        directory: The run's folder.
        changes: This Fabric's changes.
    """
    save, load, load_raw = fabric.save, fabric.load, fabric.load_raw
    listed: set[str] = set()
    changes.replaced.append(
        f"fabric.save(path) -> {os.path.join(directory, FILES)!r} for a path in the working directory, else"
        f" {os.path.join(directory, FILES_ABSOLUTE)!r}; fabric.load and load_raw read the run's copy where it saved one"
    )

    def save_in_run(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        copy = run_copy(path, directory)
        if copy is None:
            return save(path, *args, **kwargs)
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        text = os.fspath(path)
        if text not in listed and int(fabric.global_rank) == 0:
            listed.add(text)
            changes.replaced.append(f"fabric.save({text!r}) -> {copy!r}")
        return save(copy, *args, **kwargs)

    def read(path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        copy = run_copy(path, directory)
        return copy if copy is not None and os.path.exists(copy) else path

    def load_from_run(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        return load(read(path), *args, **kwargs)

    def load_raw_from_run(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        return load_raw(read(path), *args, **kwargs)

    shadow(fabric, "save", save_in_run)
    shadow(fabric, "load", load_from_run)
    shadow(fabric, "load_raw", load_raw_from_run)
