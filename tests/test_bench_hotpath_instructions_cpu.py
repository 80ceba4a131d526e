"""The instruction-count harness (benchmarks/hotpath_instructions.py) still fits the .pyx:
each of its patches (the driver calls and the stream query, replaced by C stubs) finds
exactly one place, so a change to the hot path's set-up cannot silently break it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location(
        "hotpath_instructions", ROOT / "benchmarks" / "hotpath_instructions.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_patch_applies_once_to_the_hot_path():
    h = _harness()
    import cupy_poolmem  # the .pyx beside the imported package (a wheel ships it too)

    src = (Path(cupy_poolmem.__file__).parent / "_hotpath.pyx").read_text()
    out = h.patched(src)
    for name in ("alloc", "free", "ctxdev", "capturing", "stream"):
        assert f">hp_stub_{name}\n" in out
    assert '_driver_fn(\n    "cu' not in out
    assert out.index("cdef extern from *:") < out.index("hp_stub_alloc\n")
