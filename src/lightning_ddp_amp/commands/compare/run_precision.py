"""The run's precision in place of the script's, for either front door: what ``Trainer(...)`` and ``Fabric(...)`` of
a compared run are built with (:mod:`~lightning_ddp_amp.commands.compare.patching`,
:mod:`~lightning_ddp_amp.commands.compare.fabric_patching`).

A precision string of Lightning's is handed over as it is; one of ours (``apex-O1``, ``native-O2``, ...) becomes the
door's AmpPrecision, carrying the settings of the script's own AmpPrecision where it had one; any precision plugin
the script passed is removed, since Lightning refuses a plugin and a precision at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lightning_ddp_amp.commands.compare.recording import Changes
from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.precision_strings import FLAG_BACKENDS, PRECISION_FLAG


@dataclasses.dataclass(frozen=True)
class Door:
    """What the precision replacement needs of a front door, the Trainer or Fabric.

    Args:
        name: ``"Trainer"`` or ``"Fabric"``, for messages.
        precision_base: The door's precision plugin base class: one found in ``plugins`` is removed.
        amp_precision: Returns the door's AmpPrecision class (looked up when a run needs it).
        kept: What the door's AmpPrecision takes from a script's own besides its AMP options (the Trainer's
            ``models``; nothing on Fabric, which is handed the models themselves).
    """

    name: str
    precision_base: type[Any]
    amp_precision: Callable[[], Any]
    kept: Callable[[Any], dict[str, Any]]


def replace_precision(
    given: dict[str, Any], precision: Any, plugins: list[Any], candidate: str, changes: Changes, door: Door
) -> None:
    """Give the Trainer or Fabric the ``candidate`` precision instead of the script's ``precision`` and precision
    plugins: a string of Lightning's as it is, one of ours as AmpPrecision, which carries the settings of the script's
    own.

    Args:
        given: The door's arguments, by name; ``precision`` and ``plugins`` are set in place.
        precision: The script's precision, as the door would have taken it.
        plugins: The script's plugins.
        candidate: The run's precision.
        changes: Where the changes are listed.
        door: The Trainer's or Fabric's classes.
    """
    if precision != candidate:  # the script's own precision is no change to list
        changes.replaced.append(f"precision={precision!r} -> {candidate!r}")
    removed = [plugin for plugin in plugins if isinstance(plugin, door.precision_base)]
    if removed:
        plugins = [plugin for plugin in plugins if plugin not in removed]
        changes.replaced.append(f"removed the precision plugin {', '.join(type(p).__name__ for p in removed)}")
    level = PRECISION_FLAG.match(candidate)
    if level is None:
        given["precision"] = candidate
    else:
        family, opt_level = level.groups()
        amp_precision = door.amp_precision()
        configured = next((plugin for plugin in removed if isinstance(plugin, amp_precision)), None)
        given["precision"] = None
        plugins.append(_amp_plugin(door, opt_level, FLAG_BACKENDS[family], configured, changes))
    if removed or level is not None:
        given["plugins"] = plugins


def _amp_plugin(door: Door, opt_level: str, backend: str, configured: Any, changes: Changes) -> Any:
    """The door's AmpPrecision at ``opt_level`` on ``backend``, with what the door keeps (the Trainer's models) and
    the AMP options of the script's own AmpPrecision (``configured``), if any."""
    amp_precision = door.amp_precision()
    if configured is None:
        return amp_precision(opt_level=opt_level, backend=backend)
    options, kept = configured.settings.options(), door.kept(configured)
    names = [*kept, "num_losses"]
    try:
        built = amp_precision(opt_level=opt_level, backend=backend, **kept, **options)
    except PrecisionConfigurationError as error:  # an option this level refuses (keep_batchnorm_fp32 under O1, ...)
        built = amp_precision(opt_level=opt_level, backend=backend, **kept, num_losses=options["num_losses"])
        changes.replaced.append(f"kept only {' and '.join(names)} of the script's AmpPrecision ({error})")
    else:
        changes.replaced.append(f"kept the script's AmpPrecision settings ({', '.join(names)}, loss scale, ...)")
    return built
