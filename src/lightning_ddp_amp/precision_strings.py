"""apex's optimization levels and the precision strings this package adds to ``Trainer(precision=...)``.

Imports no Lightning, so that ``compare`` reads the strings as the precision plugin does.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

OptLevel = Literal["O0", "O1", "O2", "O3"]
OPT_LEVELS: tuple[OptLevel, ...] = get_args(OptLevel)

#: ``apex-O*``, ``amp-O*`` and ``native-O*``: the family (which backend it asks for) and the opt_level.
PRECISION_FLAG = re.compile(r"^(apex|amp|native)-(O[0-3])$")
