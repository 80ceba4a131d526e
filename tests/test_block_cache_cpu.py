"""CPU tests of the block cache's reuse order across streams known by handle only.

A stream's handle is all the cache sees.  The driver hands a destroyed stream's
handle to the next stream created, while the old stream's work may still run: a
freed block must not serve that new stream before its free's event has completed.
"""

from __future__ import annotations

import itertools

import pytest
from fakes.events import EventsDriver, use_driver

from cupy_poolmem import _block_cache

S = 0x5000  # a stream handle (destroyed and handed again, or the same stream)


class Blocks(_block_cache.BlockCache):
    """Blocks made and destroyed on the host; events from the fake driver."""

    def __init__(self) -> None:
        super().__init__(0, granule=1024)
        self.made = itertools.count(0x1000, 0x1000)

    def _create(self, r):
        return 0, next(self.made)

    def _destroy(self, ptr, r):
        pass


@pytest.fixture
def drv(monkeypatch, fake_driver):
    return use_driver(fake_driver, monkeypatch, EventsDriver())


def _freed_behind_pending_work(drv):
    """A block freed on ``S`` whose free's event has not completed: (cache, ptr, event)."""
    c = Blocks()
    err, p = c.alloc(4096, S)
    c.free(p, S)
    ev = drv.log[-1][1]
    assert drv.log[-1] == ("record", ev, S) and ev not in drv.done
    return c, p, ev


def test_a_block_pending_on_a_handle_serves_that_handle_behind_a_wait_on_its_event(drv):
    c, p, ev = _freed_behind_pending_work(drv)
    assert c.alloc(4096, S) == (0, p)  # no new block: served at once...
    assert drv.log[-1] == ("wait", S, ev)  # ...but ordered after the free's event
    assert c.n_driver_allocs == 1 and c.n_hits == 1


def test_a_completed_event_needs_no_wait(drv):
    c, p, ev = _freed_behind_pending_work(drv)
    drv.done.add(ev)
    assert c.alloc(4096, S) == (0, p)
    assert not [e for e in drv.log if e[0] == "wait"]


@pytest.mark.parametrize("legacy", [0, 1])
def test_the_legacy_stream_is_never_destroyed_and_needs_no_wait(drv, legacy):
    c = Blocks()
    err, p = c.alloc(4096, legacy)
    c.free(p, legacy)
    assert c.alloc(4096, legacy) == (0, p)
    assert not [e for e in drv.log if e[0] == "wait"]


def test_the_per_thread_stream_waits_for_the_event_itself(drv):
    c = Blocks()
    err, p = c.alloc(4096, 2)
    c.free(p, 2)  # handle 2 names another stream in each thread
    err, q = c.alloc(4096, 2)
    assert q != p and c.n_driver_allocs == 2
    assert not [e for e in drv.log if e[0] == "wait"]


def test_a_wait_the_driver_refuses_leaves_the_block_cached(drv):
    c, p, ev = _freed_behind_pending_work(drv)
    drv.wait_result = 400  # CUDA_ERROR_INVALID_HANDLE
    err, q = c.alloc(4096, S)
    assert err == 0 and q != p  # a new block; the pending one is not handed out
    assert c.cached == 4096 and c.owns(p)
    drv.done.add(ev)
    drv.wait_result = 0
    assert c.alloc(4096, 0x6000) == (0, p)  # once its event completed, anywhere


def test_another_stream_still_waits_for_completion_not_a_wait(drv):
    c, p, ev = _freed_behind_pending_work(drv)
    err, q = c.alloc(4096, 0x6000)
    assert q != p and not [e for e in drv.log if e[0] == "wait"]
