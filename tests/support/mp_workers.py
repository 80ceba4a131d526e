"""Functions run in spawned child processes by the sharing tests (importable by module name)."""

from __future__ import annotations

import os
import time
import traceback


def _setup():
    import cupy

    import cupy_poolmem

    cupy_poolmem.set_allocator()
    return cupy, cupy_poolmem


def echo_check(q_in, q_out):
    """Receive arrays; report (pattern ok, ptr, sum) and write -x into them; send one back."""
    cupy, cpm = _setup()
    try:
        while True:
            msg = q_in.get(timeout=120)
            if msg is None:
                break
            tag, arr = msg
            if tag == "check":
                n = arr.size
                want = cupy.arange(3, 3 + 2 * n, 2, dtype=arr.dtype)
                ok = bool((arr == want).all())
                arr[...] = -arr  # the producer must see this
                cupy.cuda.get_current_stream().synchronize()
                res = cupy.arange(n, dtype=cupy.float32) + 0.5  # the worker's own memory
                q_out.put(("checked", ok, int(arr.data.ptr), res))
            elif tag == "back":
                q_out.put(("back", arr))
            elif tag == "hold":
                hold = arr  # noqa: F841
                q_out.put(("held", float(arr.sum())))
    except Exception:
        q_out.put(("error", traceback.format_exc()))


def pipe_worker(conn):
    """Receive (name, array) over a Pipe; reply with a host copy and metadata."""
    cupy, cpm = _setup()
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            name, arr = msg
            conn.send(
                (
                    name,
                    type(arr).__name__,
                    arr.shape,
                    arr.strides,
                    str(arr.dtype),
                    cupy.asnumpy(arr) if hasattr(arr, "device") else arr.copy(),
                )
            )
    except Exception:
        conn.send(("error", traceback.format_exc()))


def pool_square(arr):
    """Pool.map target: return (sum, arr*arr) — the result travels back zero-copy."""
    import cupy_poolmem
    from cupy_poolmem import _runtime

    if _runtime.installed_allocator("device") is None:
        cupy_poolmem.set_allocator()
    return float(arr.sum()), arr * arr


def pressure_consumer(q_in, q_out, n):
    """Receive n arrays slowly and verify each one's pattern (the producer keeps writing)."""
    cupy, cpm = _setup()
    bad = []
    try:
        held = []
        for _ in range(n):
            i, arr = q_in.get(timeout=300)
            held.append((i, arr))
        time.sleep(0.5)  # the producer overwrites freed memory meanwhile
        for i, arr in held:
            if not bool((arr == i).all()):
                bad.append(i)
        q_out.put(("done", bad))
    except Exception:
        q_out.put(("error", traceback.format_exc()))


def hold_and_wait(q_in, q_out):
    """Receive arrays, report ready, then sleep until killed."""
    cupy, cpm = _setup()
    held = []
    while True:
        a = q_in.get(timeout=300)
        if a is None:
            break
        held.append(a)
        q_out.put(("got", float(held[-1][:10].sum())))
    time.sleep(600)


def ordered_reader(q_in, q_out):
    cupy, cpm = _setup()
    arr = q_in.get(timeout=120)
    q_out.put(bool((arr == 7).all()))


def forwarder(q_in, q_next, q_out):
    """Middle process: receive, check, forward to the third process."""
    cupy, cpm = _setup()
    try:
        arr = q_in.get(timeout=120)
        q_out.put(("mid", bool((arr == 5).all())))
        q_next.put(arr)
        del arr
        q_out.put(("mid-done", q_in.get(timeout=120)))
    except Exception:
        q_out.put(("error", traceback.format_exc()))


def last_reader(q_in, q_out):
    cupy, cpm = _setup()
    try:
        arr = q_in.get(timeout=120)
        ok = bool((arr == 5).all())
        arr += 1
        cupy.cuda.get_current_stream().synchronize()
        q_out.put(("last", ok))
    except Exception:
        q_out.put(("error", traceback.format_exc()))


def no_gpu_receiver(conn):
    try:
        conn.recv()
        conn.send(("no error", None))
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc)))


def fork_child(pool, conn):
    try:
        pool.malloc(16)
        conn.send(("no error", ""))
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc)))


def exiting_producer(q_out, done):
    os.environ["CUPY_POOLMEM_EXIT_TIMEOUT"] = "0.5"
    cupy, cpm = _setup()
    cpm.sharing.exit_timeout = 0.5
    x = cupy.full(1 << 20, 9, dtype=cupy.int32)
    q_out.put(x)
    done.wait(60)


def pinned_numpy_worker(conn):
    import numpy as np

    import cupy_poolmem  # noqa: F401

    h = conn.recv()
    ok = bool((h == np.arange(h.size, dtype=h.dtype)).all())
    h[:] = -1  # the sender must see this: same host memory
    conn.send((ok, type(h).__name__))
    conn.recv()


def visible_devices_reader(q_in, q_out):
    cupy, cpm = _setup()
    arr = q_in.get(timeout=120)
    q_out.put((arr.device.id, bool((arr == 3).all()), cupy.cuda.runtime.getDeviceCount()))


def resend_reader(q_in, q_out, keep=None):
    """Receive (cmd, i, array): check the pattern i, write -i at [0], report ptr and stats.

    ``cmd`` "drop" lets the array go at once, "hold" keeps it until "release";
    "check" re-reads every held array (pattern i) without a new array.
    """
    cupy, cpm = _setup()
    if keep is not None:
        cpm.sharing.keep_mappings = keep
    held = {}
    try:
        while True:
            msg = q_in.get(timeout=120)
            if msg is None:
                break
            cmd, i, arr = msg
            if cmd == "check":
                bad = [k for k, a in held.items() if not bool((a[1:] == k).all())]
                q_out.put(("checked", bad, cpm.sharing.stats()))
                continue
            if cmd == "release":
                held.clear()
                q_out.put(("released", None, cpm.sharing.stats()))
                continue
            ok = bool((arr[1:] == i).all())
            ptr = int(arr.data.ptr)
            arr[0] = -i  # the producer must see this
            cupy.cuda.get_current_stream().synchronize()
            if cmd == "hold":
                held[i] = arr
            del arr, msg
            q_out.put(("ok", (i, ok, ptr), cpm.sharing.stats()))
    except Exception:
        q_out.put(("error", traceback.format_exc(), None))


def exiting_producer_twice(q_out, done):
    """Send one array twice, then exit (a short exit wait) once told to."""
    cupy, cpm = _setup()
    cpm.sharing.exit_timeout = 0.5  # the second message is never read before exit
    x = cupy.full(1 << 20, 4, dtype=cupy.int32)
    q_out.put(x)
    q_out.put(x)
    done.wait(60)


def slow_reader(q_in, q_out, keep=None):
    """Read an array behind a long kernel, drop it at once, report the sum afterwards.

    ``keep=0``: no idle mappings kept (the drop unmaps); else the default (a block its
    exporter recycles stays mapped, idle).
    """
    cupy, cpm = _setup()
    if keep is not None:
        cpm.sharing.keep_mappings = keep
    from support.waits import spin

    spin(1)  # compile the kernel first
    cupy.cuda.get_current_stream().synchronize()
    q_out.put("ready")
    x = q_in.get(timeout=120)
    spin(500)  # the stream stays busy for half a second
    s = x.sum()  # reads x after that
    del x  # let go now (unmapped, or kept idle), in order after the sum
    q_out.put("dropped")
    q_out.put(float(s))


def descriptor_reader(q_in, q_out):
    """Receive pickled descriptors (bytes, maybe stale or forged) and rebuild them here.

    ``("load", key, data, want)``: rebuild, check every value equals ``want`` and hold
    the array under ``key``; replies ``("ok", key, all equal, first value)`` or
    ``("refused", key, error type, message)``.  ``("drop", key, None, None)`` lets it go.
    """
    import pickle

    cupy, cpm = _setup()
    from cupy_poolmem._sharing._reducers import rebuild

    held = {}
    try:
        while True:
            msg = q_in.get(timeout=120)
            if msg is None:
                break
            cmd, key, data, want = msg
            if cmd == "drop":
                held.pop(key, None)
                cupy.cuda.get_current_stream().synchronize()
                q_out.put(("dropped", key, None, cpm.sharing.stats()))
                continue
            try:
                arr = rebuild(pickle.loads(data))
            except Exception as exc:
                q_out.put(("refused", key, type(exc).__name__, str(exc)))
                continue
            if not isinstance(want, float):
                want = cupy.asarray(want)  # a host copy of the expected values
            ok = bool((arr == want).all())
            first = float(arr.ravel()[0]) if arr.size else None
            held[key] = arr
            del arr
            q_out.put(("ok", key, ok, first))
    except Exception:
        q_out.put(("error", None, traceback.format_exc(), None))
