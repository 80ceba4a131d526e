# cython: language_level=3, boundscheck=False, wraparound=False
"""Log records of the allocation recorder, in batches, and their CSV lines.

``Batch`` holds fixed-size C records (``Rec``) that :mod:`cupy_poolmem._recorder`
appends without running Python code; the log writer thread takes full batches and
``format`` makes their CSV lines without the GIL.  ``_log_batch_py.py`` is the twin.
"""

cimport cython
from cpython.ref cimport PyObject, Py_XINCREF, Py_XDECREF
from libc.stdlib cimport free as _c_free, malloc as _c_malloc
from libc.string cimport memcpy

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*)
    void PyErr_Clear()
    object PyBytes_FromStringAndSize(const char*, Py_ssize_t)

LOG_BATCH = 4096  # log records per batch handed to the writer
cdef Py_ssize_t _LOG_BATCH = 4096


@cython.final
cdef class Batch:
    """Log records, in order; ``format`` makes their CSV lines (``stats.LOG_COLUMNS``)."""

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
