"""Spawned processes of the step-sharing GPU tests (tests/test_sharing_steps_gpu.py):
a receiver that maps the steps of another process's blocks (``StepMappings``) and checks
their data, and a short-lived exporter.  Importable by name; every message is a tuple
over a ``multiprocessing`` Pipe, and file descriptors go with ``send_handle``.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.reduction import recv_handle, send_handle

SETTLE = 10.0  # seconds a receiver waits for its unmaps after letting go


def _array(cupy, ptr: int, n: int, owner: object, device: int):
    """An int32 array of ``n`` items at ``ptr`` (memory this process maps)."""
    mem = cupy.cuda.UnownedMemory(ptr, n * 4, owner, device)
    return cupy.ndarray((n,), dtype=cupy.int32, memptr=cupy.cuda.MemoryPointer(mem, 0))


def send_block(conn, pid: int, owner, ptr: int, size: int, grants) -> None:
    """The exporter's side of one block: steps and which carry a descriptor, then the
    descriptors in order (each closed here once sent)."""
    conn.send(("map", owner, ptr, size, [(tuple(g.step), g.fd is not None) for g in grants]))
    for g in grants:
        if g.fd is not None:
            send_handle(conn, g.fd, pid)
            os.close(g.fd)


def receiver(conn, device: int, peers: tuple = (), read_on: int | None = None) -> None:
    """Map blocks the parent sends and check them; answer each request.

    First ``("ready", pid)``.  Requests: ``("map", owner, ptr, size, [(step, has_fd)])``
    then the descriptors -> ``("mapped", key, reserved bytes)``; ``("check", key_index,
    ptr, n, base)``: the block holds ``base + arange(n)`` -> ``("checked", ok, what was
    wrong)`` (read with GPU ``read_on`` when given, a peer); ``("write", key_index, ptr,
    n, base)`` -> ``("written",)``; ``("unmap", key_index)`` -> ``("unmapped", step ids
    gone)``; ``("have", owner)``; ``None``: exit.
    """
    try:
        import cupy
        from cuda.bindings import driver

        from cupy_poolmem._sharing._steps import Step, StepGrant, StepMappings

        cupy.cuda.Device(device).use()
        cupy.cuda.runtime.free(0)  # the context is current for the driver calls
        maps = StepMappings(driver, device, peers)
        conn.send(("ready", os.getpid()))
        keys: list = []
        bases: list[tuple[int, int]] = []  # (exporter's block address, address here)
        while True:
            msg = conn.recv()
            if msg is None:
                break
            op = msg[0]
            if op == "map":
                _, owner, ptr, size, steps = msg
                grants = [
                    StepGrant(Step(*s), recv_handle(conn) if has else None) for s, has in steps
                ]
                here, key = maps.map(owner, ptr, size, grants)
                keys.append(key)
                bases.append((ptr, here))
                conn.send(("mapped", len(keys) - 1, maps.reserved))
            elif op in ("check", "write"):
                _, i, ptr, n, base = msg
                there, here = bases[i]
                addr = here + (ptr - there)
                dev = device if read_on is None else read_on
                with cupy.cuda.Device(dev):
                    x = _array(cupy, addr, n, maps, device)
                    if op == "check":
                        why = mismatch(cupy, x, base)
                        cupy.cuda.Device(dev).synchronize()
                        where = f"block {i} mapped at {here:#x}, read at {addr:#x} on GPU {dev}"
                        conn.send(("checked", not why, f"{why} ({where})" if why else ""))
                    else:
                        x[...] = cupy.arange(n, dtype=cupy.int32) + base
                        cupy.cuda.Device(dev).synchronize()
                        conn.send(("written",))
                    del x
            elif op == "unmap":
                conn.send(("unmapped", maps.unmap(keys[msg[1]])))
            elif op == "have":
                conn.send(("have", sorted(maps.have(msg[1]))))
            elif op == "stats":
                conn.send(("stats", maps.stats()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def short_lived_exporter(conn, device: int, receiver_pid: int, n: int, base: int) -> None:
    """Allocate a block on an exportable expandable pool, fill it, send its steps to
    the receiver (through the parent: ``conn`` carries the descriptors), and exit."""
    try:
        import cupy
        from cuda.bindings import driver

        import cupy_poolmem as cpm
        from cupy_poolmem._sharing._steps import StepExports

        cupy.cuda.Device(device).use()
        pool = cpm.DevicePool(device=device, large_blocks="expandable", ipc=True)
        with cpm.using(pool):
            x = cupy.arange(n, dtype=cupy.int32) + base
        cupy.cuda.Device(device).synchronize()
        blocks = pool._backend
        steps = blocks.steps_under(x.data.ptr, x.nbytes)
        grants = StepExports(driver).grant(1, blocks, x.data.ptr, x.nbytes, steps)
        send_block(conn, receiver_pid, "short-lived", x.data.ptr, x.nbytes, grants)
        conn.send(("sent",))
        conn.recv()  # the parent says when to go (after the receiver mapped)
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)  # no clean-up: as an exporter that ends abruptly


def mismatch(xp, x, base) -> str:
    """Empty when ``x`` holds ``base + arange(x.size)``, else what a reader saw there:
    how many items are wrong, the first wrong index, its value and the expected one
    (``xp``: the array module, ``cupy``, or ``numpy`` in a CPU test)."""
    want = xp.arange(x.size, dtype=x.dtype) + base
    bad = xp.flatnonzero(x.ravel() != want)
    if bad.size == 0:
        return ""
    i = int(bad[0])
    return (
        f"{int(bad.size)} of {x.size} items wrong ({x.nbytes} bytes); first at index {i}: "
        f"got {x.ravel()[i].item()!r}, want {want[i].item()!r}"
    )


def serve_pickled(conn, check, stats, settle) -> None:
    """The message loop of :func:`pickled_receiver`, without CUDA (a CPU test runs it).

    ``check(x, base) -> dict`` (at least ``ok``), ``stats() -> dict``, ``settle() ->
    dict`` (after every array was let go).  Each request is answered by a function of
    its own: no array it received outlives the request in a local of this loop (a
    name bound here would keep the last array, and its mapping, after ``drop``).
    """

    def received(msg, held):
        _, x, base = msg
        held.append((x, base))
        return ("checked", {**check(x, base), **stats(), "index": len(held) - 1})

    def again(msg, held):
        _, i, base = msg
        return ("checked", {**check(held[i][0], base), **stats(), "index": i})

    def answer(msg, held):
        try:
            if msg[0] == "x":
                return received(msg, held)
            if msg[0] == "check":
                return again(msg, held)
            if msg[0] == "drop":
                held.clear()
                return ("dropped", settle())
            if msg[0] == "stats":
                return ("stats", stats())
            return ("error", f"unknown request {msg[0]!r}")
        except Exception:  # answered; the receiver goes on (its state can still be asked)
            return ("error", traceback.format_exc())

    held: list = []
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            conn.send(answer(msg, held))
            del msg
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def pickled_receiver(conn, read_on: int | None = None) -> None:
    """Receive CuPy arrays through the pipe (unpickled zero-copy by the package's reducer)
    and check them; answer each request (see :func:`serve_pickled`).

    First ``("ready", pid)``.  Requests: ``("x", array, base)``: the array holds
    ``base + arange`` (read with GPU ``read_on`` when given, a peer) -> ``("checked",
    {ok, why, ptr, nbytes, step_reserved_bytes, step_windows, ...})``, the array kept;
    ``("check", i, base)``: array ``i`` again; ``("drop",)``: let go of every array ->
    ``("dropped", stats)`` once the unmaps are done (or ``SETTLE`` seconds passed:
    then the stats say what is still mapped); ``None``: exit.
    """
    try:
        import gc
        import time

        import cupy

        import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)
        from cupy_poolmem._sharing._context import context

        cupy.cuda.Device(0).use()
        cupy.cuda.runtime.free(0)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        return
    conn.send(("ready", os.getpid()))

    def stats():
        imp = context().importer
        return {
            **imp.step_maps(0).stats(),
            "imported_blocks": imp.stats()["imported_blocks"],
            "step_pools": len(imp._step_pools),  # exporters' pools it maps from now
        }

    def check(x, base):
        dev = x.device.id if read_on is None else read_on
        with cupy.cuda.Device(dev):
            why = mismatch(cupy, x, base)
            cupy.cuda.Device(dev).synchronize()
        return {"ok": not why, "why": why, "ptr": x.data.ptr, "nbytes": x.nbytes, "dev": dev}

    def settle():
        gc.collect()
        cupy.cuda.Device(0).synchronize()
        deadline = time.monotonic() + SETTLE
        while stats()["step_windows"] and time.monotonic() < deadline:
            context().importer.trim_idle(0)
            time.sleep(0.02)
        return stats()

    serve_pickled(conn, check, stats, settle)


def exiting_exporter(q, mode: str, n: int, base: int) -> None:
    """Put one array of an exportable ``mode`` pool on ``q`` and return (the process
    exits: its exit waits until the receiver mapped the block)."""
    import cupy

    import cupy_poolmem as cpm
    import cupy_poolmem._sharing  # noqa: F401

    pool = cpm.DevicePool(device=0, large_blocks=mode, ipc=True)
    with cpm.using(pool):
        x = cupy.empty(n, dtype=cupy.int32)
    x[...] = cupy.arange(n, dtype=cupy.int32) + base
    cupy.cuda.Device(0).synchronize()
    q.put(x)
    q.close()
    q.join_thread()  # the message is out before the exit wait starts
