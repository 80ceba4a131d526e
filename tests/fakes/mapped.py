"""``DevicePool(large_blocks="mapped")`` on the fake VMM driver: the fixtures ``drv``
(the driver in place), ``world`` (the twin pools with the fake retirer), ``made`` (pools
whose mapped blocks use ``drv``), a backend the twin hot path can be handed, and a view
into a mapped block.  A test module imports the fixtures it uses."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

import cupy_poolmem as cpm
from cupy_poolmem import _device, _mapped, _pools
from fakes.events import use_driver
from fakes.hotpath import recorded_device_pools
from fakes.vmm import MiB, VmmDriver


@pytest.fixture
def drv(monkeypatch, fake_driver):
    return use_driver(fake_driver, monkeypatch, VmmDriver())


class FakeBackend:
    """The backend as the hot path sees it: alloc/free and the addresses it owns."""

    def __init__(self) -> None:
        self.ptrs: dict[int, int] = {}
        self.next = itertools.count(0x7F00_0000_0000, 0x1000_0000)
        self.log: list = []

    def alloc(self, size, sptr):
        p = next(self.next)
        self.ptrs[p] = size
        self.log.append(("alloc", p, size, sptr))
        return 0, p

    def free(self, ptr, sptr):
        self.ptrs.pop(ptr)
        self.log.append(("free", ptr, sptr))


@pytest.fixture
def world(fake_retirer, twin_world):
    twin_world.retirer = fake_retirer
    return twin_world


def mapped_twin(world, reuse_cache=0):
    p = world.pool(reuse_cache=reuse_cache)
    be = FakeBackend()
    p._backend = be
    p._attach_backend(be, 8 * MiB + 1, be.ptrs)
    p.cache_max_block = min(p.cache_max_block, 8 * MiB)
    return p, be


@pytest.fixture
def made(monkeypatch, fake_retirer, drv):
    out = recorded_device_pools(monkeypatch, retirer=fake_retirer, drv=drv)
    monkeypatch.setattr(
        _pools.device,
        "new_mapped_blocks",
        lambda dev, peers, exportable=False: _mapped.MappedBlocks(
            dev, peers, driver=drv, exportable=exportable
        ),
    )
    return out


def a_view_of_a_mapped_block(monkeypatch):
    """``(pool, block address, view)``: a 10 MiB mapped block of a pool that grants no
    peer, and a ``__cuda_array_interface__`` view into it (no pool Block behind it, as
    a torch or Numba array), on memory the driver says is not from a CUDA pool."""
    p = cpm.DevicePool(large_blocks="mapped", peer_access=None)
    va = p._backend.alloc(10 * MiB, 0x5000)[1]
    monkeypatch.setattr(_device, "pointer_info", lambda ptr: (0, 0, False))
    monkeypatch.setattr(_device, "check_device", lambda d, name="device": d)
    monkeypatch.setattr(_device, "can_access_peer", lambda a, c: True)
    cai = SimpleNamespace(
        __cuda_array_interface__={"data": (va + 4096, False), "shape": (4,), "version": 3}
    )
    return p, va, cai
