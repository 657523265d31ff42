"""How numbers are written in reports and summaries (one rule for every table mergeqp prints)."""

from __future__ import annotations

import math
from typing import Any


def format_number(x: Any, digits: int = 6) -> str:
    """A number in ``digits`` significant digits for reports and summaries (``None``: "-", text as it
    is, booleans "yes" / "no", NaN "nan")."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "nan"
    return f"{v:.{digits}g}"
