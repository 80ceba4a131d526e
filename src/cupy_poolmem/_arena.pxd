# The compiled arena (see _arena.pyx); the hot path calls take and give directly.
from libc.stdint cimport uintptr_t


cdef struct Span:       # a piece of the range, by address: free or live
    uintptr_t addr
    size_t size
    bint free


cdef struct Hole:       # a free span, by (size, address)
    size_t size
    uintptr_t addr


cdef class Arena:
    cdef readonly uintptr_t base
    cdef readonly uintptr_t top
    cdef readonly size_t limit
    cdef readonly uintptr_t stream_ptr
    cdef readonly object stream
    cdef readonly size_t free_bytes
    cdef readonly Py_ssize_t n_live
    cdef Span* _spans
    cdef Py_ssize_t _n_spans
    cdef Py_ssize_t _cap_spans
    cdef Hole* _holes
    cdef Py_ssize_t _n_holes
    cdef Py_ssize_t _cap_holes

    cdef uintptr_t _take(self, size_t size) noexcept
    cdef size_t _give(self, uintptr_t addr) noexcept
    cdef bint _room(self) noexcept
    cdef Py_ssize_t _at(self, uintptr_t addr) noexcept
    cdef Py_ssize_t _hole_at(self, size_t size, uintptr_t addr) noexcept
    cdef void _hole_in(self, size_t size, uintptr_t addr) noexcept
    cdef void _hole_out(self, size_t size, uintptr_t addr) noexcept
    cdef void _span_in(self, Py_ssize_t i, uintptr_t addr, size_t size) noexcept
    cdef void _span_out(self, Py_ssize_t i) noexcept
