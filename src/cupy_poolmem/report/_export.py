"""Allocation logs written for other memory tools: ``report LOG --to FORMAT FILE``.

``torch-snapshot`` (a pickle PyTorch's ``memory_viz`` opens) and ``rmm-log`` (the CSV
RMM's replay benchmark reads); one file per process (and device, for RMM).  What each
holds: docs/cli.rst, "report".
"""

from __future__ import annotations

import contextlib
import csv
import functools
import os
import pickle
import time as _time
from collections.abc import Iterable, Iterator
from typing import Any

from .._errors import InvalidOptionError
from ._read import LogEvent, tag_key

__all__ = ["EXPORT_FORMATS", "check_export", "export", "torch_snapshots", "rmm_rows"]

#: ``--to`` formats, and what each writes.
EXPORT_FORMATS: dict[str, str] = {
    "torch-snapshot": "a torch.cuda.memory._snapshot() pickle for PyTorch's memory_viz",
    "rmm-log": "RMM's logging_resource_adaptor CSV, for RMM's replay benchmark",
}

#: The header of RMM's log (``logging_resource_adaptor::header()``).
RMM_HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")

_SMALL_SEGMENT = 1 << 20  # torch calls segments up to 1 MiB "small"
_TAG_FILE = "<cupy_poolmem tag>"
_LOGGED = ("alloc", "free_completed")  # the trace entries that are events of the log
_BLOCK_ROWS = 1 << 16  # RMM rows held before they are written


def check_export(fmt: str, out: str | os.PathLike) -> None:
    """Refuse an unknown format, or an output whose directory does not exist."""
    if fmt not in EXPORT_FORMATS:
        raise InvalidOptionError(
            f"--to {fmt!r} is not a format; use one of {', '.join(EXPORT_FORMATS)}"
        )
    folder = os.path.dirname(os.path.abspath(os.fspath(out)))
    if not os.path.isdir(folder):
        raise InvalidOptionError(
            f"--to {fmt} {os.fspath(out)!s}: no directory {folder} (create it first)"
        )


@functools.lru_cache(maxsize=65536)
def _frames(callsite: str, tag: str) -> list[dict[str, Any]]:
    """torch frames, innermost first: the call site ``file:line in function``, then
    the tag as an outer frame.  One list per (call site, tag): the events share it, in
    memory and in the pickle."""
    frames: list[dict[str, Any]] = []
    if callsite:
        where, _, name = callsite.partition(" in ")
        filename, _, line = where.rpartition(":")
        if filename and line.isdigit():
            frames.append({"filename": filename, "line": int(line), "name": name or "?"})
        else:
            frames.append({"filename": callsite, "line": 0, "name": "?"})
    if tag:
        frames.append({"filename": _TAG_FILE, "line": 0, "name": f"tag {tag}"})
    return frames


def _matched(
    events: Iterable[LogEvent],
) -> Iterator[tuple[str, LogEvent, int, str, str]]:
    """``(action, event, size, tag, callsite)`` per device event: ``"alloc"``, ``"free"``
    of a matched allocation (its size, tag and call site), ``"free-unknown"``; an
    allocation at a live address first yields the free of the earlier one."""
    live: dict[tuple[int, int, int], LogEvent] = {}
    for e in events:
        if e.device < 0 or e.op.startswith("guard:"):
            continue
        key = (e.pid, e.device, e.ptr)
        if e.op == "alloc":
            if not (e.ptr and e.size):
                continue
            prev = live.pop(key, None)
            if prev is not None:
                yield "free", e, prev.size, prev.tag, prev.callsite
            live[key] = e
            yield "alloc", e, e.size, e.tag, e.callsite
        else:
            prev = live.pop(key, None)
            if prev is None:
                yield "free-unknown", e, e.size, e.tag, e.callsite
            else:
                yield "free", e, prev.size, prev.tag, prev.callsite


def torch_snapshots(events: Iterable[LogEvent]) -> dict[int, dict[str, Any]]:
    """One ``torch.cuda.memory._snapshot()``-style dict per process id."""
    snaps: dict[int, dict[str, Any]] = {}
    live: dict[int, dict[tuple[int, int], dict[str, Any]]] = {}
    for action, e, size, tag, site in _matched(events):
        snap = snaps.get(e.pid)
        if snap is None:
            snap = snaps[e.pid] = {"segments": [], "device_traces": []}
            live[e.pid] = {}
        traces = snap["device_traces"]
        while len(traces) <= e.device:
            traces.append([])
        frames = _frames(site, tag)
        entry = {
            "addr": e.ptr,
            "size": size,
            "stream": e.stream,
            "frames": frames,
            "time_us": int(e.time * 1e6),
        }
        if action == "alloc":
            traces[e.device].append({"action": "segment_alloc", **entry})
            traces[e.device].append({"action": "alloc", **entry})
            live[e.pid][(e.device, e.ptr)] = {
                "size": e.size,
                "requested_size": e.size,
                "address": e.ptr,
                "state": "active_allocated",
                "frames": frames,
                "stream": e.stream,
            }
        else:
            traces[e.device].append({"action": "free_requested", **entry})
            traces[e.device].append({"action": "free_completed", **entry})
            traces[e.device].append({"action": "segment_free", **entry})
            live[e.pid].pop((e.device, e.ptr), None)
    for pid, snap in snaps.items():
        for (dev, addr), block in sorted(live[pid].items()):
            stream = block.pop("stream")
            snap["segments"].append(
                {
                    "device": dev,
                    "address": addr,
                    "total_size": block["size"],
                    "allocated_size": block["size"],
                    "active_size": block["size"],
                    "stream": stream,
                    "segment_type": "small" if block["size"] <= _SMALL_SEGMENT else "large",
                    "segment_pool_id": (0, 0),
                    "blocks": [block],
                }
            )
    return snaps


def rmm_rows(events: Iterable[LogEvent]) -> Iterator[tuple[tuple[int, int], list[str]]]:
    """``((pid, device), row)`` of RMM's log per matched device event, in time order.

    ``Thread`` is a number per (process, thread name), in order of appearance (RMM
    logs the thread id); ``Time`` is the local time of day as RMM writes it
    (``HH:MM:SS.ffffff``); ``Pointer`` and ``Stream`` are hexadecimal (``0x...``; the
    default stream ``0``).
    """
    threads: dict[tuple[int, str], int] = {}
    for action, e, size, _tag, _site in _matched(events):
        if action == "free-unknown":
            continue
        tid = threads.setdefault((e.pid, e.thread), len(threads) + 1)
        whole = int(e.time)
        stamp = _time.strftime("%H:%M:%S", _time.localtime(whole))
        micros = min(int(round((e.time - whole) * 1e6)), 999_999)
        yield (
            (e.pid, e.device),
            [
                str(tid),
                f"{stamp}.{micros:06d}",
                "allocate" if action == "alloc" else "free",
                hex(e.ptr),
                str(size),
                hex(e.stream) if e.stream else "0",  # as RMM prints a null cudaStream_t
            ],
        )


def _per(out: str, parts: list[str], ext: str) -> str:
    stem = out[: -len(ext)] if ext else out
    return stem + "".join(f".{p}" for p in parts) + ext


def export(
    loaded: Any, fmt: str, out: str | os.PathLike, *, tag_depth: int | None = None
) -> tuple[int, list[str]]:
    """Write ``loaded``'s events in ``fmt`` to ``out`` (or one file per process, see the
    module's docstring); return the number of allocations and frees written, and the
    files."""
    check_export(fmt, out)
    path = os.fspath(out)
    ext = os.path.splitext(path)[1]
    events: Iterable[LogEvent] = loaded.events()
    if tag_depth is not None:
        events = (e._replace(tag=tag_key(e.tag, tag_depth)) for e in events)
    if fmt == "torch-snapshot":
        _frames.cache_clear()
        snaps = torch_snapshots(events)
        if not snaps:
            snaps = {0: {"segments": [], "device_traces": []}}
        n, written = 0, []
        for pid, snap in snaps.items():
            target = path if len(snaps) == 1 else _per(path, [f"pid{pid}"], ext)
            with open(target, "wb") as fb:
                pickle.dump(snap, fb)
            n += sum(e["action"] in _LOGGED for t in snap["device_traces"] for e in t)
            written.append(target)
        return n, written
    # rmm-log: rows go to a part file per (pid, device), written in blocks (a file is
    # open only while a block is written: thousands of processes, few open files); the
    # final names are known at the end only.
    index: dict[tuple[int, int], int] = {}  # -> its part file, in order of appearance
    pending: dict[tuple[int, int], list[Any]] = {}
    tmp = path + ".part"
    n = 0

    def flush() -> None:
        for key, rows in pending.items():
            with open(f"{tmp}.{index[key]}", "a", newline="") as f:
                csv.writer(f, lineterminator="\n").writerows(rows)
        pending.clear()

    try:
        for key, row in rmm_rows(events):
            rows = pending.get(key)
            if rows is None:
                if key not in index:
                    index[key] = len(index)
                    open(f"{tmp}.{index[key]}", "w").close()  # no stale part file
                    rows = pending[key] = [RMM_HEADER]
                else:
                    rows = pending[key] = []
            rows.append(row)
            n += 1
            if n % _BLOCK_ROWS == 0:
                flush()
        flush()
    except BaseException:
        for i in index.values():
            with contextlib.suppress(OSError):
                os.unlink(f"{tmp}.{i}")
        raise
    if not index:
        with open(path, "w", newline="") as empty:
            empty.write(",".join(RMM_HEADER) + "\n")
        return 0, [path]
    written = []
    for (pid, dev), i in index.items():
        target = path if len(index) == 1 else _per(path, [f"pid{pid}", f"dev{dev}"], ext)
        os.replace(f"{tmp}.{i}", target)
        written.append(target)
    return n, written
