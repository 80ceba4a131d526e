"""Scoped statistics: :func:`~cupy_poolmem.statistics`, its :class:`Statistics` and
:class:`TagStatistics` (live views of the recorder's counters while a scope is open)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from .._errors import InvalidOptionError, OptionTypeError
from .._sizes import format_bytes
from .observer import KIND_NAMES, OBSERVER

_time = time.time


class _PlainCounts:
    """Counters without a recorder behind them (the recorder's ``Counts``' fields)."""

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_bytes = 0


class _PlainScope:
    """A scope's counters without a recorder behind them (the recorder's ``Scope``)."""

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_used_bytes = 0
        self.per_tag: dict[str, Any] = {}


def _field(name: str, doc: str, cls: str) -> Any:
    """A property reading and writing ``self._c.<name>`` (the live counters), documented
    by ``doc`` and an example that builds a ``cls`` with that field set."""

    def get(self: Any) -> int:
        return int(getattr(self._c, name))

    def set_(self: Any, value: int) -> None:
        setattr(self._c, name, value)

    example = f">>> {cls}({name}=3).{name}\n3\n"
    return property(get, set_, doc=f"{doc}\n\nExamples\n--------\n{example}")


class TagStatistics:
    """Counts for one tag inside a :func:`~cupy_poolmem.statistics` scope.

    Read live from the recorder's counters while the scope is open.

    Attributes
    ----------
    n_allocs, n_frees : int
        Allocations made with this tag in the scope, and frees of those allocations.
    total_bytes : int
        Bytes allocated with this tag in the scope.
    current_bytes, peak_bytes : int
        Bytes of this tag still live, now and at their high-water mark.

    Examples
    --------
    >>> t = cupy_poolmem.stats.TagStatistics(n_allocs=2, total_bytes=64)
    >>> t.n_allocs, t.peak_bytes
    (2, 0)
    """

    _FIELDS = ("n_allocs", "n_frees", "total_bytes", "current_bytes", "peak_bytes")
    __slots__ = ("_c",)

    n_allocs = _field("n_allocs", "Allocations with this tag.", "TagStatistics")
    n_frees = _field("n_frees", "Frees of those allocations.", "TagStatistics")
    total_bytes = _field("total_bytes", "Bytes allocated with this tag.", "TagStatistics")
    current_bytes = _field("current_bytes", "Bytes of this tag still live.", "TagStatistics")
    peak_bytes = _field("peak_bytes", "High-water mark of current_bytes.", "TagStatistics")

    def __init__(
        self,
        n_allocs: int = 0,
        n_frees: int = 0,
        total_bytes: int = 0,
        current_bytes: int = 0,
        peak_bytes: int = 0,
    ) -> None:
        c = _PlainCounts()
        c.n_allocs, c.n_frees, c.total_bytes = n_allocs, n_frees, total_bytes
        c.current_bytes, c.peak_bytes = current_bytes, peak_bytes
        self._c: Any = c

    @classmethod
    def _of(cls, counts: Any) -> TagStatistics:
        t = cls.__new__(cls)
        t._c = counts
        return t

    def _values(self) -> dict[str, int]:
        return {k: int(getattr(self._c, k)) for k in self._FIELDS}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TagStatistics):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "TagStatistics(" + ", ".join(f"{k}={v}" for k, v in self._values().items()) + ")"


class Statistics:
    """Counts and peaks of the allocations made inside one :func:`~cupy_poolmem.statistics` scope.

    The fields are updated live while the scope is active (they read the recorder's
    counters) and frozen when it ends.  Allocations from every thread and every pool of
    the process are counted (filtered by ``device`` / ``kind`` when the scope was
    opened with them).

    Attributes
    ----------
    n_allocs : int
        Allocations made inside the scope (size-0 allocations included, as in
        ``PoolStats.n_allocs``).
    n_frees : int
        Frees, made while the scope was active, of allocations made inside it.
    current_bytes : int
        Bytes allocated inside the scope and not yet freed.
    peak_used_bytes : int
        High-water mark of ``current_bytes``.
    total_bytes : int
        Sum of the sizes of all allocations made inside the scope.
    per_tag : dict of str to TagStatistics
        The same numbers per tag path (``""`` for untagged allocations).
    device, kind : int or str or None
        The filter the scope was opened with.
    start_time, end_time : float or None
        ``time.time()`` when the scope began and ended (``None`` while active).

    Examples
    --------
    >>> with cupy_poolmem.statistics() as st:
    ...     st.active, st.n_allocs
    (True, 0)
    >>> st.active
    False
    """

    n_allocs = _field("n_allocs", "Allocations made inside the scope.", "Statistics")
    n_frees = _field("n_frees", "Frees of allocations made inside the scope.", "Statistics")
    current_bytes = _field(
        "current_bytes", "Bytes allocated inside the scope, still live.", "Statistics"
    )
    peak_used_bytes = _field("peak_used_bytes", "High-water mark of current_bytes.", "Statistics")
    total_bytes = _field(
        "total_bytes", "Sum of the sizes allocated inside the scope.", "Statistics"
    )

    def __init__(
        self,
        n_allocs: int = 0,
        n_frees: int = 0,
        current_bytes: int = 0,
        peak_used_bytes: int = 0,
        total_bytes: int = 0,
        per_tag: dict[str, TagStatistics] | None = None,
        device: int | None = None,
        kind: str | None = None,
        start_time: float = 0.0,
        end_time: float | None = None,
    ) -> None:
        c = _PlainScope()
        c.n_allocs, c.n_frees, c.current_bytes = n_allocs, n_frees, current_bytes
        c.peak_used_bytes, c.total_bytes = peak_used_bytes, total_bytes
        c.per_tag = {k: v._c for k, v in (per_tag or {}).items()}
        self._c: Any = c  # the recorder's Scope while the scope is (or was) open
        self.device = device
        self.kind = kind
        self.start_time = start_time
        self.end_time = end_time

    @property
    def per_tag(self) -> dict[str, TagStatistics]:
        """The same numbers per tag path (``""`` for untagged allocations), live.

        Examples
        --------
        >>> with cupy_poolmem.statistics() as st:
        ...     pass
        >>> st.per_tag
        {}
        """
        return {k: TagStatistics._of(c) for k, c in dict(self._c.per_tag).items()}

    @property
    def active(self) -> bool:
        """``True`` while the scope is open.

        Examples
        --------
        >>> with cupy_poolmem.statistics() as st:
        ...     st.active
        True
        >>> st.active
        False
        """
        return self.end_time is None

    @property
    def elapsed(self) -> float:
        """Seconds from the start of the scope to its end (or to now while active).

        Examples
        --------
        >>> Statistics(start_time=10.0, end_time=12.5).elapsed
        2.5
        """
        return (self.end_time if self.end_time is not None else _time()) - self.start_time

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` (JSON-friendly) of the counters, ``per_tag`` included.

        Returns
        -------
        dict
            The counters, ``device``, ``kind`` and ``elapsed`` by name; ``per_tag``
            maps each tag path to its counters as a tuple.

        Examples
        --------
        >>> d = Statistics(n_allocs=2, total_bytes=4096).to_dict()
        >>> d["n_allocs"], d["total_bytes"], d["per_tag"]
        (2, 4096, {})
        """
        return {
            "n_allocs": self.n_allocs,
            "n_frees": self.n_frees,
            "current_bytes": self.current_bytes,
            "peak_used_bytes": self.peak_used_bytes,
            "total_bytes": self.total_bytes,
            "device": self.device,
            "kind": self.kind,
            "elapsed": self.elapsed,
            "per_tag": {k: v._values() for k, v in self.per_tag.items()},
        }

    def _values(self) -> tuple:
        return (
            self.n_allocs,
            self.n_frees,
            self.current_bytes,
            self.peak_used_bytes,
            self.total_bytes,
            self.per_tag,
            self.device,
            self.kind,
            self.start_time,
            self.end_time,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Statistics):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Statistics(n_allocs={self.n_allocs}, n_frees={self.n_frees}, "
            f"current_bytes={self.current_bytes}, peak_used_bytes={self.peak_used_bytes}, "
            f"total_bytes={self.total_bytes}, per_tag={self.per_tag!r}, "
            f"device={self.device!r}, kind={self.kind!r}, start_time={self.start_time!r}, "
            f"end_time={self.end_time!r})"
        )

    def __str__(self) -> str:
        lines = [
            f"{self.n_allocs} allocs, {self.n_frees} frees, "
            f"peak {format_bytes(self.peak_used_bytes)}, "
            f"current {format_bytes(self.current_bytes)}, "
            f"total {format_bytes(self.total_bytes)} in {self.elapsed:.3f} s"
        ]
        for name, t in sorted(self.per_tag.items(), key=lambda kv: -kv[1].peak_bytes):
            lines.append(
                f"  {name or '(untagged)'}: {t.n_allocs} allocs, peak "
                f"{format_bytes(t.peak_bytes)}, total {format_bytes(t.total_bytes)}"
            )
        return "\n".join(lines)


@contextlib.contextmanager
def statistics(*, device: int | None = None, kind: str | None = None) -> Iterator[Statistics]:
    """Count allocations, frees and the peak of live bytes inside a ``with`` block.

    Like ``rmm.statistics``: scopes nest, and each scope sees only the allocations
    made while it is open (an outer scope includes those of its inner scopes).  Counts
    are process-wide: allocations from all threads and all pools (device, pinned,
    managed) are included, unless ``device`` or ``kind`` narrow them.  A free is
    counted by a scope only for an allocation made inside that scope, so memory that
    was live before the scope began never makes ``current_bytes`` negative.

    While at least one scope is open the pools carry an observer, which counts in the
    hot path's own compiled code (about a hundred nanoseconds per allocation and free,
    see :doc:`observability`); once the last one closes, the hot path is back to zero
    cost.

    Parameters
    ----------
    device : int, optional
        Count only pools of this device ordinal (``-1``: pinned pools).
    kind : {"device", "pinned", "managed"}, optional
        Count only pools of this kind.

    Yields
    ------
    Statistics
        Live counters, frozen when the block exits.

    Examples
    --------
    >>> with cupy_poolmem.statistics() as st:  # doctest: +SKIP
    ...     with cupy_poolmem.tag("step"):
    ...         run_step()
    >>> print(st.peak_used_bytes, st.n_allocs, st.per_tag["step"].peak_bytes)  # doctest: +SKIP
    """
    if kind is not None and kind not in KIND_NAMES.values():
        raise InvalidOptionError(
            f"kind must be 'device', 'pinned', 'managed' or None; got {kind!r}"
        )
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        raise OptionTypeError(f"device must be an int ordinal or None; got {device!r}")
    st = Statistics(device=device, kind=kind, start_time=_time())
    OBSERVER.add_scope(st)
    try:
        yield st
    finally:
        OBSERVER.remove_scope(st)


def get_statistics() -> Statistics | None:
    """The innermost (most recently opened, still active) :func:`~cupy_poolmem.statistics` scope.

    Scopes are process-wide, so this may be a scope opened by another thread.

    Returns
    -------
    Statistics or None
        The scope, or ``None`` when no scope is open.

    Examples
    --------
    >>> with cupy_poolmem.statistics():
    ...     cupy_poolmem.get_statistics().n_allocs
    0
    >>> cupy_poolmem.get_statistics() is None
    True
    """
    scopes = OBSERVER.scopes
    return scopes[-1] if scopes else None
