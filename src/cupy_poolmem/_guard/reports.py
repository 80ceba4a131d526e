"""How a guard reports a finding: the message, the count, the event kept, the log
line, and raising, queueing or warning as its options say."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from typing import Any

from .._errors import (
    GuardError,
    GuardWarning,
    OutOfBoundsWriteError,
    UnorderedReuseError,
    UseAfterFreeError,
)
from .options import GuardOptions
from .records import GuardEvent, Record, describe_site, log_report


class Reports:
    """The reporting half of :class:`~cupy_poolmem.Guard` (a base class of it)."""

    options: GuardOptions
    counts: dict[str, int]
    events: deque[GuardEvent]
    n_internal_errors: int
    _device: int
    _pool: Any
    _pending: deque[GuardError]
    _warned_internal: bool

    # -- reports -----------------------------------------------------------------------
    def _report_oob(self, rec: Record, first: int, n: int, when: str) -> None:
        snap = rec.snapshot(self._device)
        past = first  # offset into the red zone
        msg = (
            f"cupy_poolmem guard: out-of-bounds write past the end of {snap.describe()}: "
            f"{n} byte(s) of the {rec.red_zone}-byte red zone after it were changed, the "
            f"first at offset {rec.size + past:,} ({past} byte(s) past the end), found "
            f"{when}. Allocated at {describe_site(rec.alloc_site)}"
            + (f"; freed at {describe_site(rec.free_site)}" if rec.free_site else "")
            + ". A kernel or library wrote beyond the array: check its bounds test "
            "(i < n), its grid size and the sizes given to raw kernels or C libraries."
        )
        self._report(OutOfBoundsWriteError(msg, snap, rec.size + past, n))

    def _report_uaf(
        self, rec: Record, first: int, n: int, when: str = "when it left the quarantine"
    ) -> None:
        snap = rec.snapshot(self._device)
        part = "its red zone" if first >= rec.size else "the block"
        msg = (
            f"cupy_poolmem guard: write after free into {snap.describe()}: {n} byte(s) "
            f"changed after it was freed, the first at offset {first:,} (in {part}), found "
            f"{when}. Allocated at {describe_site(rec.alloc_site)}; freed at "
            f"{describe_site(rec.free_site)} (stream 0x{rec.stream_ptr:x}). Something kept a raw "
            "pointer (arr.data.ptr, DLPack, a Numba or C-library view) or work on another "
            "stream still wrote after the last array went: keep the array alive while its "
            "memory is used, and call cupy_poolmem.record_stream(array, stream) for other "
            "streams (or synchronize) before dropping it."
        )
        self._report(UseAfterFreeError(msg, snap, first, n))

    def _report_unordered(self, rec: Record, cur: int) -> None:
        snap = rec.snapshot(self._device)
        msg = (
            f"cupy_poolmem guard: {snap.describe()} allocated on stream 0x{rec.stream_ptr:x} "
            f"was freed at {describe_site(rec.free_site)} while stream 0x{cur:x} was current, which "
            "is neither its allocation stream nor recorded with record_stream: the pool "
            f"reuses the memory in the order of stream 0x{rec.stream_ptr:x} only, possibly "
            f"while 0x{cur:x} still uses it. Allocated at {describe_site(rec.alloc_site)}. Call "
            "cupy_poolmem.record_stream(array, stream) for every other stream that uses the "
            "array before dropping it (or synchronize that stream first). If that stream "
            "never used it, this is a false alarm: drop the array outside its `with "
            "stream:` block, or pass GuardOptions(cross_stream='off')."
        )
        self._report(UnorderedReuseError(msg, snap))

    def _report(self, err: GuardError, direct: bool = False) -> None:
        """Count, remember and log ``err``; raise, queue or warn it as the options say."""
        kind = err.kind
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.events.append(GuardEvent(kind, time.time(), err))
        log_report(self._pool, err)
        policy = self.options.cross_stream if kind == "unordered_stream" else self.options.mode
        if policy == "warn":
            with contextlib.suppress(Exception):
                warnings.warn(str(err), GuardWarning, stacklevel=3)
        elif policy == "raise":
            if direct:
                raise err
            self._pending.append(err)

    def _raise_pending(self) -> None:
        try:
            err = self._pending.popleft()
        except IndexError:
            return
        raise err

    def raise_pending(self) -> None:
        """Raise the oldest error found in a destructor and not raised yet (if any).

        Raises
        ------
        GuardError
            That error.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.raise_pending()  # doctest: +SKIP
        """
        self._raise_pending()

    def _internal(self, exc: BaseException) -> None:
        self.n_internal_errors += 1
        if not self._warned_internal:
            self._warned_internal = True
            with contextlib.suppress(BaseException):
                warnings.warn(
                    f"cupy_poolmem guard: a check could not run ({exc!r}); later failures are "
                    "only counted (pool.guard.stats()['internal_errors'])",
                    RuntimeWarning,
                    stacklevel=3,
                )
