"""Conversion of results to plain JSON types, shared by every writer of JSON reports."""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np

NonFinite = Literal["string", "null", "keep"]


def to_jsonable(x: Any, nonfinite: NonFinite = "string") -> Any:
    """``x`` with numpy arrays / scalars, enums and paths turned into plain JSON types.

    Non-finite floats (which strict JSON lacks): ``"string"`` -> ``"nan"``, ``"inf"``, ``"-inf"``;
    ``"null"`` -> ``None``; ``"keep"`` leaves them (``json.dumps`` then writes ``NaN``/``Infinity``).
    Dict keys become strings; tuples become lists.
    """
    if isinstance(x, dict):
        return {str(k): to_jsonable(v, nonfinite) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v, nonfinite) for v in x]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist(), nonfinite)
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        if math.isfinite(v) or nonfinite == "keep":
            return v
        if nonfinite == "null":
            return None
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, Path):
        return str(x)
    return x
