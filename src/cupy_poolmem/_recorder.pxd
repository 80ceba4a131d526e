# What the hot path calls in C: an Observer per allocation and free, on an Observed pool.
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t


cdef class Observer:
    cdef int _alloc(self, object core, uintptr_t ptr, size_t size, uintptr_t sptr,
                    PyObject** info) except -1
    cdef void _free(self, object core, uintptr_t ptr, size_t size, uintptr_t sptr,
                    object info) noexcept


cdef class Observed:
    cdef object _obs                 # the observer's record of this pool (its cache)
    cdef bint _observe(self, Observer observer, long long* live) except -1
