"""GcFreeze: one collection then one freeze of a worker's start-up objects, undone at
teardown; never on a worker that holds tasks.  And the plugin's option for it."""

from __future__ import annotations

import gc
import sys

import pytest

from cupy_poolmem._gc_freeze import GcFreeze


class FakeGc:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.count = 0

    def collect(self) -> int:
        self.calls.append("collect")
        return 0

    def freeze(self) -> None:
        self.calls.append("freeze")
        self.count = 1234

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")
        self.count = 0

    def get_freeze_count(self) -> int:
        return self.count


def test_collects_before_freezing_once_and_says_how_many():
    fake = FakeGc()
    f = GcFreeze(fake, preload=())
    assert f.freeze() == "froze 1234 start-up objects"
    assert fake.calls == ["collect", "freeze"]
    assert f.freeze() == "frozen already"  # a second setup does not freeze again
    assert fake.calls == ["collect", "freeze"]


def test_a_worker_holding_tasks_is_not_frozen():
    fake = FakeGc()
    f = GcFreeze(fake, preload=())
    assert f.freeze(busy=True).startswith("skipped")
    assert fake.calls == [] and not f.frozen
    f.unfreeze()  # nothing frozen by us: nothing given back
    assert fake.calls == []


def test_unfreeze_gives_back_only_what_it_froze():
    fake = FakeGc()
    f = GcFreeze(fake, preload=())
    f.freeze()
    f.unfreeze()
    f.unfreeze()
    assert fake.calls == ["collect", "freeze", "unfreeze"]


def test_preloaded_modules_are_imported_before_the_freeze():
    fake = FakeGc()
    seen: list[bool] = []
    name = "json.tool"  # not imported by the test run otherwise
    sys.modules.pop(name, None)
    orig = fake.freeze

    def freeze() -> None:
        seen.append(name in sys.modules)
        orig()

    fake.freeze = freeze  # type: ignore[method-assign]
    GcFreeze(fake, preload=(name, "no_such_module_here")).freeze()
    assert seen == [True]


def test_the_real_collector_freezes_and_unfreezes():
    before = gc.get_freeze_count()
    f = GcFreeze(preload=())
    try:
        f.freeze()
        assert gc.get_freeze_count() > before
    finally:
        f.unfreeze()
    assert gc.get_freeze_count() == before


def test_plugin_option_and_config_key():
    dask = pytest.importorskip("dask")
    pytest.importorskip("distributed")
    from cupy_poolmem._errors import OptionTypeError
    from cupy_poolmem.dask import PoolmemPlugin

    assert PoolmemPlugin().gc_freeze is True
    assert PoolmemPlugin(gc_freeze=False).gc_freeze is False
    with pytest.raises(OptionTypeError, match="gc_freeze"):
        PoolmemPlugin(gc_freeze="no")  # type: ignore[arg-type]
    with dask.config.set({"cupy-poolmem.gc-freeze": "false"}):
        assert PoolmemPlugin.from_config().gc_freeze is False
    assert PoolmemPlugin.from_config().gc_freeze is True
    assert "gc_freeze=True" in repr(PoolmemPlugin())


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_frozen_process_keeps_the_cycles_it_drops_until_unfrozen():
    # Why only a worker's start-up objects are frozen: an object alive at the freeze
    # that later becomes cyclic garbage is not collected until the unfreeze.
    import weakref

    obj = _Cycle()
    ref = weakref.ref(obj)
    f = GcFreeze(preload=())
    try:
        f.freeze()
        del obj
        gc.collect()
        assert ref() is not None  # frozen: the collector no longer sees the cycle
    finally:
        f.unfreeze()
    gc.collect()
    assert ref() is None


def test_setup_without_a_worker_freezes_nothing():
    # PoolmemPlugin().setup() in a plain process (a client, a notebook): the process's
    # objects are the application's, so nothing is collected or frozen.
    fake = FakeGc()
    f = GcFreeze(fake, preload=())
    assert f.freeze_for(None).startswith("skipped: not a Dask worker")
    assert fake.calls == [] and not f.frozen
    f.unfreeze()
    assert fake.calls == []


def test_tasks_are_read_from_a_distributed_worker():
    # The attribute path on the installed distributed: Worker.state.tasks.
    pytest.importorskip("distributed")
    from distributed import Worker
    from distributed.worker_state_machine import TaskState

    # Built, never started: no thread, no event loop, no connection.
    w = Worker("tcp://127.0.0.1:1", nthreads=1, dashboard=False, validate=False)
    w.state.tasks["x"] = TaskState("x")
    fake = FakeGc()
    assert GcFreeze(fake, preload=()).freeze_for(w).startswith("skipped: the worker holds")
    assert fake.calls == []
    del w.state.tasks["x"]
    assert GcFreeze(fake, preload=()).freeze_for(w) == "froze 1234 start-up objects"
    assert fake.calls == ["collect", "freeze"]


def test_a_worker_without_a_task_state_is_frozen():
    fake = FakeGc()
    assert GcFreeze(fake, preload=()).freeze_for(object()) == "froze 1234 start-up objects"
