"""CPU tests of the Numba EMM plugin: registration, argument checks, IPC handle transport."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import uuid

import pytest

pytest.importorskip(
    "numba.cuda", reason="numba-cuda is not installed (pip install 'cupy_poolmem[numba]')"
)

import cupy_poolmem as cpm  # noqa: E402
import cupy_poolmem.numba as cpn  # noqa: E402
from cupy_poolmem import _numba_memory  # noqa: E402

NO_GPU = cpm.device_count() == 0


def test_env_var_entry_point_is_exposed():
    import importlib

    mod = importlib.import_module("cupy_poolmem.numba")
    assert mod._numba_memory_manager is cpn.PoolmemNumbaManager
    assert set(cpn.__all__) == {"PoolmemNumbaManager", "PoolIpcHandle"}


def test_set_memory_manager_accepts_the_plugin_without_a_gpu(monkeypatch):
    from numba import cuda
    from numba.cuda.cudadrv import driver

    monkeypatch.setattr(driver, "_memory_manager", driver._memory_manager)  # restored after
    cuda.set_memory_manager(cpn.PoolmemNumbaManager)
    assert driver._memory_manager is cpn.PoolmemNumbaManager


def test_numba_resolves_the_env_var_to_the_plugin_in_a_fresh_process():
    code = (
        "from numba.cuda.cudadrv import driver; driver._ensure_memory_manager(); "
        "print(driver._memory_manager.__module__, driver._memory_manager.__name__)"
    )
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="cupy_poolmem.numba")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cupy_poolmem.numba", "PoolmemNumbaManager"]


def test_plugin_interface():
    from numba.cuda import HostOnlyCUDAMemoryManager

    mgr = cpn.PoolmemNumbaManager(context=None)  # what numba.cuda.set_memory_manager does
    assert isinstance(mgr, HostOnlyCUDAMemoryManager)
    assert mgr.interface_version == 1
    mgr.initialize()  # cheap, no GPU needed
    with pytest.raises(RuntimeError, match="Memory manager requires a context"):
        cpn.PoolmemNumbaManager()


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        (-1, cpm.InvalidOptionError, ">= 0 bytes"),
        ("10", cpm.OptionTypeError, "int number of bytes"),
        (1.5, cpm.OptionTypeError, "int number of bytes"),
        (True, cpm.OptionTypeError, "int number of bytes"),
    ],
)
def test_allocation_sizes_are_checked_first(bad, exc, match):
    mgr = cpn.PoolmemNumbaManager(context=None)
    with pytest.raises(exc, match=match):
        mgr.memalloc(bad)
    with pytest.raises(exc, match=match):
        mgr.memhostalloc(bad)


def test_allocating_without_a_context_explains():
    mgr = cpn.PoolmemNumbaManager(context=None)
    with pytest.raises(RuntimeError, match="set_memory_manager") as ei:
        mgr.memalloc(16)
    assert isinstance(ei.value, cpm.UsageError)


def test_numpy_integer_sizes_are_accepted():
    import numpy as np

    assert _numba_memory.check_size(np.int64(12)) == 12


# -- IPC handle transport (the file descriptor travels; no GPU needed to check that) ------
def _fake_handle(fd: int) -> cpn.PoolIpcHandle:
    return cpn.PoolIpcHandle(
        object(),
        pool_uuid=uuid.uuid4(),
        device_uuid="GPU-test",
        payload=bytes(range(64)),
        alloc_size=4096,
        size=1024,
        offset=256,
        base_ptr=0x7F0000000000,
        source_info={"pci_bus_id": 1},
        export_fd=fd,
    )


def test_exporter_handle_cannot_be_opened_in_its_own_process():
    r, w = os.pipe()
    try:
        h = _fake_handle(w)
        with pytest.raises(ValueError, match="process that exported it") as ei:
            h.open(None)
        assert isinstance(ei.value, cpm.HandleStateError)
        with pytest.raises(cpm.HandleStateError, match="not opened"):
            h.close()
        assert "exporter" in repr(h)
    finally:
        os.close(r)
        os.close(w)


def test_pickle_duplicates_the_pool_descriptor():
    r, w = os.pipe()
    try:
        h = _fake_handle(w)
        got = pickle.loads(pickle.dumps(h))
        assert got.base is None and got._fd is not None and got._fd != w
        assert (got.pool_uuid, got.payload, got.size, got.offset, got.alloc_size) == (
            h.pool_uuid,
            h.payload,
            1024,
            256,
            4096,
        )
        os.write(got._fd, b"via dup")  # the received descriptor is the same pipe
        assert os.read(r, 7) == b"via dup"
        with pytest.raises(cpm.SharingError, match="cannot be forwarded"):
            pickle.dumps(got)
        fd = got._fd
        got._release_fd()
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        os.close(r)
        os.close(w)


def test_received_descriptor_is_closed_when_the_pool_is_imported_already(monkeypatch):
    r, w = os.pipe()
    try:
        h = _fake_handle(w)
        monkeypatch.setitem(cpn._importer().pools, str(h.pool_uuid), object())
        got = pickle.loads(pickle.dumps(h))
        assert got._fd is None
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.skipif(not NO_GPU, reason="checks the error raised on a machine without a GPU")
def test_open_without_a_gpu_raises_no_gpu_error():
    r, w = os.pipe()
    try:
        got = pickle.loads(pickle.dumps(_fake_handle(w)))

        class Ctx:
            class device:
                id = 0

        with pytest.raises(cpm.NoGPUError):
            got.open(Ctx())
    finally:
        os.close(r)
        os.close(w)


def _child_writes_through_received_fd(q_in, q_out):
    h = q_in.get(timeout=60)
    os.write(h._fd, b"child")
    q_out.put((type(h).__name__, h.size, h.offset, h.base is None, h.payload == bytes(range(64))))


def test_handle_travels_to_a_spawned_process_through_a_queue():
    ctx = mp.get_context("spawn")
    r, w = os.pipe()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child_writes_through_received_fd, args=(q_in, q_out))
    p.start()
    try:
        q_in.put(_fake_handle(w))
        assert q_out.get(timeout=120) == ("PoolIpcHandle", 1024, 256, True, True)
        assert os.read(r, 5) == b"child"
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
        os.close(r)
        os.close(w)
    assert p.exitcode == 0
