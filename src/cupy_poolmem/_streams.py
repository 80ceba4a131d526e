"""Streams: stream arguments and keys, capture state, cross-stream ordering, device sync.

It knows nothing of pools: ``record_stream`` (in ``_pools/_blocks.py``), the pools'
capture slow paths and the retirer build on it.

Stream rules (see docs/device_pool.rst, "Streams and graphs"):

- A block is freed, stream-ordered, on the stream it was allocated on.  Work on other
  streams that still uses it must be declared with :func:`record_stream`; the free
  then makes the allocation stream wait (device-side events) for the work enqueued on
  each recorded stream up to the moment of the free.
- Handles 0 (the legacy default stream) and 1 (``CU_STREAM_LEGACY``) can never be
  captured, so the pools ask the driver about capture only for other streams.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

from . import _device, _driver
from ._errors import OptionTypeError, check_driver

__all__ = ["as_stream", "stream_key", "sync_device", "wait_streams"]

CAPTURE_NONE = 0
CAPTURE_ACTIVE = 1
CAPTURE_INVALIDATED = 2
# CUresult codes of the CUDA_ERROR_STREAM_CAPTURE_* family (and CAPTURED_EVENT):
# a call that failed with one of them must be retried once no capture is under way.
CAPTURE_ERRORS = frozenset(range(900, 909))


class CaptureRegistry:
    """The streams the pools saw capturing, with their stream objects (a handle is only
    queried while its object, hence the stream, is alive); pruned once not capturing.

    The lock is reentrant: a garbage collection can start inside it (any allocation
    under it, such as the copy in :meth:`any_underway`), and a block freed there on a
    capturing stream comes back through :meth:`note` in the same thread.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.streams: dict[int, Any] = {}

    def note(self, stream_ptr: int, stream: Any) -> None:
        with self.lock:
            self.streams[stream_ptr] = stream

    def any_underway(self) -> bool:
        with self.lock:
            # A collection started here runs before the copy iterates (at the
            # allocation of the list or of the dict's iterator): a nested note() cannot
            # change the dict under the iteration.
            streams = list(self.streams)
        live = [s for s in streams if capture_status(s) != CAPTURE_NONE]
        if len(live) != len(streams):
            with self.lock:
                for s in streams:
                    if s not in live:
                        self.streams.pop(s, None)
        return bool(live)


CAPTURES = CaptureRegistry()


def current_device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def as_stream(obj: Any, name: str = "stream", device: int | None = None) -> tuple[int, int, Any]:
    """``(handle, device, keepalive)`` for a stream argument.

    Accepts a ``cupy.cuda.Stream`` or ``ExternalStream`` and any object with the CUDA
    stream protocol (``__cuda_stream__``, as ``cuda.core`` streams have).  ``device``
    is the ordinal used for streams that do not name one (CuPy's null stream); the
    current device when ``None``.  The third item is the object itself, kept so the
    stream outlives what uses its handle.
    """
    import cupy

    if isinstance(obj, cupy.cuda.stream._BaseStream):
        ptr, dev = int(obj.ptr), int(obj.device_id)
    else:
        proto = getattr(obj, "__cuda_stream__", None)
        if proto is None or isinstance(obj, (int, str, bytes)):
            raise OptionTypeError(
                f"{name} must be a cupy.cuda.Stream (or ExternalStream) or an object with "
                f"__cuda_stream__ such as a cuda.core Stream; got {obj!r} of type "
                f"{type(obj).__name__}. Wrap a raw handle as cupy.cuda.ExternalStream(ptr, "
                "device_id), or another library's stream with cupy.cuda.Stream.from_external()."
            )
        try:
            version, handle = proto() if callable(proto) else proto
            ptr = int(handle)
        except Exception as exc:
            raise OptionTypeError(
                f"{name}={obj!r}: __cuda_stream__ did not return (version, handle) ({exc})"
            ) from None
        d = getattr(getattr(obj, "device", None), "device_id", None)
        dev = -1 if d is None else int(d)
    if dev < 0:
        dev = current_device() if device is None or device < 0 else device
    return ptr, dev, obj


def capture_status(stream_ptr: int) -> int:
    """``CAPTURE_NONE``, ``CAPTURE_ACTIVE`` or ``CAPTURE_INVALIDATED`` for a stream.

    A query the driver refuses because of a capture elsewhere (the legacy stream
    while a blocking stream captures) counts as active: work there must wait too.
    """
    if stream_ptr <= 1:
        return CAPTURE_NONE
    err, status = _driver.get().cuStreamIsCapturing(stream_ptr)
    if int(err):
        return CAPTURE_ACTIVE if int(err) in CAPTURE_ERRORS else CAPTURE_NONE
    return int(status)


def capture_info(stream_ptr: int) -> tuple[int, int]:
    """``(status, capture sequence id)`` of a stream (id 0 when not capturing)."""
    if stream_ptr <= 1:
        return CAPTURE_NONE, 0
    res = _driver.get().cuStreamGetCaptureInfo(stream_ptr)
    if int(res[0]):
        return (CAPTURE_ACTIVE if int(res[0]) in CAPTURE_ERRORS else CAPTURE_NONE), 0
    status = int(res[1])
    return status, (int(res[2]) if status == CAPTURE_ACTIVE else 0)


def note_capture(stream_ptr: int, stream: Any) -> None:
    """Remember a stream the pools saw capturing (for :func:`any_capture_underway`)."""
    CAPTURES.note(stream_ptr, stream)


def any_capture_underway() -> bool:
    """Whether a stream the pools saw capturing still is (synchronising would break it)."""
    return CAPTURES.any_underway()


@contextlib.contextmanager
def relaxed_capture_mode() -> Iterator[None]:
    """Let this thread make calls a global-mode capture forbids (creating a pool)."""
    drv = _driver.get()
    err, prev = drv.cuThreadExchangeStreamCaptureMode(
        drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    )
    try:
        yield
    finally:
        if not int(err):
            drv.cuThreadExchangeStreamCaptureMode(prev)


def wait_streams(target_ptr: int, target_dev: int, sources: list) -> None:
    """Make stream ``target_ptr`` wait, on the device, for the work now on ``sources``.

    ``sources`` holds ``(handle, device, keepalive)`` entries.  One plain event per
    source, recorded with that source's device current, waited on by the target,
    then destroyed (the driver keeps it until the wait no longer needs it).  No host
    synchronisation.
    """
    drv = _driver.get()
    flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
    for ptr, dev, _keep in sources:
        if ptr == target_ptr and dev == target_dev:
            continue
        with _device.on_device(dev):
            ev = check_driver(drv.cuEventCreate(flags), "cuEventCreate")
            try:
                check_driver(drv.cuEventRecord(ev, ptr), "cuEventRecord")
                if dev == target_dev:
                    check_driver(drv.cuStreamWaitEvent(target_ptr, ev, 0), "cuStreamWaitEvent")
                else:
                    with _device.on_device(target_dev):
                        check_driver(drv.cuStreamWaitEvent(target_ptr, ev, 0), "cuStreamWaitEvent")
            finally:
                drv.cuEventDestroy(ev)


def sync_device(dev: int) -> None:
    """Wait until every stream of ``dev`` is idle (``cuCtxSynchronize`` on its primary
    context), also while another thread captures a graph in global mode."""
    with _device.on_device(dev), relaxed_capture_mode():
        check_driver(_driver.get().cuCtxSynchronize(), "cuCtxSynchronize")


_PER_THREAD = 2  # CU_STREAM_PER_THREAD: a different stream in each thread
_TOKENS = itertools.count(1)
_THREAD = threading.local()


def stream_key(stream_ptr: int) -> int:
    """The key of a stream's arenas: its handle, but for handle 2, the per-thread
    default stream, which is another stream in each thread: ``token << 2 | 2``, the
    token the calling thread drew first (never another thread's, even once it ended,
    whose stream's work may still run; no stream's handle, an aligned pointer, looks
    like it).  Both hot paths ask this function for it."""
    if stream_ptr == _PER_THREAD:
        token = getattr(_THREAD, "token", 0)
        if not token:
            token = _THREAD.token = next(_TOKENS)
        return (token << 2) | _PER_THREAD
    return stream_ptr
