"""Child-process bodies for the sharing lifecycle GPU tests (importable by module name)."""

from __future__ import annotations

import os
import time
import traceback

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin(ms: float, stream=None) -> None:
    """Keep ``stream`` (default: current) busy for about ``ms`` milliseconds."""
    import cupy
    import numpy as np

    k = cupy.RawKernel(_SPIN, "spin")
    rate = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)
    with stream or cupy.cuda.get_current_stream():
        k((1,), (1,), (np.int64(int(ms * rate)),))


def _setup():
    import cupy

    import cupy_poolmem

    cupy_poolmem.set_allocator()
    return cupy, cupy_poolmem


def put_and_return(q, value, how):
    """The first-day pattern: allocate, put, return (or sys.exit) at once."""
    cupy, _ = _setup()
    spin(200)  # the fill below runs late: the receiver must still see it
    q.put(cupy.full(1 << 20, value, dtype=cupy.float32))
    if how == "exit":
        raise SystemExit(0)


def square_late(arr):
    """Pool task: the result is written after a long kernel, then returned at once."""

    import cupy_poolmem
    from cupy_poolmem import _runtime

    if _runtime.installed_allocator("device") is None:
        cupy_poolmem.set_allocator()
    spin(100)
    return float(arr.sum()), arr * arr, os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "")


def forkserver_orchestrator(q_out, n):
    """In a fresh process: preload cupy_poolmem in a forkserver, fork n producers from it."""
    import multiprocessing as mp

    try:
        import cupy

        import cupy_poolmem

        cupy_poolmem.set_allocator()
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["cupy_poolmem"])
        q = ctx.Queue()
        procs = [ctx.Process(target=forkserver_producer, args=(q, i)) for i in range(n)]
        for p in procs:
            p.start()
        from cupy_poolmem._sharing._reducers import rebuild

        got = []
        tickets = set()
        for _ in range(n):
            i, d = q.get(timeout=120)
            tickets.add(d.ticket)
            got.append((i, rebuild(d), None))
        ok = all(bool((a == i).all()) for i, a, _ in got)
        for p in procs:
            p.join(60)
        # every array stays valid after its producer exited
        ok_after = all(bool((a == i).all()) for i, a, _ in got)
        q_out.put(("ok", ok, ok_after, len(tickets), [p.exitcode for p in procs]))
        del got
        cupy.cuda.get_current_stream().synchronize()
    except BaseException:
        q_out.put(("error", traceback.format_exc(), None, None, None))


def forkserver_producer(q, i):
    """Send one array as its bare descriptor, so the receiver can see the ticket drawn."""
    from cupy_poolmem._sharing._reducers import reduce_cupy

    cupy, _ = _setup()
    x = cupy.full(4096, i, dtype=cupy.int32)
    _, (d,) = reduce_cupy(x)
    q.put((i, d))


def load_and_hold(q_in, q_out):
    """Unpickle bytes (one pickled message, shared by several receivers); hold; report."""
    from multiprocessing.reduction import ForkingPickler

    cupy, cpm = _setup()
    held = []
    try:
        while True:
            msg = q_in.get(timeout=120)
            if msg is None:
                break
            if msg == "drop":
                held.clear()
                cupy.cuda.get_current_stream().synchronize()
                q_out.put(("dropped", None))
                continue
            try:
                a = ForkingPickler.loads(msg)
            except cpm.SharingError as exc:
                q_out.put(("SharingError", str(exc)))
                continue
            held.append(a)
            q_out.put(("got", int(a.sum())))
            del a
    except BaseException:
        q_out.put(("error", traceback.format_exc()))


def count_receiver(q_in, q_out, n):
    """Receive n (i, array) messages, check each, report the bad ones."""
    cupy, cpm = _setup()
    try:
        bad = []
        for _ in range(n):
            i, a = q_in.get(timeout=300)
            if not bool((a == i).all()):
                bad.append(i)
            del a
        q_out.put(("done", bad, cpm.sharing.stats()))
    except BaseException:
        q_out.put(("error", traceback.format_exc(), None))


def one_shot_reader(q_in, q_out, idx):
    """Receive one array, report its sum, wait for the word to exit."""
    cupy, _ = _setup()
    try:
        a = q_in.get(timeout=300)
        q_out.put((idx, int(a.sum())))
        q_in.get(timeout=300)
    except BaseException:
        q_out.put((idx, traceback.format_exc()))


def forward_and_exit(q_in, q_next, q_out):
    """Receive, forward to a third process, exit before that one unpickles."""
    cupy, _ = _setup()
    try:
        a = q_in.get(timeout=120)
        a += 1  # a write of this process, enqueued right before forwarding
        q_next.put(a)
        del a
    except BaseException:
        q_out.put(("error", traceback.format_exc()))


def late_reader(q_in, go, q_out):
    """Wait until told (the forwarder is gone), then unpickle and check."""
    cupy, _ = _setup()
    try:
        go.wait(120)
        a = q_in.get(timeout=120)
        q_out.put(("late", int(a[0]), bool((a == a[0]).all())))
    except BaseException:
        q_out.put(("error", traceback.format_exc()))


def kernel_then_killed(q_in, q_out):
    """Map an array, queue a long kernel and then a write into it, say so; get killed."""
    cupy, _ = _setup()
    a = q_in.get(timeout=120)
    spin(1500)
    a.fill(-1)  # would land after the exporter reused the memory, if that were allowed
    q_out.put("queued")
    time.sleep(600)


def short_lived_producer(q, i):
    """Put one array and exit with the default settings."""
    cupy, _ = _setup()
    q.put((i, cupy.full(1 << 16, i, dtype=cupy.int32)))


def get_expecting_stale(q_in, q_out):
    """Unpickle one message; report the data or the SharingError."""
    cupy, cpm = _setup()
    try:
        a = q_in.get(timeout=120)
        q_out.put(("data", int(a[0])))
    except cpm.SharingError as exc:
        q_out.put(("SharingError", str(exc)))
    except BaseException:
        q_out.put(("error", traceback.format_exc()))


def load_file_expecting_stale(path, q_out):
    from multiprocessing.reduction import ForkingPickler

    cupy, cpm = _setup()
    try:
        with open(path, "rb") as f:
            a = ForkingPickler.loads(f.read())
        q_out.put(("data", int(a[0])))
    except cpm.SharingError as exc:
        q_out.put(("SharingError", str(exc)))
    except BaseException:
        q_out.put(("error", traceback.format_exc()))


def reimport_while_unmap_queued(q_in, q_out):
    """Drop a received array behind a long kernel (its unmap queued), receive it again."""
    cupy, cpm = _setup()
    try:
        a = q_in.get(timeout=120)
        spin(400)
        s = a.sum()  # queued behind the spin; the unmap is queued after it
        del a
        b = q_in.get(timeout=120)  # the same block: mapped again after that unmap ran
        ok = bool((b == 2).all())
        q_out.put(("ok", float(s), ok))
    except BaseException:
        q_out.put(("error", traceback.format_exc(), None))


def drop_during_capture(q_in, q_out):
    """Receive on a non-blocking stream, drop the array while that stream is captured."""
    cupy, cpm = _setup()
    try:
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            a = q_in.get(timeout=120)
            y = cupy.zeros(4, dtype=cupy.float32)
            total = float(a.sum())
            s.begin_capture()
            y += 1
            del a  # let go while capturing: must not become part of the graph
            g = s.end_capture()
            g.launch(s)
            s.synchronize()
        during = cpm.sharing.stats()["imported_blocks"]
        deadline = time.monotonic() + 10
        while cpm.sharing.stats()["imported_blocks"] and time.monotonic() < deadline:
            time.sleep(0.02)
        q_out.put(("ok", total, float(y.sum()), during, cpm.sharing.stats()["imported_blocks"]))
    except BaseException:
        q_out.put(("error", traceback.format_exc(), None, None, None))


def hold_until_told(q_in, q_out):
    """Receive, report the sum, re-check after being told, then drop."""
    cupy, _ = _setup()
    try:
        a = q_in.get(timeout=120)
        q_out.put(("got", int(a.sum())))
        q_in.get(timeout=120)
        q_out.put(("again", int(a.sum())))
        del a
        cupy.cuda.get_current_stream().synchronize()
        q_out.put(("dropped", None))
        q_in.get(timeout=120)
    except BaseException:
        q_out.put(("error", traceback.format_exc()))
