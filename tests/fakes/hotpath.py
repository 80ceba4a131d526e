"""A fake CUDA driver for the pools' stream, capture and managed-memory logic on a CPU.

``twin_pools()`` loads the ``cupy_poolmem._pools`` package a second time with the pure-Python
hot path (whatever this machine built), so the hot path's module-level driver calls
can be replaced; ``World`` plays the driver: streams' capture states, allocations,
frees, and a log of every call in order.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cupy

import cupy_poolmem
from cupy_poolmem import _driver, _pools, _runtime, _streams
from cupy_poolmem import _hotpath_py as twin


def twin_pools() -> Any:
    """The ``cupy_poolmem._pools`` package executed again, bound to the pure-Python hot path
    (why not classes over shared bodies: CONTRIBUTING.md, "Layout")."""
    import sys

    old = os.environ.get("CUPY_POOLMEM_PURE_PYTHON")
    os.environ["CUPY_POOLMEM_PURE_PYTHON"] = "1"
    real_runtime = sys.modules["cupy_poolmem._runtime"]
    name = "cupy_poolmem._pools_twin_for_tests"
    try:
        spec = importlib.util.spec_from_file_location("cupy_poolmem._runtime", _runtime.__file__)
        runtime = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(runtime)
        sys.modules["cupy_poolmem._runtime"] = runtime
        cupy_poolmem._runtime = runtime
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        spec = importlib.util.spec_from_file_location(
            name, _pools.__file__, submodule_search_locations=[os.path.dirname(_pools.__file__)]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its submodules import each other under this name
        spec.loader.exec_module(mod)
    finally:
        sys.modules["cupy_poolmem._runtime"] = real_runtime
        cupy_poolmem._runtime = real_runtime
        if old is None:
            del os.environ["CUPY_POOLMEM_PURE_PYTHON"]
        else:
            os.environ["CUPY_POOLMEM_PURE_PYTHON"] = old
    assert mod._base._hp is twin
    # Its pools have pretend pointers and streams: one collected after the fakes are
    # undone must not flush its reuse cache into the real driver.
    mod.Pool.__del__ = lambda self: None
    return mod


class FakeDriver:
    """The pools' stream-ordered allocations, frees and trims; every other call goes to
    ``real`` (the driver in place when the World was made)."""

    def __init__(self, world: World, real: Any) -> None:
        self._world, self._real = world, real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def cuMemAllocFromPoolAsync(self, size, pool, sptr):  # noqa: N802
        return self._world.graph_alloc("pool_alloc", size, int(sptr), pool)

    def cuMemAllocAsync(self, size, sptr):  # noqa: N802
        return self._world.graph_alloc("async_alloc", size, int(sptr), None)

    def cuMemFreeAsync(self, ptr, sptr):  # noqa: N802
        self._world.log.append(("graph_free", int(ptr), int(sptr)))
        return (0,)

    def cuMemPoolTrimTo(self, pool, keep):  # noqa: N802
        self._world.log.append(("trim", keep))
        return (0,)


class World:
    """Capture states and memory of a pretend GPU; installs itself with ``monkeypatch``
    and, as the package's driver, with ``fake_driver`` (the fixture of fakes.driver)."""

    def __init__(self, monkeypatch: Any, tp: Any, fake_driver: Any) -> None:
        self.tp = tp
        self.status: dict[int, tuple[int, int]] = {}  # stream -> (capture status, id)
        self.log: list[tuple] = []
        self.ptrs = itertools.count(0x100000, 0x10000)
        self.current = cupy.cuda.ExternalStream(0x5000, 0)
        self.graph_errors: list[int] = []  # CUresults the next graph allocations return
        self.queried: list[int] = []
        self.alloc_pools: list[int] = []  # the CUDA pool handle of each _alloc, in order
        self.handles_read: list[int] = []  # allocation handles an ipc pool's setup read
        mp = monkeypatch
        fake = twin.Driver(
            alloc=self._alloc,
            free=self._free,
            ctx_device=lambda: (0, 0),
            is_capturing=self._is_capturing,
            current_stream=lambda: self.current,
        )
        mp.setattr(twin, "driver", fake)  # the twin hot path's driver seam
        mp.setattr(cupy.cuda, "get_current_stream", lambda *a: self.current)
        mp.setattr(_streams, "capture_info", lambda s: self.status.get(s, (0, 0)))
        mp.setattr(_streams, "capture_status", lambda s: self.status.get(s, (0, 0))[0])
        # Streams noted as capturing here are pretend handles: they must not stay in the
        # module's registry, where a GPU test's real driver query of one crashed.
        mp.setattr(_streams.CAPTURES, "streams", {})
        mp.setattr(_streams, "relaxed_capture_mode", contextlib.nullcontext)
        fake_driver(FakeDriver(self, _driver.get()))
        mp.setattr(tp._driver, "set_attr", lambda *a: None)
        mp.setattr(tp._capture, "on_device", lambda dev: contextlib.nullcontext())

    def _is_capturing(self, sptr: int) -> tuple[int, int]:
        assert sptr > 1, "the legacy stream must never be queried"
        self.queried.append(sptr)
        return 0, self.status.get(sptr, (0, 0))[0]

    def _alloc(self, size: int, pool: Any, sptr: int) -> tuple[int, int]:
        p = next(self.ptrs)
        self.log.append(("alloc", p, size, sptr))
        self.alloc_pools.append(int(pool))
        return 0, p

    def _free(self, ptr: int, sptr: int) -> tuple[int]:
        self.log.append(("free", ptr, sptr))
        return (0,)

    def graph_alloc(self, how: str, size: int, sptr: int, pool: Any) -> tuple[int, int]:
        if self.graph_errors:
            err = self.graph_errors.pop(0)
            self.log.append((how + "_failed", err))
            return err, 0
        p = next(self.ptrs)
        self.log.append((how, p, size, sptr, pool))
        return 0, p

    def pool(
        self,
        cls: Any = None,
        kind: int = 0,
        reuse_cache: int = 1 << 20,
        cuda_pool: bool = True,
        small: int = 0,
        ipc: bool = False,
        **attrs: Any,
    ):
        """A pool of the twin module without a CUDA pool behind it (``cuda_pool=False``:
        none at all, as ManagedPool's "managed" backend, given as ``_backend=``).
        ``small``: the largest block of a small-block pool (handle ``0xDEF``), if any;
        ``ipc``: its CUDA pools say they are IPC-enabled (uuid ``UUID(int=handle)``, their
        allocation handles counted in ``handles_read``)."""
        cls = cls or self.tp.DevicePool
        p = cls.__new__(cls)
        for k, v in attrs.items():
            setattr(p, k, v)
        if ipc:
            p.ipc = True

        world = self

        class IpcMR(SimpleNamespace):
            @property
            def allocation_handle(self) -> int:
                world.handles_read.append(self.handle)
                return self.handle + 1000

        def fake_mr(handle: int) -> Any:
            return (IpcMR if ipc else SimpleNamespace)(
                handle=handle,
                attributes=SimpleNamespace(
                    reserved_mem_current=0, reserved_mem_high=0, used_mem_current=0
                ),
                close=lambda: None,
                is_ipc_enabled=ipc,
                uuid=str(uuid.UUID(int=handle)),
            )

        mr = fake_mr(0xABC) if cuda_pool else None
        second = (fake_mr(0xDEF), small) if small else None
        dev = 0 if kind != twin.KIND_PINNED else -1
        p._setup(mr, dev, kind, None, 0, reuse_cache, second)
        p._synchronize = lambda: self.log.append(("sync",))
        return p


def sharing_hooks(request: Any, hp: Any, **hooks: Any) -> None:
    """Replace the sharing callbacks of the hot path ``hp`` (``release``, ``retire``:
    those not given stay) until the test ends, through its ``set_shared_release``."""
    old = hp.set_shared_release(None)
    new = dict(zip(("release", "retire"), old), **hooks)
    hp.set_shared_release(new["release"], new["retire"])
    request.addfinalizer(lambda: hp.set_shared_release(*old))


def compiled_hotpath(same_version: bool = True) -> Any:
    """The compiled hot path when this checkout has one that imports, else None: only a
    build of this checkout's .pyx (an editable install elsewhere can leak one) and, with
    ``same_version``, of the twin's VERSION (a stale build is not used)."""
    try:
        hp = importlib.import_module("cupy_poolmem._hotpath")
    except Exception:
        return None
    if Path(hp.__file__).parent != Path(twin.__file__).parent:
        return None
    return hp if not same_version or hp.VERSION == twin.VERSION else None


def bare_core(hp: Any, cache: int, with_streams: bool = False, fail_free: Any = None) -> Any:
    """A PoolCore of ``hp`` without a CUDA pool, its reuse cache ``cache`` bytes: frees
    go to ``_backend_free`` (legacy streams only, so the driver is never asked about a
    capture), which lists them in ``freed`` (``(ptr, stream)`` with ``with_streams``) or
    raises ``fail_free[ptr]``; ``drained`` counts ``_drained`` calls."""

    class Core(hp.PoolCore):
        def _backend_free(self, ptr, stream_ptr):
            if fail_free is not None and ptr in fail_free:
                raise fail_free[ptr]
            self.freed.append((ptr, stream_ptr) if with_streams else ptr)

        def _drained(self):
            self.drained += 1

    c = Core()
    c._attach(0, 0, hp.KIND_DEVICE)
    c.cache_limit = c.cache_max_block = cache
    c.freed = []
    c.drained = 0
    return c


class _FakeDevice:
    """``cupy.cuda.Device`` of a 16 GiB GPU: ``mem_info`` and a context manager."""

    mem_info = (0, 1 << 34)

    def __init__(self, dev: Any) -> None:
        pass

    def __enter__(self) -> _FakeDevice:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def recorded_device_pools(monkeypatch: Any, **fields: Any) -> SimpleNamespace:
    """``DevicePool(...)`` on a fake single GPU (:func:`fake_device_pools`) whose CUDA
    pools are listed in ``mrs`` of the namespace returned (with ``fields``): each a
    handle, ``closed`` once closed, its options, and zero statistics."""
    handles = itertools.count(0x100)
    out = SimpleNamespace(mrs=[], **fields)

    def mr(dev: Any, opts: Any) -> Any:
        m = SimpleNamespace(
            handle=next(handles),
            closed=False,
            is_ipc_enabled=opts.ipc_enabled,
            max_size=opts.max_size,
            attributes=SimpleNamespace(
                reserved_mem_current=0, reserved_mem_high=0, used_mem_current=0
            ),
        )
        m.close = lambda: setattr(m, "closed", True)
        out.mrs.append(m)
        return m

    fake_device_pools(monkeypatch, mr)
    monkeypatch.setattr(_pools.device, "device_count", lambda: 1)
    monkeypatch.setattr(_pools._driver, "set_attr", lambda *a: None)
    return out


def fake_device_pools(monkeypatch: Any, make_mr: Any) -> None:
    """``DevicePool(...)`` on a fake 16 GiB GPU 0 whose CUDA pools ``make_mr(dev,
    options)`` makes (in place of cuda.core's ``DeviceMemoryResource``)."""
    monkeypatch.setattr(_pools.device.cc, "DeviceMemoryResource", make_mr)
    monkeypatch.setattr(_pools.device, "check_device", lambda d: 0)
    monkeypatch.setattr(_pools.device.cupy.cuda, "Device", _FakeDevice)
