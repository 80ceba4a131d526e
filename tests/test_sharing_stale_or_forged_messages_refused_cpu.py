"""What a stale or forged message can make a receiver read, on a CPU (docs/sharing.rst,
"Trust boundary").

A stale copy of a message (kept in a second queue, a file, or delivered after its block
was recycled) must be refused in every process, whatever that process maps; a descriptor
that names more bytes than its block (a larger size or shape, an offset past it) must
be refused before anything is mapped, on the claim path and on the hit path.  The fake
GPU's reads say which allocation, generation and payload a receiver really sees.
"""

from __future__ import annotations

import pickle

import pytest
from fakes.sharing import wait_for

from cupy_poolmem._errors import SharingError
from cupy_poolmem._sharing import _wire

KB = 1024
S0 = 0


@pytest.fixture
def world(sharing_world):
    return sharing_world


def _forge(msg: bytes, **change) -> bytes:
    return pickle.dumps(pickle.loads(msg)._replace(**change))


def _recycled_once(world):
    """An exporter whose recyclable pool's block went through life 1 (``old``: a copy
    of life 1's message, never received) and is now in life 2 (``b2``, ``second``)."""
    e = world.proc("exporter")
    core = e.pool(recycle=True)
    b = core.alloc(KB, payload=1)
    first = e.send(b)
    old = pickle.dumps(pickle.loads(first))
    del b
    return e, core, first, old


# -- stale copies: refused whatever the receiver maps ----------------------------------------
def test_a_stale_copy_is_refused_by_a_receiver_that_holds_the_later_life_fresh(world):
    """r never mapped life 1: it maps life 2 fresh (a claim) and holds an array of it;
    the copy of life 1's message must not be a hit on life 2's data."""
    e, core, first, old = _recycled_once(world)
    r0 = world.proc("first")
    del_ = r0.recv(first)  # life 1 received and let go: the block recycles
    del del_
    assert wait_for(lambda: core.cached_blocks() == 1)
    r = world.proc("receiver")
    b2 = core.alloc(KB, payload=2)
    own2 = r.recv(e.send(b2))  # r maps the block fresh, in life 2
    assert r.read(own2, S0)[1] == 2
    with pytest.raises(SharingError, match="stale"):
        r.recv(old)
    assert r.read(own2, S0)[1] == 2
    del own2, b2


def test_a_stale_copy_is_refused_by_a_receiver_that_maps_the_later_life_idle(world):
    e, core, first, old = _recycled_once(world)
    r0 = world.proc("first")
    own = r0.recv(first)
    del own
    assert wait_for(lambda: core.cached_blocks() == 1)
    r = world.proc("receiver")
    b2 = core.alloc(KB, payload=2)
    own2 = r.recv(e.send(b2))
    del own2  # idle mapping of life 2
    with pytest.raises(SharingError, match="stale"):
        r.recv(old)
    del b2


def test_a_hit_with_a_dead_ticket_or_another_life_acknowledges_nothing(world):
    """A Hit whose ticket the exporter never issued (or forgot), or of another life, is
    not an acknowledgement: it claims no ticket and is counted as ignored."""
    e = world.proc("exporter")
    core = e.pool(recycle=True)
    r = world.proc("receiver")
    b = core.alloc(KB, payload=1)
    own = r.recv(e.send(b))
    rec = b.share
    d = pickle.loads(e.send(b))  # a live ticket, not received yet
    c = r.importer.clients[e.exporter.address]
    c.sender.post(_wire.Hit(rec.export_id, b"\x01" * 16, rec.life))
    c.sender.post(_wire.Hit(rec.export_id, d.ticket, rec.life + 1))
    assert wait_for(lambda: e.stats()["ignored_hits"] == 2)
    assert b"\x01" * 16 not in rec.claimed
    assert d.ticket in rec.tickets  # still unclaimed: the Hit of another life took nothing
    c.sender.post(_wire.Hit(rec.export_id, d.ticket, rec.life))
    assert wait_for(lambda: d.ticket not in rec.tickets)
    assert e.stats()["ignored_hits"] == 2
    del own, b


# -- descriptors that name bytes outside their block -------------------------------------------
@pytest.mark.parametrize(
    "change",
    [
        {"size": 64 * KB, "shape": (64 * KB,)},  # 64 times the block
        {"size": 64 * KB, "offset": 32 * KB, "shape": (KB,)},  # wholly past it
        {"size": 2 * KB, "offset": KB, "shape": (KB,), "strides": (1,)},
        {"size": 2 * KB, "offset": 2 * KB - 1, "shape": (KB,), "strides": (-1,)},
    ],
    ids=["64x", "past", "past-by-one-block", "negative-strides-past"],
)
@pytest.mark.parametrize("path", ["claim", "hit"])
def test_a_descriptor_past_its_block_is_refused_before_mapping(world, change, path):
    e = world.proc("exporter")
    core = e.pool()
    r = world.proc("receiver")
    b = core.alloc(KB, payload=1)
    keep = r.recv(e.send(b)) if path == "hit" else None  # r maps the block already
    imports = len(world.gpu.proc("receiver").imports)
    forged = _forge(e.send(b), **change)
    with pytest.raises(SharingError, match="block"):
        r.recv(forged)
    assert len(world.gpu.proc("receiver").imports) == imports  # nothing new mapped
    # the exporter was not fooled either: a live message still works
    own = r.recv(e.send(b))
    assert r.read(own, S0)[1] == 1
    del own, keep, b


def test_negative_strides_within_the_block_are_mapped_and_read(world):
    e = world.proc("exporter")
    core = e.pool()
    r = world.proc("receiver")
    b = core.alloc(KB, payload=7)
    d = pickle.loads(e.send(b))._replace(offset=KB - 1, shape=(KB,), strides=(-1,))
    own = r.recv(pickle.dumps(d))
    assert r.read(own, S0)[1] == 7
    del own, b


def test_the_exporter_refuses_a_claim_whose_span_is_past_the_block(world):
    """The exporter's own check, whatever the receiver checked: a Claim naming more
    bytes than the block is refused (a receiver of another build cannot map past it)."""
    e = world.proc("exporter")
    core = e.pool()
    r = world.proc("receiver")
    b = core.alloc(KB, payload=1)
    d = pickle.loads(e.send(b))
    c = r.importer.client(d.address)
    blk = _wire.block_id(d.pool_uuid, d.pool_kind, d.export_data)
    for size, end in ((KB, KB + 1), (2 * KB, KB), (KB // 2, KB // 2)):
        reply, fd = c.request(
            lambda seq, size=size, end=end: _wire.Claim(
                seq, d.export_id, d.ticket, True, False, False, d.life, size, end, blk
            ),
            5.0,
        )
        assert fd is None and reply.status == _wire.OUT_OF_SPAN, (size, end)
    reply, fd = c.request(
        lambda seq: _wire.Claim(
            seq, d.export_id, d.ticket, True, False, False, d.life, KB, KB, blk
        ),
        5.0,
    )
    assert reply.status == _wire.OK and fd is not None
    import os

    os.close(fd)
    c.sender.post(_wire.Mapped(d.export_id))
    c.sender.post(_wire.Unmap(d.export_id, None))
    del b


def test_the_exporter_refuses_a_claim_of_another_life(world):
    e, core, first, old = _recycled_once(world)
    r = world.proc("receiver")
    own = r.recv(first)
    del own
    assert wait_for(lambda: core.cached_blocks() == 1)
    b2 = core.alloc(KB, payload=2)
    d = pickle.loads(e.send(b2))
    c = r.importer.client(d.address)
    reply, _ = c.request(
        lambda seq: _wire.Claim(
            seq,
            d.export_id,
            d.ticket,
            False,
            True,
            True,
            d.life + 5,
            KB,
            KB,
            _wire.block_id(d.pool_uuid, d.pool_kind, d.export_data),
        ),
        5.0,
    )
    assert reply.status == _wire.REFUSED
    own2 = r.recv(pickle.dumps(d))  # the ticket was not spent by the refused claim
    assert r.read(own2, S0)[1] == 2
    del own2, b2


@pytest.mark.parametrize("life", [0, 2, 3])
def test_a_forged_life_is_claimed_and_refused_by_a_receiver_using_the_block(world, life):
    """While a receiver's arrays use life 1 of a recycled block, its mapping serves
    life 1 only: a copy naming life 0 (never recycled), 2 or 3 is claimed and
    refused; its array still reads life 1's data."""
    e = world.proc("exporter")
    core = e.pool(recycle=True)
    r = world.proc("receiver")
    b = core.alloc(KB, payload=1)
    msg = e.send(b)
    own = r.recv(msg)
    with pytest.raises(SharingError, match="stale"):
        r.recv(_forge(msg, life=life))
    assert r.read(own, S0)[1] == 1
    del own, b
