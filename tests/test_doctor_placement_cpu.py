"""``doctor`` says which large-block placement ``set_allocator()`` uses, and why
(issue 35: the expandable pool shares its arrays, and is not the default because its
fresh arrays travel slower)."""

from __future__ import annotations

from types import SimpleNamespace

import cupy_poolmem as cpm
from cupy_poolmem import _doctor


def test_without_an_allocator_the_default_is_the_cuda_pool_and_the_way_to_the_other_named():
    placement, why = _doctor.large_block_placement(None, True)
    assert placement == "pool"
    assert "set_allocator(large_blocks='expandable')" in why and "fresh arrays" in why
    assert "Which placement set_allocator uses" in why  # where the figures are


def test_a_gpu_without_vmm_has_only_cuda_pools():
    assert _doctor.large_block_placement(None, False) == (
        "pool",
        "the GPU has no virtual memory management, which the others need",
    )


def test_an_installed_allocator_reports_its_pools_placements():
    pools = [
        SimpleNamespace(large_blocks="expandable", ipc=True),
        SimpleNamespace(large_blocks="expandable", ipc=True),
    ]
    assert _doctor.large_block_placement(pools, True) == (
        "expandable",
        "as set_allocator() was called (ipc=True)",
    )
    mixed = [SimpleNamespace(large_blocks="mapped", ipc=False), SimpleNamespace(ipc=False)]
    assert _doctor.large_block_placement(mixed, True)[0] == "mapped, pool"


def test_the_doctors_line_reads_the_allocator(monkeypatch):
    monkeypatch.setattr(_doctor, "require_attribute", lambda *a: None)  # a VMM-capable GPU
    row = _doctor._placement_row(None)  # CuPy's own allocator
    assert row.startswith("  set_allocator() large blocks: 'pool' (")
    assert "set_allocator(large_blocks='expandable')" in row

    class Installed(cpm.PoolAllocator):  # what set_allocator() installs
        def __init__(self):
            pass

        def pools(self):
            return {0: SimpleNamespace(large_blocks="expandable", ipc=True)}

    row = _doctor._placement_row(Installed())
    assert "'expandable' (as set_allocator() was called (ipc=True))" in row
