"""Physical memory that travels between processes, played on the host: ``StepVmm`` (the
expandable ranges' fake driver, plus shareable handles: retain, export as a file
descriptor, import) keeps each physical allocation alive while a handle, a mapping or
an import refers to it, and holds bytes written through any mapping of it, so a test
reads in the "receiver" what the "exporter" wrote."""

from __future__ import annotations

import os

from cuda.bindings import driver as real

from fakes.expandable import Driver

INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE
FD = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class StepVmm(Driver):
    """The VMM fake with physical allocations, shareable handles and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.phys_of: dict[int, int] = {}  # handle -> physical allocation
        self.mapped_phys: dict[int, int] = {}  # va -> physical allocation mapped there
        self.refs: dict[int, int] = {}  # physical allocation -> handles + mappings
        self.exportable: dict[int, bool] = {}
        self.freed: set[int] = set()  # physical allocations given back to the device
        self.fd_phys: dict[int, int] = {}  # exported descriptor -> physical allocation
        self.ino_phys: dict[int, int] = {}  # its file's inode -> physical allocation
        self.bytes: dict[tuple[int, int], int] = {}  # (physical, offset) -> value
        self.exports = 0
        self.phys_size: dict[int, int] = {}

    def _ref(self, phys: int, n: int) -> None:
        self.refs[phys] += n
        if self.refs[phys] == 0:
            del self.refs[phys]
            self.freed.add(phys)

    def _handle(self, phys: int) -> int:
        h = next(self.handles)
        self.handles_alive.add(h)
        self.phys_of[h] = phys
        self._ref(phys, 1)
        return h

    def cuMemCreate(self, size, prop, flags):  # noqa: N802
        err, h = super().cuMemCreate(size, prop, flags)
        if err:
            return err, h
        self.phys_of[h] = h
        self.refs[h] = 1
        self.phys_size[h] = size
        self.exportable[h] = prop.requestedHandleTypes == FD
        return 0, h

    def cuMemRelease(self, h):  # noqa: N802
        phys = self.phys_of.pop(h)
        res = super().cuMemRelease(h)
        self._ref(phys, -1)
        return res

    def cuMemMap(self, va, size, offset, h, flags):  # noqa: N802
        if offset + size > self.phys_size[self.phys_of[h]]:
            return (INVALID_VALUE,)  # past the physical allocation: the driver refuses
        res = super().cuMemMap(va, size, offset, h, flags)
        if not res[0]:
            self.mapped_phys[va] = self.phys_of[h]
            self._ref(self.phys_of[h], 1)
        return res

    def cuMemUnmap(self, va, size):  # noqa: N802
        res = super().cuMemUnmap(va, size)
        if not res[0]:
            self._ref(self.mapped_phys.pop(va), -1)
        return res

    def cuMemRetainAllocationHandle(self, va):  # noqa: N802
        if va not in self.mapped_phys:
            return INVALID_VALUE, None
        return 0, self._handle(self.mapped_phys[va])

    def cuMemExportToShareableHandle(self, h, kind, flags):  # noqa: N802
        phys = self.phys_of[h]
        if kind != FD or not self.exportable[phys]:
            return INVALID_VALUE, 0  # memory not created with that handle type
        fd = os.memfd_create("step", os.MFD_CLOEXEC)  # a file of its own: its inode
        self.fd_phys[fd] = phys  # names it wherever the descriptor travels
        self.ino_phys[os.fstat(fd).st_ino] = phys
        self.exports += 1
        self.log.append(("export", phys, fd))
        return 0, fd

    def cuMemImportFromShareableHandle(self, fd, kind):  # noqa: N802
        st = os.fstat(fd)  # a closed descriptor raises here, as a bad one fails the driver
        phys = self.ino_phys.get(st.st_ino)
        if kind != FD or phys is None or phys in self.freed:
            return INVALID_VALUE, None
        self.log.append(("import", phys))
        return 0, self._handle(phys)

    # -- bytes, through any mapping ---------------------------------------------------
    def _at(self, va: int) -> tuple[int, int]:
        for base, phys in self.mapped_phys.items():
            if base <= va < base + self.mapped[base]:
                return phys, va - base
        raise AssertionError(f"{va:#x} is not mapped: a kernel there faults")

    def write(self, va: int, value: int) -> None:
        self.bytes[self._at(va)] = value

    def read(self, va: int) -> int | None:
        return self.bytes.get(self._at(va))

    def phys_at(self, va: int) -> int:
        return self._at(va)[0]
