"""apex's optimization levels and the precision strings this package adds to ``Trainer(precision=...)`` and
``Fabric(precision=...)``.

Imports no Lightning, so that ``compare`` reads the strings as the precision plugin does.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from lightning_ddp_amp.errors import ApexUnavailableError, PrecisionConfigurationError

OptLevel = Literal["O0", "O1", "O2", "O3"]
OPT_LEVELS: tuple[OptLevel, ...] = get_args(OptLevel)

#: ``apex-O*``, ``amp-O*`` and ``native-O*``: the family (which backend it asks for) and the opt_level.
PRECISION_FLAG = re.compile(r"^(apex|amp|native)-(O[0-3])$")

#: The backend each family of the precision strings asks for.
FLAG_BACKENDS = {"apex": "apex", "amp": "auto", "native": "native"}


def resolve_flag(
    precision: object, plugins: Any, plugin_class: type[Any], precision_base: type[Any]
) -> tuple[object, Any]:
    """Turn ``precision="apex-O1"`` / ``"amp-O1"`` / ``"native-O1"`` into a ``plugin_class`` (AmpPrecision) in
    ``plugins``, with ``backend="apex"``, ``"auto"`` or ``"native"``: Lightning validates precision strings against a
    fixed list. Any other value, valid for Lightning or not, is returned unchanged for Lightning to judge.

    Args:
        precision: The Trainer's or Fabric's ``precision``.
        plugins: Its ``plugins``.
        plugin_class: The front door's AmpPrecision.
        precision_base: The front door's precision plugin base class, to find one already in ``plugins``.

    Returns:
        The ``precision`` and ``plugins`` arguments to give Lightning.

    Raises:
        PrecisionConfigurationError: ``plugins`` already holds a precision plugin.
        ApexUnavailableError: ``"apex-O*"`` and apex amp cannot be imported.
    """
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
