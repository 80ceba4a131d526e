"""Threads the sharing machinery starts on demand are not started while the interpreter
finalizes: on Python 3.11 ``Thread.start()`` then waits forever for a thread that never
runs, so an object collected at exit (in a reference cycle, or held by a failing test's
traceback) that posts a frame or defers an unmap would hang the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAD = (
    "import gc, threading\n"
    "from cupy_poolmem._sharing import _transport, _unmapping, _wire\n"
    "class Conn:\n"
    "    def send(self, data, fd=None): print('sent', flush=True)\n"
    "class Importer(_unmapping.Unmapping):\n"
    "    def __init__(self):\n"
    "        self.lock, self._deferred_thread = threading.RLock(), None\n"
    "    def _retry_deferred(self): print('retried', flush=True)\n"
    "class AtExit:\n"
    "    def __del__(self):\n"
    "        {call}\n"
    "        print('done', flush=True)\n"
    "gc.disable()\n"
    "x = AtExit()\n"
    "x.sender, x.importer = _transport.Sender(Conn(), 'test'), Importer()\n"
    "x.cycle = x\n"
    "{before}"
    "del x\n"
)


@pytest.mark.parametrize(
    "call",
    ["self.sender.post(_wire.Evict(1))", "self.importer._schedule_deferred()"],
    ids=["sender", "deferred-unmaps"],
)
def test_an_object_collected_at_exit_lets_the_process_exit(call):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    code = HEAD.format(call=call, before="")
    run = subprocess.run([sys.executable, "-c", code], env=env, timeout=30, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().split() == ["done"]  # nothing ran: the process exits


def test_before_exit_the_threads_still_start():
    """The check is for the interpreter's end only: the same calls made while it runs
    start their threads (the frame is sent, the deferred work retried)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    before = (
        "x.sender.post(_wire.Evict(1)); x.sender.flush(5.0)\n"
        "x.importer._schedule_deferred(); x.importer._deferred_thread.join(5.0)\n"
    )
    code = HEAD.format(call="pass", before=before)
    run = subprocess.run([sys.executable, "-c", code], env=env, timeout=30, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().split() == ["sent", "retried", "done"]
