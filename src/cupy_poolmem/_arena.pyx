# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""First-fit placement in one growing address range, in C (``_arena_py.py`` is its twin).

``take`` and ``give`` raise nothing and call nothing (the hot path calls them with the
GIL held).  See docs/device_pool.rst, "How it works".
"""

from libc.stdint cimport uintptr_t
from libc.stdlib cimport free as _c_free, realloc as _c_realloc
from libc.string cimport memmove

UNIT = 512
cdef size_t _UNIT = 512


cdef class Arena:
    """Free and live spans of one address range, placed first fit (see ``_arena_py.Arena``).

    Examples
    --------
    >>> a = Arena(0x10000, limit=1 << 20, stream_ptr=0)
    >>> a.extend(4096)
    >>> p = a.take(100)
    >>> hex(p), a.give(p), a.spans()
    ('0x10000', 512, [(65536, 4096, True)])
    """

    def __cinit__(self, uintptr_t base, size_t limit, uintptr_t stream_ptr, stream=None):
        self.base = self.top = base
        self.limit = limit
        self.stream_ptr = stream_ptr
        self.stream = stream

    def __dealloc__(self):
        _c_free(self._spans)
        _c_free(self._holes)

    cdef bint _room(self) noexcept:
        """Room for one more span and one more hole (False: no memory for it)."""
        cdef void* grown
        cdef Py_ssize_t cap
        if self._n_spans + 1 >= self._cap_spans:
            cap = 2 * self._cap_spans + 16
            grown = _c_realloc(self._spans, cap * sizeof(Span))
            if grown == NULL:
                return False
            self._spans, self._cap_spans = <Span*>grown, cap
        if self._n_holes + 1 >= self._cap_holes:
            cap = 2 * self._cap_holes + 16
            grown = _c_realloc(self._holes, cap * sizeof(Hole))
            if grown == NULL:
                return False
            self._holes, self._cap_holes = <Hole*>grown, cap
        return True

    cdef Py_ssize_t _at(self, uintptr_t addr) noexcept:
        """The index of the span starting at ``addr``, or -1."""
        cdef Py_ssize_t lo = 0, hi = self._n_spans, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self._spans[mid].addr < addr:
                lo = mid + 1
            else:
                hi = mid
        if lo < self._n_spans and self._spans[lo].addr == addr:
            return lo
        return -1

    cdef Py_ssize_t _hole_at(self, size_t size, uintptr_t addr) noexcept:
        """The index of the first hole not below (size, addr)."""
        cdef Py_ssize_t lo = 0, hi = self._n_holes, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if (self._holes[mid].size < size
                    or (self._holes[mid].size == size and self._holes[mid].addr < addr)):
                lo = mid + 1
            else:
                hi = mid
        return lo

    cdef void _hole_in(self, size_t size, uintptr_t addr) noexcept:
        cdef Py_ssize_t h = self._hole_at(size, addr)
        memmove(&self._holes[h + 1], &self._holes[h], (self._n_holes - h) * sizeof(Hole))
        self._holes[h].size, self._holes[h].addr = size, addr
        self._n_holes += 1

    cdef void _hole_out(self, size_t size, uintptr_t addr) noexcept:
        cdef Py_ssize_t h = self._hole_at(size, addr)
        self._n_holes -= 1
        memmove(&self._holes[h], &self._holes[h + 1], (self._n_holes - h) * sizeof(Hole))

    cdef void _span_in(self, Py_ssize_t i, uintptr_t addr, size_t size) noexcept:
        """A free span at index ``i`` (and its hole)."""
        memmove(&self._spans[i + 1], &self._spans[i], (self._n_spans - i) * sizeof(Span))
        self._spans[i].addr, self._spans[i].size, self._spans[i].free = addr, size, True
        self._n_spans += 1
        self._hole_in(size, addr)

    cdef void _span_out(self, Py_ssize_t i) noexcept:
        self._n_spans -= 1
        memmove(&self._spans[i], &self._spans[i + 1], (self._n_spans - i) * sizeof(Span))

    cdef uintptr_t _take(self, size_t size) noexcept:
        cdef Py_ssize_t h, i, k
        cdef size_t r, hs
        cdef uintptr_t ha
        if size > self.limit or not self._room():
            return 0
        r = (size + _UNIT - 1) & ~(_UNIT - 1) if size else _UNIT
        h = self._hole_at(r, 0)
        if h == self._n_holes:
            return 0
        for k in range(h + 1, self._n_holes):  # the lowest address among them
            if self._holes[k].addr < self._holes[h].addr:
                h = k
        hs, ha = self._holes[h].size, self._holes[h].addr
        self._n_holes -= 1
        memmove(&self._holes[h], &self._holes[h + 1], (self._n_holes - h) * sizeof(Hole))
        i = self._at(ha)
        self._spans[i].size, self._spans[i].free = r, False
        if hs > r:
            self._span_in(i + 1, ha + r, hs - r)
        self.free_bytes -= r
        self.n_live += 1
        return ha

    cdef size_t _give(self, uintptr_t addr) noexcept:
        cdef Py_ssize_t i
        cdef size_t size
        cdef Span* s
        if not self._room():
            return 0
        i = self._at(addr)
        if i < 0 or self._spans[i].free:
            return 0
        size = self._spans[i].size
        self.free_bytes += size
        self.n_live -= 1
        self._spans[i].free = True
        if i + 1 < self._n_spans and self._spans[i + 1].free:
            s = &self._spans[i + 1]
            self._hole_out(s.size, s.addr)
            self._spans[i].size += s.size
            self._span_out(i + 1)
        if i > 0 and self._spans[i - 1].free:
            s = &self._spans[i - 1]
            self._hole_out(s.size, s.addr)
            s.size += self._spans[i].size
            self._span_out(i)
            i -= 1
        self._hole_in(self._spans[i].size, self._spans[i].addr)
        return size

    def take(self, size_t size):
        """The address of a new live span of ``size`` bytes (rounded up to ``UNIT``, at
        least one unit) at the start of the lowest free span that fits; 0 when no free
        span is that large."""
        return self._take(size)

    def give(self, uintptr_t addr):
        """Free the live span at ``addr``, merged with its free neighbours; its size, or
        0 when no live span starts there."""
        if not self._room():
            raise MemoryError("no memory for the arena's spans")
        return self._give(addr)

    def extend(self, size_t n):
        """Add the ``n`` bytes above ``top`` (mapped by the owner) as free room."""
        cdef Py_ssize_t last = self._n_spans - 1
        if n == 0 or n % _UNIT or n > self.limit - (self.top - self.base):
            raise ValueError(f"cannot extend the arena at {self.base:#x} by {n} bytes")
        if not self._room():
            raise MemoryError("no memory for the arena's spans")
        if last >= 0 and self._spans[last].free:
            self._hole_out(self._spans[last].size, self._spans[last].addr)
            self._spans[last].size += n
            self._hole_in(self._spans[last].size, self._spans[last].addr)
        else:
            self._span_in(last + 1, self.top, n)
        self.top += n
        self.free_bytes += n

    @property
    def mapped(self):
        """Bytes from ``base`` to ``top``: what the owner has mapped."""
        return self.top - self.base

    @property
    def tail_free(self):
        """Bytes of the free span that ends at ``top`` (0 when the last span is live)."""
        cdef Py_ssize_t last = self._n_spans - 1
        if last >= 0 and self._spans[last].free:
            return self._spans[last].size
        return 0

    def retire(self):
        """Take nothing more (the owner unmaps the range): every ``take`` answers 0."""
        self.limit = 0

    def cut_tail(self, size_t n):
        """Take the top ``n`` bytes out of the arena if they are free (before the owner
        unmaps them), in one step: False, and nothing changes, when they are not."""
        cdef Py_ssize_t last = self._n_spans - 1
        if n == 0 or n % _UNIT:
            raise ValueError(f"cannot cut {n} bytes from the arena at {self.base:#x}")
        if last < 0 or not self._spans[last].free or self._spans[last].size < n:
            return False
        self._hole_out(self._spans[last].size, self._spans[last].addr)
        self._spans[last].size -= n
        if self._spans[last].size:
            self._hole_in(self._spans[last].size, self._spans[last].addr)
        else:
            self._span_out(last)
        self.top -= n
        self.free_bytes -= n
        return True

    def spans(self):
        """``[(address, bytes, free), ...]`` in address order."""
        return [(self._spans[i].addr, self._spans[i].size, bool(self._spans[i].free))
                for i in range(self._n_spans)]

    def holes(self):
        """``[(bytes, address), ...]`` of the free spans, smallest first."""
        return [(self._holes[i].size, self._holes[i].addr) for i in range(self._n_holes)]
