"""The helpers the step-sharing GPU tests stand on, checked without a GPU: the pickled
receiver's loop lets go of every array it was sent once asked to (a name left bound
kept the last one, and its mapping, alive), a child's answer is awaited within a bound
and a dead, silent or failing child fails the test with what happened, and a reader's
report of wrong data names the first wrong item."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading
import time
import weakref

import numpy as np
import pytest
from support.step_workers import mismatch, serve_pickled
from support.waits import answer


class Payload:
    """What the receiver gets: an object whose life a weak reference shows."""

    def __init__(self, n: int) -> None:
        self.n = n


def _serve(conn, refs: list) -> None:
    def check(x, base):
        refs.append(weakref.ref(x))
        return {"ok": x.n == base}

    def alive() -> dict:
        return {"alive": sum(r() is not None for r in refs)}

    def settle() -> dict:
        gc.collect()
        return alive()

    serve_pickled(conn, check, alive, settle)


@pytest.fixture
def receiver():
    """A pickled receiver's loop in a thread, and the weak references to what it got."""
    here, there = mp.Pipe()
    refs: list = []
    t = threading.Thread(target=_serve, args=(there, refs), daemon=True)
    t.start()

    def ask(*msg):
        here.send(msg)
        assert here.poll(10), f"no answer to {msg[0]}"
        return here.recv()

    yield ask, refs
    here.send(None)
    t.join(10)
    assert not t.is_alive()


def test_a_drop_lets_go_of_every_array_received_and_checked(receiver):
    ask, refs = receiver
    for k in range(3):
        assert ask("x", Payload(k), k) == ("checked", {"ok": True, "alive": k + 1, "index": k})
    assert ask("check", 2, 2)[1]["ok"]  # the last request touched the last array
    assert ask("check", 0, 1)[1]["ok"] is False  # and a wrong pattern says so
    assert ask("drop") == ("dropped", {"alive": 0})
    assert ask("stats") == ("stats", {"alive": 0})
    assert ask("x", Payload(5), 5)[1]["ok"]  # a drop right after an array came
    assert ask("drop") == ("dropped", {"alive": 0})


def test_a_request_that_fails_answers_with_its_traceback(receiver):
    ask, _refs = receiver
    reply = ask("check", 5, 0)  # no array 5
    assert reply[0] == "error" and "IndexError" in reply[1]


class _Child:
    """A child process as ``answer`` sees it."""

    def __init__(self, alive: bool = True, exitcode: int | None = None) -> None:
        self.name, self.pid = "child-x", 4242
        self._alive, self.exitcode = alive, exitcode

    def is_alive(self) -> bool:
        return self._alive


def test_answer_returns_the_next_message():
    a, b = mp.Pipe()
    b.send(("mapped", 0, 4096))
    assert answer(a, _Child(), "the mapping", 1.0) == ("mapped", 0, 4096)


def test_a_silent_child_fails_within_the_bound_naming_its_pid():
    a, _b = mp.Pipe()
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"child-x \(pid 4242\) gave no the map"):
        answer(a, _Child(), "the map", 0.3)
    assert time.monotonic() - t0 < 2.0


def test_a_dead_child_fails_at_once_with_its_exit_code():
    a, _b = mp.Pipe()
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="exited with code -9 before the map"):
        answer(a, _Child(alive=False, exitcode=-9), "the map", 30.0)
    assert time.monotonic() - t0 < 2.0


def test_a_dead_childs_last_words_are_read():
    a, b = mp.Pipe()
    b.send(("error", "Traceback...\nCUDA_ERROR_ILLEGAL_ADDRESS"))
    with pytest.raises(pytest.fail.Exception, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        answer(a, _Child(alive=False, exitcode=1), "the check", 30.0)


def test_a_closed_pipe_fails_naming_what_was_awaited():
    a, b = mp.Pipe()
    b.close()
    with pytest.raises(pytest.fail.Exception, match="closed its pipe before the check"):
        answer(a, _Child(alive=False, exitcode=0), "the check", 30.0)


def test_a_mismatch_names_the_first_wrong_item():
    x = np.arange(10, dtype=np.int32) + 7
    assert mismatch(np, x, 7) == ""
    x[4] = -1
    x[8] = -2
    why = mismatch(np, x, 7)
    assert "2 of 10 items wrong" in why and "index 4: got -1, want 11" in why
