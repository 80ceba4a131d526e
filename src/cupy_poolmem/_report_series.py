"""Memory over time for ``report --plot``, in memory bounded by the picture, not the log.

A second pass over the log, after the summary: the summary gives the time range, the
tags worth a band of their own and the panels worth drawing, so one pass with a fixed
number of time buckets per panel is enough.  Each bucket keeps two moments: the one of
highest use (peaks survive thinning) and its last one (drops show).  A moment is the
time, the used and reserved bytes, and the live bytes of each band: the shown tags,
"other tags", and memory allocated before the log started.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._report_read import LogEvent, _tag_key

__all__ = ["PanelSeries", "sample_series"]


@dataclass
class PanelSeries:
    """The moments of one (pid, device), in time order: ``(time, used, reserved or
    None, bands)``."""

    key: tuple[int, int]
    moments: list[tuple[float, int, int | None, tuple[int, ...]]] = field(default_factory=list)


@dataclass
class _State:
    matched: int = 0
    shown: list[int] = field(default_factory=list)
    used: int | None = None  # the last ``used`` column seen
    reserved: int | None = None
    buckets: dict[int, list] = field(default_factory=dict)  # index -> [max, last]
    bucket: int | None = None  # the bucket of this panel's latest event


def sample_series(
    events: Iterable[LogEvent],
    keys: Sequence[tuple[int, int]],
    shown_tags: Sequence[str],
    t0: float,
    t1: float,
    *,
    n_buckets: int,
    tag_depth: int | None = None,
) -> list[PanelSeries]:
    """At most ``2 * n_buckets`` moments per panel ``keys``, from one pass over ``events``.

    Bands of a moment: the live bytes of each of ``shown_tags`` (in that order), of all
    other tags, and the used bytes beyond the matched allocations (memory allocated
    before the log started).  The matching is the summary's: by (pid, device, pointer)
    in time order; an allocation at a live pointer ends the earlier one.
    """
    tag_index = {tg: i for i, tg in enumerate(shown_tags)}
    n_shown = len(shown_tags)
    states = {k: _State(shown=[0] * n_shown) for k in keys}
    live: dict[tuple[int, int, int], tuple[int, int]] = {}  # -> (size, band index or -1)
    span = (t1 - t0) or 1.0
    last_bucket = n_buckets - 1

    for e in events:
        if e.op.startswith("guard:"):
            continue
        st = states.get((e.pid, e.device))
        if st is None:
            continue
        b = min(max(int((e.time - t0) / span * n_buckets), 0), last_bucket)
        if st.bucket is not None and b != st.bucket:
            # The panel leaves a bucket: freeze its last moment before this event
            # changes the state it refers to.
            left = st.buckets[st.bucket]
            left[1] = _freeze(left[1])
        st.bucket = b
        lkey = (e.pid, e.device, e.ptr)
        if e.op == "alloc":
            if e.ptr and e.size:
                prev = live.pop(lkey, None)
                if prev is not None:  # its free was not logged
                    _drop(st, prev)
                band = tag_index.get(_tag_key(e.tag, tag_depth), -1)
                live[lkey] = (e.size, band)
                st.matched += e.size
                if band >= 0:
                    st.shown[band] += e.size
        else:
            prev = live.pop(lkey, None)
            if prev is not None:
                _drop(st, prev)
        if e.used is not None:
            st.used = e.used
        if e.reserved is not None:
            st.reserved = e.reserved
        used = st.used if st.used is not None else st.matched
        m = (e.time, used, st.reserved, st)  # frozen when needed: bands copied then
        slot = st.buckets.get(b)
        if slot is None:
            st.buckets[b] = [_freeze(m), m]
        else:
            if used > slot[0][1]:
                slot[0] = _freeze(m)
            slot[1] = m

    out = []
    for k in keys:
        st = states[k]
        moments = []
        for b in sorted(st.buckets):
            mx, last = st.buckets[b]
            if last[3] is st:
                last = _freeze(last)
            moments.append(mx)
            if last != mx:
                moments.append(last)
        moments.sort(key=lambda m: m[0])
        out.append(PanelSeries(k, moments))
    return out


def _drop(st: _State, prev: tuple[int, int]) -> None:
    size, band = prev
    st.matched -= size
    if band >= 0:
        st.shown[band] -= size


def _freeze(m: tuple) -> tuple[float, int, int | None, tuple[int, ...]]:
    """A moment whose bands are copied now (``m[3]`` is the live state)."""
    t, used, reserved, st = m
    if not isinstance(st, _State):
        return m
    shown = tuple(st.shown)
    other = st.matched - sum(shown)
    before = max(used - st.matched, 0)
    return (t, used, reserved, (*shown, other, before))
