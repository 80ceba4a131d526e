"""Review 3 reproducers: the observability rewrite (compiled Recorder, batched log).

Each test shows one problem found in review (see /work/notes/review3.md) on a CPU,
against the fake pools of ``_observer_fakes`` or a hot-path core whose blocks stay in
its reuse cache (no driver call).  They fail today; each says what a fix must make
true.  Where a thread switch or a signal is needed at one exact point, the test puts
the other thread's action (or the signal's exception) at that point itself.
"""

from __future__ import annotations

import errno
import gc
import importlib
import os
import subprocess
import sys
import threading
import time
import weakref
from array import array
from pathlib import Path

import pytest
from _observer_fakes import FAKES_FILE, FakeBlock, FakeCore, alloc, free, observer

from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem import _pools, report, stats

pytestmark = pytest.mark.filterwarnings(
    "ignore:ExternalStream is deprecated", "ignore:cupy_poolmem observer error"
)

PKG = os.path.join(os.path.dirname(stats.__file__), "")


def _compiled():
    try:
        hp = importlib.import_module("cupy_poolmem._hotpath")
    except Exception:
        return None
    if Path(hp.__file__).parent != Path(twin.__file__).parent or hp.VERSION != twin.VERSION:
        return None
    return hp


IMPLS = [pytest.param(twin, id="twin")]
if _compiled() is not None:
    IMPLS.append(pytest.param(_compiled(), id="cython"))


class _Tls(threading.local):
    tag = ""

    def __init__(self) -> None:
        self.thread = threading.current_thread()


class Rig:
    """A recorder of one implementation with its own tag state (as test_recorder_cpu)."""

    def __init__(self, hp) -> None:
        self.hp = hp
        self.rec = hp.Recorder()
        self.tls = _Tls()
        self.tags = array("q", [0])
        self.errors: list[BaseException] = []
        self.rec.configure(self.tls, self.tags, lambda: None, self.errors.append, self._res)
        self.rec.set_sites((FAKES_FILE, PKG), 32)

    @staticmethod
    def _res(core):
        return getattr(core, "reserved", None)

    def alloc(self, core, ptr, size, stream=0):
        b = FakeBlock(core, ptr, size, stream)
        self.rec.on_alloc(b)
        return b

    def free(self, b) -> None:
        self.rec.on_free(b.core, b.ptr, b.size, b.stream_ptr, b.info)

    def tag(self, name: str) -> None:
        self.tags[0] = 1 if name else 0
        self.tls.tag = name


def _core(hp):
    """A pool core of ``hp`` whose blocks stay on the legacy stream and in its cache."""

    class Core(hp.PoolCore):
        pass

    c = Core.__new__(Core)
    c._attach(0, 0, hp.KIND_DEVICE)
    c.cache_limit, c.cache_max_block = 1 << 30, 1 << 20
    return c


@pytest.fixture
def clean_stats():
    """Nothing observed before and after; errors this test provokes are not kept."""
    stats.stop_log()
    stats.track(False, depth=32, skip=[FAKES_FILE])
    stats._OBSERVER.n_errors = 0
    stats._OBSERVER._warned = False
    yield
    stats.stop_log()
    stats.track(False, depth=32, skip=[FAKES_FILE])
    assert stats._OBSERVER._scopes == ()
    assert observer() is None
    stats._OBSERVER.n_errors = 0
    stats._OBSERVER._warned = False


def _read(path) -> list[dict[str, str]]:
    events, n_bad = report.read_log(path)
    assert n_bad == 0, f"{n_bad} torn or unparsable line(s) in {path}"
    return [{"op": e.op, "ptr": e.ptr, "tag": e.tag, "site": e.callsite} for e in events]


# ------------------------------------------------------------------------------------------
# R11: compiled and twin disagree on a None tag in note()
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hp", IMPLS)
def test_r11_note_with_a_none_tag_writes_an_empty_field(hp):
    """Recorder.note(..., tag=None, ...): the twin writes an empty field, the compiled
    recorder stores Py_None and writes "None" (only the call site is mapped to NULL)."""
    g = Rig(hp)
    g.rec.start()
    g.rec.set_logging(True)
    g.rec.note(FakeCore(), "guard:double_free", 0x10, 8, 0, None, None)
    (batch,) = g.rec.take_batches()
    line = batch.format(1).decode()
    assert line.rstrip("\n").split(",")[8:10] == ["", ""]


def test_r0_harness_sanity():
    """The harness itself: a plain allocation and free through both recorders."""
    for p in IMPLS:
        g = Rig(p.values[0])
        g.rec.start()
        b = g.alloc(FakeCore(), 0x10, 8)
        assert [i.ptr for i in g.rec.live(None)] == [0x10]
        g.free(b)
        assert g.rec.live(None) == [] and not g.errors
