"""Closing, draining and retiring under races: two drains at once, a collection that
closes a pool mid-free, a peer change while the pool retires, an interrupted close.
Each test guards against a race that once broke these paths.

CPU only, against fakes (tests/fakes/hotpath, the ``fake_retirer`` fixture).  Where a
thread switch or a garbage collection matters it is forced at the exact point (a hook
that runs the other thread's step to its end, or a ``gc.callbacks`` entry with the
collection threshold at 1); each docstring says where.
"""

from __future__ import annotations

import gc
import itertools
import threading
from types import SimpleNamespace

import pytest
from fakes.hotpath import bare_core, compiled_hotpath
from fakes.resources import GrantsMR

import cupy_poolmem as cpm
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem import _pools, _retire

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

KB = 4096
SIZE_MAX = 2**64 - 1


def _impl(name):
    hp = twin if name == "twin" else compiled_hotpath()
    if hp is None:
        pytest.skip("the Cython hot path is not built in this checkout")
    return hp


class _Res:
    def __init__(self, name: str = "r") -> None:
        self.name, self.closed = name, False

    def close(self) -> None:
        self.closed = True


class _CloseInCollection:
    """At the next collection (threshold 1: the next allocation of a tracked object),
    run ``fn`` once: another thread's ``close()`` that a finalizer switched to, or a
    finalizer closing the pool itself."""

    def __init__(self, fn):
        self.fn, self.armed, self.fired = fn, False, False

    def __call__(self, phase, info):
        if phase == "start" and self.armed and not self.fired:
            self.fired = True
            self.fn()

    def __enter__(self):
        gc.collect()
        self.threshold = gc.get_threshold()
        gc.callbacks.append(self)
        gc.set_threshold(1)
        return self

    def __exit__(self, *exc):
        gc.set_threshold(*self.threshold)
        gc.callbacks.remove(self)


# ---------------------------------------------------------------- two drains at once
def test_a_drain_while_another_parks_loses_no_resource_and_raises_nothing():
    """_retire: _park_retired: ``drain()`` is called from two threads at once in
    the package itself (``benchmarks/churn.close_device_pool`` drains in the main
    thread while the retirer's thread drains too).  The second drain's
    ``_park_retired`` resets ``_parking_now`` to ``[]`` (and again in its ``finally``)
    while the first is parking: the first one's ``_parking_now.remove(key)`` then
    raises ValueError out of ``drain()``, and the resources it had not parked yet are
    dropped (neither parked, due nor closed: never destroyed, never reused).

    The thread switch is forced inside the first ``park()`` (a driver call, which
    releases the GIL): the other thread's drain runs to its end there.  Fails in both
    modes (the retirer is pure Python)."""
    r = _retire.Retirer(
        sync=lambda dev: None,
        capture_underway=lambda: False,
        active_devices=lambda: [0],
        background=False,
    )
    parked = []

    def park(res):
        parked.append(res)
        if len(parked) == 1:  # the other thread's drain, while this park runs
            t = threading.Thread(target=r.drain)
            t.start()
            t.join()

    a, b = _Res("a"), _Res("b")
    assert r.retire(r.adopt(a, "k", park), 0)
    assert r.retire(r.adopt(b, "k", park), 0)
    r.drain()  # ValueError: list.remove(x): x not in list
    assert r.recycled == 2 and r.pending == 0
    assert {id(r.take_recycled("k")), id(r.take_recycled("k"))} == {id(a), id(b)}


# ---------------------------------------------------------------- free vs close (.pyx)
@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_a_block_freed_while_the_pool_is_closed_is_freed_not_cached(impl):
    """PoolCore._release: the compiled ``_release`` tests ``closed``
    before ``_bin(..., True)``, which allocates (the key tuple, a new _Bin) and so can
    start a garbage collection whose finalizer switches to a thread that closes the
    pool (``close()`` -> ``_mark_closed``: closed, cache flushed).  The block is then
    pushed into the fresh cache of a closed pool: never freed, ``cached_bytes`` stays
    non-zero, and the pool is drained (retired, a plain DevicePool's CUDA pools parked
    for the next owner) with the block stranded in it.  The twin tests ``closed`` again
    after ``_bin`` and frees the block.

    The close is forced at the collection inside ``_bin``.  Fails in the compiled mode
    only (the "compiled" case; skipped where the extension is not built)."""
    hp = _impl(impl)
    c = bare_core(hp, 1 << 20)
    stream = SimpleNamespace(ptr=0)
    m = c._make_block(0x1000, KB, stream, 0)
    with _CloseInCollection(c._mark_closed) as close:
        close.armed = True
        del m  # _release: closed? no -> _bin (collection: closed now) -> push
    assert close.fired and c.closed
    assert c.drained == 1  # the closed pool saw its last block go
    assert c.freed == [0x1000]  # ... so the block must have gone back, not to a cache
    assert c.cached_bytes == 0 and all(b.n == 0 for b in c._cache.values())


# ---------------------------------------------------------------- _cache_shared vs close
@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_an_exported_block_is_not_cached_in_a_pool_closed_meanwhile(impl):
    """PoolCore._cache_shared: the exporter's
    ``_recycle`` puts a block whose receivers are done into the reuse cache; the hot
    path tests ``closed`` first, then finds the bin (``_bin(..., True)`` allocates: a
    collection, another thread's ``close()``), then pushes with no second test.  The
    block lands in a closed pool's cache and ``_cache_shared`` says True: the exporter
    takes it out of limbo and calls nothing more, so a closed pool whose last block
    this was is never drained, and the block is never freed.

    The close is forced at the collection inside ``_bin``.  Fails in both modes (both
    implementations)."""
    hp = _impl(impl)
    c = bare_core(hp, 1 << 20)
    with _CloseInCollection(c._mark_closed) as close:
        close.armed = True
        kept = c._cache_shared(0x2000, KB, 0, object(), "record")
    assert close.fired and c.closed
    assert not kept  # a closed pool's cache takes nothing
    assert c.cached_bytes == 0 and all(b.n == 0 for b in c._cache.values())


# ---------------------------------------------------------------- size_t max
def test_malloc_of_the_largest_size_t_raises_the_packages_oom_error(fake_retirer, twin_world):
    """_hotpath_py.py:476 / _hotpath.pyx:474, ``size < self.backend_min``: a pool
    with a CUDA pool and no backend has ``backend_min == SIZE_MAX``, so a request of
    exactly ``2**64 - 1`` bytes (a valid size_t) goes to ``_backend_alloc``, which
    calls ``None.alloc``: AttributeError, outside the package's hierarchy (the
    test was once ``_pool != NULL``: the driver's out-of-memory, then
    OutOfPoolMemoryError naming the device's capacity).  Fails in both modes (the
    fake driver runs the twin's malloc; the .pyx has the same line, which a CPU cannot
    run: its malloc needs a GPU)."""
    p = twin_world.pool(reuse_cache=0)
    p._capacity = 1 << 34
    with pytest.raises(cpm.OutOfPoolMemoryError):
        p.malloc(SIZE_MAX)


# ---------------------------------------------------------------- peer grants and parking
@pytest.fixture
def two_gpus(monkeypatch, fake_retirer):
    """DevicePool on a fake GPU 0 of two (as in test_cuda_pools_of_drained_pools_reused_cpu.py): each CUDA pool's
    peer grants in ``out.grants`` (handle -> peers), set through ``_set_peers``."""
    from fakes.hotpath import fake_device_pools

    handles = itertools.count(0x100)
    out = SimpleNamespace(mrs=[], grants={}, log=[], retirer=fake_retirer)

    def mr(dev, opts):
        m = GrantsMR(handle=next(handles), closed=False, is_ipc_enabled=opts.ipc_enabled)
        m.grants, m.log = out.grants, out.log
        out.grants[m.handle] = ()
        out.mrs.append(m)
        return m

    def set_peers(m, dev, peers):
        m.peer_accessible_by = peers
        return bool(peers)

    fake_device_pools(monkeypatch, mr)
    monkeypatch.setattr(_pools.device, "device_count", lambda: 2)
    monkeypatch.setattr(
        _pools.device, "revoke_stale", lambda m, dev: out.grants.update({m.handle: ()})
    )
    monkeypatch.setattr(_pools.device, "set_peers", set_peers)
    monkeypatch.setattr(
        _pools.device, "resolve_peer_access", lambda v, dev: (1,) if v == "all" else ()
    )
    monkeypatch.setattr(_pools.device, "sync_device", lambda dev: None)
    monkeypatch.setattr(_pools._driver, "set_attr", lambda *a: None)
    monkeypatch.setattr(_pools._recycle, "park", lambda res: None)
    out.set_peers = set_peers
    return out


def _handles(pool):
    return [m.handle for m in pool._mrs]


def test_a_peer_change_on_a_closed_pool_never_touches_the_next_owners_cuda_pools(
    two_gpus, monkeypatch
):
    """DevicePool.peer_access setter / _change_peers: the setter is
    allowed on a closed pool that still has live blocks, and loops over ``self._mrs``
    (the tuple read once) with one ``cuMemPoolSetAccess`` per CUDA pool, a call that
    can take seconds.  Meanwhile another thread frees the last block: the pool is
    parked (``_retire_now`` takes no ``_peers_lock``), the retirer parks it and a new
    DevicePool takes the CUDA pools over and grants GPU 1.  The setter's next
    iteration then revokes the new owner's grant on its small-block pool: kernels on
    GPU 1 using the new pool's small blocks fault (cudaErrorIllegalAddress), and
    ``q.peer_access`` (read from the main pool only) still says (1,).

    The thread switch is forced inside the setter's first ``_set_peers`` call: the
    other thread's steps (last free, drain, new pool) run there, joined with a timeout
    (a fix that holds a lock over both leaves them waiting; they finish after the
    setter).  Fails in both modes."""
    r = two_gpus.retirer
    p = cpm.DevicePool()  # GPU 1 granted on both CUDA pools
    first = _handles(p)
    p.n_allocs += 1  # a live block (the fake hot path allocates nothing)
    p.close()
    made = []

    def other_thread():
        p.n_frees += 1  # the last block is freed: the hot path calls _drained()
        p._drained()
        r.drain()
        made.append(cpm.DevicePool())  # takes the parked CUDA pools, grants GPU 1

    calls = []

    def set_peers_with_a_switch(m, dev, peers):
        ok = two_gpus.set_peers(m, dev, peers)
        if not calls:
            calls.append(1)
            t = threading.Thread(target=other_thread)
            t.start()
            t.join(0.2)  # (it waits for the setter: finished after it)
            calls.append(t)
        return ok

    monkeypatch.setattr(_pools.device, "set_peers", set_peers_with_a_switch)
    try:
        p.peer_access = None  # revoke GPU 1 (allowed: a block is live)
    except cpm.PoolClosedError:
        pass  # a fix may refuse a closed pool: fine, as long as the next owner is intact
    calls[1].join(5.0)
    monkeypatch.setattr(_pools.device, "set_peers", two_gpus.set_peers)
    (q,) = made
    assert _handles(q) == first  # the recycled CUDA pools
    assert [two_gpus.grants[h] for h in _handles(q)] == [(1,), (1,)]  # small: ()


def test_a_pool_the_retirer_destroys_revokes_its_grants_before_a_drain_closes_it(
    two_gpus, monkeypatch
):
    """DevicePool._retire_now: the pool asked ``will_park`` first and
    kept its grants when told it would be parked; ``retire`` then decided again, and
    another pool of the same key parked in between (another thread) left no room: the
    pool was destroyed with its grants still set (nvbug 5698116: a pool created later,
    by another library, can come back with the destroyed handle and its grants).  Now
    the retirer decides once, and runs the revoke before any drain may destroy it."""
    r = two_gpus.retirer
    r.max_recycled = 1
    p, other = cpm.DevicePool(), cpm.DevicePool()
    mrs = list(p._mrs)
    for m in mrs:
        m.close = lambda m=m: (two_gpus.log.append(("close", m.handle)), setattr(m, "closed", 1))
    real_retire = r.retire

    def retire_after_a_switch(token, *args, **kw):
        if token == p._retire_token:  # another thread parks a pool of the key first
            t = threading.Thread(target=lambda: (other.close(), r.drain()))
            t.start()
            t.join()
        return real_retire(token, *args, **kw)

    monkeypatch.setattr(r, "retire", retire_after_a_switch)
    p.close()  # room when it asked first; none when the retirer decides: destroyed
    assert r.recycled == 1
    assert [two_gpus.grants[m.handle] for m in mrs] == [(), ()]
    r.drain()
    assert all(m.closed for m in mrs)
    order = [e for e in two_gpus.log if e[1] in {m.handle for m in mrs}]
    assert order[-4:] == [
        ("set", mrs[0].handle, ()),
        ("set", mrs[1].handle, ()),
        ("close", mrs[0].handle),
        ("close", mrs[1].handle),
    ]


# ---------------------------------------------------------------- an interrupted close
def test_a_close_interrupted_in_its_cache_flush_still_retires_the_pool(
    fake_retirer, twin_world, monkeypatch
):
    """Pool.close: ``_mark_closed()`` sets ``closed`` first, then
    flushes the reuse cache; a free that raises there (the case the hot path guards
    against: a KeyboardInterrupt landing in a driver free; the flush frees the rest and
    re-raises the first) leaves ``close()`` before ``_close_done`` is set.  From then
    on ``close()`` returns at once (``closed``), ``_drained()`` returns at once (not
    ``_close_done``), and ``__del__`` goes through both: the CUDA pool is never
    retired (neither parked nor destroyed), and the pool stays in ``all_pools()``.

    The exception is raised by the fake driver's free of the one cached block.  Fails
    in both modes (the fake driver runs the twin; ``close`` is the same code)."""
    p = twin_world.pool()
    token = p._retire_token
    m = p.malloc(KB)
    ptr = m.ptr
    del m  # cached
    assert p.cached_bytes == KB
    real_free = twin.driver.free

    def free_interrupted(q, sptr):
        if q == ptr:
            raise KeyboardInterrupt
        return real_free(q, sptr)

    monkeypatch.setattr(twin.driver, "free", free_interrupted)
    with pytest.raises(KeyboardInterrupt):
        p.close()
    monkeypatch.setattr(twin.driver, "free", real_free)
    p.close()  # again: "Closing twice is harmless"
    assert p.closed and p.n_allocs == p.n_frees
    assert not fake_retirer.is_held(token)  # handed to the retirer
    assert p not in twin_world.tp.all_pools()
