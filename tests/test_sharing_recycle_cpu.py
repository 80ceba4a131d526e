"""Exported blocks recycled through the pool's reuse cache (P12), on a CPU.

A recyclable pool (``pool(recycle=True)``, like a DevicePool with its reuse cache)
keeps an exported block's record when the block goes back to the cache: the next
allocation that reuses it and is sent is a hit its receiver already maps.  These
tests try to break that: old arrays still alive, stale copies of earlier lives,
receivers that die, trims and closes with idle remote mappings, and long runs.
The fake GPU flags an exporter rewriting a block before a receiver's reads of it are
ordered before the write, and a free before every importer's free.
"""

from __future__ import annotations

import gc
import pickle
import random
import threading
import weakref

import pytest
from fakes.sharing import FakeStream, wait_for

from cupy_poolmem._errors import SharingError

KB = 1024
S0 = 0  # the receiver's stream in these tests (reads are kernels ordered on it)


@pytest.fixture
def world(sharing_world):
    return sharing_world


def _setup(world, **recv_opts):
    e = world.proc("exporter")
    r = world.proc("receiver", **recv_opts)
    return e, r, e.pool(recycle=True)


def _count(gpu, name, op):
    return sum(1 for x in gpu.log if x[0] == name and x[1] == op)


def _claims(monkeypatch, e):
    """Count the claims the exporter answers."""
    n = [0]

    def counting(cid):
        n[0] += 1

    monkeypatch.setattr(e.exporter, "claim_hook", counting)
    return n


def _life(e, r, core, payload, size=KB):
    """One fresh message: allocate, write, send, free (the producer); receive, read on
    a stream, drop (the consumer).  Returns the receiver's read."""
    b = core.alloc(size, payload=payload)
    msg = e.send(b)
    del b
    own = r.recv(msg)
    got = r.read(own, S0)
    del own
    return got


def test_fresh_blocks_come_back_from_the_cache_as_hits(world, monkeypatch):
    e, r, core = _setup(world)
    claims = _claims(monkeypatch, e)
    for i in range(1, 21):
        assert _life(e, r, core, payload=i)[1] == i  # each message its own life's data
        assert wait_for(lambda: core.cached_blocks() == 1)  # recycled, not freed
    assert claims[0] == 1  # one claim, then hits
    assert _count(world.gpu, "receiver", "import") == 1  # one driver import
    assert _count(world.gpu, "exporter", "free") == 0
    assert _count(world.gpu, "exporter", "alloc") == 1  # one driver allocation
    assert e.stats()["recycled_blocks"] >= 20
    st = r.stats()
    assert (st["imported_blocks"], st["idle_mappings"]) == (0, 1)


def test_a_recycled_block_is_not_handed_out_while_an_old_array_still_reads_it(world):
    e, r, core = _setup(world)
    b = core.alloc(KB, payload=1)
    ptr = b.ptr
    own = r.recv(e.send(b))
    del b  # the producer lets go; the receiver's array still uses the block
    assert wait_for(lambda: e.stats()["limbo_blocks"] == 1)
    assert not wait_for(lambda: core.cached_blocks(), 0.3)  # still leased: not recycled
    b2 = core.alloc(KB, payload=2)
    assert b2.ptr != ptr  # another block: the old one is held for the receiver
    assert r.read(own, S0) == (1, 1)  # the first life's data, untouched
    del own  # its last array goes: idle, recycled
    assert wait_for(lambda: core.cached_blocks() == 1)
    assert e.stats()["limbo_bytes"] == 0
    b3 = core.alloc(KB, payload=3)  # reuses it, ordered after the receiver's read
    assert b3.ptr == ptr
    del b2, b3


def test_a_stale_copy_of_an_earlier_life_is_refused_everywhere(world):
    e, r, core = _setup(world)
    r2 = world.proc("other")
    b = core.alloc(KB, payload=1)
    first = e.send(b)
    copy = pickle.dumps(pickle.loads(first))  # another copy of the same message
    del b
    own = r.recv(first)
    del own
    assert wait_for(lambda: core.cached_blocks() == 1)
    b2 = core.alloc(KB, payload=2)  # the block's second life
    second = e.send(b2)
    # The receiver that maps it idle must not hit: it asks, and is refused.
    with pytest.raises(SharingError, match="stale"):
        r.recv(copy)
    with pytest.raises(SharingError, match="stale"):
        r2.recv(copy)  # a process that never mapped it
    with pytest.raises(SharingError, match="freed"):
        e.recv(copy)  # back in the exporter
    own2 = r.recv(second)  # the live message still works (a hit)
    assert r.read(own2, S0)[1] == 2
    del own2, b2


def test_a_copy_for_a_receiver_that_mapped_an_earlier_life_waits_for_its_fence(world):
    """r2 maps life 1 idle; life 2 goes to r only.  Before recycling after life 2 the
    exporter asks r2 to say Idle for life 2: a copy of life 2's message reaching r2
    later is claimed (and refused), never hit on the third life's data."""
    e, r, core = _setup(world)
    r2 = world.proc("other")
    assert _life(e, r2, core, payload=1)[1] == 1
    assert wait_for(lambda: core.cached_blocks() == 1)
    b = core.alloc(KB, payload=2)
    msg = e.send(b)
    copy = pickle.dumps(pickle.loads(msg))
    del b
    own = r.recv(msg)
    assert r.read(own, S0)[1] == 2
    del own
    assert wait_for(lambda: core.cached_blocks() == 1)
    b3 = core.alloc(KB, payload=3)  # third life
    with pytest.raises(SharingError, match="stale"):
        r2.recv(copy)
    own3 = r2.recv(e.send(b3))
    assert r2.read(own3, S0)[1] == 3
    del own3, b3


def test_a_block_re_sent_within_one_life_stays_a_hit_after_eager_idles(world, monkeypatch):
    e, r, core = _setup(world)
    claims = _claims(monkeypatch, e)
    for i in range(1, 4):  # fresh lives: the receiver learns to say Idle unasked
        _life(e, r, core, payload=i)
        assert wait_for(lambda: core.cached_blocks() == 1)
    before = claims[0]
    b = core.alloc(KB, payload=9)
    for _ in range(10):  # the same array sent again and again
        own = r.recv(e.send(b))
        assert r.read(own, S0)[1] == 9
        del own
    assert claims[0] - before <= 1  # at most one claim to learn it is re-sent
    del b


def test_a_receiver_that_dies_with_an_idle_mapping_of_a_cached_block(world):
    e, r, core = _setup(world)
    _life(e, r, core, payload=1)
    assert wait_for(lambda: core.cached_blocks() == 1)
    r.kill()  # its context (and mapping) is gone
    assert wait_for(lambda: e.stats()["leases"] == 0)
    r2 = world.proc("next")
    assert _life(e, r2, core, payload=2)[1] == 2  # the cached block serves the next one
    assert wait_for(lambda: core.cached_blocks() == 1)
    core.flush_cache()  # trim: its final free, after r2 unmaps it
    assert wait_for(lambda: _count(world.gpu, "exporter", "free") == 1)
    assert e.stats()["exported_blocks"] == 0


@pytest.mark.parametrize("how", ["trim", "close"])
def test_trim_and_close_with_idle_remote_mappings_free_after_the_receivers(world, how):
    e, r, core = _setup(world)
    for i in range(1, 4):
        _life(e, r, core, payload=i)
        assert wait_for(lambda: core.cached_blocks() == 1)
    assert r.stats()["idle_mappings"] == 1
    if how == "trim":
        core.flush_cache()
    else:
        core.close()
    # The receiver is asked to unmap; the exporter frees after it (the fake checks).
    assert wait_for(lambda: _count(world.gpu, "exporter", "free") == 1)
    assert r.stats()["idle_mappings"] == 0
    st = e.stats()
    assert (st["exported_blocks"], st["limbo_bytes"], st["leases"]) == (0, 0, 0)
    if how == "close":
        assert core.released == 1  # the pool was released once the block was freed


def test_a_block_the_cache_cannot_take_goes_to_its_final_free(world):
    """Above the cache's byte limit: receivers unmap, then the driver free (the rule
    for blocks the cache cannot hold)."""
    e, r, core = _setup(world)
    core.cache_limit = KB  # holds one 1 KiB block; a 4 KiB one never fits
    for i in range(1, 4):
        assert _life(e, r, core, payload=i, size=4 * KB)[1] == i
        assert wait_for(lambda i=i: _count(world.gpu, "exporter", "free") == i)
    assert core.cached_blocks() == 0
    assert _count(world.gpu, "receiver", "import") == 3  # no recycling: a mapping each
    assert e.stats()["exported_blocks"] == 0


def test_ten_thousand_fresh_messages_keep_bounded_state(world):
    e, r, core = _setup(world)
    for i in range(1, 10_001):
        b = core.alloc(KB, payload=i)
        msg = e.send(b)
        del b
        own = r.recv(msg)
        assert r.read(own)[1] == i
        del own
    assert wait_for(lambda: e.stats()["limbo_blocks"] == 0, 10.0)
    ex, im = e.exporter, r.importer
    n = len(ex.records)
    # A few blocks rotate (recycling runs beside the loop); every record is cached.
    assert n <= 256 and core.cached_blocks() == n
    assert all(len(rec.claimed) == 0 and not rec.tickets for rec in ex.records.values())
    assert all(len(rec.events) <= 2 for rec in ex.records.values())
    assert all(len(p.events) <= 2 for p in ex.peers.values())
    assert len(im.maps) <= min(n, r.settings.keep_mappings)  # the receiver's LRU cap
    assert _count(world.gpu, "receiver", "import") < 500  # > 95 % of the messages hit
    assert e.exporter.unclaimed() == 0


def test_recycling_keeps_stream_order_with_a_second_receiver_stream(world):
    """The receiver reads on two streams; the next life's write waits for both."""
    e, r, core = _setup(world)
    b = core.alloc(KB, payload=1)
    msg1, msg2 = e.send(b), e.send(b)
    del b
    own1 = r.recv(msg1)
    r.driver._set_stream(FakeStream(0x77))
    own2 = r.recv(msg2)
    r.read(own1, S0)
    r.read(own2, 0x77)
    del own2
    r.driver._set_stream(FakeStream(0))
    del own1
    assert wait_for(lambda: core.cached_blocks() == 1)
    b2 = core.alloc(KB, payload=2)  # the fake flags a write not ordered after both reads
    del b2


# -- the pool's side: dropped pools, blocks reused unsent, lives seen by refetches ----------------
def test_a_recycled_record_does_not_keep_its_pool_alive(world):
    """While a block sits in the reuse cache its record has no pool (the cache holds the
    record, not the reverse): a pool dropped without close() can still be collected."""
    e, r, core = _setup(world)
    _life(e, r, core, payload=1)
    assert wait_for(lambda c=core: c.cached_blocks() == 1)
    (rec,) = e.exporter.records.values()
    assert rec.core is None and rec.life == 1
    e.cores.remove(core)
    core.dispose()
    ref = weakref.ref(core)
    del core, rec
    gc.collect()
    assert ref() is None


def test_a_pool_dropped_with_recycled_blocks_frees_them_through_the_retirer_after_receivers(
    world,
):
    """A pool finalized with exported blocks in its cache (Pool.__del__): nothing touches
    their streams; receivers are asked to unmap, and the block goes to the retirer only
    after their unmaps (the fake GPU flags an exporter free before an importer's)."""
    e, r, core = _setup(world)
    for i in range(1, 4):
        _life(e, r, core, payload=i)
        assert wait_for(lambda: core.cached_blocks() == 1)
    assert r.stats()["idle_mappings"] == 1
    core.finalize()
    assert wait_for(lambda: core.leftovers)  # handed to the retirer once unmapped
    assert r.stats()["idle_mappings"] == 0
    assert _count(world.gpu, "exporter", "free") == 0  # nothing freed on any stream
    core.retirer_frees()
    assert _count(world.gpu, "exporter", "free") == 1
    st = e.stats()
    assert (st["exported_blocks"], st["limbo_bytes"], st["leases"]) == (0, 0, 0)
    assert core.released == 1


def test_a_pool_dropped_with_a_recycled_block_nobody_maps_gives_it_to_the_retirer(world):
    e, r, core = _setup(world)
    _life(e, r, core, payload=1)
    assert wait_for(lambda: core.cached_blocks() == 1)
    r.importer.trim_idle(0)  # the receiver unmaps its idle mapping
    assert wait_for(lambda: e.stats()["leases"] == 0)
    core.finalize()
    assert len(core.leftovers) == 1 and e.stats()["exported_blocks"] == 0
    core.retirer_frees()
    assert core.released == 1


def test_a_block_reused_from_the_cache_of_a_finalized_pool_waits_for_the_receivers(world):
    """A block made of a recycled one (its record dormant: not sent in this life) is
    freed after its pool was finalized (a garbage cycle): it goes to the exporter
    without its stream, and to the retirer once the receivers have unmapped it."""
    e, r, core = _setup(world)
    _life(e, r, core, payload=1)
    assert wait_for(lambda: core.cached_blocks() == 1)
    b = core.alloc(KB, payload=2)
    assert b.share is not None and b.share.core is None
    core.finalize()
    assert core.released == 0  # a live block
    del b
    assert wait_for(lambda: core.leftovers)
    assert r.stats()["idle_mappings"] == 0
    core.retirer_frees()
    assert core.released == 1 and e.stats()["exported_blocks"] == 0


def test_a_reused_block_let_go_before_any_send_goes_back_to_the_cache(world, monkeypatch):
    e, r, core = _setup(world)
    claims = _claims(monkeypatch, e)
    _life(e, r, core, payload=1)
    assert wait_for(lambda: core.cached_blocks() == 1)
    (rec,) = e.exporter.records.values()
    b = core.alloc(KB, payload=2)
    del b  # never sent in its new life: straight back, same life
    assert core.cached_blocks() == 1 and rec.life == 1 and rec.core is None
    assert _life(e, r, core, payload=3)[1] == 3  # the next send: a new life, a hit
    assert rec.life == 2 and claims[0] == 1


def test_hold_live_never_serves_another_life_of_a_recycled_block(world):
    """The Dask refetch path reads a live block by its export id: a descriptor of an
    earlier life must not read the array that reuses the block now."""
    e, r, core = _setup(world)
    b = core.alloc(KB, payload=1)
    d = pickle.loads(e.send(b))
    assert e.exporter.hold_live(d.export_id, d.export_data, d.life) is not None
    own = r.recv(pickle.dumps(d))
    del b, own
    assert wait_for(lambda: core.cached_blocks() == 1)
    assert e.exporter.hold_live(d.export_id, d.export_data, d.life) is None  # in the cache
    b2 = core.alloc(KB, payload=2)
    assert e.exporter.hold_live(d.export_id, d.export_data, d.life) is None  # not sent yet
    d2 = pickle.loads(e.send(b2))
    assert d2.life == d.life + 1 and d2.export_id == d.export_id
    assert e.exporter.hold_live(d.export_id, d.export_data, d.life) is None
    hold = e.exporter.hold_live(d2.export_id, d2.export_data, d2.life)
    assert hold is not None and e.read(hold)[1] == 2
    del hold, b2
    r.recv(pickle.dumps(d2))  # (its ticket: the block is let go at teardown)


def test_a_forwarded_recycled_block_carries_its_life_and_a_stale_forward_is_refused(world):
    e, r1, core = _setup(world)
    r2 = world.proc("third")
    b = core.alloc(KB, payload=1)
    msg = e.send(b)
    del b
    own1 = r1.recv(msg)
    fwd = r1.send(own1)  # registered: r1's lease is busy in this life
    assert pickle.loads(fwd).life == 1
    copy = pickle.dumps(pickle.loads(fwd))
    own2 = r2.recv(fwd)
    assert r2.read(own2, S0)[1] == 1
    del own1, own2
    assert wait_for(lambda: core.cached_blocks() == 1)  # both said Idle (r2 when asked)
    b2 = core.alloc(KB, payload=2)
    m2 = e.send(b2)
    with pytest.raises(SharingError, match="stale"):
        r2.recv(copy)
    own = r2.recv(m2)
    assert r2.read(own, S0)[1] == 2
    del own, b2


def test_a_request_is_sent_behind_the_frames_queued_before_it():
    """A claim must not overtake an Idle (or a lazy Hit) posted before it: the receiver
    sends a request directly only when nothing is queued."""
    from cupy_poolmem._sharing import _wire
    from cupy_poolmem._sharing._client import Client
    from cupy_poolmem._sharing._transport import Sender

    sent = []

    class Conn:
        closed = False

        def send(self, data, fd=None):
            sent.append(_wire.decode(data))

        def try_send(self, data):
            if self.closed:
                return False
            sent.append(_wire.decode(data))
            return True

    c = Client.__new__(Client)  # no reader thread: requests time out unanswered
    c.conn, c.closed, c._seq, c._waiters, c._late = Conn(), False, 0, {}, {}
    c._lock = threading.Lock()
    c.sender = Sender(c.conn, "cupy_poolmem-test", delay=60.0)

    def claim(seq):
        return _wire.Claim(seq, 1, b"b" * 16, False, True, True, 1, 1024, 1024, b"c" * 16)

    c.sender.post(_wire.Idle(1, 1, b"\1" * 64))
    c.sender.post(_wire.Hit(1, b"a" * 16, 1), lazy=True)
    with pytest.raises(SharingError, match="did not answer"):
        c.request(claim, 0.05)
    assert c.sender.flush(5.0)
    frames = [f for batch in sent for f in batch]
    assert [type(f).__name__ for f in frames] == ["Idle", "Hit", "Claim"]
    with pytest.raises(SharingError, match="did not answer"):
        c.request(claim, 0.05)  # nothing queued: sent directly
    assert [type(f).__name__ for f in sent[-1]] == ["Claim"]
    c.sender.close()  # the connection is gone
    c.conn.closed = True
    with pytest.raises(SharingError, match="exited"):
        c.request(claim, 0.05)


def test_a_granted_claim_of_a_held_mapping_keeps_refusing_earlier_lives(world):
    """The receiver said Idle at life 2, then claims another message of life 2 (the
    block re-sent, still in that life): granted, its mapping is used again, and a late
    copy of a life-1 message must still be claimed (and refused), never hit."""
    e, r, core = _setup(world)
    b = core.alloc(KB, payload=1)
    m1 = e.send(b)
    late = pickle.dumps(pickle.loads(m1))  # another copy of the life-1 message
    own = r.recv(m1)
    del b, own
    assert wait_for(lambda: core.cached_blocks() == 1)
    b2 = core.alloc(KB, payload=2)  # life 2
    m2a, m2b = e.send(b2), e.send(b2)
    own = r.recv(m2a)  # a hit (life 2 > its fence 1); eager: says Idle(2) when let go
    assert r.read(own, S0)[1] == 2
    del own
    m = next(iter(r.importer.maps.values()))
    assert wait_for(lambda: m.fence == 2)
    own = r.recv(m2b)  # life 2 <= fence: claimed (held), granted: busy again
    assert r.read(own, S0)[1] == 2 and m.fence == 1
    with pytest.raises(SharingError, match="stale"):
        r.recv(late)  # life 1 <= fence 1: claimed, refused (the block is in life 2)
    del own, b2


def test_receivers_holding_copies_and_arrays_across_lives_never_see_another_lives_data(world):
    """Random traffic: three receivers get fresh arrays (some several copies of one
    message), on one of two streams, keep some arrays across later messages, and drop
    them in random order; copies of earlier messages arrive late.  Every read is its own
    message's data (or a late copy is refused); the fake GPU flags a rewrite before a
    receiver's reads are ordered before it, and a free before an importer's."""
    rng = random.Random(15)
    e = world.proc("exporter")
    core = e.pool(recycle=True)
    rs = [world.proc(f"r{i}") for i in range(3)]
    streams = (FakeStream(S0), FakeStream(0x77))
    held: list[tuple] = []  # (receiver, owner, its stream, payload)
    old: list[tuple] = []  # (receiver, message, payload): copies not received yet

    def recv(r, msg):  # on a random stream, current while the message is unpickled
        s = rng.choice(streams)
        r.driver._set_stream(s)
        try:
            return r.recv(msg), s.ptr
        finally:
            r.driver._set_stream(streams[0])

    for i in range(1, 301):
        b = core.alloc(rng.choice((KB, 2 * KB)), payload=i)
        msg = e.send(b)
        msg2 = e.send(b) if rng.random() < 0.3 else None
        del b
        # every copy is received before any is let go (a copy received after every
        # holder let go is stale, as for a block that is not recycled)
        got = [(r, *recv(r, msg)) for r in rng.sample(rs, rng.randint(1, 2))]
        for r, own, sptr in got:
            assert r.read(own, sptr)[1] == i
            if rng.random() < 0.2:
                held.append((r, own, sptr, i))
            if msg2 is not None:
                old.append((r, msg2, i))
        del got, own
        rng.shuffle(held)
        while len(held) > 4:  # let go of some held arrays, each read once more first
            r, own, sptr, want = held.pop()
            assert r.read(own, sptr)[1] == want
            del own
        if old and rng.random() < 0.3:
            late(rng, old, recv)
    while old:
        late(rng, old, recv)
    for r, own, sptr, want in held:
        assert r.read(own, sptr)[1] == want
    held.clear()
    del own
    assert e.stats()["recycled_blocks"] > 100
    assert wait_for(lambda: e.stats()["limbo_blocks"] == 0, 10.0)
    core.flush_cache()  # trim: every final free after the receivers' unmaps
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 10.0)


def late(rng, old, recv):
    """A copy of an earlier message arrives: its own data, or refused as stale."""
    r, m, want = old.pop(rng.randrange(len(old)))
    try:
        own, sptr = recv(r, m)
    except SharingError as exc:
        assert "stale" in str(exc)
    else:
        assert r.read(own, sptr)[1] == want


def test_a_recycle_while_the_blocks_stream_is_captured_waits_on_the_host(world):
    """The receiver's Idle may arrive while the producer captures a graph on the block's
    stream: its event is waited for on the host (a stream wait would join the graph;
    the fake flags one), and the next life's writes are still ordered after the read."""
    e, r, core = _setup(world)
    _life(e, r, core, payload=1)
    assert wait_for(lambda: core.cached_blocks() == 1)
    b = core.alloc(KB, payload=2)
    msg = e.send(b)
    del b  # limbo until the receiver says Idle
    e.driver._capturing.add(0x51)  # the block's stream (FakeCore's default) captures
    try:
        own = r.recv(msg)
        assert r.read(own, S0)[1] == 2
        del own
        assert wait_for(lambda: core.cached_blocks() == 1)
    finally:
        e.driver._capturing.discard(0x51)
    syncs = [x for x in world.gpu.log if x[0] == "exporter" and x[1] == "sync_event"]
    assert syncs  # the receiver's event, waited for on the host
    b3 = core.alloc(KB, payload=3)  # the fake checks this write against the read
    del b3
