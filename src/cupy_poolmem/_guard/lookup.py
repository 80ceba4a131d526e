""":func:`check`: whether a pointer still names a live allocation of a guarded pool."""

from __future__ import annotations

from typing import Any

from .._errors import InvalidOptionError, OptionTypeError, UsageError
from .guard import Guard
from .options import ENV
from .records import QUARANTINED, GuardedBlock
from .registry import GUARDS


# ----------------------------------------------------------------------------------------
# check()
# ----------------------------------------------------------------------------------------
def check(obj: Any, generation: int | None = None) -> GuardedBlock:
    """Assert that a pointer (or array) still names a live allocation of a guarded pool.

    Code that keeps raw pointers (``arr.data.ptr`` given to a C library, a DLPack or
    Numba consumer) records the generation once, then checks before each use: an
    address freed since, or handed out again to another allocation, raises
    :class:`~cupy_poolmem.UseAfterFreeError` naming both allocations and where the
    first was freed.  In ``mode="warn"`` it warns and returns the snapshot of the
    freed block instead.  Errors found earlier in destructors are raised first.

    Parameters
    ----------
    obj : cupy.ndarray, int, cupy.cuda.MemoryPointer or object with ``__cuda_array_interface__``
        The memory; an address may point inside a block.
    generation : int, optional
        The generation the pointer was taken from (``check(arr).generation``); without
        it, any live allocation at the address passes.

    Returns
    -------
    GuardedBlock
        The block the pointer is in.

    Raises
    ------
    UseAfterFreeError
        The allocation is gone (freed or quarantined), or the address now belongs
        to another generation.
    UsageError
        No guarded pool exists in this process.
    InvalidOptionError
        No guarded pool knows the address.

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
    >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
    ...     x = cupy.zeros(1000)
    >>> ptr, gen = x.data.ptr, cupy_poolmem.check(x).generation  # doctest: +SKIP
    >>> cupy_poolmem.check(ptr, gen).state  # doctest: +SKIP
    'live'
    >>> del x  # doctest: +SKIP
    >>> cupy_poolmem.check(ptr, gen)  # doctest: +SKIP
    Traceback (most recent call last):
    cupy_poolmem.UseAfterFreeError: cupy_poolmem guard: use after free: check(0x7f..., ...
    """
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)):
        raise OptionTypeError(f"generation must be an int or None; got {generation!r}")
    guard, ptr = _locate(obj, generation)
    return guard.check(ptr, generation)


def _rank(g: Guard, ptr: int, generation: int | None) -> tuple[int, int]:
    """How well guard ``g`` knows ``ptr``: (live 3 / quarantined 2 / remembered 1 / not 0,
    the generation found), so that the newest knowledge of an address wins."""
    rec = g._find_live(ptr)
    if rec is not None and (generation is None or rec.generation == generation):
        return 3, rec.generation
    dead = g._find_dead(ptr, generation)
    if dead is not None and generation is not None and dead.generation == generation:
        return 4, dead.generation  # the generation asked for: only one guard can have it
    if rec is not None:
        return 3, rec.generation
    if dead is not None:
        return (2 if dead.state == QUARANTINED else 1), dead.generation
    return 0, 0


def _locate(obj: Any, generation: int | None = None) -> tuple[Guard, int]:
    owner = None
    if isinstance(obj, bool):
        raise OptionTypeError(f"check() takes an array, a MemoryPointer or an int; got {obj!r}")
    if isinstance(obj, int):
        ptr = obj
    else:
        data = getattr(obj, "data", None)
        mem = getattr(data, "mem", None) if data is not None else getattr(obj, "mem", None)
        if mem is not None and hasattr(data if data is not None else obj, "ptr"):
            ptr = int((data if data is not None else obj).ptr)
            owner = getattr(mem, "_owner", None)
        elif hasattr(obj, "__cuda_array_interface__"):
            ptr = int(obj.__cuda_array_interface__["data"][0])
        else:
            raise OptionTypeError(
                "check() takes a cupy.ndarray, a cupy.cuda.MemoryPointer, an object with "
                f"__cuda_array_interface__ or an int address; got {type(obj).__name__}"
            )
    core = getattr(owner, "core", None)
    if core is not None:
        g = getattr(core, "guard", None)
        if g is None:
            raise UsageError(
                f"check(): this memory comes from {core!r}, which has no guard; create the "
                f"pool with guard=True (or set {ENV}=1) to check pointers"
            )
        return g, ptr
    guards = list(GUARDS.alive)
    if not guards:
        raise UsageError(
            "check(): no pool in this process has a guard; use DevicePool(guard=True), "
            f"cupy_poolmem.set_allocator(guard=True) or {ENV}=1"
        )
    # Several pools may have used an address over time: the guard that knows it best
    # (the generation asked for, live, quarantined, then the newest freed) answers.
    best = max(((_rank(g, ptr, generation), i) for i, g in enumerate(guards)), default=None)
    if best is not None and best[0][0] > 0:
        return guards[best[1]], ptr
    raise InvalidOptionError(
        f"check(0x{ptr:x}): no guarded pool has allocated this address (or freed it "
        "recently enough to remember); it is not memory from a guarded cupy_poolmem pool"
    )
