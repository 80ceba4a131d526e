"""Spawned processes of the step-sharing GPU tests (tests/test_sharing_steps_gpu.py):
a receiver that maps the steps of another process's blocks (``StepMappings``) and checks
their data, and a short-lived exporter.  Importable by name; every message is a tuple
over a ``multiprocessing`` Pipe, and file descriptors go with ``send_handle``.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.reduction import recv_handle, send_handle

TIMEOUT = 120


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

    Requests: ``("map", owner, ptr, size, [(step, has_fd)])`` then the descriptors ->
    ``("mapped", key, reserved bytes)``; ``("check", key_index, ptr, n, base)``: the
    block holds ``base + arange(n)`` -> ``("checked", ok)`` (read with GPU ``read_on``
    when given, a peer); ``("write", key_index, ptr, n, base)`` -> ``("written",)``;
    ``("unmap", key_index)`` -> ``("unmapped", step ids gone)``; ``("have", owner)``;
    ``None``: exit.
    """
    try:
        import cupy
        from cuda.bindings import driver

        from cupy_poolmem._sharing._steps import Step, StepGrant, StepMappings

        cupy.cuda.Device(device).use()
        cupy.cuda.runtime.free(0)  # the context is current for the driver calls
        maps = StepMappings(driver, device, peers)
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
                    want = cupy.arange(n, dtype=cupy.int32) + base
                    if op == "check":
                        ok = bool((x == want).all())
                        cupy.cuda.Device(dev).synchronize()
                        conn.send(("checked", ok))
                    else:
                        x[...] = want
                        cupy.cuda.Device(dev).synchronize()
                        conn.send(("written",))
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
        os.environ["CUPY_POOLMEM_EXPERIMENTAL_STEP_IPC"] = "1"
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


def pickled_receiver(conn, read_on: int | None = None) -> None:
    """Receive CuPy arrays through the pipe (unpickled zero-copy by the package's reducer)
    and check them; answer each request.

    Requests: ``("x", array, base)``: the array holds ``base + arange`` (read with GPU
    ``read_on`` when given, a peer) -> ``("checked", ok, reserved bytes, windows)``, the
    array kept; ``("check", i, base)``: array ``i`` again -> ``("checked", ok, ...)``;
    ``("drop",)``: let go of every array -> ``("dropped", reserved bytes)`` once the
    unmaps are done; ``None``: exit.
    """
    try:
        import cupy

        import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)
        from cupy_poolmem._sharing._context import context

        held: list = []

        def stats():
            maps = context().importer.step_maps(0).stats()
            return maps["step_reserved_bytes"], maps["step_windows"]

        def check(x, base):
            dev = x.device.id if read_on is None else read_on
            with cupy.cuda.Device(dev):
                want = cupy.arange(x.size, dtype=x.dtype) + base
                ok = bool((x == want).all())
                cupy.cuda.Device(dev).synchronize()
            return ok

        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg[0] == "x":
                _, x, base = msg
                held.append((x, base))
                conn.send(("checked", check(x, base), *stats()))
            elif msg[0] == "check":
                x, base = held[msg[1]]
                conn.send(("checked", check(x, base), *stats()))
            elif msg[0] == "drop":
                held.clear()
                import gc
                import time

                gc.collect()
                cupy.cuda.Device(0).synchronize()
                deadline = time.monotonic() + TIMEOUT / 4
                while stats()[1] and time.monotonic() < deadline:
                    context().importer.trim_idle(0)
                    time.sleep(0.02)
                conn.send(("dropped", *stats()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def exiting_exporter(q, mode: str, n: int, base: int) -> None:
    """Put one array of an exportable ``mode`` pool on ``q`` and return (the process
    exits: its exit waits until the receiver mapped the block)."""
    os.environ["CUPY_POOLMEM_EXPERIMENTAL_STEP_IPC"] = "1"
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
