"""Sharing a DevicePool with a small-block pool: each block travels under the uuid of
the CUDA pool that holds it, and a receiver imports each of the two pools once, from
that pool's own descriptor; against the fake driver, which refuses a pointer imported
through another pool than its own."""

from __future__ import annotations

import pickle

import pytest
from fakes.sharing import wait_for

from cupy_poolmem._errors import PoolmemError
from cupy_poolmem._sharing._exporter import LocalHold

KB = 1024
SMALL = 64 * KB


@pytest.fixture
def world(sharing_world):
    return sharing_world


def test_small_and_large_blocks_travel_under_their_own_pools(world):
    e, r = world.proc("exporter"), world.proc("receiver")
    pools_imported = []
    r.driver._hooks["import_pool"] = lambda fd, kind, dev: pools_imported.append(fd)
    core = e.pool(small=SMALL)
    small, large = core.alloc(4 * KB, payload=3), core.alloc(SMALL + 1, payload=9)
    ms, ml = e.send(small), e.send(large)
    ds, dl = pickle.loads(ms), pickle.loads(ml)
    assert ds.pool_uuid == core._small[0] and dl.pool_uuid == core._pool_uuid
    assert ds.pool_uuid != dl.pool_uuid
    ims, iml = r.recv(ms), r.recv(ml)
    assert r.read(ims) == (1, 3) and r.read(iml) == (1, 9)
    assert r.stats()["imported_pools"] == 2
    assert len(pools_imported) == 2  # one descriptor per CUDA pool
    # A second small block: its pool is imported already, no descriptor travels again.
    again = core.alloc(8 * KB, payload=4)
    im2 = r.recv(e.send(again))
    assert r.read(im2) == (1, 4)
    assert len(pools_imported) == 2 and r.stats()["imported_pools"] == 2
    assert world.gpu.violations == []
    del ims, iml, im2, small, large, again
    e.exit()  # the receiver forgets a gone exporter: both of its pools
    assert wait_for(lambda: r.stats()["imported_pools"] == 0)


def test_a_small_block_forwarded_and_round_tripped_keeps_its_pool(world):
    e, f, t = world.proc("exporter"), world.proc("forwarder"), world.proc("third")
    core = e.pool(small=SMALL)
    b = core.alloc(2 * KB, payload=33)
    imp = f.recv(e.send(b))
    fwd = f.send(imp)
    assert pickle.loads(fwd).pool_uuid == core._small[0]
    timp = t.recv(fwd)
    assert t.read(timp) == (1, 33)
    hold = e.recv(f.send(imp))  # back in its exporter: its own memory
    assert isinstance(hold, LocalHold) and e.read(hold) == (1, 33)
    assert world.gpu.violations == []
    del imp, timp, hold, b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_the_fake_refuses_a_block_sent_under_the_other_pool(world, monkeypatch):
    """What the tests above rely on: a block described with the wrong pool cannot be
    mapped (the import of its pointer through that pool fails), and the receiver says so."""
    e, r = world.proc("exporter"), world.proc("receiver")
    core = e.pool(small=SMALL)
    monkeypatch.setattr(core, "_ipc_pool_of", lambda ptr: (core._pool_uuid, core.memory_resource))
    b = core.alloc(4 * KB, payload=1)
    with pytest.raises(PoolmemError, match="CUDA_ERROR_INVALID_VALUE"):
        r.recv(e.send(b))
    del b
