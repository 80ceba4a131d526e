"""Byte sizes: one rule for every size option of the package.

* An ``int`` (or a numpy integer) is a number of bytes.
* A ``str`` is a number of bytes with an optional unit, read as dask's
  ``dask.utils.parse_bytes`` reads it: decimal units ``B``, ``kB``, ``MB``, ``GB``,
  ``TB``, ``PB`` (also ``k``, ``M``, ``G``...), binary units ``KiB``, ``MiB``,
  ``GiB``, ``TiB``, ``PiB`` (also ``Ki``, ``Mi``...), any case, spaces allowed:
  ``"40GB"``, ``"512 MiB"``, ``"1.5kB"``, ``"1e9"``.  Without a unit the number must
  be a whole number of bytes: ``"0.9"`` or ``"1.5"`` are errors, never 0 or 1 byte.
* A fraction of the device's memory is written explicitly: a ``float`` in ``(0, 1]``
  (``0.9``) or a percentage string (``"90%"``).  ``1`` and ``"1"`` are one byte;
  ``1.0`` and ``"100%"`` are the whole device.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Literal, overload

from ._errors import InvalidOptionError, OptionTypeError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 10 ** (3 * _i)
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 2 ** (10 * _i)

_NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?"
_SIZE_RE = re.compile(rf"^({_NUMBER})([a-zA-Z]*)$")
_PERCENT_RE = re.compile(rf"^({_NUMBER})%$")

#: The largest size: what fits in ``size_t`` (16 EiB).
_MAX_BYTES = 2**64 - 1
# A number whose decimal exponent is above this is far beyond _MAX_BYTES whatever its
# unit (PiB is 2**50 < 10**16): refused before it is turned into an exact fraction.
_MAX_EXPONENT = 40

_FORMS = (
    "use an int number of bytes (1048576), a string with a unit ('40GB', '512MiB'), "
    "or a fraction of the device's memory as a float (0.9) or a percentage ('90%')"
)


@overload
def parse_bytes(
    value: int | float | str,
    *,
    name: str = ...,
    total: int | None = ...,
    allow_none: Literal[False] = ...,
) -> int: ...
@overload
def parse_bytes(
    value: int | float | str | None,
    *,
    name: str = ...,
    total: int | None = ...,
    allow_none: bool = ...,
) -> int | None: ...
def parse_bytes(
    value: int | float | str | None,
    *,
    name: str = "size",
    total: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """Turn ``value`` into a number of bytes, by the package's one size rule.

    Parameters
    ----------
    value : int, float or str
        An ``int`` (or numpy integer): bytes.  A ``str``: bytes with an optional unit, as
        ``dask.utils.parse_bytes`` reads it (``"40GB"``, ``"512 MiB"``, ``"1.5kB"``);
        without a unit it must be a whole number (``"2048"``, ``"1e9"``).  A fraction
        of ``total``: a ``float`` in ``(0, 1]`` (``0.9``) or a percentage string
        (``"90%"``).
    name : str
        The option's name, used in error messages.
    total : int, optional
        What a fraction is a fraction of (usually the device's memory).
    allow_none : bool
        Return ``None`` for ``None`` instead of raising.

    Returns
    -------
    int or None
        The number of bytes; ``None`` only for ``None`` with ``allow_none=True``.

    Raises
    ------
    OptionTypeError
        ``value`` is not an int, float or str.
    InvalidOptionError
        ``value`` is negative, unparsable, a unitless string that is not a whole number
        of bytes, a float outside ``(0, 1]``, or a fraction with no ``total``.

    Examples
    --------
    >>> parse_bytes("40GB")
    40000000000
    >>> parse_bytes("2 GiB")
    2147483648
    >>> parse_bytes("1.5kB")
    1500
    >>> parse_bytes("1")
    1
    >>> parse_bytes(0.5, total=1000), parse_bytes("90%", total=1000)
    (500, 900)
    >>> parse_bytes("0.9")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    cupy_poolmem._errors.InvalidOptionError: size='0.9' is not a whole number of bytes ...
    """
    if value is None and allow_none:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        value = int(value)  # numpy's integers (np.prod(shape) * 4, arr.size * itemsize)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise OptionTypeError(
            f"{name} must be an int, float or str; got {value!r} of type "
            f"{type(value).__name__}: {_FORMS}"
        )
    if isinstance(value, int):
        if value < 0:
            raise InvalidOptionError(f"{name} must be >= 0 bytes; got {value}")
        return _check_max(value, value, name)
    if isinstance(value, float):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise InvalidOptionError(
                f"{name}={value!r}: a float is a fraction in (0, 1] of the device's memory; "
                f"for bytes use an int ({int(value) if math.isfinite(value) else 0}"
                ") or a string with a unit"
            )
        return _fraction(value, value, name, total)
    text = value.replace(" ", "").replace("_", "")
    m = _PERCENT_RE.match(text)
    if m:
        pct = Decimal(m.group(1))  # exact compare, whatever its exponent
        if not 0 < pct <= 100:
            raise InvalidOptionError(f"{name}={value!r}: a percentage must be in (0%, 100%]")
        return _fraction(float(pct) / 100, value, name, total)
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidOptionError(f"{name}={value!r} is not a size; {_FORMS}")
    number, unit = _exact(m.group(1), value, name), m.group(2).lower()
    if unit in ("", "b") and number.denominator != 1:
        raise InvalidOptionError(
            f"{name}={value!r} is not a whole number of bytes (a string without a unit "
            f"is bytes); for a fraction of the device's memory write "
            f"'{float(number) * 100:g}%' or the float {float(number)!r}"
        )
    return _check_max(int(number * _UNITS[unit]), value, name)


def _exact(digits: str, value: object, name: str) -> Fraction:
    """The exact value of a decimal number (``"12345678901234567891"``, ``"1.5"``,
    ``"1e9"``): a float would round integers above 2**53 to another number."""
    try:
        d = Decimal(digits)
    except InvalidOperation:  # an exponent beyond what Decimal holds
        raise InvalidOptionError(f"{name}={value!r} is not a size; {_FORMS}") from None
    if d and d.adjusted() > _MAX_EXPONENT:
        raise _too_large(value, name)
    if d and d.adjusted() < -_MAX_EXPONENT:  # "1e-999999999": not whole, 0 of any unit
        return Fraction(1, 10 ** (_MAX_EXPONENT + 1))
    return Fraction(d)


def _check_max(n: int, value: object, name: str) -> int:
    if n > _MAX_BYTES:
        raise _too_large(value, name)
    return n


def _too_large(value: object, name: str) -> InvalidOptionError:
    text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return InvalidOptionError(
        f"{name}={text} is too large: a size is at most 2**64 - 1 bytes (16 EiB); "
        "give a byte count such as '40GB'"
    )


def _fraction(frac: float, value: object, name: str, total: int | None) -> int:
    if total is None:
        raise InvalidOptionError(
            f"{name}={value!r} is a fraction, but there is no total to take it of; "
            "give a byte count such as '40GB'"
        )
    return int(frac * total)


def format_bytes(n: int) -> str:
    """Format ``n`` bytes with a binary unit.

    Parameters
    ----------
    n : int
        A number of bytes.

    Returns
    -------
    str
        ``"12 B"`` below 1 KiB, else two decimals and the largest binary unit that
        keeps the number at 1 or more.

    Examples
    --------
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    >>> format_bytes(12)
    '12 B'
    """
    for unit, scale in (
        ("EiB", 2**60),
        ("PiB", 2**50),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
