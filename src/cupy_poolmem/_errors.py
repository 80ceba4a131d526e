"""One exception hierarchy for cupy_poolmem.

Every error the package raises derives from :class:`PoolmemError`, and also from the
builtin (or CuPy) type that existing handlers already catch, so adopting the package
never silently changes which ``except`` clause runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


def _cupy_bases() -> tuple[type[MemoryError], type[RuntimeError]]:
    """CuPy's out-of-memory and runtime-error types, or the builtins they derive from.

    A base install has no CuPy: the package then still imports (``report`` needs no GPU),
    and its errors derive from ``MemoryError`` / ``RuntimeError``, which CuPy's own types
    derive from, so the same ``except`` clauses catch them.
    """
    try:
        from cupy.cuda.memory import OutOfMemoryError
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
    except ImportError:
        return MemoryError, RuntimeError
    return OutOfMemoryError, CUDARuntimeError


if TYPE_CHECKING:
    _CupyOutOfMemoryError = MemoryError
    _CUDARuntimeError = RuntimeError
else:
    _CupyOutOfMemoryError, _CUDARuntimeError = _cupy_bases()

__all__ = [
    "PoolmemError",
    "PoolClosedError",
    "WrongDeviceError",
    "InvalidOptionError",
    "OptionTypeError",
    "InvalidSizeError",
    "NoGPUError",
    "UnsupportedError",
    "CUDADriverError",
    "OutOfPoolMemoryError",
    "PinnedOutOfMemoryError",
    "SharingError",
    "TransferError",
    "MissingDependencyError",
    "LogFormatError",
    "UsageError",
    "HandleStateError",
    "GuardError",
    "UseAfterFreeError",
    "UnorderedReuseError",
    "DoubleFreeError",
    "OutOfBoundsWriteError",
    "GuardWarning",
    "check_driver",
    "GPU_EXTRA_HINT",
]

_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation, what CuPy's staging catches


class PoolmemError(Exception):
    """Base class of every error raised by cupy_poolmem.

    Examples
    --------
    One ``except`` clause catches every error of the package:

    >>> try:
    ...     cupy_poolmem.parse_bytes("twelve")
    ... except cupy_poolmem.PoolmemError:
    ...     print("not a size")
    not a size
    """


class PoolClosedError(PoolmemError, RuntimeError):
    """The pool was closed; create a new pool (or stop using this one).

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
    >>> pool.close()  # doctest: +SKIP
    >>> pool.malloc(1024)  # doctest: +SKIP
    Traceback (most recent call last):
    ...
    cupy_poolmem._errors.PoolClosedError: ...
    """


class WrongDeviceError(PoolmemError, ValueError):
    """A pool was used while another CUDA device was current.

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool(device=1)  # doctest: +SKIP
    >>> with cupy.cuda.Device(0):  # doctest: +SKIP
    ...     pool.malloc(1024)
    Traceback (most recent call last):
    ...
    cupy_poolmem._errors.WrongDeviceError: ...
    """


class InvalidOptionError(PoolmemError, ValueError):
    """An option has a value of the right type but outside its valid range.

    Examples
    --------
    >>> isinstance(InvalidOptionError("reuse_cache=-1: give 0 or more"), ValueError)
    True
    """


class OptionTypeError(PoolmemError, TypeError):
    """An option has a value of the wrong type.

    Examples
    --------
    >>> isinstance(OptionTypeError("ipc='yes': give True or False"), TypeError)
    True
    """


class InvalidSizeError(PoolmemError, OverflowError, ValueError):
    """An allocation size is negative or does not fit in ``size_t``.

    Derives from :class:`OverflowError`, what CuPy's own allocators raise for such a
    size, and from :class:`ValueError`.  A size that is not an integer raises
    :class:`OptionTypeError` (a :class:`TypeError`) instead.

    Examples
    --------
    >>> e = InvalidSizeError("size=-1: give a size of 0 or more bytes")
    >>> isinstance(e, OverflowError), isinstance(e, ValueError)
    (True, True)
    >>> cupy_poolmem.DevicePool().malloc(-1)  # doctest: +SKIP
    Traceback (most recent call last):
    ...
    cupy_poolmem._errors.InvalidSizeError: ...
    """


class NoGPUError(PoolmemError, RuntimeError):
    """No CUDA driver or no CUDA device is available in this process.

    Examples
    --------
    >>> if cupy_poolmem.device_count() == 0:
    ...     try:
    ...         cupy_poolmem.DevicePool()
    ...     except (NoGPUError, MissingDependencyError):
    ...         pass
    """


class UnsupportedError(PoolmemError, RuntimeError):
    """The driver, device or CUDA version lacks a feature (for example managed pools).

    Examples
    --------
    >>> try:  # doctest: +SKIP
    ...     pool = cupy_poolmem.ManagedPool()
    ... except cupy_poolmem.UnsupportedError:
    ...     pool = cupy_poolmem.ManagedPool(backend="cupy")
    """


class SharingError(PoolmemError, RuntimeError):
    """An array could not be shared with, or received from, another process.

    Examples
    --------
    >>> try:  # doctest: +SKIP
    ...     x = queue.get(timeout=60)
    ... except cupy_poolmem.SharingError as e:
    ...     print("not received:", e)
    """


class TransferError(SharingError, ConnectionError):
    """A Dask chunk sent through pool IPC could not be received, nor fetched again.

    Neither through pool IPC nor through Dask's own serialization.  Derives from :class:`ConnectionError` (an :class:`OSError`): Dask's worker then
    treats the sender as unreachable for that transfer (it asks the scheduler where
    else the data is, or has it computed again) instead of marking the task failed.

    Examples
    --------
    >>> e = TransferError("worker tcp://10.0.0.2:4000 is gone")
    >>> isinstance(e, SharingError), isinstance(e, ConnectionError)
    (True, True)
    """


class CUDADriverError(PoolmemError, RuntimeError):
    """A CUDA driver call failed.

    Parameters
    ----------
    call : str
        The driver function that failed.
    code : int
        The numeric ``CUresult``.
    name : str
        The CUDA error name.
    detail : str, optional
        The driver's description of the error, appended to the message.

    Attributes
    ----------
    name : str
        The CUDA error name, for example ``"CUDA_ERROR_INVALID_VALUE"``.
    code : int
        The numeric ``CUresult``.
    call : str
        The driver function that failed.

    Examples
    --------
    >>> e = CUDADriverError("cuMemPoolCreate", 1, "CUDA_ERROR_INVALID_VALUE")
    >>> str(e), e.name
    ('cuMemPoolCreate failed: CUDA_ERROR_INVALID_VALUE (1)', 'CUDA_ERROR_INVALID_VALUE')
    """

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call, self.code, self.name = call, int(code), name
        msg = f"{call} failed: {name} ({int(code)})"
        super().__init__(msg + (f": {detail}" if detail else ""))


class OutOfPoolMemoryError(PoolmemError, _CupyOutOfMemoryError):
    """A device or managed pool could not satisfy an allocation.

    Subclasses :class:`cupy.cuda.memory.OutOfMemoryError`, so existing CuPy handlers
    keep working.  Raised only after one retry that follows garbage collection, the
    collection of blocks held for other processes, and a trim of the pool.

    Parameters
    ----------
    pool : str
        Description of the pool (kind, device).
    size : int
        Requested bytes.
    stats : PoolStats, optional
        The pool's statistics when the allocation failed.
    detail : str, optional
        What was tried before giving up (the default names the retry).

    Attributes
    ----------
    pool : str
        Description of the pool (kind, device).
    size : int
        Requested bytes.
    stats : object
        The pool's :class:`~cupy_poolmem.PoolStats` when the error was raised.

    Examples
    --------
    >>> e = OutOfPoolMemoryError("DevicePool(device=0)", 1 << 40)
    >>> isinstance(e, MemoryError), e.size
    (True, 1099511627776)
    """

    def __init__(self, pool: str, size: int, stats: Any = None, detail: str | None = None) -> None:
        self.pool, self.size, self.stats = pool, int(size), stats
        used = getattr(stats, "used_bytes", 0)
        reserved = getattr(stats, "reserved_bytes", 0)
        limit = getattr(stats, "max_size", 0)
        # OutOfMemoryError's own __init__ formats its message from (size, total, limit).
        _CupyOutOfMemoryError.__init__(self, int(size), int(used), int(limit or 0))
        lim = f"{limit:,} bytes" if limit else "device memory"
        self.args = (
            f"{pool}: out of memory allocating {int(size):,} bytes "
            f"(used {used:,} bytes, reserved {reserved:,} bytes, limit {lim}) "
            + (
                detail or "after garbage collection, collecting shared blocks and trimming the pool"
            ),
        )

    def __str__(self) -> str:
        return self.args[0]


class PinnedOutOfMemoryError(PoolmemError, _CUDARuntimeError):
    """The pinned pool could not satisfy an allocation.

    Subclasses CuPy's ``CUDARuntimeError`` with ``status == cudaErrorMemoryAllocation``:
    that is what CuPy's asynchronous host-to-device staging catches before it falls back
    to a synchronous copy, so the fallback keeps working with a :class:`PinnedPool`.

    Parameters
    ----------
    pool : str
        Description of the pool (kind, NUMA node).
    size : int
        Requested bytes.
    stats : PoolStats, optional
        The pool's statistics when the allocation failed.
    detail : str, optional
        Appended to the message.

    Examples
    --------
    >>> e = PinnedOutOfMemoryError("PinnedPool(numa_node=0)", 1 << 40)
    >>> e.status, e.size
    (2, 1099511627776)
    """

    def __init__(self, pool: str, size: int, stats: Any = None, detail: str | None = None) -> None:
        _CUDARuntimeError.__init__(self, _CUDA_ERROR_MEMORY_ALLOCATION)
        if not hasattr(self, "status"):  # no CuPy: RuntimeError has no status of its own
            self.status = _CUDA_ERROR_MEMORY_ALLOCATION
        self.pool, self.size, self.stats = pool, int(size), stats
        self.args = (
            f"{pool}: out of pinned memory allocating {int(size):,} bytes "
            "(cudaErrorMemoryAllocation)" + (f": {detail}" if detail else ""),
        )

    def __str__(self) -> str:
        return self.args[0]


def error_name(code: Any) -> str:
    """The CUDA error name of a ``CUresult`` (its number where the driver has no name).

    Examples
    --------
    >>> error_name(2), error_name(123456)
    ('CUDA_ERROR_OUT_OF_MEMORY', 'CUresult 123456')
    """
    from cuda.bindings import driver

    try:
        return driver.CUresult(int(code)).name
    except ValueError:
        return f"CUresult {int(code)}"


def check_driver(result: Any, call: str) -> Any:
    """Unpack a ``cuda.bindings.driver`` result tuple; raise :class:`CUDADriverError` on failure.

    Examples
    --------
    A successful call's values come back without the status:

    >>> check_driver((0, 13000), "cuDriverGetVersion")
    13000
    >>> check_driver((0,), "cuCtxSynchronize") is None
    True
    """
    err, *rest = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != 0:
        from cuda.bindings import driver

        name = error_name(code)
        try:
            _, desc = driver.cuGetErrorString(driver.CUresult(code))
            desc = desc.decode() if isinstance(desc, bytes) else ""
        except Exception:  # no libcuda: the name alone
            desc = ""
        raise CUDADriverError(call, code, name, desc)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


#: How to get the GPU features on a base install; every :class:`MissingDependencyError` says it.
GPU_EXTRA_HINT = 'pip install "cupy_poolmem[cu13]" (or "cupy_poolmem[cu12]" for CUDA 12 drivers)'


class MissingDependencyError(PoolmemError, ImportError):
    """An optional dependency of the feature used is not installed.

    A base install (``pip install cupy_poolmem``) imports and reads allocation logs
    without CUDA packages; the GPU features need the ``cu13`` (or ``cu12``) extra,
    plots need matplotlib.  The message names what to install.  Derives from
    :class:`ImportError`, which code probing for optional features already catches.

    Parameters
    ----------
    feature : str
        What was used.
    reason : str, optional
        The import error's own message, appended in parentheses.
    needs : str, optional
        What the feature needs (default: CuPy and cuda.core).
    install : str, optional
        The command that installs it (default: the ``cu13`` / ``cu12`` extra).

    Attributes
    ----------
    feature : str
        What was used (``"cupy_poolmem.DevicePool"``, ``"report --plot"``).
    install : str
        The command that installs what is missing.
    reason : str
        The import error's own message ("" if none was given).

    Examples
    --------
    >>> e = MissingDependencyError("cupy_poolmem.DevicePool", "No module named 'cupy'")
    >>> isinstance(e, ImportError), e.install.startswith("pip install")
    (True, True)
    >>> print(e)  # doctest: +ELLIPSIS
    cupy_poolmem.DevicePool needs CuPy and cuda.core, which is not installed: pip install ...
    """

    def __init__(
        self,
        feature: str,
        reason: str = "",
        *,
        needs: str = "CuPy and cuda.core",
        install: str = GPU_EXTRA_HINT,
    ) -> None:
        self.feature, self.install, self.reason = feature, install, reason
        msg = f"{feature} needs {needs}, which is not installed: {install}"
        super().__init__(msg + (f" ({reason})" if reason else ""))


class LogFormatError(PoolmemError, ValueError):
    """A file given to :mod:`cupy_poolmem.report` is not a readable allocation log.

    Raised for binary or undecodable files, empty files, files whose first line is not
    the log's header, and directories without logs.  The message starts with the
    file's name.

    Parameters
    ----------
    path : str
        The file (or directory) at fault.
    reason : str
        What is wrong with it.

    Attributes
    ----------
    path : str
        The file (or directory) at fault.

    Examples
    --------
    >>> str(LogFormatError("run.csv", "empty file (no header line)"))
    'run.csv: empty file (no header line)'
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: {reason}")


class UsageError(PoolmemError, RuntimeError):
    """An object was used in a way it cannot work.

    For example a Numba memory manager created by hand instead of by Numba.  The
    message says how to use it instead.

    Examples
    --------
    >>> isinstance(UsageError("let Numba create the memory manager"), RuntimeError)
    True
    """


class HandleStateError(SharingError, ValueError):
    """A sharing handle was used in a state that does not allow it.

    Opened twice, closed before it was opened, or opened in the process that
    exported it.  Also a :class:`ValueError`, which Numba's own ``IpcHandle`` raises
    in these cases.

    Examples
    --------
    >>> e = HandleStateError("the handle is already open")
    >>> isinstance(e, SharingError), isinstance(e, ValueError)
    (True, True)
    """


# ----------------------------------------------------------------------------------------
# Guard mode (cupy_poolmem._guard): memory-safety bugs, distinct from out-of-memory and
# driver errors.  RuntimeError as the common builtin base: a corrupted heap is a runtime
# failure, and none of them is an OutOfMemoryError that a retry-after-freeing handler
# would swallow.
# ----------------------------------------------------------------------------------------
class GuardError(PoolmemError, RuntimeError):
    """A memory-safety bug found by the guard (``DevicePool(guard=True)``).

    The message names the block (pointer, size, generation), where it was allocated
    and freed, and the likely fix.  Raised, or only warned about
    (:class:`GuardWarning`), as :class:`~cupy_poolmem.GuardOptions` says.

    Parameters
    ----------
    message : str
        What happened, where the block was allocated and freed, and the likely fix.
    block : GuardedBlock, optional
        The block concerned.
    offset : int, optional
        For damaged memory: offset of the first changed byte.
    n_changed : int, optional
        For damaged memory: how many bytes were changed.

    Attributes
    ----------
    kind : str
        ``"use_after_free"``, ``"unordered_stream"``, ``"double_free"``,
        ``"unknown_free"`` or ``"out_of_bounds"``; the column ``op`` of the allocation
        log says ``guard:<kind>``.
    block : GuardedBlock or None
        The block concerned (a snapshot), when known.
    offset : int or None
        For damaged memory: offset of the first changed byte from the block's start.
    n_changed : int
        For damaged memory: how many bytes were changed.

    Examples
    --------
    >>> e = UseAfterFreeError("block 0x7f00 was written after it was freed")
    >>> isinstance(e, GuardError), isinstance(e, RuntimeError), e.kind
    (True, True, 'use_after_free')
    """

    kind = "guard"

    def __init__(
        self, message: str, block: Any = None, offset: int | None = None, n_changed: int = 0
    ) -> None:
        super().__init__(message)
        self.block, self.offset, self.n_changed = block, offset, int(n_changed)


class UseAfterFreeError(GuardError, ReferenceError):
    """Memory was used after its allocation was freed.

    Written after the free (the poison pattern of a quarantined block changed), or a
    pointer checked with :func:`~cupy_poolmem.check` that no longer names a live
    allocation (freed, or its address reused by a newer generation).  Also a
    :class:`ReferenceError`, Python's error for using an object that is gone.

    Parameters
    ----------
    message : str
        What happened, where the block was allocated and freed, and the likely fix.
    block : GuardedBlock, optional
        The block concerned.
    offset : int, optional
        For damaged memory: offset of the first changed byte.
    n_changed : int, optional
        For damaged memory: how many bytes were changed.

    Examples
    --------
    >>> e = UseAfterFreeError("block 0x7f00 (4096 bytes) was written after its free")
    >>> isinstance(e, ReferenceError), e.kind
    (True, 'use_after_free')
    """

    kind = "use_after_free"


class UnorderedReuseError(UseAfterFreeError):
    """A block was freed while a stream that may still use it was not ordered before its reuse.

    The block was dropped while a stream other than its allocation stream was current,
    and that stream was not declared with :func:`~cupy_poolmem.record_stream`: the pool
    reuses the memory in the order of the allocation stream only.

    Parameters
    ----------
    message : str
        What happened, where the block was allocated and freed, and the likely fix.
    block : GuardedBlock, optional
        The block concerned.
    offset : int, optional
        For damaged memory: offset of the first changed byte.
    n_changed : int, optional
        For damaged memory: how many bytes were changed.

    Examples
    --------
    >>> e = UnorderedReuseError("block 0x7f00 freed on stream 2, not recorded")
    >>> isinstance(e, UseAfterFreeError), e.kind
    (True, 'unordered_stream')
    """

    kind = "unordered_stream"


class DoubleFreeError(GuardError):
    """A block was freed twice, or a pointer the pool never handed out was freed.

    ``kind`` is ``"double_free"`` or ``"unknown_free"``.  The second free is not
    done: the guard never frees memory twice.

    Parameters
    ----------
    message : str
        What happened and where the block was allocated and freed.
    block : GuardedBlock, optional
        The block concerned.
    unknown : bool, optional
        The pointer was never handed out by the pool (``kind == "unknown_free"``).

    Examples
    --------
    >>> DoubleFreeError("0x7f00 freed twice").kind
    'double_free'
    >>> DoubleFreeError("0x1234 is not a block of this pool", unknown=True).kind
    'unknown_free'
    """

    kind = "double_free"

    def __init__(self, message: str, block: Any = None, *, unknown: bool = False) -> None:
        super().__init__(message, block)
        if unknown:
            self.kind = "unknown_free"


class OutOfBoundsWriteError(GuardError):
    """Something wrote past the end of an allocation (into the guard's red zone).

    Parameters
    ----------
    message : str
        What happened, where the block was allocated and freed, and the likely fix.
    block : GuardedBlock, optional
        The block concerned.
    offset : int, optional
        For damaged memory: offset of the first changed byte.
    n_changed : int, optional
        For damaged memory: how many bytes were changed.

    Examples
    --------
    >>> e = OutOfBoundsWriteError("block 0x7f00: 8 bytes written past its end", offset=4096)
    >>> e.kind, e.offset
    ('out_of_bounds', 4096)
    """

    kind = "out_of_bounds"


class GuardWarning(RuntimeWarning):
    """The warning category of the guard's reports in ``mode="warn"``.

    The message is the text the matching :class:`GuardError` would carry.  Turn them
    into errors for one run with ``python -W error::cupy_poolmem.GuardWarning``, or
    filter them with the ``warnings`` module.

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("block 0x7f00 written after its free", GuardWarning)
    >>> caught[0].category.__name__
    'GuardWarning'
    """


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (which keeps ``__notes__`` but does
    not print them)."""
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]
