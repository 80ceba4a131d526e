"""A producer/consumer pipeline that passes CuPy arrays between processes without copies.

The main process (the producer) makes arrays with known patterns on its GPU and puts
them on a ``multiprocessing`` queue; consumer processes, started with ``spawn``,
receive arrays on the *same* GPU memory, verify the pattern, sum it, and send back the
sum and a small array of their own (which travels back zero-copy too).  No
``synchronize()`` is needed before ``put``: each message carries a CUDA IPC event that
the receiver's stream waits on.  At the end the producer prints the sharing counters
(nothing is left held for other processes) and shuts the consumers down with a sentinel
and join timeouts.

    python examples/queue_zero_copy.py [--consumers 2] [--arrays 32] [--mib 16]

Needs: an NVIDIA GPU and ``pip install -e ".[cu13]"``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time

JOIN_TIMEOUT = 60.0
GET_TIMEOUT = 120.0


def pattern(cupy, i: int, n: int):
    """Array ``i`` of the stream: ``arange(n) * (i + 1) + i`` as int64 (exact sums)."""
    return cupy.arange(n, dtype=cupy.int64) * (i + 1) + i


def expected_sum(i: int, n: int) -> int:
    return (i + 1) * n * (n - 1) // 2 + i * n


def consumer(cid: int, inbox, outbox) -> None:
    """Receive (i, array) until None; reply (cid, i, ok, sum, head * 2) or an error."""
    import traceback

    try:
        import cupy

        import cupy_poolmem

        cupy_poolmem.set_allocator()  # replies allocated here travel back zero-copy
        while True:
            msg = inbox.get(timeout=GET_TIMEOUT)
            if msg is None:
                break
            i, x = msg  # x is the producer's memory, mapped into this process
            ok = bool((x == pattern(cupy, i, x.size)).all())
            total = int(x.sum())
            head = x[:8] * 2  # allocated in this consumer's pool
            outbox.put(("result", cid, i, ok, total, head))
            del x, head  # let go: the producer may now reuse the block
        outbox.put(("done", cid, cupy_poolmem.sharing.stats()))
    except Exception:
        outbox.put(("error", cid, traceback.format_exc()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--arrays", type=int, default=32)
    ap.add_argument("--mib", type=int, default=16, help="size of each array in MiB")
    args = ap.parse_args()
    try:
        import cupy

        import cupy_poolmem
    except ImportError as exc:
        print(f"this example needs CuPy and cupy_poolmem: {exc}", file=sys.stderr)
        return 1
    if cupy_poolmem.device_count() == 0:
        print(
            "this example needs an NVIDIA GPU and its driver, and this machine has none "
            "(cupy_poolmem.device_count() == 0)",
            file=sys.stderr,
        )
        return 1

    alloc = cupy_poolmem.set_allocator()  # IPC-enabled pools
    n = (args.mib << 20) // 8
    ctx = mp.get_context("spawn")  # never fork a process that uses CUDA
    inbox = ctx.Queue(maxsize=4)  # back-pressure: at most 4 arrays in flight
    outbox = ctx.Queue()
    procs = [
        ctx.Process(target=consumer, args=(c, inbox, outbox), name=f"consumer-{c}")
        for c in range(args.consumers)
    ]
    for p in procs:
        p.start()

    bad: list[str] = []
    received = 0
    heads = []
    t0 = time.perf_counter()
    try:
        sent = 0
        while received < args.arrays:
            # Keep the queue busy, then drain replies.
            while sent < args.arrays and not inbox.full():
                x = pattern(cupy, sent, n)
                try:
                    inbox.put((sent, x), timeout=0.1)
                except queue.Full:
                    break
                sent += 1
                del x  # only the consumer holds it now (limbo)
            try:
                msg = outbox.get(timeout=GET_TIMEOUT if sent == args.arrays else 0.05)
            except queue.Empty:
                if not all(p.is_alive() for p in procs):
                    bad.append("a consumer exited early")
                    break
                continue
            if msg[0] == "error":
                bad.append(f"consumer {msg[1]} failed:\n{msg[2]}")
                break
            _, cid, i, ok, total, head = msg
            received += 1
            if not ok or total != expected_sum(i, n):
                bad.append(f"array {i}: pattern ok={ok}, sum {total} != {expected_sum(i, n)}")
            if not bool((head == (cupy.arange(8, dtype=cupy.int64) * (i + 1) + i) * 2).all()):
                bad.append(f"array {i}: the consumer's reply has wrong data")
            heads.append(head)  # consumer memory, mapped here
        dt = time.perf_counter() - t0
        print(
            f"{received} arrays of {args.mib} MiB through {args.consumers} consumer(s) in "
            f"{dt:.2f} s ({received * args.mib / 1024 / dt:.1f} GiB/s of arrays, no copies)"
        )
        heads.clear()  # give the consumers' memory back
    finally:
        for _ in procs:
            try:
                inbox.put(None, timeout=5)
            except queue.Full:
                pass
        done = 0
        deadline = time.monotonic() + JOIN_TIMEOUT
        while done < len(procs) and time.monotonic() < deadline:
            try:
                msg = outbox.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if msg[0] == "done":
                done += 1
            elif msg[0] == "error":
                bad.append(f"consumer {msg[1]} failed:\n{msg[2]}")
        for p in procs:
            p.join(timeout=JOIN_TIMEOUT)
            if p.is_alive():
                bad.append(f"{p.name} did not exit; killing it")
                p.kill()
                p.join(timeout=5)
            elif p.exitcode != 0:
                bad.append(f"{p.name} exited with status {p.exitcode}")

    # Consumers gone: everything they held has been given back to this process.
    deadline = time.monotonic() + 10
    while cupy_poolmem.sharing.stats()["limbo_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    print("sharing:", cupy_poolmem.sharing.stats())
    print("pool:", alloc.pool().stats())
    for b in bad:
        print("ERROR:", b, file=sys.stderr)
    if not bad:
        print("all arrays verified by the consumers; all replies verified here")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
