"""What a guard records of each allocation (its generation, state, streams, tag and
call sites), and the snapshots and events it hands out."""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from .._errors import GuardError
from .._observe.events import EVENTS
from .._observe.sites import SITES
from .._observe.tags import current_tag

LIVE = "live"
QUARANTINED = "quarantined"
FREED = "freed"

# One generation counter for the whole process: (pointer, generation) never repeats,
# and a generation alone names one allocation, whichever pool made it.
GENERATIONS = itertools.count(1)
_WEAKREF_FILE = weakref.__file__


# ----------------------------------------------------------------------------------------
# Blocks and events
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GuardedBlock:
    """A snapshot of one allocation the guard knows, as :func:`check` returns it.

    Attributes
    ----------
    ptr, size : int
        Address and size the program asked for (the red zone follows it).
    generation : int
        Unique to this allocation: an address handed out again gets a new one.
    state : {"live", "quarantined", "freed"}
    device : int
    stream : int
        Handle of the allocation stream.
    streams : tuple of int
        The allocation stream, then the streams given to ``record_stream``.
    tag : str
        Tag path at allocation (:func:`~cupy_poolmem.tag`), ``""`` if none.
    alloc_site, free_site : str or None
        ``file:line in function`` of the allocation and of the free.
    free_stream : int or None
        The stream current when it was freed.

    Examples
    --------
    >>> with cupy_poolmem.using(cupy_poolmem.DevicePool(guard=True)):  # doctest: +SKIP
    ...     x = cupy.zeros(1000)
    >>> block = cupy_poolmem.check(x)  # doctest: +SKIP
    >>> block.state, block.size  # doctest: +SKIP
    ('live', 8000)
    """

    ptr: int
    size: int
    generation: int
    state: str
    device: int
    stream: int
    streams: tuple[int, ...]
    tag: str
    alloc_site: str | None
    free_site: str | None
    free_stream: int | None

    def describe(self) -> str:
        """One line naming the block: address, size, generation and device.

        Returns
        -------
        str
            ``"block 0x7f... (4,096 bytes, generation 17, device 0)"``.

        Examples
        --------
        >>> b = GuardedBlock(0x7F00, 4096, 17, "live", 0, 0, (0,), "", None, None, None)
        >>> b.describe()
        'block 0x7f00 (4,096 bytes, generation 17, device 0)'
        """
        return (
            f"block 0x{self.ptr:x} ({self.size:,} bytes, generation {self.generation}, "
            f"device {self.device})"
        )


@dataclass(frozen=True)
class GuardEvent:
    """One report of the guard (kept in ``pool.guard.events``, written to the log).

    Attributes
    ----------
    kind : str
        As :attr:`GuardError.kind <cupy_poolmem.GuardError>`.
    time : float
        ``time.time()`` when it was found.
    error : GuardError
        The error raised (``mode="raise"``) or described by the warning.

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool(guard="warn")  # doctest: +SKIP
    >>> # ... a kernel writes into an array after it was freed ...
    >>> pool.guard.verify()  # doctest: +SKIP
    >>> event = pool.guard.events[-1]  # doctest: +SKIP
    >>> event.kind, type(event.error).__name__  # doctest: +SKIP
    ('use_after_free', 'UseAfterFreeError')
    """

    kind: str
    time: float
    error: GuardError = field(repr=False)

    @property
    def block(self) -> GuardedBlock | None:
        """The block concerned, when known.

        Examples
        --------
        >>> from cupy_poolmem import UseAfterFreeError
        >>> GuardEvent("use_after_free", 0.0, UseAfterFreeError("written after free")).block
        """
        return self.error.block

    @property
    def message(self) -> str:
        """The error's text.

        Examples
        --------
        >>> from cupy_poolmem import UseAfterFreeError
        >>> GuardEvent("use_after_free", 0.0, UseAfterFreeError("written after free")).message
        'written after free'
        """
        return str(self.error)


class Record:
    """The guard's mutable record of one allocation."""

    __slots__ = (
        "ptr",
        "size",
        "total",
        "generation",
        "state",
        "stream_ptr",
        "stream",
        "streams",
        "tag",
        "alloc_site",
        "free_site",
        "free_stream",
        "red_zone",
    )

    def __init__(
        self, ptr: int, size: int, total: int, gen: int, stream: Any, site: Any, tag: str
    ) -> None:
        self.ptr, self.size, self.total, self.generation = ptr, size, total, gen
        self.state = LIVE
        self.stream = stream
        self.stream_ptr = int(stream.ptr)
        self.streams: list[int] = [self.stream_ptr]
        self.tag = tag
        self.alloc_site: str | None = site
        self.free_site: str | None = None
        self.free_stream: int | None = None
        self.red_zone = total - size

    def contains(self, ptr: int) -> bool:
        return self.ptr <= ptr < self.ptr + max(self.size, 1)

    def snapshot(self, device: int) -> GuardedBlock:
        return GuardedBlock(
            ptr=self.ptr,
            size=self.size,
            generation=self.generation,
            state=self.state,
            device=device,
            stream=self.stream_ptr,
            streams=tuple(self.streams),
            tag=self.tag,
            alloc_site=self.alloc_site,
            free_site=self.free_site,
            free_stream=self.free_stream,
        )


def call_site() -> str | None:
    """The call site of the guard's caller: the first frame outside the packages that
    tracking skips (:func:`cupy_poolmem.track`'s list) and outside ``weakref``."""
    skip = SITES.prefixes()
    f: Any = sys._getframe(1)
    for _ in range(SITES.depth + 8):
        if f is None:
            return None
        fn = f.f_code.co_filename
        if not fn.startswith(skip) and fn != _WEAKREF_FILE:
            return f"{fn}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return None


def describe_site(site: str | None) -> str:
    """A call site as a report names it."""
    return site or "(unknown: no Python frame outside cupy_poolmem, CuPy and Numba)"


def tag_now() -> str:
    """The tag path of this thread ("" when untagged)."""
    return current_tag() or ""


def log_report(pool: Any, err: GuardError) -> None:
    """Write a ``guard:<kind>`` line to the allocation log (when one is open), through
    the event hook the observer installs."""
    b = err.block
    sites = ""
    if b is not None:
        sites = f"alloc {b.alloc_site or '?'}" + (f" | free {b.free_site}" if b.free_site else "")
    EVENTS.note(
        pool,
        f"guard:{err.kind}",
        b.ptr if b is not None else 0,
        b.size if b is not None else 0,
        b.stream if b is not None else 0,
        b.tag if b is not None else "",
        sites,
    )
