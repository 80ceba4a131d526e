"""Checks of the pools' options: sizes, booleans, small_pool and large_blocks."""

from __future__ import annotations

from typing import Any

from .. import _expandable
from .._errors import InvalidOptionError, InvalidSizeError, OptionTypeError
from .._sizes import format_bytes, parse_bytes

_UINT64_MAX = 2**64 - 1
#: DevicePool(small_pool="auto"): blocks up to this size come from a CUDA pool of their
#: own, when the pool has no max_size (see DevicePool's Notes).
SMALL_POOL_AUTO = 8 << 20
MAP_ABOVE_MIN = 2 << 20  # large_blocks="mapped": blocks up to this size stay pooled


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(f"{name} must be True or False; got {value!r}")
    return value


def raise_bad_size(size: Any, who: str) -> None:
    """The typed error for a size CuPy's ``size_t`` conversion refused."""
    import operator

    try:
        n = operator.index(size)
    except TypeError:
        raise OptionTypeError(
            f"{who}(size={size!r}): the size must be an integer number of bytes, not "
            f"{type(size).__name__}; pass int(nbytes)"
        ) from None
    what = "negative" if n < 0 else f"larger than {_UINT64_MAX:,} (size_t)"
    raise InvalidSizeError(
        f"{who}(size={n}): the size is {what}; pass the number of bytes to allocate, "
        "an integer >= 0"
    ) from None


def small_pool_size(value: Any, max_size: int) -> int:
    """Bytes of the largest block a DevicePool's small-block pool serves (0: none).

    Examples
    --------
    >>> small_pool_size("auto", max_size=0) == SMALL_POOL_AUTO
    True
    >>> small_pool_size("auto", max_size=1 << 30), small_pool_size(None, 0)
    (0, 0)
    >>> small_pool_size("1MiB", max_size=0)
    1048576
    """
    if isinstance(value, str) and value == "auto":
        return 0 if max_size else SMALL_POOL_AUTO
    size = parse_bytes(value, name="small_pool", allow_none=True) or 0
    if size and max_size:
        raise InvalidOptionError(
            f"small_pool={value!r} cannot be used with max_size={format_bytes(max_size)} "
            "(a second CUDA pool could exceed the cap); pass small_pool=None or 'auto' "
            "(which uses one CUDA pool there)"
        )
    return size


def large_blocks_mode(value: Any) -> str:
    """``large_blocks=value``, checked first: "pool", "mapped" or "expandable"."""
    if not isinstance(value, str):
        raise OptionTypeError(
            "large_blocks must be 'pool', 'mapped' or 'expandable'; got "
            f"{value!r} of type {type(value).__name__}"
        )
    if value not in ("pool", "mapped", "expandable"):
        raise InvalidOptionError(
            f"large_blocks={value!r} is not one of 'pool' (blocks from the CUDA pool), "
            "'mapped' (each large block mapped on memory of its own) or 'expandable' "
            "(every block placed in growing mapped ranges, one pair per stream)"
        )
    return value


def check_expandable(small_pool: Any, release_threshold: Any, max_size: Any) -> None:
    """Refuse the options ``large_blocks="expandable"`` has no use for."""
    for name, value, why in (
        ("max_size", max_size, "the cap is a CUDA pool's, and the ranges are not in one"),
        (
            "release_threshold",
            release_threshold,
            "the ranges keep freed memory mapped until trim() or an out-of-memory retry",
        ),
    ):
        if value is not None:
            raise InvalidOptionError(
                f"{name}={value!r} cannot be used with large_blocks='expandable': {why}. "
                f"Leave {name} unset, or use large_blocks='pool'"
            )
    if not (isinstance(small_pool, str) and small_pool == "auto"):
        raise InvalidOptionError(
            f"small_pool={small_pool!r} cannot be used with large_blocks='expandable': "
            f"blocks up to {format_bytes(_expandable.SMALL_MAX)} share a range of their "
            "own per stream. Leave small_pool='auto'"
        )


def mapped_threshold(small_pool: Any) -> int:
    """The largest block a mapped pool's CUDA pool serves: ``small_pool``'s size.

    Examples
    --------
    >>> mapped_threshold("auto") == SMALL_POOL_AUTO
    True
    >>> mapped_threshold("2MiB")
    2097152
    """
    if isinstance(small_pool, str) and small_pool == "auto":
        return SMALL_POOL_AUTO
    size = parse_bytes(small_pool, name="small_pool", allow_none=True) or 0
    if size < MAP_ABOVE_MIN:
        raise InvalidOptionError(
            f"small_pool={small_pool!r} is below {format_bytes(MAP_ABOVE_MIN)}, the "
            "smallest size large_blocks='mapped' maps above (each mapped block takes a "
            "2 MiB granule at least); pass small_pool='auto' (8 MiB) or a larger size"
        )
    return size
