"""Plotting allocation logs (``report --plot``): used memory over time, stacked by tag,
in memory bounded by the picture, not the log."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._cli import printable
from .._errors import InvalidOptionError, LogFormatError, MissingDependencyError
from ..stats import LOG_COLUMNS  # noqa: F401  (the examples write logs with it)
from ._read import Loaded, LogEvent, load, tag_key
from ._summary import BEFORE_LOG, UNTAGGED, Summary, check_tag_depth, summarize_loaded

#: File suffixes :func:`plot` writes, and the format each one gets.
PLOT_FORMATS: dict[str, str] = {
    ".png": "png",
    ".pdf": "pdf",
    ".svg": "svg",
    ".svgz": "svgz",
    ".eps": "eps",
    ".ps": "ps",
    ".jpg": "jpeg",
    ".jpeg": "jpeg",
    ".webp": "webp",
}

OTHER_TAGS = "(other tags)"


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

    The pass after the summary, which gave the time range, the tags worth a band and
    the panels worth drawing.  Each time bucket keeps two moments: its highest use
    (peaks survive thinning) and its last one (drops show).

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
                band = tag_index.get(tag_key(e.tag, tag_depth), -1)
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


def plot_format(out: str | os.PathLike) -> str:
    """The format :func:`plot` writes ``out`` in, from its suffix (``.png``, ``.pdf``...).

    Parameters
    ----------
    out : str or os.PathLike
        The file the plot is to be written to.

    Returns
    -------
    str
        The format's name, lower case (``"png"``, ``"pdf"``, ``"svg"`` ...).

    Raises
    ------
    InvalidOptionError
        The suffix is missing or not one of :data:`PLOT_FORMATS`.

    Examples
    --------
    >>> plot_format("usage.PDF"), plot_format("usage.png")
    ('pdf', 'png')
    """
    suffix = os.path.splitext(os.fspath(out))[1].lower()
    fmt = PLOT_FORMATS.get(str(suffix))
    if fmt is None:
        raise InvalidOptionError(
            f"{os.fspath(out)!s}: cannot tell the picture format from the suffix "
            f"{suffix or '(none)'!s}; use one of {', '.join(PLOT_FORMATS)}"
        )
    return fmt


# ----------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------
def _need_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            "plotting an allocation log",
            str(exc),
            needs="matplotlib",
            install='pip install matplotlib (or "cupy_poolmem[plot]")',
        ) from None
    return Figure


def plot(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tag_depth: int | None = None,
    max_tags: int = 8,
    max_panels: int = 8,
    max_points: int = 20000,
    title: str | None = None,
) -> str:
    """Draw used memory over time, stacked by tag, with reserved memory as a line.

    One panel per (process, device), biggest peak first; time is in seconds since the
    first event of all logs.  The stacked areas are the live bytes per tag (the
    ``max_tags`` biggest; the rest as "other tags"); memory that was already allocated
    when the log started shows as its own grey band, so the top of the stack follows the
    ``used`` column.  Needs matplotlib (the Agg renderer, no display); no GPU.

    Parameters
    ----------
    paths : path or sequence of paths
        Log files or directories, as for :func:`summarize`.
    out : path
        Picture to write; its suffix picks the format (``.png``, ``.pdf``, ``.svg``,
        see :data:`PLOT_FORMATS`).  Its directory must exist (none is created).
    tag_depth : int, optional
        Group nested tags by their first components, as in :func:`summarize`.
    max_tags, max_panels, max_points : int
        Limits that keep the picture readable and quick to draw; long logs are thinned
        to ``max_points`` points per panel (time buckets, keeping each one's highest
        and last moments), so memory does not grow with the log.
    title : str, optional
        Figure title.

    Returns
    -------
    str
        ``out``.

    Raises
    ------
    MissingDependencyError
        matplotlib is not installed (an :class:`ImportError` too).
    InvalidOptionError
        ``out`` has no suffix of a known picture format.
    LogFormatError
        A file is not an allocation log, or the logs hold no events.
    FileNotFoundError
        ``out``'s directory does not exist (none is created).

    Examples
    --------
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "alloc-7.csv"), "w") as f:
    ...     _ = f.write(",".join(LOG_COLUMNS) + "\\n")
    ...     _ = f.write("1.0,7,MainThread,0,0,alloc,0x100,4096,step,,4096,8192\\n")
    ...     _ = f.write("2.0,7,MainThread,0,0,free,0x100,4096,step,,0,8192\\n")
    >>> out = plot(d, os.path.join(d, "usage.svg"))
    >>> with open(out) as f:
    ...     f.read(5)
    '<?xml'
    """
    plot_format(out)
    check_tag_depth(tag_depth)
    return plot_loaded(
        load(paths),
        out,
        tag_depth=tag_depth,
        max_tags=max_tags,
        max_panels=max_panels,
        max_points=max_points,
        title=title,
    )


def plot_loaded(
    loaded: Loaded,
    out_path: str | os.PathLike,
    *,
    tag_depth: int | None = None,
    max_tags: int = 8,
    max_panels: int = 8,
    max_points: int = 20000,
    title: str | None = None,
    summ: Summary | None = None,
) -> str:
    fmt = plot_format(out_path)
    Figure = _need_matplotlib()
    path = str(os.fspath(out_path))
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # never create directories the user did not ask for
        raise FileNotFoundError(
            errno.ENOENT, "no such directory (create it first, or pick another file)", folder
        )
    import numpy as np

    summ = summ if summ is not None else summarize_loaded(loaded, 0, tag_depth)
    if not summ.n_events or not summ.series:
        raise LogFormatError(", ".join(loaded.files), "no events to plot")
    t0, t_end = summ.start_time, summ.end_time
    by_peak = sorted(summ.tags, key=lambda t: (-t.peak_live_bytes, t.tag))
    shown = [t.tag for t in by_peak if t.peak_live_bytes > 0][:max_tags]
    has_other = sum(1 for t in summ.tags if t.peak_live_bytes > 0) > len(shown)
    hidden = max(0, len(summ.series) - max_panels)
    order = sorted((s.pid, s.device) for s in summ.series[:max_panels])
    panels = sample_series(
        loaded.events(),
        order,
        shown,
        t0,
        t_end,
        n_buckets=max(1, max_points // 2),
        tag_depth=tag_depth,
    )
    peak_all = 0.0
    for ps in panels:
        for _, used, reserved, _bands in ps.moments:
            peak_all = max(peak_all, float(used), float(reserved or 0))
    unit, scale = next(
        ((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if peak_all >= s),
        ("B", 1),
    )

    from matplotlib import colormaps

    # The qualitative palettes without their greys: grey means "other tags" here.
    small = len(shown) <= 9
    cmap = colormaps["tab10" if small else "tab20"]
    palette = [cmap(i) for i in range(cmap.N) if i not in ((7,) if small else (14, 15))]
    colors = [palette[i % len(palette)] for i in range(len(shown))]
    labels_all = [_label(tg or UNTAGGED) for tg in shown] + [OTHER_TAGS, BEFORE_LOG]
    colors += [(0.55, 0.55, 0.55, 1.0), (0.82, 0.82, 0.82, 1.0)]

    fig = Figure(figsize=(11, 1.2 + 2.8 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, ps in zip(axes, panels):
        m = ps.moments
        # Hold each series' last state until the end of all logs (step plots draw
        # nothing after their last point).
        m = [*m, (t_end, *m[-1][1:])]
        x = np.array([mo[0] for mo in m], dtype=float) - t0
        used_a = np.array([mo[1] for mo in m], dtype=float)
        res = np.array([np.nan if mo[2] is None else mo[2] for mo in m], dtype=float)
        bands = np.array([mo[3] for mo in m], dtype=float).reshape(len(m), len(shown) + 2)
        keep = [i for i in range(len(shown) + 2) if bands[:, i].any()]
        if not has_other and len(shown) in keep:
            keep.remove(len(shown))
        if keep:
            ax.stackplot(
                x,
                *[np.clip(bands[:, i], 0, None) / scale for i in keep],
                labels=[labels_all[i] for i in keep],
                colors=[colors[i] for i in keep],
                step="post",
                linewidth=0,
            )
        ax.step(x, used_a / scale, where="post", color="black", linewidth=0.8, label="used")
        if not np.isnan(res).all():
            ax.step(
                x,
                res / scale,
                where="post",
                color="black",
                linewidth=1.2,
                linestyle="--",
                label="reserved",
            )
        pid, dev = ps.key
        where = "pinned host memory" if dev < 0 else f"device {dev}"
        ax.set_title(f"pid {pid}, {where}", fontsize=10, loc="left")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        # Outside the axes, so no line runs through it.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    axes[-1].set_xlabel("time since the first event (s)")
    head = _label(title) if title else "cupy_poolmem: used memory by tag"
    if hidden:
        head += f" ({hidden} more process/device panel(s) not shown)"
    fig.suptitle(head)
    fig.savefig(path, format=fmt, dpi=100)
    return path


def _label(text: str) -> str:
    """A tag as matplotlib should draw it: printable, and ``$`` not read as math."""
    return printable(text).replace("$", r"\$")
