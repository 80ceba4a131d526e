# cython: language_level=3, boundscheck=False, wraparound=False
"""The allocation hot path: ``malloc -> MemoryPointer``, the stream-ordered free, and
the reuse cache between them.

It owns a pool's per-allocation state (``PoolCore``) and its live blocks (``Block``);
the pool classes subclass ``PoolCore`` and supply the slow paths.  ``_hotpath_py.py``
is its pure-Python twin; docs/hotpath.rst describes both.
"""

cimport cython
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer
from cpython.ref cimport PyObject, Py_XDECREF

cdef extern from "Python.h":
    int PyObject_GC_IsFinalized(object)  # 0 for None and objects the GC does not track
from libc.stdint cimport intptr_t, uintptr_t
from libc.stdlib cimport free as _c_free, realloc as _c_realloc
from libc.string cimport strcmp

from cupy_poolmem._arena cimport Arena
from cupy_poolmem._recorder cimport Observed, Observer

import cupy.cuda.stream as _cupy_stream
from cupy.cuda.memory import MemoryPointer as _MemoryPointer
from cupy.cuda.memory import UnownedMemory as _UnownedMemory
from cupy.cuda.pinned_memory import PinnedMemoryPointer as _PinnedMemoryPointer
from cupy.cuda.stream import get_current_stream as _get_current_stream

cdef extern from *:
    """
    /* type(*args) the way type_call makes it (tp_new, then tp_init on an instance of
       the type) without the call protocol around it; for types whose metatype is
       ``type`` (checked below), so no metaclass __call__ is skipped. */
    static PyObject* cpm_make(PyTypeObject* t, PyObject* args) {
        PyObject* o = t->tp_new(t, args, NULL);
        if (o != NULL && Py_IS_TYPE(o, t) && t->tp_init(o, args, NULL) < 0) {
            Py_CLEAR(o);
        }
        return o;
    }
    """
    object _make "cpm_make"(type t, tuple args)

# CuPy's memory objects, made without the generic call (the types checked are those made).
cdef type _c_memory_pointer = _MemoryPointer
cdef type _c_unowned_memory = _UnownedMemory
cdef bint _direct = type(_MemoryPointer) is type and type(_UnownedMemory) is type

import cuda.bindings.cydriver as _cydriver
from operator import index as _operator_index
from cupy_poolmem._recorder import LOG_BATCH, Recorder  # noqa: F401  (re-exported: _runtime)

# The four driver calls, from cuda.bindings' compiled ``cydriver`` (its exported C
# functions, signatures checked: see docs/hotpath.rst); the driver ABI's 64-bit types.
ctypedef int CUresult
ctypedef int CUdevice
ctypedef unsigned long long CUdeviceptr
ctypedef void* CUmemoryPool
ctypedef void* CUstream
ctypedef int CUstreamCaptureStatus
ctypedef CUresult (*_alloc_fn)(CUdeviceptr*, size_t, CUmemoryPool, CUstream) except ?500 nogil
ctypedef CUresult (*_free_fn)(CUdeviceptr, CUstream) except ?500 nogil
ctypedef CUresult (*_ctxdev_fn)(CUdevice*) except ?500 nogil
ctypedef CUresult (*_capturing_fn)(CUstream, CUstreamCaptureStatus*) except ?500 nogil


cdef void* _driver_fn(str name, bytes signature) except NULL:
    capsule = _cydriver.__pyx_capi__.get(name)
    if capsule is None:
        raise ImportError(f"cuda.bindings.cydriver exports no {name}")
    if strcmp(PyCapsule_GetName(capsule), signature) != 0:
        raise ImportError(f"cuda.bindings.{name} has signature "
                          f"{PyCapsule_GetName(capsule)!r}, expected {signature!r}")
    return PyCapsule_GetPointer(capsule, signature)


cdef _alloc_fn cuMemAllocFromPoolAsync = <_alloc_fn>_driver_fn(
    "cuMemAllocFromPoolAsync", b"CUresult (CUdeviceptr *, size_t, CUmemoryPool, CUstream)")
cdef _free_fn cuMemFreeAsync = <_free_fn>_driver_fn(
    "cuMemFreeAsync", b"CUresult (CUdeviceptr, CUstream)")
cdef _ctxdev_fn cuCtxGetDevice = <_ctxdev_fn>_driver_fn(
    "cuCtxGetDevice", b"CUresult (CUdevice *)")
cdef _capturing_fn cuStreamIsCapturing = <_capturing_fn>_driver_fn(
    "cuStreamIsCapturing", b"CUresult (CUstream, CUstreamCaptureStatus *)")

# CuPy's exported C function for the current stream's handle (no Python call).
ctypedef intptr_t (*_stream_ptr_fn)() noexcept
cdef _stream_ptr_fn _c_current_stream_ptr = NULL
try:
    _c_current_stream_ptr = <_stream_ptr_fn>PyCapsule_GetPointer(
        _cupy_stream.__pyx_capi__["get_current_stream_ptr"], b"intptr_t (void)")
except Exception:
    _c_current_stream_ptr = NULL


cdef inline uintptr_t _current_stream_ptr() except? 0:
    if _c_current_stream_ptr != NULL:
        return <uintptr_t>_c_current_stream_ptr()
    return _get_current_stream().ptr


KIND_DEVICE = 0
KIND_PINNED = 1
KIND_MANAGED = 2
cdef int _KIND_PINNED = 1  # the C twin of KIND_PINNED (no module lookup and compare)
IMPLEMENTATION = "cython"
# Bumped whenever the compiled modules change shape: a stale build is not used.
VERSION = 16
from cupy_poolmem._streams import stream_key as _stream_key
#: The arena class the hot path takes blocks from (``DevicePool(large_blocks="expandable")``).
ARENA = Arena

# Misses beyond hits (see PoolCore._cache_missed) at which a non-empty reuse cache is flushed.
FLUSH_AFTER_MISSES = 16
cdef unsigned int _FLUSH_AFTER_MISSES = 16

# Block.flags: why a block's free leaves the plain path (one test when none is set).
FLAG_RECORDED = 1   # record_stream: the free waits for the recorded streams first
FLAG_CAPTURED = 2   # graph-owned memory from a stream capture: never cached
FLAG_ADVISED = 4    # managed memory given hints: they are reset before reuse
cdef unsigned int _FLAG_RECORDED = 1
cdef unsigned int _FLAG_ADVISED = 4
cdef unsigned int _FLAG_SPECIAL = 2 | 4

# Set by cupy_poolmem._sharing, both fn(core, ptr, size, stream, share) for an exported
# block: on its free (True: the exporter kept it), and when the cache lets it go or its
# pool was finalized (stream None; True: the exporter frees it after its receivers).
_shared_release = None
_shared_retire = None


def set_shared_release(fn, retire=None):
    """Install the sharing package's callbacks; returns the two it replaced."""
    global _shared_release, _shared_retire
    old = _shared_release, _shared_retire
    _shared_release, _shared_retire = fn, retire
    return old


cdef object _index(object owner, object size):
    """A size that is not exactly an int: ``__index__`` (no float truncation), as the twin."""
    try:
        return _operator_index(size)
    except TypeError:
        owner._bad_size(size)
        raise


@cython.freelist(256)
@cython.no_gc_clear
cdef class Block:
    """One live pool allocation; CuPy's memory object owns it through ``UnownedMemory``."""
    cdef readonly uintptr_t ptr
    cdef readonly size_t size
    cdef readonly uintptr_t stream_ptr
    cdef readonly object stream
    cdef readonly PoolCore core
    cdef public object share   # sharing record once exported (see _sharing.py)
    cdef public object info    # tracking record (tag, call site) when observed
    cdef readonly unsigned int flags  # FLAG_* bits; 0 on the plain path
    cdef object _recorded      # None, or [(stream handle, device, stream object), ...]
    cdef object __weakref__

    @property
    def recorded_streams(self):
        """The streams given to ``record_stream`` for this block, as a tuple."""
        if self._recorded is None:
            return ()
        return tuple(e[2] for e in self._recorded)

    def wait_recorded(self, stream):
        """Make ``stream`` wait (on the device) for the work now on the recorded streams."""
        if self._recorded is not None:
            self.core._wait_recorded(stream, self._recorded)

    def _record(self, entry):
        """Add a ``(handle, device, stream)`` entry (``record_stream`` validated it)."""
        if self._recorded is None:
            self._recorded = []
        for e in self._recorded:
            if e[0] == entry[0] and e[1] == entry[1]:
                return
        self._recorded.append(entry)
        self.flags |= _FLAG_RECORDED

    def _mark_advised(self):
        self.flags |= _FLAG_ADVISED

    def __dealloc__(self):
        cdef PoolCore core = self.core
        cdef bint kept = False
        if core is None:
            return
        if self.ptr == 0:  # a size-0 allocation: counted, nothing to free
            core.n_frees += 1
            if core.closed and core.n_frees == core.n_allocs:
                core._drained()
            return
        core.live_bytes -= self.size
        try:
            if (core.finalized or PyObject_GC_IsFinalized(self.stream)
                    or (self.flags & _FLAG_RECORDED and _any_finalized(self._recorded))):
                # Its pool, its stream or a recorded stream was finalized in a garbage
                # cycle: no stream is touched (docs/hotpath.rst, frees in garbage cycles).
                if core.observer is not None:
                    core.observer._free(core, self.ptr, self.size, self.stream_ptr, self.info)
                # An exported block goes to its exporter first (receivers may map it).
                if self.share is not None and core._retire_shared(
                        self.ptr, self.size, None, self.share):
                    kept = True
                else:
                    kept = core._orphan(self.ptr, self.size, self.flags)
            else:
                if self.flags & _FLAG_RECORDED:
                    # First: every later path is ordered after the recorded streams.
                    core._wait_recorded(self.stream, self._recorded)
                if core.observer is not None:
                    core.observer._free(core, self.ptr, self.size, self.stream_ptr, self.info)
                if self.share is not None and _shared_release is not None:
                    if _shared_release(core, self.ptr, self.size, self.stream, self.share):
                        core.n_frees += 1  # in limbo: the exporter frees it, then drains
                        return
                if core.release_hook is not None:  # pinned deferral, graph memory
                    kept = core.release_hook(self.ptr, self.size, self.stream)
                if not kept and self.flags & _FLAG_SPECIAL:
                    kept = core._free_flagged(self.ptr, self.size, self.stream, self.flags)
        except BaseException:
            # A hook could not decide its fate: leaked (reuse while mapped is not safe).
            core.n_free_errors += 1
            core.n_frees += 1
            return
        if not kept:
            try:
                core._release(self.ptr, self.size, self.stream_ptr, self.stream)
            except BaseException:
                # Its free raised: leaked, and counted below (or a closed pool would
                # wait for it forever).
                core.n_free_errors += 1
        # Counted once its free is queued: a close() seeing every block freed may retire.
        core.n_frees += 1
        if core.closed and core.n_frees == core.n_allocs:
            core._drained()  # a closed pool's last block, however it went


cdef bint _any_finalized(list recorded):
    """Whether a stream given to record_stream was finalized (destroyed by cupy)."""
    if recorded is None:
        return False
    for entry in recorded:
        if PyObject_GC_IsFinalized(entry[2]):
            return True
    return False


@cython.final
@cython.no_gc_clear  # its list is never set to None (the pool's dict breaks cycles)
cdef class _Bin:
    """The reuse cache's blocks of one (stream handle, size), the last freed reused first:
    addresses in a C array, the stream object that freed each in a list beside it."""
    cdef readonly uintptr_t stream_ptr
    cdef readonly size_t size
    cdef readonly Py_ssize_t n       # blocks held: ptrs[:n], streams[:n]
    cdef Py_ssize_t cap
    cdef uintptr_t* ptrs
    cdef list streams

    def __cinit__(self):
        self.streams = []

    def __dealloc__(self):
        _c_free(self.ptrs)

    @cython.boundscheck(True)  # n and the list agree; checked anyway (a compare)
    cdef int push(self, uintptr_t ptr, object stream) except -1:
        cdef uintptr_t* grown
        if self.n == self.cap:
            grown = <uintptr_t*>_c_realloc(self.ptrs, (2 * self.cap + 4) * sizeof(uintptr_t))
            if grown == NULL:
                raise MemoryError("no memory for the reuse cache")
            self.ptrs = grown
            self.cap = 2 * self.cap + 4
        if self.n >= len(self.streams):
            self.streams.append(stream)  # may fail: nothing changed yet
        else:
            self.streams[self.n] = stream
        self.ptrs[self.n] = ptr
        self.n += 1
        return 0

    @cython.boundscheck(True)
    cdef object take(self, CUdeviceptr* ptr):
        """The last block in (``n`` > 0): its address in ``ptr``; returns its stream."""
        self.n -= 1
        ptr[0] = self.ptrs[self.n]
        stream = self.streams[self.n]
        self.streams[self.n] = None
        return stream

    @cython.boundscheck(True)
    def entries(self):
        """``[(ptr, stream), ...]``, first cached first (flush, tests)."""
        return [(self.ptrs[i], self.streams[i]) for i in range(self.n)]


cdef class PoolCore(Observed):
    """The per-pool state the hot path needs; Python pool classes subclass it.

    It owns the reuse cache (``_cache``: (stream handle, size) -> ``_Bin``; ``_shares``:
    address -> sharing record of each cached exported block) and the pool's counters.
    """
    cdef CUmemoryPool _pool
    cdef CUmemoryPool _small         # the small-block pool (``_pool`` when there is none)
    cdef readonly size_t small_max   # blocks up to this size come from ``_small`` (0: none)
    cdef readonly int device_id
    cdef readonly int kind
    cdef readonly bint closed
    cdef public Observer observer    # None while nothing is observed (see Recorder)
    cdef public object release_hook  # None, or fn(ptr, size, stream) -> bool
    cdef public unsigned long long n_allocs
    cdef public unsigned long long n_frees
    cdef public unsigned long long n_free_errors
    cdef public unsigned long long n_oom
    cdef public long long live_bytes
    cdef public long long peak_live_bytes
    cdef readonly dict _cache        # (stream_ptr, size) -> _Bin
    cdef dict _shares                # ptr -> sharing record, for cached exported blocks
    cdef _Bin _last_bin              # the bin of (_last_sptr, _last_size), or None
    cdef uintptr_t _last_sptr
    cdef size_t _last_size
    cdef public size_t cache_limit
    cdef public size_t cache_max_block
    cdef readonly size_t cached_bytes
    cdef public size_t soft_limit    # 0, or max live bytes (checked before the driver)
    cdef public size_t n_capture_held  # driver frees held until a capture ends
    cdef public object _backend      # allocator object for blocks no CUDA pool serves
    cdef public size_t backend_min   # blocks of at least this size come from ``_backend``
    cdef public object _backend_ptrs  # the backend's blocks (``in``), when it serves some only
    # Plain C fields, so they survive tp_clear of a pool in a garbage cycle (it empties
    # the __dict__ and sets the object fields above to None) for its blocks freed after.
    cdef public unsigned long long _retire_token  # the retirer's name for its pool (0: none)
    cdef readonly bint finalized     # the pool's finalizer ran: blocks avoid their streams
    cdef public bint _close_done     # close() has handed everything over: may be retired
    cdef readonly unsigned int cache_misses  # the cache's misses less its hits (see _cache_missed)
    # large_blocks="expandable": stream handle -> (small blocks' Arena, large ones'),
    # the ExpandableBlocks' own dict; the arenas of _arena_sptr are remembered.
    cdef readonly dict _arenas
    cdef uintptr_t _arena_sptr
    cdef Arena _arena_small          # None: look the stream up in _arenas
    cdef Arena _arena_large
    cdef readonly size_t arena_small_max

    def _attach(self, uintptr_t pool_handle, int device_id, int kind):
        self._pool = <CUmemoryPool>pool_handle
        self._small = self._pool
        self.small_max = 0
        # No CUDA pool: every block from ``_backend``; else none until _attach_backend.
        self.backend_min = <size_t>-1 if pool_handle else 0
        self._backend_ptrs = None
        self.device_id = device_id
        self.kind = kind
        self._cache = {}
        self._shares = {}

    def _attach_small(self, uintptr_t pool_handle, size_t small_max):
        """Blocks of 1 to ``small_max`` bytes come from the CUDA pool ``pool_handle``."""
        self._small = <CUmemoryPool>pool_handle
        self.small_max = small_max

    def _attach_backend(self, backend, size_t backend_min, ptrs):
        """Blocks of ``backend_min`` bytes or more come from ``backend`` (its
        ``_backend_alloc``); a freed address in ``ptrs`` goes back to it."""
        self._backend = backend
        self._backend_ptrs = ptrs
        self.backend_min = backend_min

    def _attach_arenas(self, dict arenas, size_t small_max):
        """Blocks from ``arenas`` (stream handle -> (arena of blocks up to ``small_max``
        bytes, arena of larger ones), the backend's dict) before the backend."""
        self._arenas = arenas
        self.arena_small_max = small_max
        self._arena_small = self._arena_large = None

    @cython.final
    cdef inline Arena _arena(self, uintptr_t sptr, size_t size):
        """The arena of (``sptr``, ``size``), or None when the stream has none yet (handle
        2, the per-thread default stream: this thread's arenas, by ``stream_key``)."""
        if sptr == 2:
            sptr = _stream_key(2)
        if self._arena_small is None or sptr != self._arena_sptr:
            pair = self._arenas.get(sptr)
            if pair is None:
                return None
            self._arena_small, self._arena_large = pair
            self._arena_sptr = sptr
        return self._arena_small if size <= self.arena_small_max else self._arena_large

    @cython.final
    cdef inline CUdeviceptr _arena_take(self, size_t size, uintptr_t sptr):
        """A block from the stream's arena without a driver call; 0 when it has no room
        (the backend maps more, or makes the arenas)."""
        cdef Arena a = self._arena(sptr, size)
        cdef CUdeviceptr p = 0
        if a is not None:
            p = a._take(size)
            if p == 0:
                self._arena_small = None  # the backend may replace the stream's arenas
        return p

    @cython.final
    cdef inline bint _arena_give(self, uintptr_t ptr, size_t size, uintptr_t sptr):
        """Whether the block at ``ptr`` went back to its stream's arena."""
        cdef Arena a = self._arena(sptr, size)
        if a is not None and a._give(ptr):
            return True
        self._arena_small = None
        return False

    cdef bint _observe(self, Observer observer, long long* live) except -1:
        if self.observer is observer:
            return False
        self.observer = observer
        live[0] = self.live_bytes
        return True

    def _mark_closed(self):
        self.closed = True
        self.flush_cache()

    def _poison(self):
        """Refuse allocations without touching CUDA (after a fork)."""
        self.closed = True

    def _mark_finalized(self):
        """From now on a freed block goes to :meth:`_orphan`, never to its stream."""
        self.finalized = True

    def malloc(self, size):
        """Allocate ``size`` bytes on CuPy's current stream; see the pool's docstring."""
        cdef size_t n
        if type(size) is not int:
            size = _index(self, size)
        try:
            n = size
        except OverflowError:
            self._bad_size(size)
            raise
        return self._malloc(n, False)

    cdef object _malloc(self, size_t size, bint device_checked):
        cdef CUdevice cur = -1
        cdef CUdeviceptr dptr = 0
        cdef CUresult err
        cdef CUstreamCaptureStatus cap = 0
        cdef uintptr_t sptr
        cdef _Bin hit
        cdef object share = None
        if self.closed:
            self._raise_closed()
        if self.kind != _KIND_PINNED and not device_checked:
            err = cuCtxGetDevice(&cur)
            if err != 0 or cur != self.device_id:
                self._raise_wrong_device(int(cur))
        sptr = _current_stream_ptr()
        if sptr > 1:  # 0 and 1 are the legacy stream, which cannot capture
            err = cuStreamIsCapturing(<CUstream>sptr, &cap)
            if err != 0 or cap != 0:
                return self._capture_malloc(size, int(err), int(cap))
        stream = None
        if size != 0:
            if self.soft_limit and self.live_bytes + size > self.soft_limit:
                stream = _get_current_stream()
                dptr = self._alloc_failed(2, size, stream)  # CUDA_ERROR_OUT_OF_MEMORY
            elif self.cached_bytes:
                hit = self._bin(sptr, size, False)
                if hit is not None and hit.n:
                    stream = hit.take(&dptr)  # and the stream object that freed it
                    if self._shares:  # an exported block comes back with its record
                        share = self._shares.pop(dptr, None)
                    self.cached_bytes -= size
                    if self.cache_misses:  # a hit takes one miss back (see _cache_missed)
                        self.cache_misses -= 1
                    if PyObject_GC_IsFinalized(stream):  # see _drop_stale
                        self._drop_stale(dptr, size, share)
                        dptr, share = 0, None
                else:
                    self._cache_missed()
            if dptr == 0:
                stream = _get_current_stream()
                if self.n_capture_held:
                    self._drain_capture_held()
                if self._arenas is not None:
                    dptr = self._arena_take(size, sptr)
                    if dptr == 0:
                        dptr = self._backend_alloc(size, stream)
                elif size < self.backend_min:
                    err = cuMemAllocFromPoolAsync(&dptr, size, self._pool_for(size),
                                                  <CUstream>sptr)
                    if err != 0:
                        dptr = self._alloc_failed(int(err), size, stream)
                else:
                    dptr = self._backend_alloc(size, stream)
        else:
            stream = _get_current_stream()
        return self._wrap(dptr, size, sptr, stream, 0, share)

    def _make_block(self, uintptr_t ptr, size_t size, stream, unsigned int flags):
        """A live block for memory a slow path allocated (graph capture)."""
        return self._wrap(ptr, size, stream.ptr, stream, flags, None)

    cdef object _wrap(self, CUdeviceptr dptr, size_t size, uintptr_t sptr, object stream,
                      unsigned int flags, object share):
        cdef Block b = Block.__new__(Block)
        cdef PyObject* info = NULL
        b.ptr = dptr
        b.size = size
        b.stream_ptr = sptr
        b.stream = stream
        b.core = self
        b.flags = flags
        b.share = share  # None, or the record of an exported block back from the cache
        self.n_allocs += 1
        self.live_bytes += size
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
        if self.observer is not None:  # statistics(), a log, tracking: see Recorder
            try:
                self.observer._alloc(self, dptr, size, sptr, &info)  # raises only a Ctrl-C
            finally:
                if info != NULL:  # the block's Info, set even when it raises
                    b.info = <object>info
                    Py_XDECREF(info)
        if self.kind == _KIND_PINNED:
            return _PinnedMemoryPointer(b, 0)
        if _direct:  # as below, without the generic call protocol (cpm_make)
            mem = _make(_c_unowned_memory, (dptr, size, b, self.device_id))
            return _make(_c_memory_pointer, (mem, 0))
        return _MemoryPointer(_UnownedMemory(dptr, size, b, self.device_id), 0)

    cdef _cache_missed(self):
        """A miss while the cache holds blocks (a hit takes one back): at
        FLUSH_AFTER_MISSES the cache is flushed (docs/hotpath.rst, the reuse cache)."""
        self.cache_misses += 1
        if self.cache_misses >= _FLUSH_AFTER_MISSES:
            self.cache_misses = 0
            self.flush_cache()

    @cython.final
    cdef inline CUmemoryPool _pool_for(self, size_t size) noexcept:
        """The CUDA pool a block of ``size`` bytes comes from (``_small`` up to ``small_max``)."""
        return self._small if size <= self.small_max else self._pool

    @cython.final
    cdef _Bin _bin(self, uintptr_t sptr, size_t size, bint create):
        """The cache's bin of (sptr, size); None when it has none and not ``create``."""
        cdef _Bin b = self._last_bin
        if b is not None and size == self._last_size and sptr == self._last_sptr:
            return b
        key = (sptr, size)
        b = self._cache.get(key)
        if b is None:
            if not create:
                return None
            b = _Bin.__new__(_Bin)
            b.stream_ptr, b.size = sptr, size
            # setdefault: a garbage collection in __new__ may have freed a block here
            b = self._cache.setdefault(key, b)
        self._last_bin, self._last_sptr, self._last_size = b, sptr, size
        return b

    cdef _release(self, uintptr_t ptr, size_t size, uintptr_t stream_ptr, object stream):
        cdef _Bin b
        if self._arenas is not None and self._arena_give(ptr, size, stream_ptr):
            return  # back in its stream's arena: the next allocation there may take it
        if (size <= self.cache_max_block and self.cached_bytes + size <= self.cache_limit
                and not self.closed):
            b = self._bin(stream_ptr, size, True)
            # A collection in _bin (it allocates) may have closed the pool: its cache
            # is flushed and takes nothing more.  From here to the push no allocation.
            if not self.closed:
                b.push(ptr, stream)
                self.cached_bytes += size
                return
        self._free(ptr, stream_ptr, stream)

    def _cache_shared(self, uintptr_t ptr, size_t size, uintptr_t stream_ptr, stream, share):
        """Keep an exported block with its sharing record ``share`` (any size within
        ``cache_limit``); False when the cache cannot take it (full, off, closed)."""
        cdef _Bin b
        if self.closed or self.finalized or self.cached_bytes + size > self.cache_limit:
            return False
        # First: a block is never cached without its record.  The map is never swapped
        # out: a flush (a collection in _bin may run one) takes only the records of the
        # blocks it takes, so this one stays for the block pushed next.
        self._shares[ptr] = share
        try:
            b = self._bin(stream_ptr, size, True)
            if self.closed or self.finalized:  # closed by a collection in _bin
                self._shares.pop(ptr, None)
                return False
            b.push(ptr, stream)
        except BaseException:
            self._shares.pop(ptr, None)
            raise
        self.cached_bytes += size
        return True

    cdef bint _retire_shared(self, ptr, size, stream, share):
        """Whether the exporter keeps an exported block for its final free (True, also when
        its hook fails), or it may be freed now on ``stream`` (None: the legacy one)."""
        if _shared_retire is None:
            return False
        try:
            return bool(_shared_retire(self, ptr, size, stream, share))
        except BaseException:
            self.n_free_errors += 1
            return True

    def flush_cache(self):
        """Free every block held in the reuse cache (stream-ordered; an exported one by its
        exporter); returns bytes freed.  The first error of a free is raised at the end."""
        cdef size_t freed = 0
        cdef _Bin b
        err = None
        for b in self._swap_cache().values():
            freed += b.n * b.size
            for ptr, stream in b.entries():
                try:
                    share = self._shares.pop(ptr, None) if self._shares else None
                    if PyObject_GC_IsFinalized(stream):
                        self._drop_stale(ptr, b.size, share)
                        continue
                    if share is not None and self._retire_shared(ptr, b.size, stream, share):
                        continue
                    self._free(ptr, b.stream_ptr, stream)
                except BaseException as e:
                    if err is None:
                        err = e
        if err is not None:
            raise err
        return freed

    cdef _drop_stale(self, uintptr_t ptr, size_t size, object share):
        """A cached block whose stream object was finalized since (its handle may name a
        new stream now): an exported block goes to its exporter, any other to the
        retirer (``_orphan``: freed after a sync)."""
        if share is not None and self._retire_shared(ptr, size, None, share):
            return
        self._orphan(ptr, size, 0)

    cdef dict _swap_cache(self):
        """Empty the cache: its old ``_cache``, whose blocks are the caller's now (who pops
        their records from ``_shares``: a block taken meanwhile keeps its own)."""
        fresh = {}  # made first: a collection here may still cache a block in the old
        old = self._cache
        self._cache = fresh
        self._last_bin, self._last_sptr, self._last_size = None, 0, 0
        self.cached_bytes = 0
        return old

    def _take_cache(self):
        """Empty the reuse cache without freeing: ``[ptr, ...]`` for the caller to free
        after a device synchronise (a pool finalized in a garbage cycle).  An exported
        block goes to its exporter first, without its stream, and is listed only when no
        receiver maps it any more."""
        cdef _Bin b
        out = []
        for b in self._swap_cache().values():
            for ptr, _ in b.entries():
                share = self._shares.pop(ptr, None) if self._shares else None
                if share is not None and self._retire_shared(ptr, b.size, None, share):
                    continue
                out.append(ptr)
        return out

    def _try_alloc(self, size_t size, uintptr_t stream_ptr):
        """One raw attempt: returns ``(CUresult, ptr)``; used by the slow paths."""
        cdef CUdeviceptr dptr = 0
        cdef CUresult err
        if size >= self.backend_min:
            return self._backend_try(size, stream_ptr)
        err = cuMemAllocFromPoolAsync(&dptr, size, self._pool_for(size), <CUstream>stream_ptr)
        return int(err), int(dptr)

    cdef _free(self, uintptr_t ptr, uintptr_t stream_ptr, object stream):
        # ``stream``: the stream object when the caller has it (kept alive while held).
        cdef CUresult err
        cdef CUstreamCaptureStatus cap = 0
        if stream_ptr > 1:
            # A free on a capturing stream would become a graph node (or invalidate
            # the capture): hold it until the capture ends.
            err = cuStreamIsCapturing(<CUstream>stream_ptr, &cap)
            if err != 0 or cap != 0:
                self._hold_free(ptr, stream_ptr, int(err), stream)
                return
        if self._pool == NULL or (self._backend_ptrs is not None and ptr in self._backend_ptrs):
            self._backend_free(ptr, stream_ptr)
            return
        err = cuMemFreeAsync(<CUdeviceptr>ptr, <CUstream>stream_ptr)
        if err != 0:
            self._free_failed(ptr, stream_ptr, int(err), stream)

    def _free_now(self, uintptr_t ptr, uintptr_t stream_ptr, stream=None):
        """Free a block a hook kept earlier (limbo, deferred pinned frees)."""
        self._free(ptr, stream_ptr, stream)

    def _free_direct(self, uintptr_t ptr, uintptr_t stream_ptr):
        """The driver (or backend) free without the capture check; returns the CUresult."""
        if self._pool == NULL or (self._backend_ptrs is not None and ptr in self._backend_ptrs):
            self._backend_free(ptr, stream_ptr)
            return 0
        return int(cuMemFreeAsync(<CUdeviceptr>ptr, <CUstream>stream_ptr))

    # Slow paths, overridden by the Python pool classes.
    def _bad_size(self, size):
        pass  # the caller re-raises the conversion error

    def _capture_malloc(self, size, err, status):
        raise RuntimeError(f"stream capture (CUresult {err}, status {status})")

    def _free_flagged(self, ptr, size, stream, flags):
        return False

    def _orphan(self, ptr, size, flags):
        self.n_free_errors += 1  # leaked: no retirer to free it safely
        return True

    def _wait_recorded(self, stream, recorded):
        raise RuntimeError("record_stream needs a cupy_poolmem pool")

    def _hold_free(self, ptr, stream_ptr, err, stream):
        self.n_free_errors += 1

    def _free_failed(self, ptr, stream_ptr, err, stream):
        self.n_free_errors += 1

    def _drain_capture_held(self):
        pass

    def _backend_alloc(self, size, stream):
        raise MemoryError("no allocator")

    def _backend_try(self, size, stream_ptr):
        return 2, 0

    def _backend_free(self, ptr, stream_ptr):
        self.n_free_errors += 1

    def _raise_closed(self):
        raise RuntimeError("pool is closed")

    def _raise_wrong_device(self, current):
        raise RuntimeError(f"wrong device {current}")

    def _alloc_failed(self, err, size, stream):
        raise MemoryError(f"CUresult {err} allocating {size} bytes")

    def _drained(self):
        pass


cdef class Dispatch:
    """``malloc(size)`` that forwards to the current device's pool (created on first use)."""
    cdef list _mallocs
    cdef object _create

    def __init__(self, create, int n_devices):
        self._mallocs = [None] * n_devices
        self._create = create

    def __call__(self, size):
        cdef CUdevice d = 0
        cdef size_t n
        if type(size) is not int:
            size = _index(self, size)
        try:
            n = size
        except OverflowError:
            self._bad_size(size)
            raise
        if cuCtxGetDevice(&d) != 0 or d >= len(self._mallocs):
            return self._slow(-1).malloc(n)
        p = self._mallocs[d]
        if p is None:
            p = self._slow(d)
        return (<PoolCore>p)._malloc(n, (<PoolCore>p).device_id == d)

    def _bad_size(self, size):
        pass  # the caller re-raises the conversion error

    def _slow(self, int d):
        if d < 0:
            import cupy
            d = cupy.cuda.runtime.getDevice()
        p = self._create(d)
        self._mallocs[d] = p
        return p

    def _forget(self):
        self._mallocs = [None] * len(self._mallocs)
