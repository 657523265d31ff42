"""Conversion of results to plain JSON types, shared by every writer of JSON reports."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

NonFinite = Literal["string", "null", "keep"]


def to_jsonable(x: Any, nonfinite: NonFinite = "string", other: Literal["keep", "string"] = "keep") -> Any:
    """``x`` with numpy arrays / scalars, enums and paths turned into plain JSON types.

    Non-finite floats (which strict JSON lacks): ``"string"`` -> ``"nan"``, ``"inf"``, ``"-inf"``;
    ``"null"`` -> ``None``; ``"keep"`` leaves them (``json.dumps`` then writes ``NaN``/``Infinity``).
    Dict keys (also of other mappings) become strings; tuples become lists, sets sorted lists (in
    the order of their text where they do not sort). Any other object is left as it is
    (``other="keep"``) or written as its text (``"string"``: for a user's extras, such as a solver's
    ``info``, that must never stop a report from being written).
    """
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v, nonfinite, other) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v, nonfinite, other) for v in x]
    if isinstance(x, (set, frozenset)):
        try:
            items = sorted(x)
        except TypeError:
            items = sorted(x, key=repr)
        return [to_jsonable(v, nonfinite, other) for v in items]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist(), nonfinite, other)
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
    if other == "string" and not (x is None or isinstance(x, (str, int))):
        return str(x)
    return x
