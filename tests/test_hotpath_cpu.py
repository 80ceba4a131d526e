"""CPU tests of the hot path's two implementations: same names and signatures, same
behaviour without a CUDA context, and typed errors for bad sizes."""

from __future__ import annotations

import gc
import inspect
import re
import sys
from pathlib import Path

import pytest
from _hotpath_fakes import compiled_hotpath
from cuda.bindings import driver

import cupy_poolmem as cpm
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem import _pools

PYX = Path(cpm.__file__).with_name("_hotpath.pyx")


def _params(arglist: str) -> list[str]:
    """Parameter names of a Cython ``def`` line: ``uintptr_t ptr, size=0`` -> [ptr, size]."""
    out = []
    for part in arglist.split(","):
        part = part.split("=")[0].strip()
        if part:
            out.append(re.findall(r"[A-Za-z_]\w*", part)[-1])
    return out


def _pyx_api() -> tuple[set[str], dict[str, dict[str, object]]]:
    """Public module names and, per class, ``{name: params | "attr" | "cdef"}``."""
    module: set[str] = set()
    classes: dict[str, dict[str, object]] = {}
    cur = None
    for line in PYX.read_text().splitlines():
        if m := re.match(r"cdef class (\w+)", line):
            cur = classes.setdefault(m.group(1), {})
            continue
        if line and not line[0].isspace():
            cur = None
            if m := re.match(r"def (\w+)\(", line):
                module.add(m.group(1))
            elif m := re.match(r"([A-Z][A-Z_0-9]*) = ", line):
                module.add(m.group(1))
            continue
        if cur is None:
            continue
        if m := re.match(r"    def (\w+)\((.*)\):", line):
            cur[m.group(1)] = _params(m.group(2))
        elif m := re.match(r"    cdef (?:readonly|public) [\w ]+? (\w+)\s*(#.*)?$", line):
            cur[m.group(1)] = "attr"
        elif m := re.match(r"    cdef (?:inline )?[\w ]*?(\w+)\(", line):
            cur[m.group(1)] = "cdef"
    return module, classes


def test_pyx_parser_sees_the_api():
    module, classes = _pyx_api()
    assert {"Block", "PoolCore", "Dispatch", "Recorder", "Info", "Batch"} <= set(classes)
    assert classes["Recorder"]["on_free"] == ["self", "core", "ptr", "size", "stream_ptr", "info"]
    assert classes["Recorder"]["_alloc"] == "cdef"
    assert classes["PoolCore"]["observer"] == "attr"
    assert {"set_shared_release", "KIND_DEVICE", "FLAG_CAPTURED", "VERSION"} <= module
    assert classes["PoolCore"]["malloc"] == ["self", "size"]
    assert classes["PoolCore"]["_malloc"] == "cdef"
    assert classes["Block"]["flags"] == "attr"
    assert classes["Block"]["wait_recorded"] == ["self", "stream"]


def test_twin_has_every_name_and_signature_of_the_pyx():
    module, classes = _pyx_api()
    missing = sorted(n for n in module if not hasattr(twin, n))
    assert not missing, f"in _hotpath.pyx but not in _hotpath_py.py: {missing}"
    for cls_name, members in classes.items():
        cls = getattr(twin, cls_name)
        slots = set(getattr(cls, "__slots__", ()))
        for name, what in members.items():
            if name in ("__cinit__", "__dealloc__", "__weakref__"):
                continue
            if what == "attr":
                assert name in slots or hasattr(cls, name), f"{cls_name}.{name} missing"
            elif what != "cdef":
                fn = getattr(cls, name, None)
                assert fn is not None, f"{cls_name}.{name} missing in the twin"
                if isinstance(fn, property):
                    continue
                got = list(inspect.signature(fn).parameters)
                assert got == what, f"{cls_name}.{name}{tuple(what)} vs twin {tuple(got)}"
        # And nothing the .pyx lacks: the twin's methods are the .pyx's def or cdef ones.
        extra = sorted(
            n
            for n, v in vars(cls).items()
            if callable(v) and not n.startswith("__") and n not in members
        )
        assert not extra, f"twin {cls_name} has methods the .pyx lacks: {extra}"


def test_compiled_and_twin_match_when_the_extension_imports():
    hp = compiled_hotpath(same_version=False)
    if hp is None:
        pytest.skip("the Cython hot path is not built in this checkout (the .pyx was compared)")
    assert hp.IMPLEMENTATION == "cython" and hp.VERSION == twin.VERSION
    for name in (
        "Block",
        "_Bin",
        "PoolCore",
        "Dispatch",
        "Recorder",
        "Scope",
        "Counts",
        "Info",
        "Batch",
        "PoolObs",
        "DevObs",
    ):
        c, t = getattr(hp, name), getattr(twin, name)
        for attr, v in vars(c).items():
            if attr.startswith("__"):
                continue
            assert hasattr(t, attr) or attr in getattr(t, "__slots__", ()), f"{name}.{attr}"
            if callable(v) and not isinstance(getattr(t, attr, None), property):
                got = list(inspect.signature(getattr(t, attr)).parameters)
                want = list(inspect.signature(v).parameters)
                assert got == want, f"{name}.{attr}: {want} vs twin {got}"
    for const in ("KIND_DEVICE", "KIND_PINNED", "KIND_MANAGED", "FLAG_RECORDED", "FLAG_CAPTURED"):
        assert getattr(hp, const) == getattr(twin, const)


# ---------------------------------------------------------------- Dispatch without a context
class _FakePool:
    def __init__(self, device: int) -> None:
        self.device_id = device
        self.sizes: list[int] = []

    def malloc(self, size: int) -> tuple:
        self.sizes.append(size)
        return ("mem", self.device_id, size)


def test_twin_dispatch_without_a_context_asks_cupy_for_the_device(monkeypatch):
    """The dask-worker-thread case: cuCtxGetDevice fails; the Cython version takes the
    slow path with d = -1, which asks CuPy for its device (and binds it later)."""
    import cupy

    created: list[int] = []

    def create(dev: int) -> _FakePool:
        created.append(dev)
        return _FakePool(dev)

    err = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
    monkeypatch.setattr(twin, "_ctx_device", lambda: (err, None))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 1)
    d = twin.Dispatch(create, 2)
    assert d(64) == ("mem", 1, 64)
    assert created == [1]

    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(twin, "_ctx_device", lambda: (ok, driver.CUdevice(1)))
    assert d(32) == ("mem", 1, 32)
    assert created == [1]  # the pool of device 1 is known now: no second creation
    monkeypatch.setattr(twin, "_ctx_device", lambda: (ok, driver.CUdevice(0)))
    assert d(16) == ("mem", 0, 16) and created == [1, 0]
    # An ordinal past the table (the device count changed): the slow path too.
    monkeypatch.setattr(twin, "_ctx_device", lambda: (ok, driver.CUdevice(5)))
    assert d(8) == ("mem", 1, 8)


# ---------------------------------------------------------------- sizes
def _bare_device_pool():
    """A DevicePool object without a CUDA pool: enough for the paths before the driver."""
    return _pools.DevicePool.__new__(_pools.DevicePool)


@pytest.mark.parametrize("bad", [-1, -(1 << 40), 1 << 64, 1 << 70])
def test_bad_sizes_raise_invalid_size_error_naming_the_value(bad):
    p = _bare_device_pool()
    with pytest.raises(cpm.InvalidSizeError) as ei:
        p.malloc(bad)
    e = ei.value
    assert isinstance(e, OverflowError) and isinstance(e, ValueError)
    assert isinstance(e, cpm.PoolmemError)
    assert f"size={bad}" in str(e) and ">= 0" in str(e)


@pytest.mark.parametrize("bad", [2.5, "64", None, b"1"])
def test_non_integer_sizes_raise_option_type_error(bad):
    p = _bare_device_pool()
    with pytest.raises(cpm.OptionTypeError) as ei:
        p.malloc(bad)
    assert isinstance(ei.value, TypeError)
    assert repr(bad) in str(ei.value) and type(bad).__name__ in str(ei.value)


def test_allocator_rejects_bad_sizes_with_the_same_errors():
    alloc = cpm.PoolAllocator.__new__(cpm.PoolAllocator)
    alloc.kind = "device"
    with pytest.raises(cpm.InvalidSizeError, match="size=-1"):
        alloc(-1)
    with pytest.raises(cpm.OptionTypeError, match="float"):
        alloc(1.0)


def test_twin_size_conversion_matches_cythons_size_t():
    assert twin._as_size(True) == 1
    import numpy as np

    assert twin._as_size(np.int64(12)) == 12
    with pytest.raises(OverflowError):
        twin._as_size(-1)
    with pytest.raises(OverflowError):
        twin._as_size(1 << 64)
    with pytest.raises(TypeError):
        twin._as_size(1.0)


def test_closed_pool_refuses_before_touching_cuda():
    p = _bare_device_pool()
    p._poison()
    p.device_id  # noqa: B018
    with pytest.raises(cpm.PoolClosedError, match="closed"):
        p.malloc(16)
    with pytest.raises(cpm.PoolClosedError):
        with cpm.using(p):
            pass


# ---------------------------------------------------------------- CuPy's memory objects
@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_a_block_is_wrapped_in_cupys_memory_objects_and_freed_into_the_cache(impl):
    """_make_block runs _wrap without a GPU: the compiled one makes CuPy's objects
    through tp_new + tp_init (cpm_make); they must be what CuPy's constructors make,
    and the block, dropped, must reach the reuse cache (a legacy stream: no driver)."""
    import types

    import cupy

    hp = twin if impl == "twin" else compiled_hotpath(same_version=False)
    if hp is None:
        pytest.skip("the Cython hot path is not built in this checkout")

    class Core(hp.PoolCore):
        pass

    c = Core()
    c._attach(0, 0, hp.KIND_DEVICE)
    c.cache_limit = c.cache_max_block = 1 << 20
    stream = types.SimpleNamespace(ptr=0)
    m = c._make_block(0x7000, 4096, stream, 0)
    assert type(m) is cupy.cuda.MemoryPointer and type(m.mem) is cupy.cuda.UnownedMemory
    assert (m.ptr, m.device_id, m.mem.ptr, m.mem.size, m.mem.device_id) == (
        0x7000,
        0,
        0x7000,
        4096,
        0,
    )
    b = m.mem._owner
    assert (b.ptr, b.size, b.stream, b.core) == (0x7000, 4096, stream, c)
    assert (c.n_allocs, c.live_bytes) == (1, 4096)
    del m, b
    assert (c.n_frees, c.live_bytes, c.cached_bytes) == (1, 0, 4096)
    assert c._cache[0, 4096].entries() == [(0x7000, stream)]
    # Nothing leaks: no memory object outlives its pointer, the stream is not held.
    c.cache_limit = 0  # each block goes to _backend_free (counted as an error here)
    refs = sys.getrefcount(stream)
    for _ in range(1000):
        c._make_block(0x7000, 4096, stream, 0)
    gc.collect()
    assert sys.getrefcount(stream) == refs and c.n_free_errors == 1000
    assert not [o for o in gc.get_objects() if type(o) is cupy.cuda.UnownedMemory]
    assert type(cupy.cuda.MemoryPointer) is type and type(cupy.cuda.UnownedMemory) is type
    # An error in CuPy's constructor propagates (no device for a null pointer).
    c._attach(0, -1, hp.KIND_DEVICE)
    with pytest.raises(RuntimeError, match="explicit device ID for a null pointer"):
        c._make_block(0, 0, stream, 0)
    assert c.n_allocs == c.n_frees == 1002
