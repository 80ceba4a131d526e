"""Outstanding allocations: :func:`outstanding`, what it lists (:class:`Allocation`) and
the list it returns (:class:`Outstanding`)."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidOptionError, OptionTypeError
from .._sizes import format_bytes
from .observer import OBSERVER

_time = time.time


@dataclass(frozen=True)
class Allocation:
    """One live allocation, as returned by :func:`~cupy_poolmem.stats.outstanding`.

    Attributes
    ----------
    ptr : int
        Address of the allocation.
    size : int
        Size in bytes.
    tag : str or None
        Tag path when it was allocated (``None``: untagged).
    callsite : str or None
        ``"file:line in function"`` of the first frame outside cupy_poolmem and CuPy,
        when tracking was on (``None`` otherwise).
    age : float
        Seconds since it was allocated.
    device : int
        Device ordinal of its pool (``-1``: pinned).
    stream : int
        Handle of the stream it was allocated on.

    Examples
    --------
    >>> _ = cupy_poolmem.track(True)  # doctest: +SKIP
    >>> x = cupy.zeros(1 << 20)  # doctest: +SKIP
    >>> a = cupy_poolmem.stats.outstanding()[0]  # doctest: +SKIP
    >>> a.size, a.tag, a.callsite  # doctest: +SKIP
    (8388608, None, 'train.py:12 in <module>')
    """

    ptr: int
    size: int
    tag: str | None
    callsite: str | None
    age: float
    device: int
    stream: int

    def __str__(self) -> str:
        where = self.callsite or "(call site not tracked)"
        return (
            f"{format_bytes(self.size):>12}  {self.tag or '(untagged)'}  {where}  "
            f"age {self.age:.1f} s  ptr 0x{self.ptr:x}"
        )


class Outstanding(list):
    """The list :func:`~cupy_poolmem.stats.outstanding` returns, plus whether allocations were observed.

    Parameters
    ----------
    iterable : iterable of Allocation, optional
        The allocations, biggest first.

    Attributes
    ----------
    observed : bool
        ``False`` when no observer was active (the list is then empty by necessity).
    note : str
        Explanation shown by ``print`` when nothing could be listed.

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # "no allocations are being observed"
    ...     listed = cupy_poolmem.stats.outstanding()
    >>> listed.observed, len(listed)
    (False, 0)
    """

    observed: bool = True
    note: str = ""

    def __str__(self) -> str:
        if not self.observed:
            return self.note
        if not self:
            return "no live allocations observed"
        return "\n".join(str(a) for a in self)


_NOT_OBSERVED = (
    "no allocations are being observed, so none can be listed: call "
    "cupy_poolmem.track(True) (or open a statistics() scope or start_log()) "
    "before the allocations you want to see"
)


def outstanding(pool: Any = None, limit: int | None = 20) -> Outstanding:
    """Live allocations, biggest first, with their tags and (when tracked) call sites.

    Only allocations made while an observer was active are known: the observer is
    active while :func:`~cupy_poolmem.track` is on, a :func:`~cupy_poolmem.statistics` scope is open, or a log is
    being written.  Call sites are recorded only while tracking is on; other entries
    have ``callsite=None``.  When no observer is active at all, an empty list with
    ``observed=False`` is returned and a :class:`UserWarning` says why.

    Parameters
    ----------
    pool : Pool, optional
        Only this pool's allocations (``pool.outstanding()`` passes itself); default
        every pool.
    limit : int or None
        At most this many entries (``None``: all).

    Returns
    -------
    Outstanding
        A list of :class:`~cupy_poolmem.stats.Allocation`.

    Examples
    --------
    >>> cupy_poolmem.track(True)  # doctest: +SKIP
    >>> x = cupy.empty(1 << 30, dtype="u1")  # doctest: +SKIP
    >>> for a in pool.outstanding(limit=5):  # doctest: +SKIP
    ...     print(a.size, a.callsite)
    1073741824 train.py:42 in step
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise OptionTypeError(f"limit must be a non-negative int or None; got {limit!r}")
    if limit is not None and limit < 0:
        raise InvalidOptionError(f"limit must be a non-negative int or None; got {limit!r}")
    out = Outstanding()
    if not OBSERVER.active:
        out.observed = False
        out.note = _NOT_OBSERVED
        warnings.warn(_NOT_OBSERVED, UserWarning, stacklevel=2)
        return out
    now = _time()
    rec = OBSERVER.rec
    for info in rec.live(pool) if rec is not None else ():
        out.append(
            Allocation(
                ptr=info.ptr,
                size=info.size,
                tag=info.tag or None,
                callsite=info.callsite,
                age=max(0.0, now - info.time),
                device=info.device,
                stream=info.stream,
            )
        )
    out.sort(key=lambda a: (-a.size, a.ptr))
    if limit is not None:
        del out[limit:]
    return out
