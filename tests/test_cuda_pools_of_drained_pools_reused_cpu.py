"""CPU tests of DevicePool reusing the CUDA pools of a drained plain pool (no device
sync, so no capture broken: see ``_retire.py``), against a fake cuda.core."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from fakes.hotpath import fake_device_pools
from fakes.resources import PlainMR

import cupy_poolmem as cpm
from cupy_poolmem import _pools, _retire

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")


@pytest.fixture
def made(monkeypatch, fake_retirer):
    """DevicePool on a fake GPU 0 (16 GiB): the CUDA pools created, in order; the
    driver attribute calls and parks in ``made.log``."""
    handles = itertools.count(0x100)
    out = SimpleNamespace(mrs=[], log=[], retirer=fake_retirer)

    def mr(dev, opts):
        m = PlainMR(
            handle=next(handles),
            ipc=opts.ipc_enabled,
            closed=False,
            is_ipc_enabled=opts.ipc_enabled,
            uuid="u",
            allocation_handle=3,
        )
        out.mrs.append(m)
        return m

    fake_device_pools(monkeypatch, mr)
    monkeypatch.setattr(_pools.device, "device_count", lambda: 1)
    monkeypatch.setattr(
        _pools._driver,
        "set_attr",
        lambda m, attr, v: out.log.append(("attr", m.handle, attr.name, v)),
    )
    monkeypatch.setattr(_pools._recycle, "park", lambda res: out.log.append(("park", res)))
    return out


def _handles(pool):
    return [m.handle for m in pool._mrs]


def test_a_drained_plain_pool_leaves_its_cuda_pools_to_the_next_one(made):
    p = cpm.DevicePool(peer_access=None)
    first = _handles(p)
    assert len(first) == 2 and len(made.mrs) == 2  # the pool and its small-block pool
    p.close()
    assert made.retirer.drain()
    assert [e[0] for e in made.log].count("park") == 1
    assert made.retirer.log.events == []  # no sync, nothing closed
    assert not any(m.closed for m in made.mrs)
    n = len(made.log)
    q = cpm.DevicePool(peer_access=None)
    assert _handles(q) == first and len(made.mrs) == 2  # reused, none created
    assert ("attr", first[0], "CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH", 0) in made.log[n:]
    assert ("attr", first[1], "CU_MEMPOOL_ATTR_USED_MEM_HIGH", 0) in made.log[n:]
    q.close()


def test_only_a_pool_of_the_same_shape_takes_them(made):
    p = cpm.DevicePool(peer_access=None)
    first = _handles(p)
    p.close()
    made.retirer.drain()
    for other in (
        cpm.DevicePool(peer_access=None, small_pool=None),
        cpm.DevicePool(peer_access=None, max_size="1GiB"),
    ):
        assert not set(_handles(other)) & set(first)
    assert _handles(cpm.DevicePool(peer_access=None)) == first


def test_a_shareable_pool_is_destroyed_after_a_sync_never_reused(made):
    p = cpm.DevicePool(ipc=True, peer_access=None)
    first = _handles(p)
    p.close()
    assert made.retirer.drain()
    assert made.retirer.log.events[0] == ("sync", 0) and all(m.closed for m in made.mrs)
    assert made.retirer.recycled == 0
    q = cpm.DevicePool(ipc=True, peer_access=None)
    assert not set(_handles(q)) & set(first)


def test_a_pool_with_live_blocks_is_parked_only_once_drained(made, monkeypatch):
    p = cpm.DevicePool(peer_access=None, reuse_cache=0)
    p.n_allocs += 1  # a live block (the fake hot path allocates nothing)
    p.close()
    made.retirer.drain()
    assert made.retirer.recycled == 0 and made.retirer.pending == 0
    assert _retire.retirer() is made.retirer and made.retirer.held == 1
    p.n_frees += 1  # freed: the hot path calls _drained() for a closed pool's last block
    p._drained()
    assert made.retirer.drain() and made.retirer.recycled == 1


def test_a_retired_pool_no_longer_touches_the_cuda_pools_it_gave_up(made):
    """Once retired, the old object's trim, thresholds and peaks act on nothing: its
    CUDA pools may be the next pool's."""
    p = cpm.DevicePool(peer_access=None)
    p.close()
    made.retirer.drain()
    q = cpm.DevicePool(peer_access=None)
    n = len(made.log)
    p.set_release_threshold(0)
    p.reset_peak()
    assert p.trim(sync=False) == 0 and made.log[n:] == []
    st = p.stats()
    assert st.reserved_bytes == 0 and st.peak_reserved_bytes == 0
    assert q._mrs and all(not m.closed for m in q._mrs)


def test_a_pool_destroyed_rather_than_parked_keeps_reading_its_cuda_pools(made):
    """A shareable pool is destroyed after a sync, later: until then its statistics
    still read its own CUDA pools (a test of the guard reads the used bytes of a closed
    pool whose quarantine waits for the retirer)."""
    p = cpm.DevicePool(ipc=True, peer_access=None)
    mrs = p._mrs
    p.close()
    assert p._mrs == mrs and made.retirer.pending == 1


def test_a_parked_pools_handle_and_resource_are_no_longer_given_out(made):
    p = cpm.DevicePool(peer_access=None)
    p.close()
    made.retirer.drain()
    q = cpm.DevicePool(peer_access=None)
    with pytest.raises(cpm.PoolClosedError, match="closed"):
        p.handle  # noqa: B018
    with pytest.raises(cpm.PoolClosedError, match="closed"):
        p.memory_resource  # noqa: B018
    assert p.peer_access == () and q.handle == q._mrs[0].handle


def test_a_pool_with_max_size_is_not_reused(made):
    """The driver counts the last owner's pending frees against ``max_size``."""
    p = cpm.DevicePool(peer_access=None, max_size="1GiB")
    first = _handles(p)
    p.close()
    made.retirer.drain()
    assert made.retirer.recycled == 0 and made.retirer.log.events[0] == ("sync", 0)
    assert not set(_handles(cpm.DevicePool(peer_access=None, max_size="1GiB"))) & set(first)


@pytest.fixture
def two_gpus(made, monkeypatch):
    """A fake second GPU: peer grants written to ``made.log``."""
    monkeypatch.setattr(_pools.device, "device_count", lambda: 2)
    monkeypatch.setattr(
        _pools.device, "revoke_stale", lambda m, dev: made.log.append(("revoke", m.handle))
    )

    def set_peers(m, dev, peers):
        made.log.append(("grant", m.handle, tuple(peers)))
        return bool(peers)

    monkeypatch.setattr(_pools.device, "set_peers", set_peers)
    monkeypatch.setattr(
        _pools.device, "resolve_peer_access", lambda v, dev: (1,) if v == "all" else ()
    )
    PlainMR.peer_accessible_by = property(
        lambda self: (), lambda self, v: made.log.append(("revoked", self.handle, tuple(v)))
    )
    yield made
    del PlainMR.peer_accessible_by


def test_closing_a_pool_that_is_parked_makes_no_peer_call(two_gpus):
    """No driver call in the closing thread, where a capture may be under way: the
    next owner revokes stale grants."""
    p = cpm.DevicePool()
    first = _handles(p)
    n = len(two_gpus.log)
    p.close()
    assert [e for e in two_gpus.log[n:] if e[0] == "revoked"] == []
    two_gpus.retirer.drain()
    cpm.DevicePool(peer_access=None)
    assert [("revoke", h) for h in first] == [e for e in two_gpus.log if e[0] == "revoke"][-2:]


def test_a_pool_destroyed_rather_than_parked_revokes_its_grants_first(two_gpus):
    p = cpm.DevicePool(ipc=True)
    p.close()
    assert [e[0] for e in two_gpus.log].count("revoked") == 2


def test_a_recycled_pool_whose_peer_grant_fails_is_parked_again(two_gpus, monkeypatch):
    p = cpm.DevicePool()
    first = _handles(p)
    p.close()
    two_gpus.retirer.drain()

    def broken(m, dev, peers):
        raise RuntimeError("cuMemPoolSetAccess failed: CUDA_ERROR_INVALID_DEVICE")

    monkeypatch.setattr(_pools.device, "set_peers", broken)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_DEVICE"):
        cpm.DevicePool()
    assert two_gpus.retirer.drain()
    assert two_gpus.retirer.recycled == 1 and two_gpus.retirer.log.events == []  # no sync
    monkeypatch.setattr(_pools.device, "set_peers", lambda m, dev, peers: False)
    assert _handles(cpm.DevicePool(peer_access=None)) == first
