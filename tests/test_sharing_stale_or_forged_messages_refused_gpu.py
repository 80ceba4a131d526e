"""What a stale or forged message can make another process read, on a GPU.

Descriptors are pickled here the way the reducer makes them (a registered ticket, an
event) and rebuilt in spawned readers, so a test can keep a copy, deliver it after
the block was recycled, or change a field first.  Every array a reader takes is
checked value by value there; everything else must be refused.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import time

import pytest

import cupy_poolmem as cpm

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ipc_allocator")]

cupy = pytest.importorskip("cupy")

from support import mp_workers as W  # noqa: E402
from support.waits import ipc_allocator  # noqa: E402, F401 - the module fixture
from support.waits import join as _join  # noqa: E402
from support.waits import wait_for as _wait_for  # noqa: E402

TIMEOUT = 120
N = 1 << 18  # float32 items: a 1 MiB block that fits the reuse cache


def _message(x, **change) -> bytes:
    """A descriptor of ``x`` as the reducer makes it (ticket registered), maybe changed."""
    from cupy_poolmem._sharing._reducers import reduce_cupy

    _, (d,) = reduce_cupy(x)
    return pickle.dumps(d._replace(**change))


@contextlib.contextmanager
def _readers(n):
    ctx = mp.get_context("spawn")
    out = []
    for _ in range(n):
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=W.descriptor_reader, args=(q_in, q_out))
        p.start()
        out.append((p, q_in, q_out))
    try:
        yield out
    finally:
        for p, q_in, _ in out:
            if p.is_alive():
                q_in.put(None)
        _join(*(p for p, _, _ in out))


def _ask(reader, *msg):
    _, q_in, q_out = reader
    q_in.put(msg)
    reply = q_out.get(timeout=TIMEOUT)
    assert reply[0] != "error", reply[2]
    return reply


@pytest.fixture(autouse=True)
def _no_tickets_left():
    """Messages refused here keep their tickets (pinning their blocks) until
    ``inflight_timeout``: give them back at the end, for the tests that follow."""
    yield
    from cupy_poolmem._sharing import context

    context().exporter.expire(now=time.monotonic() + 1e6)


def _same_block_again(ptr, value):
    """A fresh array that the reuse cache hands out on block ``ptr`` (its next life);
    arrays on other cached blocks taken meanwhile are let go after."""
    others = []
    for _ in range(16):
        y = cupy.full(N, value, dtype=cupy.float32)
        if int(y.data.ptr) == ptr:
            cupy.cuda.get_current_stream().synchronize()
            return y
        others.append(y)
    pytest.fail("the reuse cache did not hand the recycled block out again")


def test_a_stale_copy_is_refused_by_every_reader_whatever_it_maps():
    """Life 1 goes to A (kept idle after); the block is recycled and life 2 goes to B,
    which maps it fresh and holds it.  A copy of life 1's message is refused by A, by
    B (holding life 2, then idle), by a reader that never mapped it and back here;
    B still reads life 2's values."""
    with _readers(3) as (a, b, c):
        x = cupy.full(N, 1, dtype=cupy.float32)
        cupy.cuda.get_current_stream().synchronize()
        ptr = int(x.data.ptr)
        old = _message(x)  # its bytes are kept: a copy arrives again later
        assert _ask(a, "load", 1, old, 1.0)[:3] == ("ok", 1, True)
        assert _ask(a, "drop", 1, None, None)[0] == "dropped"  # A keeps it mapped, idle
        recycled = cpm.sharing.stats()["recycled_blocks"]
        del x  # A says Idle when asked: the block goes back to the reuse cache
        assert _wait_for(lambda: cpm.sharing.stats()["recycled_blocks"] > recycled)
        y = _same_block_again(ptr, 2.0)  # life 2
        assert _ask(b, "load", 1, _message(y), 2.0)[:3] == ("ok", 1, True)
        for reader in (b, a, c):
            tag, _, kind, text = _ask(reader, "load", 9, old, 1.0)
            assert (tag, kind) == ("refused", "SharingError"), (tag, kind, text)
            assert "stale" in text
        from cupy_poolmem._sharing._reducers import rebuild

        with pytest.raises(cpm.SharingError):
            rebuild(pickle.loads(old))  # back in the exporter
        assert _ask(b, "drop", 1, None, None)[0] == "dropped"  # B's mapping idle now
        tag, _, kind, _ = _ask(b, "load", 9, old, 1.0)
        assert (tag, kind) == ("refused", "SharingError")
        assert _ask(b, "load", 3, _message(y), 2.0)[:3] == ("ok", 3, True)  # live: taken
        assert float(y[0]) == 2.0
        del y


@pytest.mark.parametrize("held", [False, True], ids=["claim", "hit"])
def test_a_descriptor_past_its_block_is_refused_before_mapping(held):
    """With a live ticket, a message 64 times its block, one wholly past it and one
    whose negative strides reach before it are refused, whether the reader maps the
    block already (hit) or not (claim); a live message still reads its values."""
    with _readers(1) as (r,):
        x = cupy.arange(N, dtype=cupy.float32)
        cupy.cuda.get_current_stream().synchronize()
        size = N * 4
        if held:
            assert _ask(r, "load", 0, _message(x), x.get())[:3] == ("ok", 0, True)
        for i, change in enumerate(
            [
                dict(size=64 * size, shape=(64 * N,), strides=(4,)),
                dict(size=64 * size, offset=32 * size, shape=(N,)),
                dict(offset=0, shape=(N,), strides=(-4,)),
            ],
            start=1,
        ):
            tag, _, kind, text = _ask(r, "load", i, _message(x, **change), 0.0)
            assert tag == "refused" and kind == "ProtocolError", (change, tag, kind, text)
        rev = _message(x, offset=size - 4, strides=(-4,))  # within the block: mapped
        tag, _, ok, first = _ask(r, "load", 7, rev, x[::-1].get())
        assert (tag, ok, first) == ("ok", True, float(N - 1))
        assert _ask(r, "load", 8, _message(x), x.get())[:3] == ("ok", 8, True)
        del x


def test_a_live_ticket_with_another_blocks_allocation_is_refused():
    """x's message (its ticket live) naming y's pool and export data: the reader would
    map y under x's lease and size (2x past y).  Refused by the exporter
    (ProtocolError); the genuine messages still read their own values."""
    from cupy_poolmem._sharing._reducers import reduce_cupy

    with _readers(1) as (r,):
        x = cupy.arange(N, dtype=cupy.float32)
        y = cupy.full(N // 2, 7.0, dtype=cupy.float32)
        cupy.cuda.get_current_stream().synchronize()
        _, (dy,) = reduce_cupy(y)
        forged = _message(x, pool_uuid=dy.pool_uuid, export_data=dy.export_data)
        tag, _, kind, text = _ask(r, "load", 1, forged, 0.0)
        assert tag == "refused" and kind == "ProtocolError", (tag, kind, text)
        assert _ask(r, "load", 2, _message(x), x.get())[:3] == ("ok", 2, True)
        assert _ask(r, "load", 3, pickle.dumps(dy), 7.0)[:3] == ("ok", 3, True)
        del x, y
