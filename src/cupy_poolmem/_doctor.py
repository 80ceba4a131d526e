"""``python -m cupy_poolmem`` doctor: what this machine supports, then a short self-check."""

from __future__ import annotations

import platform
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import cupy_poolmem

from ._device import (
    can_access_peer,
    device_count,
    granted_access,
    nearest_numa_node,
    peer_topology,
    require_attribute,
)
from ._errors import MissingDependencyError, UnsupportedError

__all__ = ["doctor", "large_block_placement", "self_check", "time_alloc", "versions"]


def versions() -> list[tuple[str, str]]:
    """``(name, version)`` of Python, this package, CuPy, cuda.core, cuda.bindings, NumPy
    and the loaded hot path; a package that cannot be imported says why."""
    out = [("python", platform.python_version())]
    for mod in ("cupy_poolmem", "cupy", "cuda.core", "cuda.bindings", "numpy"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out.append((mod, getattr(m, "__version__", "?")))
        except Exception as exc:
            out.append((mod, f"not importable ({type(exc).__name__}: {exc})"))
    try:
        out.append(("hot path", cupy_poolmem.hotpath_implementation()))
    except MissingDependencyError as exc:  # the rows above say what to install
        out.append(("hot path", f"unavailable ({exc.reason or exc})"))
    except Exception as exc:
        out.append(("hot path", f"unavailable ({exc})"))
    return out


def _driver_version() -> tuple[int | None, str]:
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        if int(err):
            return None, f"cuDriverGetVersion failed ({err})"
        return v, f"{v // 1000}.{v % 1000 // 10}"
    except Exception as exc:
        return None, f"no CUDA driver ({type(exc).__name__}: {exc})"


def _gpu_rows(n: int) -> list[str]:
    import cuda.core as cc
    import cupy

    rows = []
    for i in range(n):
        d = cc.Device(i)
        p = d.properties
        free, total = cupy.cuda.Device(i).mem_info
        feats = {
            "device pools": p.memory_pools_supported,
            "host NUMA pools": getattr(p, "host_numa_memory_pools_supported", False),
            "managed": getattr(p, "concurrent_managed_access", False),
        }
        try:
            from cuda.bindings import driver

            err, types = driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, i
            )
            feats["pool IPC (fd)"] = bool(int(types) & 1) if not int(err) else False
        except Exception:
            feats["pool IPC (fd)"] = False
        f = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in feats.items())
        rows.append(
            f"  GPU {i}: {d.name} | {total / 2**30:.1f} GiB ({free / 2**30:.1f} free) | "
            f"cc {p.compute_capability_major}.{p.compute_capability_minor} | "
            f"UUID {d.uuid} | PCI {d.pci_bus_id} | NUMA node {nearest_numa_node(i)}"
        )
        rows.append(f"         {f}")
    return rows


def _peer_rows(matrix: list[list[bool]]) -> list[str]:
    """The peer topology as a table: may the row's GPU use the column GPU's memory?"""
    n = len(matrix)
    if n < 2:
        return ["  peer access: one GPU, nothing to grant"]
    head = "".join(f"{'GPU ' + str(j):>7s}" for j in range(n))
    rows = [
        "  peer access (cudaDeviceCanAccessPeer: may the row's GPU read and write the "
        "column GPU's memory?)",
        f"    {'':7s}{head}",
    ]
    for i, row in enumerate(matrix):
        cells = "".join(
            f"{'-' if i == j else ('yes' if ok else 'NO'):>7s}" for j, ok in enumerate(row)
        )
        rows.append(f"    {'GPU ' + str(i):7s}{cells}")
    missing = [(i, j) for i in range(n) for j in range(n) if i != j and not matrix[i][j]]
    if missing:
        rows.append(
            "    pairs marked NO cannot share memory: peer_access='all' skips them, a list "
            "that names them raises UnsupportedError; copy through the host instead"
        )
    return rows


def _pool_access(pool: Any) -> str:
    """What one pool grants, in words."""
    kind = getattr(pool, "_kind_name", "")
    if kind == "managed":
        return "every GPU (managed memory migrates to the GPU that uses it)"
    try:
        if kind == "pinned":
            devs = list(getattr(pool, "devices", []))
            return "GPUs " + ", ".join(map(str, devs)) if devs else "no GPU"
        peers = list(pool.peer_access)
    except Exception as exc:  # a closed pool, a failing query
        return f"unknown ({type(exc).__name__}: {exc})"
    own = f"GPU {pool.device_id}"
    return own + (" and peers " + ", ".join(map(str, peers)) if peers else " only")


def _access_rows(pools: list[Any], imported: dict[int, tuple[int, ...]]) -> list[str]:
    """What the pools of this process grant, and the grants given to imported pools."""
    rows = ["  pool access grants (set_allocator() default: peer_access='all', every GPU above)"]
    if not pools:
        rows.append("    no pool alive in this process yet")
    for p in pools:
        rows.append(f"    {p._describe()}: {_pool_access(p)}")
    if imported:
        pairs = sum(len(d) for d in imported.values())
        rows.append(
            f"    imported pools: {len(imported)} with grants to other GPUs ({pairs} in all)"
        )
    return rows


def large_block_placement(pools: list[Any] | None, vmm: bool | None) -> tuple[str, str]:
    """Which large-block placement ``set_allocator()``'s device pools use, and why.

    Parameters
    ----------
    pools
        The installed allocator's device pools, or None when none is installed (then
        the answer is what ``set_allocator()`` with its defaults would use).
    vmm
        Whether the GPU supports virtual memory management (None: unknown).

    Returns
    -------
    tuple of str
        ``(placement, reason)``.

    Examples
    --------
    >>> large_block_placement(None, True)[0]
    'pool'
    """
    if pools:
        modes = ", ".join(sorted({str(getattr(p, "large_blocks", "pool")) for p in pools}))
        ipc = any(getattr(p, "ipc", False) for p in pools)
        return modes, f"as set_allocator() was called (ipc={ipc})"
    if vmm is False:
        return "pool", "the GPU has no virtual memory management, which the others need"
    return "pool", (
        "the default: it sends fresh arrays to other processes faster than the "
        "expandable placement; set_allocator(large_blocks='expandable') reserves less "
        "on varied sizes and shares its arrays too (docs/device_pool.rst, "
        "'Which placement set_allocator uses')"
    )


def _placement_row(alloc: Any) -> str:
    """The doctor's line for :func:`large_block_placement`; ``alloc``: CuPy's current
    allocator (a :class:`~cupy_poolmem.PoolAllocator` when set_allocator() was called)."""
    pools = list(alloc.pools().values()) if isinstance(alloc, cupy_poolmem.PoolAllocator) else None
    try:
        require_attribute(0, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "mapped blocks")
        vmm: bool | None = True
    except UnsupportedError:
        vmm = False
    except Exception:
        vmm = None
    placement, why = large_block_placement(pools, vmm)
    return f"  set_allocator() large blocks: {placement!r} ({why})"


def _managed_row(device: int) -> str:
    """Which backend ManagedPool uses on ``device`` and why (runs the one-time probe)."""
    try:
        backend, reason = cupy_poolmem.managed_backend(device)
        return f"  GPU {device} managed backend: {backend!r} ({reason})"
    except Exception as exc:
        return f"  GPU {device} managed backend: unavailable ({type(exc).__name__}: {exc})"


def self_check(out: Callable[[str], Any] = print) -> bool:
    """Write a pattern through each pool kind, read it back; return ``True`` if all pass."""
    import cupy
    import cupyx
    import numpy as np

    DevicePool, ManagedPool = cupy_poolmem.DevicePool, cupy_poolmem.ManagedPool

    ok = True
    n = 1 << 20

    def check(name: str, fn: Callable[[], bool]) -> None:
        nonlocal ok
        try:
            good = fn()
        except Exception as exc:
            good = False
            out(f"  {name:8s} FAILED ({type(exc).__name__}: {exc})")
            ok = False
            return
        ok &= good
        out(f"  {name:8s} {'ok' if good else 'WRONG DATA'}")

    def dev_check(pool_cls: type) -> Callable[[], bool]:
        def run() -> bool:
            with pool_cls() as pool, cupy.cuda.using_allocator(pool.malloc):
                x = cupy.arange(n, dtype=cupy.uint32) * 3 + 1
                good = bool((x.get() == np.arange(n, dtype=np.uint32) * 3 + 1).all())
                return good and pool.stats().n_allocs >= 1

        return run

    def pinned_check() -> bool:
        with cupy_poolmem.PinnedPool() as pool:
            with cupy_poolmem.using(pool):
                h = cupyx.empty_pinned((n,), dtype=np.uint32)
                h[:] = np.arange(n, dtype=np.uint32)
                d = cupy.asarray(h)
                h2 = cupyx.empty_pinned((n,), dtype=np.uint32)
                (d * 2).get(out=h2)
                return bool((h2 == np.arange(n, dtype=np.uint32) * 2).all())

    def peer_check() -> bool:
        # GPU 1 reads and writes GPU 0's pool memory through the grant peer_access makes.
        with DevicePool(0) as p0, DevicePool(1) as p1:
            with cupy.cuda.Device(0), cupy.cuda.using_allocator(p0.malloc):
                x = cupy.arange(n, dtype=cupy.uint32)
                cupy.cuda.Device(0).synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # CuPy: peer access activated automatically
                with cupy.cuda.Device(1), cupy.cuda.using_allocator(p1.malloc):
                    y = x * 2
                    x += 1
                    cupy.cuda.Device(1).synchronize()
            with cupy.cuda.Device(1):
                good = bool((y.get() == np.arange(n, dtype=np.uint32) * 2).all())
                del y
            with cupy.cuda.Device(0):
                good &= bool((x.get() == np.arange(n, dtype=np.uint32) + 1).all())
                del x
            return good

    check("device", dev_check(DevicePool))
    check("pinned", pinned_check)
    check("managed", dev_check(ManagedPool))
    if device_count() > 1 and can_access_peer(1, 0):
        check("peer", peer_check)
    return ok


def time_alloc(malloc: Callable[[int], Any] | None, size: int = 1 << 20, n: int = 20000) -> float:
    """Microseconds per ``cupy.empty(size)`` + free with ``malloc`` as CuPy's allocator."""
    import cupy

    with cupy.cuda.using_allocator(malloc):
        for _ in range(500):
            cupy.empty(size, dtype=cupy.uint8)
        t0 = time.perf_counter()
        for _ in range(n):
            cupy.empty(size, dtype=cupy.uint8)
        dt = time.perf_counter() - t0
    return dt / n * 1e6


def doctor(out: Callable[[str], Any] = print, check: bool = True) -> int:
    """Print versions, driver, GPUs, NUMA placement and pool features; then self-check.

    Returns the process exit status: ``0`` when everything works, ``2`` without a
    usable GPU or driver, ``1`` when a self-check fails.
    """
    out("cupy_poolmem doctor")
    for k, v in versions():
        out(f"  {k:14s} {v}")
    driver, text = _driver_version()
    out(f"  {'CUDA driver':14s} {text}")
    if driver is None:
        out(
            "\nNo usable CUDA driver: cupy_poolmem needs an NVIDIA GPU with its driver "
            "(check `nvidia-smi`). Nothing else to check."
        )
        return 2
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        out(
            f"\nCUDA could not be initialised ({type(exc).__name__}: {exc}).\n"
            "Check the driver, that it is new enough for this CuPy build, and CUDA_VISIBLE_DEVICES."
        )
        return 2
    if n == 0:
        out("\nThe driver sees no GPU (is CUDA_VISIBLE_DEVICES empty?).")
        return 2
    out(f"  {'GPUs':14s} {n}")
    for row in _gpu_rows(n):
        out(row)
    pools = cupy_poolmem.all_pools()
    for row in _peer_rows(peer_topology(n)) + _access_rows(pools, granted_access()):
        out(row)
    for i in range(n):
        out(_managed_row(i))
    out(_placement_row(cupy.cuda.get_allocator()))
    if not check:
        return 0
    out("self-check (write a pattern, read it back):")
    ok = self_check(out)
    with cupy_poolmem.DevicePool() as pool:
        mp = cupy.cuda.MemoryPool()
        ours, ref = float("inf"), float("inf")
        for _ in range(3):  # alternate, keep the best: clocks ramp up during the first rounds
            ours = min(ours, time_alloc(pool.malloc, n=10000))
            ref = min(ref, time_alloc(mp.malloc, n=10000))
        mp.free_all_blocks()
    out(
        f"timing: cupy.empty(1 MiB)+free  DevicePool {ours:.2f} us  vs  CuPy MemoryPool "
        f"{ref:.2f} us  ({ours / ref:.2f}x)"
    )
    out("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(doctor())
