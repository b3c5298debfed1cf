"""Byte quantities: parse ``"8GiB"``-style budgets and format byte counts for people."""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(-?\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "value") -> int:
    """Turn ``8GiB``, ``"512 MB"``, ``1.5e9`` or ``1024`` into a number of bytes.

    Args:
        value: an int/float count of bytes, or a string: a number followed by one of
            B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024); case-insensitive. A string
            needs its unit (``"24"`` is refused, "did you mean '24GiB'?": a budget typed as a bare number is never
            meant as bytes); give bytes as an int or with ``B``.
        name: the argument name used in error messages.

    Returns:
        The number of bytes, rounded down to an int.

    Raises:
        ValueError: the string does not parse, has no unit, or the value is negative.
        TypeError: ``value`` is neither a number nor a string.

    Example::

        >>> parse_bytes("8GiB")
        8589934592
        >>> parse_bytes("1.5 MB")
        1500000
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"`{name}` must be a byte count or a string like '8GiB', got {type(value).__name__}: {value!r}")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match is not None and not match.group(2) and not match.group(1).startswith("-"):
            raise ValueError(
                f"`{name}`={value!r} has no unit: did you mean '{value.strip()}GiB'? Give a size with its unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '24GiB' or '512MB'."
            )
        unit = match.group(2).lower() if match else None
        if (match is None or unit not in _UNITS) and not (match and match.group(1).startswith("-")):
            raise ValueError(
                f"`{name}`={value!r} is not a byte size. Use a number with a unit from "
                f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, e.g. '12GiB' or '512MB'."
            )
        number = float(match.group(1)) * _UNITS.get(unit, 1)
    else:
        number = float(value)
    if number < 0:
        raise ValueError(f"`{name}` must be >= 0 bytes, got {value!r}")
    return int(number)


def format_bytes(num_bytes: int | float) -> str:
    """Format a byte count with a binary unit, e.g. ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    sign = "-" if num_bytes < 0 else ""
    size = abs(float(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{sign}{size:.0f} {unit}" if unit == "B" else f"{sign}{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def describe_bytes(value: int | float | str, *, name: str = "value") -> str:
    """What a byte quantity was understood as, for a log line: ``"'24gb' = 24,000,000,000 B = 22.35 GiB"``.

    KB, MB, GB, TB are powers of 1000 (SI), KiB, MiB, GiB, TiB powers of 1024, so ``"24gb"`` is 22.35 GiB of
    GPU memory, not 24: saying so at once lets the user write ``"24GiB"`` if that was meant.

    Raises:
        ValueError, TypeError: as :func:`parse_bytes`.

    Example::

        >>> describe_bytes("24gb")
        "'24gb' = 24,000,000,000 B = 22.35 GiB"
        >>> describe_bytes(2**30)
        '1,073,741,824 B = 1.00 GiB'
    """
    num_bytes = parse_bytes(value, name=name)
    given = f"{value!r} = " if isinstance(value, str) else ""
    return f"{given}{num_bytes:,} B = {format_bytes(num_bytes)}"
