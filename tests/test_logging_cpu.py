"""CPU tests of the ``cupy_poolmem`` logger: silent by default, and the operational
events it carries (exporter started, peer gone, fallbacks, pool retired)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from fakes.sharing import wait_for

import cupy_poolmem

KB = 1024
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))


def _records(caplog, needle: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if needle in r.getMessage()]


def test_the_logger_is_silent_until_routed():
    """A NullHandler on "cupy_poolmem": Python's last-resort handler never prints its
    records, even warnings, when the application configured nothing."""
    code = (
        "import logging, cupy_poolmem;"
        "log = logging.getLogger('cupy_poolmem._sharing._exporter');"
        "log.warning('must not print'); log.info('nor this');"
        "h = logging.getLogger('cupy_poolmem').handlers;"
        "print(type(h[0]).__name__, len(h))"
    )
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "NullHandler 1" and r.stderr == ""


def test_exporter_started_and_peer_gone(sharing_world, caplog):
    caplog.set_level(logging.INFO, logger="cupy_poolmem")
    e, r = sharing_world.proc("exporter"), sharing_world.proc("receiver")
    core = e.pool()
    b = core.alloc(KB, payload=3)
    imp = r.recv(e.send(b))
    (started,) = _records(caplog, "exporter listening at")
    assert started.name == "cupy_poolmem._sharing._exporter" and started.levelno == logging.INFO
    assert _records(caplog, "is gone") == []
    del b
    r.kill()
    assert wait_for(lambda: _records(caplog, "is gone"), 5.0)
    (gone,) = _records(caplog, "is gone")
    assert gone.levelno == logging.INFO and "leases are released" in gone.getMessage()
    del imp


def test_pool_retired(fake_retirer, caplog):
    caplog.set_level(logging.INFO, logger="cupy_poolmem")

    class Resource:
        def close(self) -> None:
            pass

    a = fake_retirer.adopt(Resource())
    fake_retirer.retire(a, 1)
    fake_retirer.retire(a, 1)
    msgs = [r.getMessage() for r in caplog.records if r.name == "cupy_poolmem._retire"]
    assert msgs == [
        f"pool {a:#x} on device 1 retired: to be destroyed",
        f"pool {a:#x} on device 1 retired: retired already",
    ]


def test_hot_path_fallback_is_logged():
    """A compiled hot path that does not import: the pure-Python twin, and one INFO line."""
    code = """
import importlib.abc, logging, sys
class NoCompiled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "cupy_poolmem._hotpath":
            raise ImportError("simulated: not built")
sys.meta_path.insert(0, NoCompiled())
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
import cupy_poolmem._pools as p
print("impl", p.hotpath_implementation())
"""
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUPY_POOLMEM_PURE_PYTHON", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode != 0 and "No module named 'cupy'" in r.stderr:
        pytest.skip("needs CuPy installed (the pools module imports it)")
    assert r.returncode == 0, r.stderr
    assert "impl python" in r.stdout
    assert (
        "cupy_poolmem._pools INFO hot path: the pure-Python twin "
        "(compiled module not loaded: simulated: not built)" in r.stderr
    )


def test_dask_fallback_is_logged_at_debug(caplog):
    from cupy_poolmem._dask_transfer._process import Counters

    caplog.set_level(logging.DEBUG, logger="cupy_poolmem")
    c = Counters()
    c.fell_back("not_cupy_poolmem")
    (rec,) = _records(caplog, "takes Dask's own serialization")
    assert rec.levelno == logging.DEBUG and "(not_cupy_poolmem)" in rec.getMessage()
    assert c.to_dict()["fallback"] == {"not_cupy_poolmem": 1}
