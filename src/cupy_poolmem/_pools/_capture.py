"""Allocation and frees while a stream captures a CUDA graph (the hot path's slow paths)."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import cuda.core as cc
import cupy

from .. import _streams
from .._device import on_device
from .._errors import CUDADriverError, UnsupportedError, check_driver
from .._runtime import hp as _hp
from . import _driver

_graph_templates: dict[int, Any] = {}


def graph_template(device: int) -> Any:
    """A pool without IPC whose properties graph allocation nodes of ``device`` can use.

    Created on first need, which is during a capture: under the relaxed capture mode
    so that a global-mode capture does not forbid it.  It never allocates itself.
    """
    mr = _graph_templates.get(device)
    if mr is None:
        with _streams.relaxed_capture_mode():
            mr = cc.DeviceMemoryResource(device, cc.DeviceMemoryResourceOptions(ipc_enabled=False))
        mr = _graph_templates.setdefault(device, mr)
    return _driver.pool_handle(mr)


class CaptureMixin(_hp.PoolCore):
    """The slow paths of the hot path for streams and graph capture: record_stream's
    waits, allocation during a capture, and the frees held until a capture ends."""

    # Set by Pool._setup (declared here for the type checker).
    _lock: Any
    _mr: Any
    _graph_blocks: dict[int, tuple[int, int]]
    _graph_bytes: int
    n_graph_allocs: int
    _capture_held: list[tuple]

    if TYPE_CHECKING:  # Pool's

        def _describe(self) -> str: ...
        def _oom_error(self, size: int, detail: str | None = None) -> Exception: ...
        def _reset_advice(self, ptr: int, size: int) -> None: ...
        def _drained(self) -> None: ...
        def trim(self, keep: int | str = 0, *, sync: bool = True) -> int: ...

    # -- streams: record_stream and graph capture (slow paths of the hot path) --------
    def _wait_recorded(self, stream: Any, recorded: list) -> None:
        """Make ``stream`` wait for the work now on the streams in ``recorded``."""
        dev = self.device_id if self.device_id >= 0 else -1
        ptr, sdev, _ = _streams.as_stream(stream, device=dev)
        _streams.wait_streams(ptr, sdev, recorded)

    def _capture_malloc(self, size: int, err: int, status: int) -> Any:
        """An allocation on a stream the driver says is capturing (or could not say)."""
        stream = cupy.cuda.get_current_stream()
        if err:
            check_driver((_driver.drv().CUresult(err),), "cuStreamIsCapturing")
        sptr = int(stream.ptr)
        state, cap_id = _streams.capture_info(sptr)
        if state == _streams.CAPTURE_INVALIDATED:
            raise CUDADriverError(
                "cuStreamIsCapturing",
                901,
                "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
                f"the capture on stream {sptr:#x} was invalidated by an earlier error; "
                "end it with stream.end_capture() (which raises) and capture again",
            )
        if state == _streams.CAPTURE_NONE:  # capture ended in between: the plain path
            return _hp.PoolCore.malloc(self, size)  # the hot path's (a guard's adds nothing)
        _streams.note_capture(sptr, stream)
        if size == 0:
            return self._make_block(0, 0, stream, 0)
        if self.kind == _hp.KIND_PINNED:
            raise UnsupportedError(
                f"{self._describe()}: pinned host memory cannot be allocated while stream "
                f"{sptr:#x} is capturing a CUDA graph (a graph copy reads its host buffer "
                "at every launch, and graph memory is not host-accessible). Allocate pinned "
                "buffers before begin_capture() and keep them alive while the graph is used."
            )
        if self.kind == _hp.KIND_MANAGED:
            raise UnsupportedError(
                f"{self._describe()}: managed memory cannot be allocated while stream "
                f"{sptr:#x} is capturing a CUDA graph (graph memory is device memory). "
                "Allocate managed arrays before begin_capture(), or capture with a DevicePool."
            )
        ptr = self._graph_alloc(size, sptr)
        with self._lock:
            self._graph_blocks[ptr] = (cap_id, sptr)
            self._graph_bytes += size
            self.n_graph_allocs += 1
        return self._make_block(ptr, size, stream, _hp.FLAG_CAPTURED)

    def _graph_alloc(self, size: int, sptr: int) -> int:
        """Graph-owned memory: an allocation node of the capture on ``sptr``."""
        err, ptr = self._graph_try(size, sptr)
        if err == _driver.CUDA_ERROR_OUT_OF_MEMORY:
            # Graph memory comes from the device, beside this pool: give back what the
            # pool holds unused (no synchronisation during a capture) and retry once.
            self.n_oom += 1
            gc.collect()
            self.flush_cache()
            self.trim(sync=False)
            err, ptr = self._graph_try(size, sptr)
            if err == _driver.CUDA_ERROR_OUT_OF_MEMORY:
                raise self._oom_error(
                    size,
                    "for a CUDA graph being captured (graph memory, beside the pool's own), "
                    "after returning the pool's unused memory to the device",
                )
        if err:
            check_driver((_driver.drv().CUresult(err),), "cuMemAllocAsync (stream capture)")
        return ptr

    def _graph_try(self, size: int, sptr: int) -> tuple[int, int]:
        if not getattr(self, "ipc", False):
            # The pool's own properties for the allocation node.
            err, p = _driver.drv().cuMemAllocFromPoolAsync(
                size, _driver.pool_handle(self._mr), sptr
            )
        else:
            # IPC pools cannot make graph nodes (CUDA_ERROR_NOT_SUPPORTED): the
            # device's current pool (its default unless someone changed it) can.
            err, p = _driver.drv().cuMemAllocAsync(size, sptr)
            if int(err) == _driver.CUDA_ERROR_NOT_SUPPORTED:
                err, p = _driver.drv().cuMemAllocFromPoolAsync(
                    size, graph_template(self.device_id), sptr
                )
        return int(err), (int(p) if not int(err) else 0)

    def _free_flagged(self, ptr: int, size: int, stream: Any, flags: int) -> bool:
        """Free path of blocks with FLAG_CAPTURED or FLAG_ADVISED; True when handled."""
        if flags & _hp.FLAG_CAPTURED:
            self._free_captured(ptr, size, stream)
            return True
        if flags & _hp.FLAG_ADVISED:
            self._reset_advice(ptr, size)
        return False

    def _free_captured(self, ptr: int, size: int, stream: Any) -> None:
        """Free graph-owned memory: a free node inside its own capture, else after it."""
        with self._lock:
            cap_id, sptr = self._graph_blocks.pop(ptr, (0, int(stream.ptr)))
            self._graph_bytes -= size
        state, now_id = _streams.capture_info(sptr)
        if state == _streams.CAPTURE_INVALIDATED:
            return  # the graph is discarded with its allocations: nothing to free
        if state == _streams.CAPTURE_ACTIVE and now_id != cap_id:
            with self._lock:  # another capture on that stream: free once it is over
                self._capture_held.append(("graph", ptr, size, sptr, stream))
                self.n_capture_held = len(self._capture_held)
            return
        # In its capture: a free node.  After it: a plain stream-ordered free, which
        # must come after a launch of the graph (see the docs' rule).
        err = int(_driver.drv().cuMemFreeAsync(ptr, sptr)[0])
        if err:
            self.n_free_errors += 1

    def _hold_free(self, ptr: int, stream_ptr: int, err: int, stream: Any = None) -> None:
        """A driver free on a capturing stream: keep it until the capture ends.

        ``stream`` (the stream object, when the caller had it) stays referenced with the
        entry, so the handle is still valid when the free is done.
        """
        if err and err not in _streams.CAPTURE_ERRORS:
            # Not a capture: the query failed (a destroyed stream?); free directly.
            if self._free_direct(ptr, stream_ptr):
                self.n_free_errors += 1
            return
        if not err and stream is not None:
            # A capture the pools may not have seen (nothing allocated in it): the
            # retirer must not synchronise while it runs.
            _streams.note_capture(stream_ptr, stream)
        with self._lock:
            self._capture_held.append(("free", ptr, 0, stream_ptr, stream))
            self.n_capture_held = len(self._capture_held)

    def _free_failed(self, ptr: int, stream_ptr: int, err: int, stream: Any = None) -> None:
        if err in _streams.CAPTURE_ERRORS:  # the legacy stream during a capture
            self._hold_free(ptr, stream_ptr, err, stream)
        else:
            self.n_free_errors += 1

    def _drain_capture_held(self) -> None:
        """Do the frees held for captures that have ended since."""
        with self._lock:
            held, self._capture_held = self._capture_held, []
            self.n_capture_held = 0
        keep = []
        for entry in held:
            what, ptr, size, sptr, stream = entry
            if _streams.capture_status(sptr) != _streams.CAPTURE_NONE or (
                sptr <= 1 and _streams.any_capture_underway()
            ):
                keep.append(entry)
                continue
            if what == "pinned":
                self._defer_free(ptr, size, stream)  # type: ignore[attr-defined]
                continue
            if what == "graph":
                err = int(_driver.drv().cuMemFreeAsync(ptr, sptr)[0])
            else:
                err = self._free_direct(ptr, sptr)
            if err in _streams.CAPTURE_ERRORS:  # a capture the pools did not see
                keep.append(entry)
            elif err:
                self.n_free_errors += 1
        if keep:
            with self._lock:
                self._capture_held.extend(keep)
                self.n_capture_held = len(self._capture_held)

    def _drained_after_capture(self) -> bool:
        """The retirer's poll (its thread): True once the held frees are done and the
        pool is retired."""
        # A context bound to the retirer's thread, and a global-mode capture elsewhere
        # must not forbid the capture queries (and pinned event queries) here.
        with on_device(max(self.device_id, 0)), _streams.relaxed_capture_mode():
            self._drain_capture_held()
        if self.n_capture_held:
            return False
        self._drained()
        return True


class GraphFrees:
    """The retirer's poll for graph memory whose free waited for a capture to end, of a
    pool finalized meanwhile: freed on its stream (as ``_drain_capture_held`` does)
    once that stream's capture is over; dropped if the stream itself was finalized
    (destroyed: the graph and its memory go with it or stay the graph's)."""

    def __init__(self, entries: list, device: int) -> None:
        self.entries, self.device = entries, device

    def __call__(self) -> bool:
        keep = []
        with on_device(self.device), _streams.relaxed_capture_mode():
            for entry in self.entries:
                _what, ptr, _size, sptr, stream = entry
                if stream is not None and gc.is_finalized(stream):
                    continue
                if _streams.capture_status(sptr) != _streams.CAPTURE_NONE:
                    keep.append(entry)
                    continue
                _driver.drv().cuMemFreeAsync(ptr, sptr)
        self.entries = keep
        return not keep
