"""Functions run in spawned children by tests/test_sharing_operational_limits_gpu.py (importable by name)."""

from __future__ import annotations

import os
import traceback


def _setup():
    import cupy

    import cupy_poolmem

    cupy_poolmem.set_allocator()
    return cupy, cupy_poolmem


def fd_starved_receiver(q_in, q_out):
    """Receive an array (the connection is made), then run out of descriptors and
    receive one from a pool not imported yet (its descriptor is lost); with
    descriptors back, receive again.  Reports each outcome."""
    import resource

    cupy, cpm = _setup()
    fillers = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        first = q_in.get(timeout=120)
        q_out.put(("first", float(first.sum())))
        r, w = os.pipe()
        fillers += [r, w]
        n_open = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (n_open + 16, hard))
        try:
            while True:
                fillers.append(os.dup(w))
        except OSError:
            pass
        try:
            lost = q_in.get(timeout=120)
            starved = ("mapped", float(lost.sum()))  # (not expected)
            del lost
        except Exception as exc:
            starved = (type(exc).__name__, str(exc))
        for fd in fillers:
            os.close(fd)
        fillers = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        q_out.put(("starved", *starved))
        again = q_in.get(timeout=120)
        q_out.put(("again", float(again.sum()), int(again[7])))
        del first, again
    except Exception:
        q_out.put(("error", traceback.format_exc()))
    finally:
        for fd in fillers:
            os.close(fd)


def many_streams_receiver(q_in, q_out, n):
    """Receive ``n`` arrays, each written on a stream of its own; check each one's
    pattern; report the opened events and the check."""
    cupy, cpm = _setup()
    try:
        kept, ok = [], True
        for _ in range(n):
            i, arr = q_in.get(timeout=120)
            ok = ok and bool((arr == i).all())
            kept.append(arr)
        q_out.put(("done", ok, cpm.sharing.stats()["opened_events"]))
        q_in.get(timeout=120)  # hold the arrays until told
    except Exception:
        q_out.put(("error", traceback.format_exc()))


def exporting_task(i):
    """A pool task that returns an array of its own memory (its exporter's listener
    started) and the directory of its sharing socket."""
    cupy, cpm = _setup()
    from cupy_poolmem._sharing import context

    d = os.path.dirname(context().exporter.address)
    out = cupy.full(1000, i, dtype=cupy.int32)
    cupy.cuda.get_current_stream().synchronize()
    return out, d
