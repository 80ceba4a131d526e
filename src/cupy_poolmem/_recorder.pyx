# cython: language_level=3, boundscheck=False, wraparound=False
"""The allocation recorder: the counters of statistics(), outstanding() and the log.

It owns the process's observation records (scopes, live allocations, log batches).
The hot path calls ``Recorder._alloc`` and ``_free`` in C (``_recorder.pxd``); stats
configures and reads it.  ``_recorder_py.py`` is its twin; docs/hotpath.rst says how
an allocation is recorded.
"""

cimport cython
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE
from cpython.ref cimport PyObject, Py_INCREF, Py_XINCREF, Py_XDECREF
from libc.stdint cimport uintptr_t
from posix.time cimport clock_gettime, timespec, CLOCK_REALTIME

from cupy_poolmem._log_batch cimport Batch, Rec

from weakref import ref as weakref_ref

from cupy_poolmem._log_batch import LOG_BATCH  # noqa: F401  (re-exported)
# What is not per allocation is the twin's code, one copy for both.
from cupy_poolmem._recorder_py import Held, code_entry


cdef extern from "Python.h":
    ctypedef struct PyFrameObject:
        pass
    ctypedef struct PyCodeObject:
        pass
    PyFrameObject* PyEval_GetFrame()
    PyCodeObject* PyFrame_GetCode(PyFrameObject*)
    PyFrameObject* PyFrame_GetBack(PyFrameObject*)
    int PyFrame_GetLineNumber(PyFrameObject*)

cdef str _OP_ALLOC = "alloc"
cdef str _OP_FREE = "free"
cdef long long _ONE = 1  # open tag scopes until configure() says: read the thread-local


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
    references through ``Held``), and nothing it holds refers back to it."""
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



# No pickling support of their own (none to inherit): a pool class is made again by a
# second import of the hot path (after one failed without CuPy), and Cython's set-up
# of its pickling takes an inherited ``__reduce_cython__`` for its own.
@cython.auto_pickle(False)
cdef class Observer:
    """What the hot path calls in C for each allocation and free (``Recorder``)."""

    cdef int _alloc(self, object core, uintptr_t ptr, size_t size, uintptr_t sptr,
                    PyObject** info) except -1:
        return 0

    cdef void _free(self, object core, uintptr_t ptr, size_t size, uintptr_t sptr,
                    object info) noexcept:
        pass


@cython.auto_pickle(False)
cdef class Observed:
    """A pool as its observer keeps it in C: the observer's record of it, and
    ``_observe``, which makes an observer its own (the hot path's ``PoolCore``)."""

    cdef bint _observe(self, Observer observer, long long* live) except -1:
        """Install ``observer`` and put the bytes live at that instant in ``live``, in
        one step; False when it was installed already."""
        raise NotImplementedError


@cython.final
@cython.no_gc_clear
cdef class Recorder(Observer):
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

        For a hot path pool (an ``Observed``) both happen in one step (no Python code in between), so an
        allocation or free by another thread is counted by the hook or in the
        baseline, never both or neither; a pool already observed by this recorder
        (made after the global observer was set) is left as it is.  For another kind
        of pool ``live_bytes(core)`` is read just before."""
        cdef PoolObs p = self._pool_of(core)
        cdef long long n
        if isinstance(core, Observed):
            if not (<Observed>core)._observe(self, &n):
                return
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
        cdef PyObject* info = NULL
        try:
            core, ptr, size, sptr = block.core, block.ptr, block.size, block.stream_ptr
        except Exception as exc:  # a conversion of the block's fields
            self._error(exc)
            return
        try:
            self._alloc(core, ptr, size, sptr, &info)
        finally:
            if info != NULL:  # set even when a KeyboardInterrupt is raised (see _alloc)
                obj = <object>info
                Py_XDECREF(info)
                block.info = obj

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
                    PyObject** block_info) except -1:
        """Count an allocation, log it and put the block's Info (a new reference) in
        ``block_info`` (unless not active); the caller sets ``block.info`` from it.

        An ``Exception`` of the Python pre-step is counted (the block is then not
        observed).  Any other ``BaseException`` (a KeyboardInterrupt, the SystemExit of
        a signal handler that ran there) is the program's: the allocation is counted
        with what is known so far, its Info handed back, then it is raised, so that the
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
        Py_INCREF(info)
        block_info[0] = <PyObject*>info
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
        if isinstance(core, Observed):
            o = (<Observed>core)._obs
            if o is not None and (<PoolObs>o).epoch == self._epoch:
                return <PoolObs>o
        key = id(core)
        o = self._pools.get(key)
        if o is None or not (<PoolObs>o)._is(core):
            p = PoolObs.__new__(PoolObs)
            try:
                p.ref = weakref_ref(core)
            except TypeError:  # an object without weak references: held
                p.ref = Held(core)
            p.core_id = key
            p.device = core.device_id
            p.kind = core.kind
            p.reserved = -1
            p.epoch = self._epoch
            p.dev = self._devs.get(p.device)
            if p.dev is None:
                p.dev = self._devs.setdefault(p.device, DevObs.__new__(DevObs))
            o = self._add_pool(core, p)
        if isinstance(core, Observed):
            (<Observed>core)._obs = o
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
                        entry = code_entry(self._codes, <object>code, self._skip)
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

    cdef void _error(self, object exc) noexcept:
        """Count an error in a hook (stats warns about the first).  Never raises."""
        self.n_errors += 1
        try:
            if self._on_error is not None:
                self._on_error(exc)
        except BaseException:
            pass
