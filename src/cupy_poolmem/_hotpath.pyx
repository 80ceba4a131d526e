# cython: language_level=3, boundscheck=False, wraparound=False
"""The allocation hot path: ``malloc -> MemoryPointer`` and the stream-ordered free.

Everything that happens per allocation is in :meth:`PoolCore.malloc` and
:meth:`Block.__dealloc__`; everything else (creating pools, statistics, errors,
sharing) lives in Python modules that call into this one.  ``_hotpath_py.py`` is the
pure-Python twin used when this extension is not built; keep the two in step.

Stream rule (documented for users): a block is allocated on CuPy's current stream
and freed, stream-ordered, on that same stream when its last reference goes away.
Streams recorded with ``record_stream`` make that free wait for their work first.

Graph capture: handles 0 and 1 name the legacy default stream, which cannot be
captured.  For any other stream the allocation asks the driver once whether it is
capturing (``cuStreamIsCapturing``) before the reuse cache is looked at; a capturing
stream goes to the pool's ``_capture_malloc`` slow path, which hands out graph-owned
memory flagged ``FLAG_CAPTURED``.  Such a block never enters the reuse cache, and no
cached block is ever handed to a capture.  A driver free on a stream that is
capturing is held by the pool until the capture ends.
"""

cimport cython
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer

cdef extern from "Python.h":
    int PyObject_GC_IsFinalized(object)  # 0 for None and objects the GC does not track
from libc.stdint cimport intptr_t, uintptr_t
from libc.stdlib cimport free as _c_free, realloc as _c_realloc
from libc.string cimport strcmp

from cupy_poolmem._arena cimport Arena

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

# CuPy's memory objects, made without the generic call (two per device allocation):
# the types checked here are the ones made (the module's names may be rebound).
cdef type _c_memory_pointer = _MemoryPointer
cdef type _c_unowned_memory = _UnownedMemory
cdef bint _direct = type(_MemoryPointer) is type and type(_UnownedMemory) is type

import cuda.bindings.cydriver as _cydriver
from operator import index as _operator_index
from weakref import ref as weakref_ref

# The four driver calls of the hot path, taken from cuda.bindings' compiled
# ``cydriver`` module (its exported C functions, which load libcuda themselves).
# Resolving them at import time, with their signatures checked, means this module
# needs no CUDA header to build and works with any cuda-bindings release that
# exports these signatures; on a mismatch the import fails and the package uses
# the pure-Python twin.  The types are the driver ABI's on 64-bit Linux.
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

# CuPy exports its C function for the current stream's handle; calling it directly
# costs nanoseconds where get_current_stream() costs a Python call.
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
# Bumped whenever the interface the pools use changes: a stale build is not used.
VERSION = 15
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

# Set by cupy_poolmem._sharing: called as fn(core, ptr, size, stream, share) for a
# block that was exported to other processes; returns True when it kept the block
# (limbo, or back in the reuse cache with its record: see _cache_shared).
_shared_release = None
# And fn(core, ptr, size, stream, share) when the reuse cache lets such a block go
# (trim, close, out of memory) or its pool was finalized (stream None: not to be
# touched): True when the exporter keeps it until its receivers have unmapped it;
# False: free it now (ordered after their unmaps).
_shared_retire = None


def set_shared_release(fn, retire=None):
    global _shared_release, _shared_retire
    _shared_release = fn
    _shared_retire = retire


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
                # The pool's finalizer ran: it was dropped in a garbage cycle with this
                # block, whose stream may be destroyed already (a cupy Stream's own
                # finalizer), and tp_clear may have emptied the pool's __dict__.  Or the
                # block's own stream, or one given to record_stream for it, was finalized
                # (a cycle of this array and its streams, the pool alive).  No stream is
                # touched: the retirer frees the block after a sync.
                if core.observer is not None:
                    core.observer._free(core, self.ptr, self.size, self.stream_ptr, self.info)
                # An exported block (reused from the cache) goes to its exporter first:
                # receivers may map it still (then it frees the block after them).
                if self.share is not None and core._retire_shared(
                        self.ptr, self.size, None, self.share):
                    kept = True
                else:
                    kept = core._orphan(self.ptr, self.size, self.flags)
            else:
                if self.flags & _FLAG_RECORDED:
                    # First, so every later path (cache, sharing limbo, pinned deferral,
                    # the driver free) is ordered after the recorded streams' work.
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
            # Never free memory whose fate a hook could not decide: leaking is safe,
            # reuse while another process reads is not (nor is its pool destroyed).
            core.n_free_errors += 1
            core.n_frees += 1
            return
        if not kept:
            try:
                core._release(self.ptr, self.size, self.stream_ptr, self.stream)
            except BaseException:
                # Its free raised (a hook, a KeyboardInterrupt landing there, no memory
                # for the cache): leaked, as above, and still counted below, or a
                # closed pool would wait for it forever (never retired).
                core.n_free_errors += 1
        # Counted once the free (or its hand-off) is queued: a close() in another thread
        # that sees every block freed may retire the pool at once.
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
    """The reuse cache's blocks of one (stream handle, size); the last freed is reused first.

    Addresses in a C array; the stream object that freed each block in a list beside
    it, kept alive while the block is cached and handed to the block made of it.  The
    list only grows (a taken slot is set to None), so a steady alloc + free moves no
    memory.  Sharing records of exported blocks are the pool's ``_shares``.
    """
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


cdef class PoolCore:
    """The per-pool state the hot path needs; Python pool classes subclass it.

    Reuse cache: a freed block of at most ``cache_max_block`` bytes is kept, keyed by
    (stream, size), while the cache holds under ``cache_limit`` bytes, and handed to
    the next allocation of that size on that stream without a driver call.  Reuse on
    the same stream is exactly the guarantee stream-ordered allocation gives, so the
    cache changes speed, not semantics.  Out-of-memory, ``trim`` and ``close`` flush it.
    An exported block comes back with its sharing record (``share``, see
    ``_cache_shared``); the next block made of it carries that record.

    The cache is ``_cache``: (stream handle, size) -> :class:`_Bin`, with the last bin
    used in C fields, so a steady loop of one size on one stream finds it with two
    compares (no key tuple, no hash); ``_shares`` maps the address of each cached
    exported block to its record (empty unless something was shared).
    """
    cdef CUmemoryPool _pool
    cdef CUmemoryPool _small         # the small-block pool (``_pool`` when there is none)
    cdef readonly size_t small_max   # blocks up to this size come from ``_small`` (0: none)
    cdef readonly int device_id
    cdef readonly int kind
    cdef readonly bint closed
    cdef public Recorder observer    # None while nothing is observed (see Recorder)
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
    cdef object _obs                 # the observer's PoolObs for this pool (its cache)
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
        """Every block from the arenas in ``arenas`` (stream handle -> (arena of blocks
        up to ``small_max`` bytes, arena of larger ones)) before the backend; a freed
        block goes back to its stream's arena.  The backend fills and empties the dict."""
        self._arenas = arenas
        self.arena_small_max = small_max
        self._arena_small = self._arena_large = None

    @cython.final
    cdef inline Arena _arena(self, uintptr_t sptr, size_t size):
        """The arena of (``sptr``, ``size``), or None when the stream has none yet.

        Handle 2, the per-thread default stream, is another stream in each thread: its
        arenas are keyed by this thread's token (``_expandable.stream_key``)."""
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
            self.observer._alloc(self, dptr, size, sptr, b)  # raises only a KeyboardInterrupt
        if self.kind == _KIND_PINNED:
            return _PinnedMemoryPointer(b, 0)
        if _direct:  # as below, without the generic call protocol (cpm_make)
            mem = _make(_c_unowned_memory, (dptr, size, b, self.device_id))
            return _make(_c_memory_pointer, (mem, 0))
        return _MemoryPointer(_UnownedMemory(dptr, size, b, self.device_id), 0)

    cdef _cache_missed(self):
        """A miss while the cache holds blocks.  A hit takes one miss back (never below
        zero), so the count reaches FLUSH_AFTER_MISSES when misses outrun hits (most
        allocations find nothing: sizes or streams this program stopped asking for, or
        sizes that never repeat); then the blocks it holds go back to the CUDA pool,
        where an allocation of any size can reuse their memory.  A working set served
        about two times in three or more keeps its cache; at one in two, a random order
        of hits and misses flushes it every few hundred allocations."""
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
        ``cache_limit``: ``cache_max_block`` is for blocks never exported); False when
        the cache cannot take it (full, off, or the pool is closed or finalized)."""
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
        """Whether the exporter keeps an exported block for its final free (True), or it
        may be freed now (False: ordered after its receivers' unmaps, on ``stream``; on
        the legacy stream when ``stream`` is None).  A failing hook keeps it: leaking is
        safe, freeing while another process maps it is not."""
        if _shared_retire is None:
            return False
        try:
            return bool(_shared_retire(self, ptr, size, stream, share))
        except BaseException:
            self.n_free_errors += 1
            return True

    def flush_cache(self):
        """Free every block held in the reuse cache (stream-ordered); returns bytes freed.

        An exported block's final free is its exporter's, after its receivers unmap it.
        A free that raises does not stop the others: the first error is raised after.
        """
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
        """A cached block whose stream object was finalized since: a cupy Stream that
        died in a garbage cycle after a finalizer there freed the block into the cache
        (which resurrected the object, its CUDA stream destroyed; the handle may name a
        new stream now).  Neither reused nor freed on it: an exported block goes to its
        exporter, any other to the retirer (``_orphan``: freed after a sync)."""
        if share is not None and self._retire_shared(ptr, size, None, share):
            return
        self._orphan(ptr, size, 0)

    cdef dict _swap_cache(self):
        """Empty the cache: its old ``_cache``, whose blocks are the caller's now.

        The sharing records stay in ``_shares``: the caller pops those of the blocks it
        took (a block taken by another path meanwhile keeps its record)."""
        fresh = {}  # made first: a collection here may still cache a block in the old
        old = self._cache
        self._cache = fresh
        self._last_bin, self._last_sptr, self._last_size = None, 0, 0
        self.cached_bytes = 0
        return old

    def _take_cache(self):
        """Empty the reuse cache without freeing: ``[ptr, ...]`` for the caller to free.

        For a pool finalized inside a garbage cycle, whose cached blocks' streams may
        be destroyed already: the retirer frees them after a device synchronise.  An
        exported block goes to its exporter first (without its stream): it is in the
        list only when no receiver maps it any more, else the exporter hands it to the
        retirer once they have unmapped it.
        """
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


# ---------------------------------------------------------------------------------------
# Observation: the counters and log records of statistics(), outstanding() and the log
# ---------------------------------------------------------------------------------------
# One Recorder per process is every pool's ``observer`` while something observes
# (stats.py installs it and reads it).  Per allocation it takes what may run Python
# code first (the time, the thread's tag, the call site, the pool's record, a new
# Info), then changes the counters and appends the log record in C, with no Python
# code in between: the GIL makes that step atomic between threads, and a free that a
# garbage collection runs on this thread lands before or after it, never inside.  The
# log records are fixed-size C structs in batches of LOG_BATCH; stats' writer thread
# takes the batches and formats them into CSV lines without the GIL (Batch.format).
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE
from cpython.ref cimport PyObject, Py_XINCREF, Py_XDECREF
from libc.stdlib cimport malloc as _c_malloc
from libc.string cimport memcpy
from posix.time cimport clock_gettime, timespec, CLOCK_REALTIME

cdef extern from "Python.h":
    ctypedef struct PyFrameObject:
        pass
    ctypedef struct PyCodeObject:
        pass
    PyFrameObject* PyEval_GetFrame()
    PyCodeObject* PyFrame_GetCode(PyFrameObject*)
    PyFrameObject* PyFrame_GetBack(PyFrameObject*)
    int PyFrame_GetLineNumber(PyFrameObject*)
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*)
    void PyErr_Clear()
    object PyBytes_FromStringAndSize(const char*, Py_ssize_t)

LOG_BATCH = 4096  # log records per batch handed to the writer
cdef Py_ssize_t _LOG_BATCH = 4096
cdef Py_ssize_t _SITE_CACHE_MAX = 8192  # code objects whose call sites are cached
cdef str _OP_ALLOC = "alloc"
cdef str _OP_FREE = "free"
cdef long long _ONE = 1  # open tag scopes until configure() says: read the thread-local

ctypedef struct Rec:  # one log line; the objects are owned references (str, site NULL)
    long long ns  # time.time_ns()
    unsigned long long ptr
    unsigned long long size
    unsigned long long stream
    long long used
    long long reserved
    int device
    PyObject* op
    PyObject* thread
    PyObject* tag
    PyObject* site


cdef inline long long _wall_ns() noexcept nogil:
    """``time.time_ns()``."""
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <long long>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline double _wall_time() noexcept nogil:
    """``time.time()``."""
    return <double>_wall_ns() * 1e-9


@cython.final
@cython.freelist(64)
cdef class Counts:
    """Counters of one tag inside one ``statistics()`` scope."""
    cdef public long long n_allocs
    cdef public long long n_frees
    cdef public long long total_bytes
    cdef public long long current_bytes
    cdef public long long peak_bytes


@cython.final
cdef class Scope:
    """Counters of one ``statistics()`` scope; ``per_tag`` maps a tag to its Counts."""
    cdef public long long n_allocs
    cdef public long long n_frees
    cdef public long long current_bytes
    cdef public long long peak_used_bytes
    cdef public long long total_bytes
    cdef readonly dict per_tag
    cdef readonly unsigned long long start_serial
    cdef int _device
    cdef int _kind
    cdef bint _any_device
    cdef bint _any_kind
    cdef Counts _untagged            # per_tag[""] once made (the common case, no dict)

    cdef inline Counts _counts(self, object tag):
        return self._untagged if not tag else self.per_tag.get(tag)

    def __cinit__(self):
        self.per_tag = {}
        self._any_device = self._any_kind = True

    cdef inline bint _matches(self, int device, int kind) noexcept:
        return ((self._any_device or self._device == device)
                and (self._any_kind or self._kind == kind))


@cython.final
cdef class DevObs:
    """Bytes used and last known reserved (-1: unknown) in the pools of one device."""
    cdef public long long used
    cdef public long long reserved

    def __cinit__(self):
        self.reserved = -1


@cython.final
@cython.no_gc_clear  # an Info's pool: read by Block.__dealloc__ of a block freed by GC
cdef class PoolObs:
    """What the recorder keeps of one pool (found by ``id(core)``, or ``core._obs``)."""
    cdef object ref                  # weak reference (or a holder) to the pool
    cdef readonly uintptr_t core_id
    cdef readonly int device
    cdef readonly int kind
    cdef long long used
    cdef long long reserved
    cdef double reserved_t
    cdef DevObs dev
    cdef unsigned long long epoch    # the Recorder.start() it belongs to

    cdef bint _is(self, object core) except -1:
        return self.ref() is core


@cython.final
@cython.freelist(256)
@cython.no_gc_clear
cdef class Info:
    """What the recorder knows of one observed allocation (``Block.info``).

    Not cleared by the garbage collector: when a block dies in a reference cycle (an
    exception's traceback holding the frame that holds the array), ``Block.__dealloc__``
    reads its tag, call site and pool after the collector's tp_clear ran on the
    cycle.  It can still be traversed (its pool may hold a pool without weak
    references through ``_Held``), and nothing it holds refers back to it."""
    cdef readonly unsigned long long serial
    cdef readonly double time
    cdef readonly object tag
    cdef readonly object callsite
    cdef readonly uintptr_t ptr
    cdef readonly size_t size
    cdef readonly uintptr_t stream
    cdef readonly int device
    cdef long long _ns               # time_ns of the allocation (its log record's)
    cdef PoolObs _pool
    # The recorder's list of live allocations runs through them: borrowed links (the
    # block owns its Info), NULL when not in it; the recorder's sentinel Info heads it.
    cdef PyObject* _prev
    cdef PyObject* _next

    def __dealloc__(self):
        _unlink(self)  # a block freed while nothing observed: it leaves the list

    @property
    def core_id(self):
        return self._pool.core_id


cdef inline void _link(Info head, Info i) noexcept:
    i._prev = <PyObject*>head
    i._next = head._next
    (<Info>head._next)._prev = <PyObject*>i
    head._next = <PyObject*>i


cdef inline void _unlink(Info i) noexcept:
    if i._next == NULL or i._next == <PyObject*>i:  # not listed, or a sentinel
        return
    (<Info>i._prev)._next = i._next
    (<Info>i._next)._prev = i._prev
    i._prev = i._next = NULL


cdef Info _new_list():
    cdef Info head = Info.__new__(Info)
    head._prev = head._next = <PyObject*>head
    return head


cdef void _drop_list(Info head) noexcept:
    """Take every Info off the list (the recorder stops or restarts)."""
    cdef PyObject* p = head._next
    cdef PyObject* nxt
    while p != <PyObject*>head:
        nxt = (<Info>p)._next
        (<Info>p)._prev = (<Info>p)._next = NULL
        p = nxt
    head._prev = head._next = <PyObject*>head


@cython.final
cdef class Batch:
    """Log records, in order; ``format`` makes their CSV lines (``stats.LOG_COLUMNS``)."""
    cdef Rec* recs
    cdef Py_ssize_t n
    cdef Py_ssize_t cap

    def __cinit__(self):
        self.recs = <Rec*>_c_malloc(_LOG_BATCH * sizeof(Rec))
        if self.recs == NULL:
            raise MemoryError("no memory for a log batch")
        self.cap = _LOG_BATCH

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.recs == NULL:
            return
        for i in range(self.n):
            Py_XDECREF(self.recs[i].op)
            Py_XDECREF(self.recs[i].thread)
            Py_XDECREF(self.recs[i].tag)
            Py_XDECREF(self.recs[i].site)
        _c_free(self.recs)

    def __len__(self):
        return self.n

    def rows(self):
        """The records (for tests): (time_ns, ptr, size, stream, used, reserved, device,
        op, thread, tag, callsite)."""
        cdef Rec* r
        out = []
        for i in range(self.n):
            r = &self.recs[i]
            out.append((r.ns, r.ptr, r.size, r.stream, r.used, r.reserved, r.device,
                        _obj(r.op), _obj(r.thread), _obj(r.tag), _obj(r.site)))
        return out

    def format(self, int pid):
        """The CSV lines of the records, UTF-8; formatted without the GIL."""
        cdef Py_ssize_t i, total = 0, pos = 0, n = self.n
        cdef const char** s = NULL
        cdef Py_ssize_t* ln = NULL
        cdef char* buf = NULL
        cdef Rec* r
        if n == 0:
            return b""
        s = <const char**>_c_malloc(4 * n * sizeof(char*))
        ln = <Py_ssize_t*>_c_malloc(4 * n * sizeof(Py_ssize_t))
        try:
            if s == NULL or ln == NULL:
                raise MemoryError("no memory to format a log batch")
            for i in range(n):
                r = &self.recs[i]
                _utf8(&r.thread, &s[4 * i], &ln[4 * i])
                _utf8(&r.op, &s[4 * i + 1], &ln[4 * i + 1])
                _utf8(&r.tag, &s[4 * i + 2], &ln[4 * i + 2])
                _utf8(&r.site, &s[4 * i + 3], &ln[4 * i + 3])
                total += 2 * (ln[4 * i] + ln[4 * i + 1] + ln[4 * i + 2] + ln[4 * i + 3])
            buf = <char*>_c_malloc(total + n * 400)
            if buf == NULL:
                raise MemoryError("no memory to format a log batch")
            with nogil:
                pos = _format_rows(self.recs, n, s, ln, pid, buf)
            return PyBytes_FromStringAndSize(buf, pos)
        finally:
            _c_free(s)
            _c_free(ln)
            _c_free(buf)


cdef inline object _obj(PyObject* p):
    return None if p == NULL else <object>p


cdef int _utf8(PyObject** slot, const char** out, Py_ssize_t* n) except -1:
    """UTF-8 of a record's string (an unencodable one is replaced, as the twin does)."""
    cdef const char* p
    if slot[0] == NULL:
        out[0] = ""
        n[0] = 0
        return 0
    obj = <object>slot[0]
    p = PyUnicode_AsUTF8AndSize(obj, n) if type(obj) is str else NULL
    if p == NULL:
        PyErr_Clear()
        # What cannot be encoded (a lone surrogate: an undecodable byte of a file name)
        # as a backslash escape, the rest as UTF-8 (as the twin's whole-batch encode).
        safe = str(obj).encode("utf-8", "backslashreplace").decode("utf-8")
        Py_XINCREF(<PyObject*>safe)
        Py_XDECREF(slot[0])
        slot[0] = <PyObject*>safe
        p = PyUnicode_AsUTF8AndSize(safe, n)
        if p == NULL:
            raise MemoryError("cannot encode a log field")
    out[0] = p
    return 0


cdef inline char* _put(char* o, const char* s, Py_ssize_t n) noexcept nogil:
    """A CSV field as ``csv.writer`` quotes it (QUOTE_MINIMAL, '\\n' lines)."""
    cdef Py_ssize_t i
    cdef bint quote = False
    for i in range(n):
        if s[i] == c',' or s[i] == c'"' or s[i] == c'\n' or s[i] == c'\r':
            quote = True
            break
    if not quote:
        memcpy(o, s, n)
        return o + n
    o[0] = c'"'
    o += 1
    for i in range(n):
        o[0] = s[i]
        o += 1
        if s[i] == c'"':
            o[0] = c'"'
            o += 1
    o[0] = c'"'
    return o + 1


cdef inline char* _dec(char* o, unsigned long long v, int width) noexcept nogil:
    """``v`` in decimal, zero-padded to ``width`` digits."""
    cdef char tmp[24]
    cdef int n = 0
    while True:
        tmp[n] = c'0' + <char>(v % 10)
        n += 1
        v //= 10
        if v == 0 and n >= width:
            break
    while n:
        n -= 1
        o[0] = tmp[n]
        o += 1
    return o


cdef inline char* _sdec(char* o, long long v) noexcept nogil:
    if v < 0:
        o[0] = c'-'
        return _dec(o + 1, <unsigned long long>(-(v + 1)) + 1, 1)
    return _dec(o, <unsigned long long>v, 1)


cdef inline char* _hex(char* o, unsigned long long v) noexcept nogil:
    cdef char tmp[24]
    cdef int n = 0
    o[0] = c'0'
    o[1] = c'x'
    o += 2
    while True:
        tmp[n] = b"0123456789abcdef"[v & 15]
        n += 1
        v >>= 4
        if v == 0:
            break
    while n:
        n -= 1
        o[0] = tmp[n]
        o += 1
    return o


cdef Py_ssize_t _format_rows(Rec* recs, Py_ssize_t n, const char** s, Py_ssize_t* ln,
                             int pid, char* buf) noexcept nogil:
    """The lines of ``Batch.format`` (the twin's f-string, field for field)."""
    cdef char* o = buf
    cdef Rec* r
    cdef Py_ssize_t i, k
    for i in range(n):
        r = &recs[i]
        k = 4 * i
        o = _sdec(o, r.ns // 1000000000)
        o[0] = c'.'
        o = _dec(o + 1, <unsigned long long>(r.ns // 1000 % 1000000), 6)
        o[0] = c','
        o = _sdec(o + 1, pid)
        o[0] = c','
        o = _put(o + 1, s[k], ln[k])
        o[0] = c','
        o = _sdec(o + 1, r.device)
        o[0] = c','
        o = _dec(o + 1, r.stream, 1)
        o[0] = c','
        o = _put(o + 1, s[k + 1], ln[k + 1])
        o[0] = c','
        o = _hex(o + 1, r.ptr)
        o[0] = c','
        o = _dec(o + 1, r.size, 1)
        o[0] = c','
        o = _put(o + 1, s[k + 2], ln[k + 2])
        o[0] = c','
        o = _put(o + 1, s[k + 3], ln[k + 3])
        o[0] = c','
        o += 1
        if r.used >= 0:
            o = _sdec(o, r.used)
        o[0] = c','
        o += 1
        if r.reserved >= 0:
            o = _sdec(o, r.reserved)
        o[0] = c'\n'
        o += 1
    return o - buf


class _Held:
    """A strong reference that answers like a weak one."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


@cython.final
@cython.no_gc_clear
cdef class Recorder:
    """The pools' observer (``PoolCore.observer``); stats.py configures and reads it."""
    cdef readonly bint active
    cdef public bint tracking
    cdef readonly bint logging
    cdef readonly tuple scopes
    cdef public unsigned long long n_errors
    cdef unsigned long long _serial
    cdef unsigned long long _epoch
    cdef Info _live                  # head of the list of observed live allocations
    cdef dict _pools                 # id(pool) -> PoolObs
    cdef dict _devs                  # device -> DevObs
    cdef Batch _batch
    cdef list _sealed
    cdef object _tls                 # stats' thread-local: .tag, .thread
    cdef Py_buffer _tags             # stats' count of open tag() scopes (an array)...
    cdef long long* _n_tags          # ...its item: 0 lets _alloc skip the thread-local
    cdef object _on_batch            # fn(): a batch is full
    cdef object _on_error            # fn(exc)
    cdef object _refresh             # fn(pool) -> reserved bytes or None
    cdef int _depth
    cdef tuple _skip
    cdef dict _codes                 # id(code) -> (code, None: skipped | {line: site})

    def __cinit__(self):
        self.scopes = ()
        self._live = _new_list()
        self._n_tags = &_ONE
        self._pools = {}
        self._devs = {}
        self._batch = Batch.__new__(Batch)
        self._sealed = []
        self._depth = 32
        self._skip = ()
        self._codes = {}

    def __dealloc__(self):
        if self._live is not None:
            _drop_list(self._live)  # the Infos still listed must not point to its head
        if self._tags.buf != NULL:
            PyBuffer_Release(&self._tags)

    # -- configuration (stats.py) ------------------------------------------------------
    def configure(self, tls, tags, on_batch, on_error, refresh):
        """The tag thread-local and the count of open tag scopes (``array('q', [n])``),
        then fn() for a full batch, fn(exc), fn(core) -> reserved bytes."""
        cdef Py_buffer buf
        PyObject_GetBuffer(tags, &buf, PyBUF_WRITABLE)  # held: the array cannot be resized
        if buf.len < <Py_ssize_t>sizeof(long long):
            PyBuffer_Release(&buf)
            raise ValueError("tags must hold one 64-bit count")
        if self._tags.buf != NULL:
            PyBuffer_Release(&self._tags)
        self._tags = buf
        self._n_tags = <long long*>buf.buf
        self._tls, self._on_batch, self._on_error, self._refresh = tls, on_batch, on_error, refresh

    def set_sites(self, skip, depth):
        """Path prefixes whose frames are not call sites, and the most frames walked."""
        self._skip, self._depth, self._codes = tuple(skip), depth, {}

    def start(self):
        pools, devs = {}, {}
        self._epoch += 1
        _drop_list(self._live)
        self._pools, self._devs = pools, devs
        self.active = True

    def stop(self):
        pools, devs, codes = {}, {}, {}
        self.active = False
        _drop_list(self._live)
        self._pools, self._devs = pools, devs
        self._codes = codes  # the code objects met while tracking: not kept alive

    def install(self, core, live_bytes):
        """Become ``core``'s observer and count the bytes live in it at that instant.

        For a ``PoolCore`` both happen in one step (no Python code in between), so an
        allocation or free by another thread is counted by the hook or in the
        baseline, never both or neither; a pool already observed by this recorder
        (made after the global observer was set) is left as it is.  For another kind
        of pool ``live_bytes(core)`` is read just before."""
        cdef PoolObs p = self._pool_of(core)
        cdef long long n
        if isinstance(core, PoolCore):
            if (<PoolCore>core).observer is self:
                return
            (<PoolCore>core).observer = self
            n = (<PoolCore>core).live_bytes
        else:
            if core.observer is self:
                return
            v = live_bytes(core)
            core.observer = self
            n = v if v is not None else 0
        if n > 0:
            p.used += n
            p.dev.used += n

    def baseline(self, core, used, reserved):
        """Count ``used`` bytes already live in ``core`` (and its reserved bytes)."""
        cdef PoolObs p = self._pool_of(core)
        if used:
            p.used += used
            p.dev.used += used
        if reserved is not None:
            self._set_reserved(p, reserved, _wall_time())

    def add_scope(self, device, kind):
        cdef Scope s = Scope.__new__(Scope)
        if device is not None:
            s._device, s._any_device = device, False
        if kind is not None:
            s._kind, s._any_kind = kind, False
        while True:
            old = self.scopes
            new = old + (s,)
            if self.scopes is old:  # no garbage collection's code changed them meanwhile
                s.start_serial = self._serial
                self.scopes = new
                return s

    def remove_scope(self, scope):
        while True:
            old = self.scopes
            new = tuple([x for x in old if x is not scope])
            if self.scopes is old:
                self.scopes = new
                return

    def set_logging(self, on):
        self.logging = bool(on)

    def refresh_all(self):
        """Re-read the reserved bytes of every pool seen (a log starts)."""
        for p in list(self._pools.values()):
            core = (<PoolObs>p).ref()
            if core is not None:
                self._refresh_pool(<PoolObs>p, core, _wall_time())

    def after_fork(self):
        """In a forked child: the parent's records are the parent's to write."""
        self._batch = Batch.__new__(Batch)
        self._sealed = []

    # -- hooks (the hot path calls _alloc and _free directly) -----------------------------
    def on_alloc(self, block):
        cdef uintptr_t ptr, sptr
        cdef size_t size
        try:
            core, ptr, size, sptr = block.core, block.ptr, block.size, block.stream_ptr
        except Exception as exc:  # a conversion of the block's fields
            self._error(exc)
            return
        self._alloc(core, ptr, size, sptr, block)

    def on_free(self, core, ptr, size, stream_ptr, info):
        try:
            self._free(core, ptr, size, stream_ptr, info)
        except Exception as exc:  # a conversion of the arguments
            self._error(exc)

    def note(self, core, op, ptr, size, stream_ptr, tag, callsite):
        """A log line for another event (a guard report).  Never raises."""
        cdef DevObs d
        cdef long long ns
        try:
            if not self.logging:
                return
            ns = _wall_ns()
            thread = self._thread_name()
            dev = int(core.device_id)
            d = self._devs.get(dev)
            if self._append(ns, ptr, size, stream_ptr, d.used if d is not None else -1,
                            d.reserved if d is not None else -1, dev, op, thread, tag,
                            callsite):
                self._on_batch()
        except Exception as exc:  # a KeyboardInterrupt, a SystemExit: the caller's
            self._error(exc)

    # -- reading (stats.py) --------------------------------------------------------------
    def live(self, core):
        """Live observed allocations, of ``core`` only unless it is None."""
        cdef PyObject* p = self._live._next
        infos = []
        while p != <PyObject*>self._live:  # no Python code runs in this walk
            infos.append(<Info>p)
            p = (<Info>p)._next
        if core is None:
            return infos
        key = id(core)
        return [i for i in infos if (<Info>i)._pool.core_id == key]

    def take_batches(self):
        """The records so far, the partly filled batch included, for the writer."""
        fresh_list = []
        cdef Batch fresh = Batch.__new__(Batch)
        out, self._sealed = self._sealed, fresh_list
        if self._batch.n:
            out.append(self._batch)
            self._batch = fresh
        return out

    # -- the work ------------------------------------------------------------------------
    cdef int _alloc(self, object core, uintptr_t ptr, size_t size, uintptr_t sptr,
                    object block) except -1:
        """Count an allocation, log it and set ``block.info`` (unless not active).

        An ``Exception`` of the Python pre-step is counted (the block is then not
        observed).  Any other ``BaseException`` (a KeyboardInterrupt, the SystemExit of
        a signal handler that ran there) is the program's: the allocation is counted
        with what is known so far, ``block.info`` set, then it is raised, so that the
        block's free, when the caller drops it, is counted as usual."""
        cdef Info info
        cdef PoolObs p
        cdef double t
        thread = None
        stop = None
        if not self.active:
            return 0
        info = Info.__new__(Info)
        info._ns = _wall_ns()
        t = info.time = <double>info._ns * 1e-9
        info.tag = ""
        info.ptr = ptr
        info.size = size
        info.stream = sptr
        try:
            # What may run Python code first (see above); then _apply_alloc in one go.
            if self._n_tags[0]:
                info.tag = self._tls.tag
            if self.tracking:
                info.callsite = self._site()
            p = info._pool = self._pool_of(core)
            info.device = p.device
            if self.logging:
                thread = self._thread_name()
                if (p.reserved >= 0 and p.used + <long long>size > p.reserved
                        or t - p.reserved_t > 1.0):  # grown, or a second old
                    self._refresh_pool(p, core, t)
            self._prepare_tags(info.tag, p.device, p.kind)
        except Exception as exc:
            self._error(exc)
            return 0
        except BaseException as exc:
            stop = exc
        if stop is not None:
            if type(info.tag) is not str:
                info.tag = ""
            if info._pool is None:
                try:
                    info._pool = self._pool_of(core)
                    info.device = info._pool.device
                except BaseException:
                    raise stop
            if thread is None and self.logging:
                thread = ""
        try:
            if self._apply_alloc(info, thread):
                self._on_batch()
        except Exception as exc:
            self._error(exc)
        if isinstance(block, Block):
            (<Block>block).info = info
        else:
            block.info = info
        if stop is not None:
            raise stop
        return 0

    cdef bint _apply_alloc(self, Info info, object thread) except -1:
        cdef PoolObs p = info._pool
        cdef DevObs d = p.dev
        cdef Scope s
        cdef Counts c
        cdef long long size = info.size
        self._serial += 1
        info.serial = self._serial
        p.used += size
        d.used += size
        if info.ptr:
            _link(self._live, info)
        for s in self.scopes:
            if s._matches(p.device, p.kind):
                s.n_allocs += 1
                s.total_bytes += size
                s.current_bytes += size
                if s.current_bytes > s.peak_used_bytes:
                    s.peak_used_bytes = s.current_bytes
                c = s._counts(info.tag)
                if c is not None:
                    c.n_allocs += 1
                    c.total_bytes += size
                    c.current_bytes += size
                    if c.current_bytes > c.peak_bytes:
                        c.peak_bytes = c.current_bytes
        if thread is None or not self.logging:
            return False
        return self._append(info._ns, info.ptr, info.size, info.stream, d.used, d.reserved,
                            p.device, _OP_ALLOC, thread, info.tag, info.callsite)

    cdef void _free(self, object core, uintptr_t ptr, size_t size, uintptr_t sptr,
                    object info) noexcept:
        # From Block.__dealloc__: never raises.
        cdef PoolObs p = None
        cdef long long ns = 0
        if not self.active:
            return
        try:
            thread = None
            if self.logging:
                ns = _wall_ns()
                thread = self._thread_name()
            if info is not None:
                p = (<Info?>info)._pool
            if p is None or p.epoch != self._epoch:  # observed before a restart
                p = self._pool_of(core)
            if self._apply_free(p, ptr, size, sptr, info, ns, thread):
                self._on_batch()
        except BaseException as exc:  # a deallocator cannot raise: even a Ctrl-C is counted
            self._error(exc)

    cdef bint _apply_free(self, PoolObs p, uintptr_t ptr, size_t size, uintptr_t sptr,
                          object info, long long ns, object thread) except -1:
        cdef DevObs d = p.dev
        cdef Info i
        cdef Scope s
        cdef Counts c
        cdef long long n = size
        p.used = p.used - n if p.used > n else 0
        d.used = d.used - n if d.used > n else 0
        tag = site = ""
        if info is not None:
            i = <Info>info
            _unlink(i)
            tag, site = i.tag, i.callsite
            for s in self.scopes:
                if i.serial > s.start_serial and s._matches(p.device, p.kind):
                    s.n_frees += 1
                    s.current_bytes -= n
                    c = s._counts(tag)
                    if c is not None:
                        c.n_frees += 1
                        c.current_bytes -= n
        if thread is None or not self.logging:
            return False
        return self._append(ns, ptr, size, sptr, d.used, d.reserved, p.device, _OP_FREE,
                            thread, tag, site)

    cdef bint _append(self, long long ns, unsigned long long ptr, unsigned long long size,
                      unsigned long long sptr, long long used, long long reserved, int dev,
                      object op, object thread, object tag, object site) except -1:
        """Add a record; True when it filled the batch (the writer is to be woken)."""
        cdef Batch b = self._batch
        cdef Rec* r
        if b.n >= b.cap:  # an earlier roll found no memory
            self._roll()
            b = self._batch
        r = &b.recs[b.n]
        r.ns, r.ptr, r.size, r.stream = ns, ptr, size, sptr
        r.used, r.reserved, r.device = used, reserved, dev
        Py_XINCREF(<PyObject*>op)
        Py_XINCREF(<PyObject*>thread)
        r.op, r.thread = <PyObject*>op, <PyObject*>thread
        r.tag = r.site = NULL  # None: an empty field, as the twin writes it
        if tag is not None:
            Py_XINCREF(<PyObject*>tag)
            r.tag = <PyObject*>tag
        if site is not None:
            Py_XINCREF(<PyObject*>site)
            r.site = <PyObject*>site
        b.n += 1
        if b.n < b.cap:
            return False
        self._roll()
        return True

    cdef int _roll(self) except -1:
        # A Batch holds no Python objects: making one starts no garbage collection.
        cdef Batch fresh = Batch.__new__(Batch)
        self._sealed.append(self._batch)
        self._batch = fresh
        return 0

    cdef int _prepare_tags(self, object tag, int device, int kind) except -1:
        """Make the per-tag counters an allocation with ``tag`` will bump."""
        cdef Scope s
        for s in self.scopes:
            if not s._matches(device, kind):
                continue
            if not tag:
                if s._untagged is None:
                    c = Counts.__new__(Counts)
                    s._untagged = s.per_tag.setdefault(tag, c)
            elif tag not in s.per_tag:
                c = Counts.__new__(Counts)
                s.per_tag.setdefault(tag, c)
        return 0

    cdef PoolObs _pool_of(self, object core):
        cdef PoolObs p
        cdef object o
        if isinstance(core, PoolCore):
            o = (<PoolCore>core)._obs
            if o is not None and (<PoolObs>o).epoch == self._epoch:
                return <PoolObs>o
        key = id(core)
        o = self._pools.get(key)
        if o is None or not (<PoolObs>o)._is(core):
            p = PoolObs.__new__(PoolObs)
            try:
                p.ref = weakref_ref(core)
            except TypeError:  # an object without weak references: held
                p.ref = _Held(core)
            p.core_id = key
            p.device = core.device_id
            p.kind = core.kind
            p.reserved = -1
            p.epoch = self._epoch
            p.dev = self._devs.get(p.device)
            if p.dev is None:
                p.dev = self._devs.setdefault(p.device, DevObs.__new__(DevObs))
            o = self._add_pool(core, p)
        if isinstance(core, PoolCore):
            (<PoolCore>core)._obs = o
        return <PoolObs>o

    cdef PoolObs _add_pool(self, object core, PoolObs p):
        cur = self._pools.get(p.core_id)
        if cur is not None and (<PoolObs>cur)._is(core):
            return <PoolObs>cur  # a garbage collection's free made it meanwhile
        self._pools[p.core_id] = p
        return p

    cdef int _refresh_pool(self, PoolObs p, object core, double t) except -1:
        self._set_reserved(p, self._refresh(core), t)
        return 0

    cdef int _set_reserved(self, PoolObs p, object r, double t) except -1:
        cdef long long v
        p.reserved_t = t
        if r is None:
            return 0
        v = r
        p.dev.reserved = (p.dev.reserved if p.dev.reserved > 0 else 0) + v - (
            p.reserved if p.reserved > 0 else 0)
        p.reserved = v
        return 0

    cdef object _thread_name(self):
        return self._tls.thread.name

    cdef object _site(self):
        """The first frame outside the skipped packages, within ``depth`` frames."""
        cdef PyFrameObject* f = PyEval_GetFrame()
        cdef PyFrameObject* back
        cdef PyObject* code
        cdef int left = self._depth
        site = None
        Py_XINCREF(<PyObject*>f)
        try:
            while left > 0 and f != NULL:
                left -= 1
                code = <PyObject*>PyFrame_GetCode(f)
                try:
                    entry = self._codes.get(<uintptr_t>code)
                    if entry is None or (<tuple>entry)[0] is not <object>code:
                        entry = self._code_lines(<object>code)
                    lines = (<tuple>entry)[1]
                    if lines is not None:
                        lineno = PyFrame_GetLineNumber(f)
                        site = (<dict>lines).get(lineno)
                        if site is None:
                            c = <object>code
                            site = f"{c.co_filename}:{lineno} in {c.co_name}"
                            (<dict>lines)[lineno] = site
                        break
                finally:
                    Py_XDECREF(code)
                back = PyFrame_GetBack(f)
                Py_XDECREF(<PyObject*>f)
                f = back
        finally:
            Py_XDECREF(<PyObject*>f)
        return site

    cdef tuple _code_lines(self, object code):
        """``(code, None)`` for a skipped frame's code, else ``(code, {line: site})``."""
        if len(self._codes) >= _SITE_CACHE_MAX:
            self._codes = {}
        entry = (code, None if code.co_filename.startswith(self._skip) else {})
        self._codes[id(code)] = entry
        return entry

    cdef void _error(self, object exc) noexcept:
        """Count an error in a hook (stats warns about the first).  Never raises."""
        self.n_errors += 1
        try:
            if self._on_error is not None:
                self._on_error(exc)
        except BaseException:
            pass
