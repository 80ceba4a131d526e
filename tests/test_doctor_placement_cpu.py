"""``doctor`` says which large-block placement ``set_allocator()`` uses, and why
(issue 35: the expandable pool is not the default while its shared-memory figures are
pending)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import cupy_poolmem as cpm
from cupy_poolmem import _doctor
from cupy_poolmem._experimental import STEP_IPC_ENV


def test_without_an_allocator_the_default_is_the_cuda_pool_and_the_reason_is_sharing():
    placement, why = _doctor.large_block_placement(None, False, True)
    assert placement == "pool"
    assert "ipc=True" in why and "set_allocator(ipc=False, large_blocks='expandable')" in why


def test_with_the_opt_in_the_reason_names_the_pending_figures_and_the_option():
    placement, why = _doctor.large_block_placement(None, True, True)
    assert placement == "pool"
    assert "issue 35" in why and "set_allocator(large_blocks='expandable')" in why


def test_a_gpu_without_vmm_has_only_cuda_pools():
    assert _doctor.large_block_placement(None, True, False) == (
        "pool",
        "the GPU has no virtual memory management, which the others need",
    )


def test_an_installed_allocator_reports_its_pools_placements():
    pools = [
        SimpleNamespace(large_blocks="expandable", ipc=True),
        SimpleNamespace(large_blocks="expandable", ipc=True),
    ]
    assert _doctor.large_block_placement(pools, False, True) == (
        "expandable",
        "as set_allocator() was called (ipc=True)",
    )
    mixed = [SimpleNamespace(large_blocks="mapped", ipc=False), SimpleNamespace(ipc=False)]
    assert _doctor.large_block_placement(mixed, False, True)[0] == "mapped, pool"


@pytest.mark.parametrize("opted", [False, True])
def test_the_doctors_line_reads_the_allocator_and_the_opt_in(monkeypatch, opted):
    if opted:
        monkeypatch.setenv(STEP_IPC_ENV, "1")
    else:
        monkeypatch.delenv(STEP_IPC_ENV, raising=False)
    monkeypatch.setattr(_doctor, "require_attribute", lambda *a: None)  # a VMM-capable GPU
    row = _doctor._placement_row(None)  # CuPy's own allocator
    assert row.startswith("  set_allocator() large blocks: 'pool' (")
    assert ("issue 35" in row) is opted

    class Installed(cpm.PoolAllocator):  # what set_allocator() installs
        def __init__(self):
            pass

        def pools(self):
            return {0: SimpleNamespace(large_blocks="expandable", ipc=True)}

    row = _doctor._placement_row(Installed())
    assert "'expandable' (as set_allocator() was called (ipc=True))" in row
