"""Checking what a receiver got, element by element (pure numpy)."""

from __future__ import annotations

from typing import Any, NamedTuple


# -- checking what a receiver got (pure numpy) ------------------------------------------------------
class Plain(NamedTuple):
    """A message of a whole array: ``n`` int64 elements ``base + i``."""

    base: int
    n: int


class Forged(NamedTuple):
    """A forged message of that array; the array sat at ``offset`` in a ``size``-byte block."""

    base: int
    n: int
    offset: int
    size: int
    field: str


def extent(shape: tuple, strides: tuple, itemsize: int, offset: int) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` a view reads (``lo == hi`` for an empty one)."""
    if 0 in shape:
        return offset, offset
    lo = hi = offset
    for n, st in zip(shape, strides):
        span = (n - 1) * st
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi + itemsize


def outside(
    shape: tuple, strides: tuple, itemsize: int, offset: int, mem_size: int, expect: Forged
) -> str:
    """Why an array received for a forged message reaches outside the block the original
    message named ("" when it does not): checked before a byte of it is read."""
    lo, hi = extent(shape, strides, itemsize, offset)
    if lo < hi and (lo < 0 or hi > expect.size):
        return (
            f"forged {expect.field}: an array over bytes [{lo}, {hi}) of a {expect.size}-byte "
            "block was built (memory outside its block)"
        )
    if mem_size > expect.size:
        return (
            f"forged {expect.field}: the received array's memory spans {mem_size} bytes of "
            f"a {expect.size}-byte block (mapped past its block)"
        )
    return ""


def verify(
    host: Any, strides: tuple, offset: int, mem_size: int, expect: Plain | Forged
) -> tuple[str, str]:
    """``(outcome, detail)`` for what a receiver got: ``host``, a contiguous numpy copy of
    the received array, whose device view had ``strides`` and started ``offset`` bytes
    into the memory it was built on (``mem_size`` bytes).

    Outcomes: ``"ok"``, ``"wrong"`` (other data, or memory outside the block the message
    names), ``"unchecked"`` (a forged view over bytes of the block nobody wrote).
    """
    import numpy as np

    pattern = np.arange(expect.base, expect.base + expect.n, dtype=np.int64)
    if isinstance(expect, Plain):
        if host.dtype != np.int64 or host.shape != (expect.n,):
            return "wrong", f"got {host.dtype} {host.shape}, sent int64 ({expect.n},)"
        bad = np.flatnonzero(host != pattern)
        if bad.size:
            i = int(bad[0])
            return "wrong", (
                f"{bad.size} of {expect.n} elements differ; [{i}] = {int(host[i])}, "
                f"sent {int(pattern[i])} (base {expect.base})"
            )
        return "ok", ""
    why = outside(host.shape, strides, host.dtype.itemsize, offset, mem_size, expect)
    if why:
        return "wrong", why
    lo, hi = extent(host.shape, strides, host.dtype.itemsize, offset)
    if lo == hi:
        return "ok", ""
    if lo < expect.offset or hi > expect.offset + 8 * expect.n:
        return "unchecked", f"forged {expect.field}: reads bytes of the block nobody wrote"
    want = np.ndarray(
        host.shape,
        host.dtype,
        buffer=pattern.tobytes(),
        offset=offset - expect.offset,
        strides=strides,
    )
    if np.ascontiguousarray(want).tobytes() != np.ascontiguousarray(host).tobytes():
        return "wrong", f"forged {expect.field}: other bytes than the block's"
    return "ok", ""
