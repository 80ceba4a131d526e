"""``DevicePool(large_blocks="expandable")`` on the fake VMM driver: ``Driver`` (streams
idle unless listed as busy), the fixtures ``drv``, ``world`` and ``made``, and the twin
hot path on ranges that count their slow-path calls.  A test module imports the fixtures
it uses."""

from __future__ import annotations

import pytest

from cupy_poolmem import _expandable, _pools, _runtime
from cupy_poolmem import _hotpath_py as twin
from fakes.events import use_driver
from fakes.hotpath import recorded_device_pools
from fakes.vmm import VmmDriver

GiB = 1 << 30
SPAN = 1 * GiB  # the fake driver's address ranges are 4 GiB apart


class Driver(VmmDriver):
    """The VMM fake, with streams that are idle unless listed in ``busy``."""

    def __init__(self) -> None:
        super().__init__()
        self.busy: set = set()

        self.capturing: set = set()

    def cuStreamQuery(self, s):  # noqa: N802
        self.log.append(("query", s))
        return (600 if s in self.busy else 0,)  # CUDA_ERROR_NOT_READY

    def cuStreamIsCapturing(self, s):  # noqa: N802
        return 0, int(s in self.capturing)

    def sync_device(self, dev):
        """The ranges' ``sync``: every stream's work done."""
        self.log.append(("devsync", dev))
        self.busy.clear()


@pytest.fixture
def drv(monkeypatch, fake_driver):
    """The fake in place; ranges made with ``driver=drv`` are given ``sync=drv.sync_device``."""
    return use_driver(fake_driver, monkeypatch, Driver())


class Ranges(_expandable.ExpandableBlocks):
    """The ranges with every slow-path call counted."""

    def alloc(self, size, stream_ptr):
        self.slow.append(("alloc", size, stream_ptr))
        return super().alloc(size, stream_ptr)

    def free(self, ptr, stream_ptr):
        self.slow.append(("free", ptr, stream_ptr))
        return super().free(ptr, stream_ptr)


@pytest.fixture
def world(fake_retirer, drv, twin_world):
    twin_world.retirer = fake_retirer
    return twin_world


def expandable_twin(world, drv):
    p = world.pool(reuse_cache=1 << 30)
    b = Ranges(0, span=SPAN, arena=twin.ARENA, driver=drv, sync=drv.sync_device)
    b.slow = []
    p._backend = b
    p._attach_backend(b, 0, b)
    p._attach_arenas(b.arenas, _expandable.SMALL_MAX)
    p.cache_limit = p.cache_max_block = 0
    return p, b


@pytest.fixture
def made(monkeypatch, fake_retirer, drv):
    out = recorded_device_pools(monkeypatch, retirer=fake_retirer, drv=drv)
    monkeypatch.setattr(
        _pools.device,
        "new_expandable_blocks",
        lambda dev, peers, total, exportable=False: _expandable.ExpandableBlocks(
            dev,
            peers,
            span=SPAN,
            arena=_runtime.hp.ARENA,
            driver=drv,
            sync=drv.sync_device,
            exportable=exportable,
        ),
    )
    return out
