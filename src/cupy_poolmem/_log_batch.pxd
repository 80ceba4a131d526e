# A batch of log records: the recorder fills them in C (see _log_batch.pyx).
cimport cython
from cpython.ref cimport PyObject


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


@cython.final
cdef class Batch:
    cdef Rec* recs
    cdef Py_ssize_t n
    cdef Py_ssize_t cap
