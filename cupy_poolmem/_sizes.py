"""Parsing of byte sizes: ints, strings with units ("40GB", "512MiB") and fractions ("0.9")."""

from __future__ import annotations

import re

from ._errors import InvalidOptionError, OptionTypeError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(
    value: int | float | str,
    *,
    name: str = "size",
    total: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """Turn ``value`` into a number of bytes.

    Parameters
    ----------
    value : int, float or str
        An integer number of bytes; a string with a unit (``"40GB"``, ``"512MiB"``,
        ``"1.5 TB"``); or a fraction in ``(0, 1]`` of ``total`` (``0.9`` or ``"0.9"``),
        like dask-cuda's ``rmm_pool_size``.
    name : str
        The option's name, used in error messages.
    total : int, optional
        What a fraction is a fraction of (usually the device's memory).
    allow_none : bool
        Return ``None`` for ``None`` instead of raising.

    Returns
    -------
    int or None

    Raises
    ------
    OptionTypeError
        ``value`` is not an int, float or str.
    InvalidOptionError
        ``value`` is negative, unparsable, or a fraction with no ``total``.

    Examples
    --------
    >>> parse_bytes("40GB")
    40000000000
    >>> parse_bytes("2 GiB")
    2147483648
    >>> parse_bytes("0.5", total=1000)
    500
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise OptionTypeError(
            f"{name} must be an int number of bytes, a string such as '40GB', or a fraction "
            f"such as 0.9; got {value!r} of type {type(value).__name__}"
        )
    if isinstance(value, int):
        if value < 0:
            raise InvalidOptionError(f"{name} must be >= 0 bytes; got {value}")
        return value
    if isinstance(value, float):
        number, unit = value, None
    else:
        m = _RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidOptionError(
                f"{name}={value!r} is not a size; use bytes (1048576), a unit "
                "('40GB', '512MiB') or a fraction of device memory ('0.9')"
            )
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit == "" and number == int(number) and "." not in m.group(1) and number > 1:
            return int(number)
    if (
        unit in (None, "")
        and 0 < number <= 1
        and not (isinstance(value, str) and number == 1 and "." not in value)
    ):
        if total is None:
            raise InvalidOptionError(
                f"{name}={value!r} is a fraction, but there is no total to take it of; "
                "give a byte count such as '40GB'"
            )
        return int(number * total)
    if number < 0:
        raise InvalidOptionError(f"{name} must be >= 0 bytes; got {value!r}")
    if unit is None:
        raise InvalidOptionError(
            f"{name}={value!r}: a float must be a fraction in (0, 1]; use an int for bytes"
        )
    return int(number * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Format ``n`` bytes with a binary unit.

    Examples
    --------
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
