"""Parsing of human quantities: memory sizes ("40GiB", "80 GB", 1e9) and mesh shapes ("2x4")."""
from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> float | None:
    """``"40GiB"`` -> 42949672960.0; numbers pass through; ``None`` stays ``None``.

    Raises ``ValueError`` naming the text and the accepted forms.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"memory budget must be a positive number of bytes, got {value!r}")
        return float(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n > 0:
                return n
    raise ValueError(f"cannot read memory size {value!r}: use a number of bytes or a size such as "
                     f"'80GiB', '40GB', '512MiB'")


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x4"`` -> ``(2, 4)``; ``"8"`` -> ``(8,)``; ``"4x16x8"`` -> ``(4, 16, 8)`` (up to 4 axes).
    Raises ``ValueError`` with the accepted form."""
    if isinstance(text, str) and re.fullmatch(r"\s*\d+(\s*[xX,]\s*\d+){0,3}\s*", text):
        shape = tuple(int(x) for x in re.split(r"[xX,]", text.replace(" ", "")))
        if all(s >= 1 for s in shape):
            return shape
    raise ValueError(f"cannot read mesh {text!r}: use AxB for a 2D mesh (e.g. 2x4), N for a 1D mesh, "
                     f"up to 4 axes (4x16x8)")
