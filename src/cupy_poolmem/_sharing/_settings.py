"""Options of array sharing (``cupy_poolmem.sharing``), with their checks."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .._errors import InvalidOptionError, OptionTypeError

__all__ = ["SharingSettings"]

_FALLBACKS = ("device-copy", "host", "error")
_ORDERS = ("sync", "stream")
_FOREVER = 1e15  # seconds (30 million years): beyond it a timeout is a mistake


def _seconds(name: str, value: Any, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionTypeError(
            f"sharing.{name}={value!r}; give a number of seconds"
            + (" or None" if allow_none else "")
        )
    if not 0 <= value < _FOREVER:  # also nan, inf and ints no float holds
        raise InvalidOptionError(
            f"sharing.{name}={value!r}; give a finite number of seconds >= 0"
            + (" (None: no limit)" if allow_none else "")
        )
    return float(value)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise InvalidOptionError(f"{name}={raw!r}; give a number of seconds") from None
    if not 0 <= v < _FOREVER:
        raise InvalidOptionError(f"{name}={raw!r}; give a finite number of seconds >= 0")
    return v


class SharingSettings:
    """Options for sharing arrays between processes, and its two calls.

    The one instance is ``cupy_poolmem.sharing``.

    Parameters
    ----------
    on_keep_change : callable, optional
        Called with no argument after ``keep_mappings`` changes (the receiver
        trims the mappings it keeps).

    Attributes
    ----------
    fallback : str
        What to do with an array whose memory cannot be exported (CuPy's default
        pool, another allocator, a pool without ``ipc=True``): ``"device-copy"``
        (default: copy on the GPU into an IPC pool, then share), ``"host"`` (CuPy's
        own pickling through host memory) or ``"error"``.
    exit_timeout : float
        Seconds a process that shared arrays waits at exit, after multiprocessing has
        flushed its queues, for its messages to be received (default 10, or
        ``CUPY_POOLMEM_EXIT_TIMEOUT``).  Arrays a receiver got stay valid after the
        sender exits; a message received after this wait raises :class:`SharingError`.
    inflight_timeout : float or None
        Seconds a message may stay unreceived before its block is let go (default 60,
        or ``CUPY_POOLMEM_INFLIGHT_TIMEOUT``): a message nobody reads, or one that
        failed to pickle halfway, pins memory this long at most.  Receiving it later
        raises :class:`SharingError`, never maps other data.  ``None``: no limit.
    keep_mappings : int
        How many mappings of blocks received more than once a receiver keeps after
        their arrays are gone (default 64), so re-sending a block costs no new
        mapping; ``0`` unmaps at once.  The exporter can still reuse such a block: it
        asks the receiver to unmap it as soon as it frees the block itself.
    receive_order : str
        How a received array is ordered after the sender's writes: ``"sync"``
        (default) waits on the host, when the array is unpickled, for the work the
        sender enqueued before sending (usually done already), so the array is ready
        on every stream and in every thread; ``"stream"`` makes only the unpickling
        thread's current stream wait, on the device (no host wait; use it when the
        thread that receives is the one that uses the arrays).
    warn_bytes : int
        Warn once when more than this many bytes wait in limbo for other processes.

    Examples
    --------
    >>> import cupy_poolmem
    >>> cupy_poolmem.sharing.keep_mappings = 16
    >>> cupy_poolmem.sharing.keep_mappings
    16
    >>> cupy_poolmem.sharing.keep_mappings = 64
    """

    def __init__(self, on_keep_change: Callable[[], Any] | None = None) -> None:
        self._fallback = "device-copy"
        self._order = "sync"
        self.warn_bytes = 8 << 30
        self._exit = _env_seconds("CUPY_POOLMEM_EXIT_TIMEOUT", 10.0)
        self._inflight: float | None = _env_seconds("CUPY_POOLMEM_INFLIGHT_TIMEOUT", 60.0)
        self._keep = 64
        self.claim_timeout = 30.0
        self._on_keep_change = on_keep_change
        self._stats: Callable[[], dict[str, int]] | None = None
        self._collect: Callable[[], int] | None = None

    @property
    def fallback(self) -> str:
        """What is shared for an array whose memory cannot be exported.

        Setting a value it does not accept raises
        :class:`~cupy_poolmem.InvalidOptionError`; the class's "Attributes" say what
        each value does.

        Examples
        --------
        >>> cupy_poolmem.sharing.fallback
        'device-copy'
        """
        return self._fallback

    @fallback.setter
    def fallback(self, value: str) -> None:
        if value not in _FALLBACKS:
            raise InvalidOptionError(f"sharing.fallback={value!r}; choose one of {_FALLBACKS}")
        self._fallback = value

    @property
    def receive_order(self) -> str:
        """How a received array is ordered after the sender's writes.

        Setting a value it does not accept raises
        :class:`~cupy_poolmem.InvalidOptionError`; the class's "Attributes" say what
        each value does.

        Examples
        --------
        >>> cupy_poolmem.sharing.receive_order
        'sync'
        """
        return self._order

    @receive_order.setter
    def receive_order(self, value: str) -> None:
        if value not in _ORDERS:
            raise InvalidOptionError(f"sharing.receive_order={value!r}; choose one of {_ORDERS}")
        self._order = value

    @property
    def exit_timeout(self) -> float:
        """Seconds a process that shared arrays waits at exit for its messages.

        Setting a value it does not accept raises
        :class:`~cupy_poolmem.InvalidOptionError`; the class's "Attributes" say what
        each value does.

        Examples
        --------
        >>> cupy_poolmem.sharing.exit_timeout  # CUPY_POOLMEM_EXIT_TIMEOUT unset
        10.0
        """
        return self._exit

    @exit_timeout.setter
    def exit_timeout(self, value: float) -> None:
        self._exit = _seconds("exit_timeout", value, False) or 0.0

    @property
    def inflight_timeout(self) -> float | None:
        """Seconds a message may stay unreceived before its block is let go.

        Setting a value it does not accept raises
        :class:`~cupy_poolmem.InvalidOptionError`; the class's "Attributes" say what
        each value does.

        Examples
        --------
        >>> cupy_poolmem.sharing.inflight_timeout  # CUPY_POOLMEM_INFLIGHT_TIMEOUT unset
        60.0
        """
        return self._inflight

    @inflight_timeout.setter
    def inflight_timeout(self, value: float | None) -> None:
        self._inflight = _seconds("inflight_timeout", value, True)

    @property
    def keep_mappings(self) -> int:
        """How many mappings of blocks received more than once a receiver keeps.

        Setting a value it does not accept raises
        :class:`~cupy_poolmem.InvalidOptionError`; the class's "Attributes" say what
        each value does.

        Examples
        --------
        >>> cupy_poolmem.sharing.keep_mappings
        64
        """
        return self._keep

    @keep_mappings.setter
    def keep_mappings(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidOptionError(
                f"sharing.keep_mappings={value!r}; give an int >= 0 "
                "(0 unmaps received blocks as soon as they are dropped)"
            )
        self._keep = value
        if self._on_keep_change is not None:
            self._on_keep_change()

    def stats(self) -> dict[str, int]:
        """Return the counts of the sharing protocol in this process.

        Returns
        -------
        dict
            ``exported_blocks``, ``limbo_blocks`` and ``limbo_bytes`` (blocks freed
            here but held for other processes), ``tickets_out`` (messages not yet
            received), ``leases`` (mappings other processes hold of this process's
            blocks), ``peers`` (receivers connected), ``recycled_blocks`` (exported
            blocks put back into a reuse cache with their records, so far),
            ``imported_blocks`` (blocks of other processes mapped here and in use),
            ``idle_mappings`` (mapped, unused, kept for a re-send),
            ``imported_pools``, ``clients`` (exporters this process is connected
            to), ``opened_events`` (their IPC events open here) and
            ``dropped_frames`` (protocol messages a stalled peer never took).

        Examples
        --------
        >>> cupy_poolmem.sharing.stats()["limbo_bytes"]
        0
        """
        return self._stats() if self._stats is not None else {}

    def collect(self) -> int:
        """Free limbo blocks nobody holds, expire unclaimed tickets, unmap idle mappings.

        Blocks are normally freed as soon as the last receiver lets go; this is the
        safety net (also run before an out-of-memory retry).

        Returns
        -------
        int
            The bytes of this process's pools freed.

        Examples
        --------
        >>> cupy_poolmem.sharing.collect()
        0
        """
        return self._collect() if self._collect is not None else 0
