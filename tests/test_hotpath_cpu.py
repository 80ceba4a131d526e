"""CPU tests of the hot path's two implementations: same names and signatures, same
behaviour without a CUDA context, and typed errors for bad sizes."""

from __future__ import annotations

import gc
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
from cuda.bindings import driver
from fakes.hotpath import compiled_hotpath

import cupy_poolmem as cpm
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem import _log_batch_py, _pools, _recorder_py

# Each compiled module of the hot path, by its .pyx, and its pure-Python twin.
PAIRS = {
    Path(cpm.__file__).with_name(f"{name}.pyx"): mod
    for name, mod in (
        ("_hotpath", twin),
        ("_recorder", _recorder_py),
        ("_log_batch", _log_batch_py),
    )
}


def _params(arglist: str) -> list[str]:
    """Parameter names of a Cython ``def`` line: ``uintptr_t ptr, size=0`` -> [ptr, size]."""
    out = []
    for part in arglist.split(","):
        part = part.split("=")[0].strip()
        if part:
            out.append(re.findall(r"[A-Za-z_]\w*", part)[-1])
    return out


def _pyx_api(pyx: Path | None = None) -> tuple[set[str], dict[str, dict[str, object]]]:
    """Public module names and, per class, ``{name: params | "attr" | "cdef"}``, of one
    .pyx (of all of them when ``pyx`` is None)."""
    module: set[str] = set()
    classes: dict[str, dict[str, object]] = {}
    cur = None
    lines = [t for f in ([pyx] if pyx else PAIRS) for t in f.read_text().splitlines()]
    for line in lines:
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


@pytest.mark.parametrize("pyx", list(PAIRS), ids=lambda p: p.name)
def test_twin_has_every_name_and_signature_of_the_pyx(pyx):
    twin = PAIRS[pyx]
    module, classes = _pyx_api(pyx)
    missing = sorted(n for n in module if not hasattr(twin, n))
    assert not missing, f"in {pyx.name} but not in {twin.__name__}: {missing}"
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
    rec = importlib.import_module("cupy_poolmem._recorder")
    batch = importlib.import_module("cupy_poolmem._log_batch")
    for compiled, py, name in (
        (hp, twin, "Block"),
        (hp, twin, "_Bin"),
        (hp, twin, "PoolCore"),
        (hp, twin, "Dispatch"),
        (rec, _recorder_py, "Recorder"),
        (rec, _recorder_py, "Scope"),
        (rec, _recorder_py, "Counts"),
        (rec, _recorder_py, "Info"),
        (batch, _log_batch_py, "Batch"),
        (rec, _recorder_py, "PoolObs"),
        (rec, _recorder_py, "DevObs"),
    ):
        c, t = getattr(compiled, name), getattr(py, name)
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
    monkeypatch.setattr(twin.driver, "ctx_device", lambda: (err, None))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 1)
    d = twin.Dispatch(create, 2)
    assert d(64) == ("mem", 1, 64)
    assert created == [1]

    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(twin.driver, "ctx_device", lambda: (ok, driver.CUdevice(1)))
    assert d(32) == ("mem", 1, 32)
    assert created == [1]  # the pool of device 1 is known now: no second creation
    monkeypatch.setattr(twin.driver, "ctx_device", lambda: (ok, driver.CUdevice(0)))
    assert d(16) == ("mem", 0, 16) and created == [1, 0]
    # An ordinal past the table (the device count changed): the slow path too.
    monkeypatch.setattr(twin.driver, "ctx_device", lambda: (ok, driver.CUdevice(5)))
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
    assert _recorder_py.as_size(True) == 1
    import numpy as np

    assert _recorder_py.as_size(np.int64(12)) == 12
    with pytest.raises(OverflowError):
        _recorder_py.as_size(-1)
    with pytest.raises(OverflowError):
        _recorder_py.as_size(1 << 64)
    with pytest.raises(TypeError):
        _recorder_py.as_size(1.0)


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


# ---------------------------------------------------------------- the twin's seams
def test_the_twin_calls_the_driver_it_is_given_and_use_driver_hands_the_old_one_back():
    import types

    calls: list[tuple] = []
    stream = types.SimpleNamespace(ptr=0)
    fake = twin.Driver(
        alloc=lambda size, pool, s: calls.append(("alloc", size, s)) or (0, 0x9000),
        free=lambda ptr, s: calls.append(("free", ptr, s)) or (0,),
        ctx_device=lambda: calls.append(("ctx",)) or (0, 0),
        is_capturing=lambda s: calls.append(("capturing", s)) or (0, 0),
        current_stream=lambda: stream,
    )
    real = twin.driver
    old = twin.use_driver(fake)
    try:
        assert old is real and twin.driver is fake

        class Core(twin.PoolCore):
            pass

        c = Core()
        c._attach(0xABC, 0, twin.KIND_DEVICE)  # no reuse cache: the free is the driver's
        m = c.malloc(256)
        assert m.ptr == 0x9000 and m.mem._owner.stream is stream
        del m
    finally:
        assert twin.use_driver(old) is fake
    assert twin.driver is real
    assert calls == [("ctx",), ("alloc", 256, 0), ("free", 0x9000, 0)]  # legacy stream


@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_set_shared_release_hands_back_the_callbacks_it_replaced(impl):
    hp = twin if impl == "twin" else compiled_hotpath()
    if hp is None:
        pytest.skip("the Cython hot path is not built in this checkout")

    def release(*a):
        return False

    def retire(*a):
        return False

    old = hp.set_shared_release(release, retire)
    try:
        assert hp.set_shared_release(None) == (release, retire)
        assert hp.set_shared_release(release) == (None, None)
    finally:
        assert hp.set_shared_release(*old) == (release, None)


def test_a_compiled_pool_takes_only_a_compiled_recorder():
    """The compiled hot path calls its observer in C: the twin's recorder (or any other
    object) is refused when it is installed, not when an allocation calls it."""
    hp = compiled_hotpath()
    if hp is None:
        pytest.skip("the Cython hot path is not built in this checkout")

    class Core(hp.PoolCore):
        pass

    c = Core()
    c._attach(0, 0, hp.KIND_DEVICE)
    with pytest.raises(TypeError):
        c.observer = _recorder_py.Recorder()
    c.observer = hp.Recorder()
    c.observer = None


@pytest.mark.parametrize("module", ["_recorder_py", "_log_batch_py", "_recorder", "_log_batch"])
def test_the_recorder_loads_without_the_hot_path_and_cupy(module):
    """The recorder sits beside the hot path, not on it: it imports neither the hot path
    nor CuPy or the cuda packages (the compiled one only when built)."""
    import subprocess

    if not module.endswith("_py") and compiled_hotpath() is None:
        pytest.skip("the Cython hot path is not built in this checkout")
    code = (  # what it loads beyond the package itself (which may load CuPy)
        "import sys, cupy_poolmem\n"
        "before = set(sys.modules)\n"
        f"import cupy_poolmem.{module}\n"
        "bad = [m for m in set(sys.modules) - before if m.split('.')[0] in ('cupy', 'cuda')\n"
        "       or m.startswith(('cupy_poolmem._hotpath', 'cupy_poolmem._runtime'))]\n"
        "assert not bad, bad\n"
        "assert 'cupy_poolmem._hotpath_py' not in sys.modules\n"
    )
    src = str(Path(twin.__file__).parents[1])
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": src},
    )
    assert r.returncode == 0, r.stderr
