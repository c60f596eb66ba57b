"""apex's optimization levels and the precision strings this package adds to ``Trainer(precision=...)`` and
``Fabric(precision=...)``, and the refusal of a precision string that is neither Lightning's nor ours.

Imports no Lightning, so that ``compare`` reads the strings as the precision plugin does.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Any, Literal, get_args

from lightning_ddp_amp.errors import ApexUnavailableError, PrecisionConfigurationError, nearest

OptLevel = Literal["O0", "O1", "O2", "O3"]
OPT_LEVELS: tuple[OptLevel, ...] = get_args(OptLevel)

#: ``apex-O*``, ``amp-O*`` and ``native-O*``: the family (which backend it asks for) and the opt_level.
PRECISION_FLAG = re.compile(r"^(apex|amp|native)-(O[0-3])$")

#: The backend each family of the precision strings asks for.
FLAG_BACKENDS = {"apex": "apex", "amp": "auto", "native": "native"}

#: Every precision string this package adds, family by family: ``"apex-O0"`` ... ``"native-O3"``.
PRECISION_FLAGS: tuple[str, ...] = tuple(f"{family}-{level}" for family in FLAG_BACKENDS for level in OPT_LEVELS)

#: One of ours as it gets mistyped: in any case, ``0`` or ``o`` for the ``O``, ``_`` or nothing for the ``-``, and
#: any level (``"amp-o1"``, ``"apex-01"``, ``"apex_O1"``, ``"amp-O4"``): the family and the level's number.
_MISTYPED_FLAG = re.compile(r"(apex|amp|native)[-_]?[oO0](\d+)", re.IGNORECASE)


def nearest_precision(value: str, lightning_values: Iterable[str]) -> str | None:
    """The precision string ``value`` was most likely meant to be, or None when none is near.

    One of ours however it is mistyped (``"amp-o1"``, ``"apex-01"``, ``"apex_O1"``), with a level past apex's last
    taken as the last (``"amp-O4"`` is ``"amp-O3"``); otherwise the nearest of ours and Lightning's
    (:func:`~lightning_ddp_amp.errors.nearest`: ``"natve-O1"``, ``"16_mixed"``).

    Args:
        value: The precision as given.
        lightning_values: The strings Lightning accepts (:func:`lightning_ddp_amp._lightning.precision_values`).
    """
    mistyped = _MISTYPED_FLAG.fullmatch(value)
    if mistyped:
        level = min(int(mistyped.group(2)), len(OPT_LEVELS) - 1)
        return f"{mistyped.group(1).lower()}-{OPT_LEVELS[level]}"
    return nearest(value, (*PRECISION_FLAGS, *lightning_values))


def check_precision(
    value: object,
    lightning_values: Collection[str],
    *,
    field: str = "precision",
    unknown: str = "not a precision Lightning or lightning_ddp_amp knows",
) -> None:
    """Refuse a precision string that is neither Lightning's nor this package's, naming the nearest one and listing
    both. Any other value (one of those strings, an int, None, a plugin) passes, for Lightning to judge.

    Args:
        value: The precision as given.
        lightning_values: The strings Lightning accepts (:func:`lightning_ddp_amp._lightning.precision_values`).
        field: What the message calls the value.
        unknown: What the message says of a string that is no precision (one of ours past ``O3`` is told so).

    Raises:
        PrecisionConfigurationError: ``value`` is such a string.
    """
    if not isinstance(value, str) or PRECISION_FLAG.match(value) or value in lightning_values:
        return
    mistyped = _MISTYPED_FLAG.fullmatch(value)
    past_last = mistyped is not None and int(mistyped.group(2)) >= len(OPT_LEVELS)
    problem = f"apex's opt_levels are {OPT_LEVELS[0]} to {OPT_LEVELS[-1]}" if past_last else unknown
    ours = ", ".join(f"{family}-{OPT_LEVELS[0]} ... {family}-{OPT_LEVELS[-1]}" for family in FLAG_BACKENDS)
    listed = f"lightning_ddp_amp's {ours} and Lightning's {', '.join(lightning_values)}"
    near = nearest_precision(value, lightning_values)
    fix = f"did you mean {near!r}? The precisions are {listed}" if near else f"name one of {listed}"
    raise PrecisionConfigurationError(field, value, problem, fix)


def resolve_flag(
    precision: object,
    plugins: Any,
    plugin_class: type[Any],
    precision_base: type[Any],
    lightning_values: Collection[str],
) -> tuple[object, Any]:
    """Turn ``precision="apex-O1"`` / ``"amp-O1"`` / ``"native-O1"`` into a ``plugin_class`` (AmpPrecision) in
    ``plugins``, with ``backend="apex"``, ``"auto"`` or ``"native"``: Lightning validates precision strings against a
    fixed list. A string that is neither ours nor Lightning's is refused (:func:`check_precision`), so that the user
    learns ours exist; any other value is returned unchanged for Lightning to judge.

    Args:
        precision: The Trainer's or Fabric's ``precision``.
        plugins: Its ``plugins``.
        plugin_class: The front door's AmpPrecision.
        precision_base: The front door's precision plugin base class, to find one already in ``plugins``.
        lightning_values: The strings Lightning accepts (:func:`lightning_ddp_amp._lightning.precision_values`).

    Returns:
        The ``precision`` and ``plugins`` arguments to give Lightning.

    Raises:
        PrecisionConfigurationError: ``precision`` is a string neither Lightning nor this package knows, or
            ``plugins`` already holds a precision plugin.
        ApexUnavailableError: ``"apex-O*"`` and apex amp cannot be imported.
    """
    check_precision(precision, lightning_values)
    match = PRECISION_FLAG.match(precision) if isinstance(precision, str) else None
    if match is None:
        return precision, plugins
    given = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    for plugin in given:
        if isinstance(plugin, precision_base):
            raise PrecisionConfigurationError(
                "precision",
                precision,
                f"plugins also holds a precision plugin ({type(plugin).__name__})",
                "choose one: drop precision=... or the precision plugin from plugins",
            )
    family, level = match.groups()
    try:
        plugin = plugin_class(opt_level=level, backend=FLAG_BACKENDS[family])
    except ApexUnavailableError as error:
        raise ApexUnavailableError("precision", precision, error.problem, error.fix) from None
    return None, [*given, plugin]
