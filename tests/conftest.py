"""Shared test set-up: GPU tests skip, with a reason, where there is no GPU; fixtures of
the fake driver (``fake_driver``, ``tp``, ``twin_world``) and of the pool retirer
(``fake_retirer``)."""

from __future__ import annotations

import gc

import pytest
from fakes.driver import fake_driver  # noqa: F401  (a fixture every test may ask for)

import cupy_poolmem

N_GPUS = cupy_poolmem.device_count()


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU (none found: no driver, no device, or CUDA_VISIBLE_DEVICES empty)"
    )
    one_gpu = pytest.mark.skip(reason=f"needs 2 GPUs; this machine has {N_GPUS}")
    for item in items:
        if "gpu" in item.keywords and N_GPUS == 0:
            item.add_marker(no_gpu)
        elif "multigpu" in item.keywords and N_GPUS < 2:
            item.add_marker(one_gpu)
    if N_GPUS:
        # On a GPU machine the GPU tests run first.  The CPU tests drive the pools
        # against fakes of the driver in this same process; a fake block that
        # outlives its test (collected after the fakes are undone) reaches the real
        # driver with a pretend pointer and stream, and a later GPU test crashed
        # (SIGSEGV / SIGFPE in the driver).  `.ci/gpu tests` also runs the two halves
        # in separate processes.
        items.sort(key=lambda it: 0 if ("gpu" in it.keywords or "multigpu" in it.keywords) else 1)


class _RetireLog:
    """What a fake retirer did: devices synchronised, and resources closed, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.capturing = False
        self.active = [0]


@pytest.fixture
def fake_retirer():
    """The process's pool retirer replaced by one that syncs nothing and never runs by
    itself: ``r.drain()`` does the work; ``r.log.events`` says what it did."""
    from cupy_poolmem import _retire

    log = _RetireLog()
    r = _retire.Retirer(
        sync=lambda dev: log.events.append(("sync", dev)),
        capture_underway=lambda: log.capturing,
        active_devices=lambda: log.active,
        free=lambda ptr, dev: log.events.append(("free", ptr, dev)),
        background=False,
    )
    r.log = log
    old = _retire.PROCESS.install(r)
    yield r
    _retire.PROCESS.install(old)


@pytest.fixture
def sharing_world():
    """tests/fakes/sharing.World: simulated processes on a fake GPU.  At the end every
    thread the protocol started has ended and the fake GPU saw no violation."""
    from fakes.sharing import World, sharing_threads, wait_for

    before = set(sharing_threads())
    w = World()
    yield w
    w.teardown()
    left = lambda: [t for t in sharing_threads() if t not in before and t.is_alive()]  # noqa: E731
    assert wait_for(lambda: not left(), 5.0), f"threads left running: {left()}"
    assert w.gpu.violations == []


@pytest.fixture(scope="module")
def tp():
    """``cupy_poolmem._pools`` loaded again over the pure-Python hot path (one per module)."""
    from fakes.hotpath import twin_pools

    return twin_pools()


@pytest.fixture
def twin_world(monkeypatch, fake_driver, tp):  # noqa: F811  (the fixture conftest imports)
    """tests/fakes/hotpath.World playing the driver for the twin pools ``tp``; streams'
    waits do nothing.  Garbage is collected before the fakes are undone (a fake block
    must never reach the real driver).  A test that also wants ``fake_retirer`` asks for
    it *before* this fixture, so the collection runs while the fake retirer is in place."""
    from fakes.hotpath import World

    from cupy_poolmem import _hotpath_py, _runtime, _streams

    monkeypatch.setattr(_runtime, "hp", _hotpath_py)
    monkeypatch.setattr(_streams, "wait_streams", lambda *a: None)
    yield World(monkeypatch, tp, fake_driver)
    gc.collect()
