"""The worker processes: what each one does with the messages it gets."""

from __future__ import annotations

import gc
import os
import time
import traceback
from typing import Any

from ..._errors import PoolmemError
from .backends import BACKENDS
from .checks import Forged, Plain, outside, verify

# -- the worker processes ----------------------------------------------------------------------------
WORKER_SETTINGS = {"exit_timeout": 3.0, "inflight_timeout": 1.0, "claim_timeout": 5.0}
IDLE_EXIT_S = 300.0  # a worker whose hub went silent this long exits


def classify_exc(exc: BaseException) -> tuple[str, str]:
    """``("refused:TYPE", why)`` for cupy_poolmem's typed errors, else ``("error", why)``."""

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PoolmemError):
        return f"refused:{type(exc).__name__}", text
    tb = " ".join("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).split())
    return "error", f"{text} | {tb[-900:]}"


def check_received(be: Any, arr: Any, expect: Plain | Forged) -> tuple[str, str]:
    """:func:`verify` for a received array (``be``: the backend it lives on).  An array
    of a forged message that reaches outside its block is not read."""
    try:
        if isinstance(expect, Forged):
            shape, strides, item, offset, mem_size = be.geometry(arr)
            why = outside(shape, strides, item, offset, mem_size, expect)
            if why:
                return "wrong", why
        host, strides, offset, mem_size = be.view(arr)
        return verify(host, strides, offset, mem_size, expect)
    except Exception as exc:
        return "error", f"reading a received array: {type(exc).__name__}: {exc}"


class _WorkerState:
    """A worker's arrays: what it made (by batch) and what it holds (by message)."""

    def __init__(self, conn: Any, be: Any) -> None:
        self.conn, self.be = conn, be
        self.held: dict[int, tuple[Any, Any]] = {}  # mid -> (array, expectation or None)
        self.own: dict[Any, list[tuple[Any, Plain]]] = {}  # batch tag -> its arrays

    def make(self, items: list, copies: int) -> tuple[list, list]:
        """Allocate and fill one array per item; pickle ``copies`` messages of each."""
        from multiprocessing.reduction import ForkingPickler

        arrays, msgs = [], []
        for ai, base, n in items:
            a = self.be.arange(base, n)
            arrays.append((a, Plain(base, n)))
            for c in range(copies):
                msgs.append((ai, c, bytes(ForkingPickler.dumps(a))))
        return arrays, msgs

    def take(self, mid: int, arr: Any, expect: Any, action: str) -> None:
        """Check a received array, act on it, and report."""
        from multiprocessing.reduction import ForkingPickler

        extra = None
        try:
            outcome, detail = check_received(self.be, arr, expect)
            if outcome in ("ok", "unchecked"):
                if action in ("forward", "return"):
                    try:
                        extra = bytes(ForkingPickler.dumps(arr))
                    except BaseException as exc:
                        outcome, detail = classify_exc(exc)
                elif action == "hold":
                    self.held[mid] = (arr, expect)
                elif action == "write":
                    self.be.write_late(arr)
                    self.held[mid] = (arr, None)
        except BaseException as exc:
            outcome, detail = classify_exc(exc)
        self.conn.send(("result", mid, outcome, detail, extra))

    def recheck(self) -> list[tuple[int | None, str, str]]:
        """Re-read every array held or made here: what is no longer what was sent."""
        out: list[tuple[int | None, str, str]] = []
        for mid, (arr, expect) in self.held.items():
            if expect is not None:
                o, d = check_received(self.be, arr, expect)
                if o not in ("ok", "unchecked"):
                    out.append((mid, o, "a held array re-read: " + d))
        for tag, arrays in self.own.items():
            for a, expect in arrays:
                o, d = check_received(self.be, a, expect)
                if o != "ok":
                    out.append((None, o, f"an array it made ({tag}) re-read: {d}"))
        return out

    def recycle(self, old: Any, tag: Any, items: list) -> None:
        """Drop a batch's arrays, let their blocks go back to the pool, make new ones."""
        ptrs = {self.be.ptr(a) for a, _ in self.own.pop(old, [])}
        deadline = time.monotonic() + 0.5
        while self.be.stats().get("limbo_blocks", 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        arrays, msgs = self.make(items, 2)
        reused = sum(self.be.ptr(a) in ptrs for a, _ in arrays)
        self.own[tag] = arrays
        del arrays
        self.conn.send(("produced", tag, msgs, reused))

    def settle(self) -> None:
        """Re-read, let everything go, unmap idle mappings; report with the counters."""
        found = self.recheck()
        self.held.clear()
        self.own.clear()
        gc.collect()
        self.be.sync()
        self.be.collect()
        self.conn.send(("settled", found, self.be.stats()))


def worker_main(conn: Any, wid: int, backend: str = "gpu") -> None:
    """A long-lived worker: produce, receive, check, forward on the hub's word, until told
    to exit, killed, or the hub goes away (its pipe closes, or stays silent)."""
    from multiprocessing.reduction import ForkingPickler

    be = BACKENDS[backend]()
    be.setup(WORKER_SETTINGS)
    conn.send(("ready", wid, os.getpid()))
    st = _WorkerState(conn, be)
    seq = 0  # messages read from the hub, failed ones too (the hub counts its sends)
    while True:
        if not conn.poll(IDLE_EXIT_S):
            return
        seq += 1
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        except BaseException as exc:  # a message of the hub's own arrays was refused
            conn.send(("recv_failed", seq, *classify_exc(exc)))
            continue
        op = msg[0]
        try:
            if op == "produce":
                _, tag, items, copies, then = msg
                arrays, msgs = st.make(items, copies)
                conn.send(("produced", tag, msgs, 0))
                if then == "return":
                    return  # the process exits at once: its exit waits for the claims
                if then != "drop":
                    st.own[tag] = arrays
                del arrays
            elif op == "recycle":
                st.recycle(*msg[1:])
            elif op == "load":
                _, mid, expect, data, action = msg
                msg = None
                try:
                    arr = ForkingPickler.loads(data)
                except BaseException as exc:
                    conn.send(("result", mid, *classify_exc(exc), None))
                    continue
                st.take(mid, arr, expect, action)
                del arr
            elif op == "take":
                _, mid, expect, arr, action = msg
                msg = None
                st.take(mid, arr, expect, action)
                del arr
            elif op == "recheck":
                conn.send(("rechecked", st.recheck()))
            elif op == "settle":
                st.settle()
            elif op == "exit":
                return
        except BaseException as exc:
            conn.send(("failed", op, *classify_exc(exc)))
        finally:
            msg = None
