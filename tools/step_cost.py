"""What creating range steps exportable costs (issue 35): the time of one expandable
range step (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``, then ``cuMemUnmap`` and
``cuMemRelease``) with and without ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` in the
allocation properties, interleaved, on GPU 0.  Prints one line per step size.

    python tools/step_cost.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()

    import cupy
    from cuda.bindings import driver as d

    from cupy_poolmem._errors import check_driver
    from cupy_poolmem._mapped import access_descriptors, device_allocation

    cupy.cuda.Device(args.device).use()
    cupy.cuda.runtime.free(0)  # a current context for the driver calls
    props = {x: device_allocation(d, args.device, exportable=x)[0] for x in (False, True)}
    access = access_descriptors(d, (args.device,), ())

    def step(prop, n: int) -> float:
        va = check_driver(d.cuMemAddressReserve(n, 0, 0, 0), "cuMemAddressReserve")
        t0 = time.perf_counter()  # (a range reserves once: not part of a step)
        h = check_driver(d.cuMemCreate(n, prop, 0), "cuMemCreate")
        check_driver(d.cuMemMap(va, n, 0, h, 0), "cuMemMap")
        check_driver(d.cuMemSetAccess(va, n, access, len(access)), "cuMemSetAccess")
        d.cuMemRelease(h)
        check_driver(d.cuMemUnmap(va, n), "cuMemUnmap")
        t1 = time.perf_counter()
        d.cuMemAddressFree(va, n)
        return t1 - t0

    name = cupy.cuda.runtime.getDeviceProperties(args.device)["name"].decode()
    _, ver = d.cuDriverGetVersion()
    for n in (2 << 20, 20 << 20, 200 << 20):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(5):  # warm
            step(props[False], n), step(props[True], n)
        for i in range(args.rounds):
            for x in (bool(i % 2), not i % 2):  # alternate which goes first
                times[x].append(step(props[x], n))
        plain, fd = (statistics.median(times[x]) * 1e6 for x in (False, True))
        print(
            f"step {n >> 20:4d} MiB: plain {plain:8.1f} us, exportable {fd:8.1f} us, "
            f"ratio {fd / plain:5.2f} ({name}, driver {ver}, {args.rounds} rounds, medians)"
        )


if __name__ == "__main__":
    main()
