"""CPU tests of the core: options, errors without a GPU, sizes, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fakes.driver import PassThrough

import cupy_poolmem as cpm
from cupy_poolmem import _errors

NO_GPU = cpm.device_count() == 0


@pytest.mark.parametrize(
    "value,expected",
    [
        ("40GB", 40 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 kB", 1500),
        (1024, 1024),
        ("2048", 2048),
        (0, 0),
        ("1TiB", 2**40),
        # dask's parse_bytes: short units, "Ki"-style binary units, any case, exponents.
        ("5k", 5000),
        ("2Gi", 2 * 2**30),
        ("1gib", 2**30),
        ("1e9", 10**9),
        ("1", 1),
        ("1.0", 1),  # a whole number of bytes: no longer "all of the device"
        ("10 B", 10),
        ("1_000", 1000),
    ],
)
def test_parse_bytes_units(value, expected):
    assert cpm.parse_bytes(value) == expected


def test_parse_bytes_fractions_are_explicit():
    assert cpm.parse_bytes(0.25, total=1000) == 250
    assert cpm.parse_bytes(1.0, total=1000) == 1000
    assert cpm.parse_bytes("90%", total=1000) == 900
    assert cpm.parse_bytes("12.5 %", total=1000) == 125
    assert cpm.parse_bytes("100%", total=1000) == 1000
    with pytest.raises(cpm.InvalidOptionError, match="fraction"):
        cpm.parse_bytes("90%")  # no total to take it of
    with pytest.raises(cpm.InvalidOptionError, match="fraction"):
        cpm.parse_bytes(0.9)


@pytest.mark.parametrize("text,hint", [("0.9", "'90%'"), ("1.5", "'150%'"), ("0.25", "0.25")])
def test_unitless_decimal_strings_are_errors_not_bytes_or_fractions(text, hint):
    """'1.5' used to be 1 byte and '1.0' the whole device: now one rule, and a hint."""
    with pytest.raises(cpm.InvalidOptionError, match="whole number of bytes") as ei:
        cpm.parse_bytes(text, name="max_size", total=1000)
    assert "max_size" in str(ei.value) and hint in str(ei.value)


@pytest.mark.parametrize("bad", [[1], True, b"1GB", object()])
def test_parse_bytes_type_errors_name_the_value(bad):
    with pytest.raises(cpm.OptionTypeError, match="max_size") as ei:
        cpm.parse_bytes(bad, name="max_size")
    assert isinstance(ei.value, TypeError)
    assert type(bad).__name__ in str(ei.value)


@pytest.mark.parametrize(
    "bad", ["lots", -5, "12 parsecs", 1.5, 0.0, -0.5, float("nan"), "0%", "150%", "-5", "GB"]
)
def test_parse_bytes_value_errors(bad):
    with pytest.raises(cpm.InvalidOptionError) as ei:
        cpm.parse_bytes(bad, name="max_size", total=1000)
    assert isinstance(ei.value, ValueError) and "max_size" in str(ei.value)


def test_format_bytes():
    assert cpm.format_bytes(3 * 2**30) == "3.00 GiB"
    assert cpm.format_bytes(12) == "12 B"


def test_error_hierarchy():
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    assert issubclass(cpm.OutOfPoolMemoryError, cupy.cuda.memory.OutOfMemoryError)
    assert issubclass(cpm.PinnedOutOfMemoryError, CUDARuntimeError)
    for cls in (
        cpm.PoolClosedError,
        cpm.WrongDeviceError,
        cpm.InvalidOptionError,
        cpm.OptionTypeError,
        cpm.NoGPUError,
        cpm.UnsupportedError,
        cpm.CUDADriverError,
        cpm.OutOfPoolMemoryError,
        cpm.PinnedOutOfMemoryError,
        cpm.SharingError,
        cpm.TransferError,
        cpm.MissingDependencyError,
        cpm.LogFormatError,
        cpm.UsageError,
        cpm.HandleStateError,
    ):
        assert issubclass(cls, cpm.PoolmemError)
    assert issubclass(cpm.MissingDependencyError, ImportError)
    assert issubclass(cpm.LogFormatError, ValueError)
    assert issubclass(cpm.UsageError, RuntimeError)
    assert issubclass(cpm.HandleStateError, ValueError)
    assert issubclass(cpm.HandleStateError, cpm.SharingError)
    assert issubclass(cpm.TransferError, cpm.SharingError)
    assert issubclass(cpm.TransferError, ConnectionError)  # Dask: sender unreachable


def test_every_exported_error_is_in_the_hierarchy():
    errors = [getattr(cpm, n) for n in cpm.__all__ if n.endswith("Error")]
    assert len(errors) >= 14
    assert all(issubclass(e, cpm.PoolmemError) for e in errors)


def test_missing_dependency_error_names_the_install_command():
    e = cpm.MissingDependencyError("cupy_poolmem.DevicePool", "No module named 'cupy'")
    assert 'pip install "cupy_poolmem[cu13]"' in str(e) and "No module named" in str(e)
    e = cpm.MissingDependencyError("x", needs="matplotlib", install="pip install matplotlib")
    assert str(e) == "x needs matplotlib, which is not installed: pip install matplotlib"


def test_oom_error_message_names_pool_size_and_stats():
    st = cpm.PoolStats(
        kind="device",
        device=0,
        used_bytes=5000,
        peak_used_bytes=6000,
        reserved_bytes=8000,
        peak_reserved_bytes=8000,
        n_allocs=3,
        n_frees=1,
        max_size=10000,
    )
    e = cpm.OutOfPoolMemoryError("DevicePool(device=0)", 123456, st)
    s = str(e)
    assert "DevicePool(device=0)" in s and "123,456" in s and "5,000" in s and "10,000" in s
    assert e.size == 123456 and e.stats is st


def test_pinned_oom_is_what_cupy_staging_catches():
    e = cpm.PinnedOutOfMemoryError("PinnedPool(numa_node=0)", 99)
    assert e.status == 2  # cudaErrorMemoryAllocation
    assert "99" in str(e)


def test_driver_error_keeps_cuda_error_name():
    from cuda.bindings import driver

    with pytest.raises(cpm.CUDADriverError) as ei:
        _errors.check_driver((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuSomething")
    assert ei.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert "CUDA_ERROR_INVALID_VALUE" in str(ei.value) and "cuSomething" in str(ei.value)


def test_check_driver_unpacks_success():
    from cuda.bindings import driver

    assert _errors.check_driver((driver.CUresult.CUDA_SUCCESS, 7), "x") == 7
    assert _errors.check_driver((driver.CUresult.CUDA_SUCCESS,), "x") is None


def test_poolstats_derived_fields():
    st = cpm.PoolStats(
        kind="device",
        device=0,
        used_bytes=1,
        peak_used_bytes=2,
        reserved_bytes=3,
        peak_reserved_bytes=4,
        n_allocs=10,
        n_frees=7,
    )
    assert st.live_allocs == 3
    assert st.to_dict()["live_allocs"] == 3 and st.to_dict()["reserved_bytes"] == 3


def test_hotpath_implementation_reported():
    assert cpm.hotpath_implementation() in ("cython", "python")


def test_public_api_is_exported_and_documented():
    for name in cpm.__all__:
        obj = getattr(cpm, name)
        if callable(obj) and not isinstance(obj, type(Exception)) and name != "__version__":
            assert obj.__doc__, f"{name} has no docstring"


def test_py_typed_marker_shipped():
    import os

    assert os.path.exists(os.path.join(os.path.dirname(cpm.__file__), "py.typed"))


@pytest.mark.skipif(not NO_GPU, reason="checks the behaviour without a GPU")
class TestWithoutGPU:
    def test_device_pool_raises_no_gpu(self):
        with pytest.raises(cpm.NoGPUError, match="GPU"):
            cpm.DevicePool()

    def test_pinned_pool_raises_no_gpu(self):
        with pytest.raises(cpm.NoGPUError):
            cpm.PinnedPool()

    def test_set_allocator_raises_no_gpu_and_leaves_cupy_alone(self):
        import cupy

        before = cupy.cuda.get_allocator()
        with pytest.raises(cpm.NoGPUError):
            cpm.set_allocator()
        assert cupy.cuda.get_allocator() is before

    def test_doctor_explains_and_exits_nonzero(self):
        r = subprocess.run(
            [sys.executable, "-m", "cupy_poolmem"], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 2
        assert "Traceback" not in r.stdout + r.stderr
        assert "cupy_poolmem doctor" in r.stdout and "cuda.core" in r.stdout
        assert "GPU" in r.stdout

    def test_demo_without_gpu_exits_nonzero_without_traceback(self):
        r = subprocess.run(
            [sys.executable, "-m", "cupy_poolmem", "demo"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr


def test_cli_rejects_unknown_command():
    r = subprocess.run(
        [sys.executable, "-m", "cupy_poolmem", "frobnicate"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_cli_help_lists_commands():
    r = subprocess.run(
        [sys.executable, "-m", "cupy_poolmem", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    for cmd in ("doctor", "demo", "bench", "report"):
        assert cmd in r.stdout


@pytest.mark.parametrize("bad", [-1, True, 2.5, "64"])
def test_sharing_keep_mappings_rejects_bad_values(bad):
    before = cpm.sharing.keep_mappings
    with pytest.raises(cpm.InvalidOptionError, match=f"keep_mappings={bad!r}"):
        cpm.sharing.keep_mappings = bad
    assert cpm.sharing.keep_mappings == before  # unchanged


def test_sharing_settings_and_stats_without_a_gpu():
    with pytest.raises(cpm.InvalidOptionError, match="'copy'.*device-copy"):
        cpm.sharing.fallback = "copy"
    cpm.sharing.keep_mappings = 3
    try:
        assert cpm.sharing.keep_mappings == 3
    finally:
        cpm.sharing.keep_mappings = 64
    stats = cpm.sharing.stats()
    assert set(stats) == {
        "exported_blocks",
        "limbo_blocks",
        "limbo_bytes",
        "tickets_out",
        "leases",
        "peers",
        "recycled_blocks",
        "imported_blocks",
        "idle_mappings",
        "imported_pools",
        "clients",
        "opened_events",
        "dropped_frames",
    }
    assert cpm.sharing.collect() == 0 and stats["leases"] == 0


def test_old_top_level_spellings_warn_and_forward():
    with pytest.warns(DeprecationWarning, match="sharing.stats"):
        assert cpm.sharing_stats() == cpm.sharing.stats()
    with pytest.warns(DeprecationWarning, match="sharing.collect"):
        assert cpm.collect() == 0


def test_on_device_asks_the_driver_for_the_context_once_per_thread(fake_driver):
    """on_device: a thread with no context gets the primary context bound; afterwards
    the same thread pays one runtime query per entry, a new thread asks again."""
    import threading

    from cupy_poolmem import _device

    # (thread, call): threads left running by other tests (the process's retirer) may
    # call on_device too; Thread objects, held here, are never another thread's (idents
    # of ended threads are reused)
    calls: list[tuple[threading.Thread, str]] = []
    bound: set[threading.Thread] = set()  # threads with a current context

    class RT:
        def getDevice(self):
            calls.append((threading.current_thread(), "getDevice"))
            return 0

        def setDevice(self, d):
            calls.append((threading.current_thread(), f"setDevice({d})"))

        def free(self, p):
            calls.append((threading.current_thread(), "free(0)"))
            bound.add(threading.current_thread())

    class Drv(PassThrough):
        def cuCtxGetCurrent(self):
            calls.append((threading.current_thread(), "cuCtxGetCurrent"))
            return 0, (1 if threading.current_thread() in bound else 0)

    fake_driver.runtime(RT())
    fake_driver(Drv())

    def enter_twice(out):
        for _ in range(2):
            with _device.on_device(0):
                pass
        me = threading.current_thread()
        out.extend(c for t, c in calls if t is me)
        calls.clear()

    first: list[str] = []
    t = threading.Thread(target=enter_twice, args=(first,))
    t.start()
    t.join(5)
    # no context in a fresh thread: bound once, then only the device query
    assert first == ["getDevice", "cuCtxGetCurrent", "setDevice(0)", "free(0)", "getDevice"]
    second: list[str] = []
    t = threading.Thread(target=enter_twice, args=(second,))
    t.start()
    t.join(5)
    assert second == first  # a new thread: asked and bound again, once
    # another device than the current one: set, and restored after
    with _device.on_device(1):
        pass
    mine = [c for t, c in calls if t is threading.current_thread()]
    assert mine[-2:] == ["setDevice(1)", "setDevice(0)"]


def test_uninstall_gives_cupy_its_allocator_back_only_for_the_installed_one(monkeypatch):
    import cupy

    from cupy_poolmem import _allocator, _runtime

    def mine(size):  # stands for an installed PoolAllocator
        raise AssertionError("never called")

    other = object()
    monkeypatch.setitem(_runtime.INSTALLED_ALLOCATORS, "device", mine)
    monkeypatch.setitem(_runtime.INSTALLED_ALLOCATORS, "pinned", mine)
    before = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(mine)
    try:
        assert _allocator.uninstall("device", other) is False  # not the installed one
        assert cupy.cuda.get_allocator() is mine
        assert _allocator.uninstall("device", mine) is True
        assert _runtime.installed_allocator("device") is None
        assert cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc
        assert _allocator.uninstall("device", mine) is False  # once
        assert _allocator.uninstall("pinned", mine) is True
        assert _runtime.installed_allocator("pinned") is None
    finally:
        cupy.cuda.set_allocator(before)
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
