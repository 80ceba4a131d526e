"""GPU tests of dask-cuda deployments with cupy_poolmem switched on by configuration alone.

Two GPUs; every chunk's sum is checked on the receiver, and the transfer counters
say which path it took (a test that passed without the IPC path would prove nothing):

* ``LocalCUDACluster`` configured only by environment variables (in a process of its
  own, so they reach Dask's config at import): the workers meet at start, a chunk
  moves GPU 0 -> GPU 1 through IPC without a first contact; a worker restarted by its
  nanny gets the plugin again and meets the other; the client imported no CUDA
  library beyond what the same script imports without the preload keys (holding
  futures of CuPy arrays imports CuPy: distributed unpickles their type);
* ``dask scheduler`` + one ``dask cuda worker`` command for both GPUs;
* two separate ``dask cuda worker`` commands: with a per-host secret they share the
  IPC path, without it they fall back (``other-family``);
* the same ``LocalCUDACluster`` on the ``ucxx`` protocol (when distributed-ucxx is
  installed): pools from the plugin, chunks moved by UCX, sums right.

Processes are started in sessions of their own and killed with their children in
``finally`` blocks; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support.gpus import visible

import cupy_poolmem as cpm

pytestmark = pytest.mark.multigpu

if cpm.device_count() < 2:
    pytest.skip(
        f"needs two CUDA GPUs; this machine has {cpm.device_count()}", allow_module_level=True
    )

pytest.importorskip("dask_cuda", reason="needs dask-cuda (pip install dask-cuda)")
pytest.importorskip("distributed", reason="distributed is not installed")

from distributed import Client, wait  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the package under test (and cupy_poolmem_dask beside it) is imported from.
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cpm.__file__)))
MiB = 1 << 20
TIMEOUT = 120
CONFIGURED = {
    "DASK_DISTRIBUTED__NANNY__PRELOAD": '["cupy_poolmem_dask"]',
    "DASK_DISTRIBUTED__WORKER__PRELOAD": '["cupy_poolmem_dask"]',
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    # The package under test, and this module (tasks defined here are pickled by name).
    here = os.path.join(ROOT, "tests")
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, here, env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _kill_group(p: subprocess.Popen) -> None:
    """End ``p`` and everything it started (its session): TERM, then KILL."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the nanny's workers too, if still there
    except OSError:
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-4000:]
    except OSError:
        return "(no log)"


# -- tasks ---------------------------------------------------------------------------------
def _make(nbytes: int, seed: int):
    import cupy

    return cupy.arange(nbytes // 8, dtype="f8") % 1009 + seed


def _keep(x):
    return x


def _total(x) -> float:
    return float(x.sum())


def _expected(nbytes: int, seed: int) -> float:
    return float((np.arange(nbytes // 8, dtype="f8") % 1009 + seed).sum())


def _counters() -> dict:
    from cupy_poolmem import _dask_transfer

    return _dask_transfer.counters()


def _gpu(dask_worker=None) -> str:
    import cupy

    return cupy.cuda.Device(0).pci_bus_id


def _move(client, a: str, b: str, nbytes: int, seed: int) -> float:
    x = client.submit(_make, nbytes, seed, workers=[a], pure=False)
    wait(x, timeout=TIMEOUT)
    y = client.submit(_keep, x, workers=[b], pure=False)
    wait(y, timeout=TIMEOUT)
    assert y.status == "finished", f"the transfer failed: {y.exception()!r}"
    return client.submit(_total, y, workers=[b], pure=False).result(timeout=TIMEOUT)


# -- LocalCUDACluster configured by environment (in a process of its own) --------------------
_LOCAL_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np

    def make(n, seed):
        import cupy
        return cupy.arange(n // 8, dtype="f8") % 1009 + seed

    def keep(x):
        return x

    def total(x):
        return float(x.sum())

    def counters():
        from cupy_poolmem import _dask_transfer
        return _dask_transfer.counters()

    def preloads(dask_worker):
        return [p.name for p in dask_worker.preloads._preloads]

    def expected(n, seed):
        return float((np.arange(n // 8, dtype="f8") % 1009 + seed).sum())

    def move(c, a, b, n, seed):
        from distributed import wait
        x = c.submit(make, n, seed, workers=[a], pure=False)
        wait(x, timeout=120)
        y = c.submit(keep, x, workers=[b], pure=False)
        wait(y, timeout=120)
        return c.submit(total, y, workers=[b], pure=False).result(timeout=120) == expected(n, seed)

    def met(c):
        # Every worker has mapped the blocks of every other one (met_peers): "served"
        # in warm says only that a peer met it, not that its meeting back is done.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            cs = c.run(counters)
            if all(s["installed"] and set(cs) - {w} <= set(s["met_peers"])
                   for w, s in cs.items()):
                break
            time.sleep(0.2)
        return c.run(counters)

    CUDA_TOPS = ("cupy", "cupy_backends", "cupy_poolmem", "cuda", "rmm")

    def cuda_modules():
        return sorted(m for m in sys.modules if m.split(".")[0] in CUDA_TOPS
                      or m == "numba.cuda" or m.startswith("numba.cuda."))

    if __name__ == "__main__":
        from dask_cuda import LocalCUDACluster
        from distributed import Client
        protocol, restart = sys.argv[1], sys.argv[2] == "1"
        configured = sys.argv[3] == "configured"  # else plain: no preload keys, no plugin
        out = {}
        with LocalCUDACluster(CUDA_VISIBLE_DEVICES=sys.argv[4], n_workers=2, threads_per_worker=1,
                              protocol=protocol, dashboard_address=None) as cluster, \\
                Client(cluster) as c:
            c.wait_for_workers(2, timeout=120)
            a, b = sorted(c.scheduler_info()["workers"])
            out["a"], out["b"] = a, b
            out["preloads"] = c.run(preloads)
            out["before"] = met(c) if configured else None
            # Nannies, preloads and meetings done; no future of a CuPy array yet.
            out["client_cuda_started"] = cuda_modules()
            out["ok"] = [move(c, a, b, 64 << 20, 3), move(c, a, b, 64 << 20, 4)]
            out["after"] = c.run(counters) if configured else None
            if restart:
                c.restart_workers([a], timeout=120)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    ws = set(c.scheduler_info()["workers"])
                    if len(ws) == 2:
                        break
                    time.sleep(0.2)
                a2 = next(w for w in c.scheduler_info()["workers"] if w != b)
                out["a2"] = a2
                out["preloads2"] = c.run(preloads, workers=[a2])[a2]
                out["before2"] = met(c) if configured else None
                out["ok2"] = move(c, a2, b, 64 << 20, 5)
                out["after2"] = c.run(counters) if configured else None
            # The client unpickles the type of each future's result (distributed's
            # key-in-memory message): holding futures of CuPy arrays imports CuPy,
            # plugin or not.  So the test compares with a plain run.
            out["client_cuda"] = cuda_modules()
        print("RESULT " + json.dumps(out), flush=True)
    """
)


def _run_local(
    tmp_path, protocol: str, restart: bool, timeout: float = 170, configured: bool = True
) -> dict:
    """Run the cluster script; ``configured=False``: the same script without the
    preload keys in its environment (no plugin anywhere)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "local.py"
    script.write_text(_LOCAL_SCRIPT)
    log = tmp_path / "local.log"
    with open(log, "w") as f:
        p = subprocess.Popen(
            [
                sys.executable,
                str(script),
                protocol,
                "1" if restart else "0",
                "configured" if configured else "plain",
                ",".join(visible(2)),  # this process's first two GPUs
            ],
            env=_env(**CONFIGURED) if configured else _env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=str(tmp_path),
            start_new_session=True,
        )
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the cluster script ran past {timeout} s:\n{_tail(log)}")
        finally:
            _kill_group(p)
    text = log.read_text(errors="replace")
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc {p.returncode}:\n{text[-4000:]}"
    return json.loads(lines[-1][7:])


def _first_contacts(counters: dict) -> int:
    """The chunks' receives that connected to their sender (a meeting's are
    ``warm.first-contact``)."""
    return counters["timings"].get("receive.first-contact", {}).get("n", 0)


def _meetings(cs: dict) -> dict:
    """What each worker's counters say of its meetings (for failure messages)."""
    keys = ("installed", "warm", "met_peers", "timings")
    return {w: {k: c.get(k) for k in keys} for w, c in cs.items()}


def test_local_cuda_cluster_configured_by_environment_only(tmp_path):
    got = _run_local(tmp_path / "configured", "tcp", restart=True, timeout=150)
    a, b = got["a"], got["b"]
    for w, pre in got["preloads"].items():
        assert pre == ["dask_cuda.initialize", "cupy_poolmem.dask"], (w, pre)
    assert got["ok"] == [True, True], got
    before, after = got["before"], got["after"]
    assert before[a]["installed"] and before[b]["installed"], before
    assert after[a]["sent_ipc"] - before[a]["sent_ipc"] == 2, after[a]
    assert after[b]["received_copy"] - before[b]["received_copy"] == 2, after[b]
    # The workers met at start (each mapped the other's blocks): the chunks made
    # no first contact.
    assert a in before[b]["met_peers"] and b in before[a]["met_peers"], _meetings(before)
    assert _first_contacts(after[b]) == 0, _meetings(after)
    # A worker restarted by its nanny gets the preload and the plugin again, and
    # meets the running one.
    a2 = got["a2"]
    assert got["preloads2"] == ["dask_cuda.initialize", "cupy_poolmem.dask"]
    assert got["ok2"] is True
    after2 = got["after2"]
    assert after2[a2]["installed"] and after2[a2]["sent_ipc"] >= 1, after2
    assert a2 in got["before2"][b]["met_peers"], _meetings(got["before2"])
    assert _first_contacts(after2[b]) == 0, _meetings(after2)
    # The nannies live in the client's process: the hook and the plugin brought no
    # CUDA library there.  Before any CuPy result exists, and at the end compared
    # with the same script without the preload keys (a client holding futures of
    # CuPy arrays imports CuPy to unpickle their type, plugin or not).
    plain = _run_local(tmp_path / "plain", "tcp", restart=True, timeout=120, configured=False)
    assert plain["ok"] == [True, True] and plain["ok2"] is True, plain
    assert plain["preloads"] and all(
        p == ["dask_cuda.initialize"] for p in plain["preloads"].values()
    )
    for when in ("client_cuda_started", "client_cuda"):
        added = sorted(set(got[when]) - set(plain[when]))
        assert added == [], (when, added)
    assert [m for m in got["client_cuda"] if m.split(".")[0] == "cupy_poolmem"] == []


def test_ucxx_cluster_with_the_plugin_moves_chunks_right(tmp_path):
    pytest.importorskip(
        "distributed_ucxx", reason="needs distributed-ucxx (pip install distributed-ucxx-cu13)"
    )
    got = _run_local(tmp_path, "ucxx", restart=False)
    assert got["ok"] == [True, True], got
    a, b = got["a"], got["b"]
    assert a.startswith("ucxx://"), a
    assert got["after"][a]["installed"] and got["after"][b]["installed"], got["after"]
    # (UCXX's own client side may import CUDA libraries: not checked here.)


# -- dask scheduler + dask cuda worker commands -----------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Deployment:
    """A scheduler and worker commands, each in a session of its own, logs in ``tmp``."""

    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen, object]] = []
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = self.tmp / f"{name}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(
                [sys.executable, "-m", "dask", *args],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=str(self.tmp),
                start_new_session=True,
            )
        self.procs.append((p, log))

    def scheduler(self) -> None:
        self.start(
            "scheduler",
            ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"],
            _env(),
        )

    def cuda_worker(self, name: str, visible: str, **env: str) -> None:
        self.start(
            name,
            ["cuda", "worker", self.address, "--nthreads", "1", "--no-dashboard",
             "--name", name, "--death-timeout", "60"],
            _env(CUDA_VISIBLE_DEVICES=visible, **CONFIGURED, **env),
        )  # fmt: skip

    def logs(self) -> str:
        return "\n".join(f"--- {log}\n{_tail(log)}" for _, log in self.procs)

    def close(self) -> None:
        for p, _ in reversed(self.procs):
            _kill_group(p)


def _by_name(client, n: int) -> dict[str, str]:
    client.wait_for_workers(n, timeout=TIMEOUT)
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {w["name"]: addr for addr, w in info.items()}


def _wait_met(client, pairs=(), timeout: float = 30) -> dict:
    """Every worker's counters once all have the plugin and, for each ``(receiver,
    sender)`` of ``pairs``, the receiver has mapped the sender's blocks at a meeting
    (``met_peers``; ``warm`` counts ``served`` before the meeting back is done).
    At ``timeout``, the counters as they are: the caller's asserts say what is missing."""
    deadline = time.monotonic() + timeout
    while True:
        cs = client.run(_counters)
        if all(s["installed"] for s in cs.values()) and all(
            snd in cs.get(rcv, {}).get("met_peers", ()) for rcv, snd in pairs
        ):
            return cs
        if time.monotonic() > deadline:
            return cs
        time.sleep(0.2)


def test_one_dask_cuda_worker_command_for_two_gpus_preloaded_by_configuration(tmp_path):
    dep = _Deployment(tmp_path)
    try:
        dep.scheduler()
        dep.cuda_worker("w", ",".join(visible(2)))
        with Client(dep.address, timeout=TIMEOUT) as client:
            names = _by_name(client, 2)
            a, b = names["w-0"], names["w-1"]
            gpus = client.run(_gpu)
            assert gpus[a] != gpus[b], gpus
            before = _wait_met(client, [(b, a), (a, b)])
            assert before[a]["installed"] and before[b]["installed"], dep.logs()
            assert a in before[b]["met_peers"], (_meetings(before), dep.logs())
            assert _move(client, a, b, 64 * MiB, 7) == _expected(64 * MiB, 7)
            after = client.run(_counters)
            assert after[a]["sent_ipc"] - before[a]["sent_ipc"] == 1, after[a]
            assert after[b]["received_copy"] - before[b]["received_copy"] == 1, after[b]
            assert _first_contacts(after[b]) == 0, _meetings(after)
    finally:
        dep.close()


@pytest.mark.parametrize("secret", [True, False], ids=["with-secret", "without-secret"])
def test_two_dask_cuda_worker_commands_share_ipc_only_with_the_per_host_secret(tmp_path, secret):
    extra = {}
    if secret:
        f = tmp_path / "secret"
        f.write_bytes(os.urandom(32).hex().encode())
        os.chmod(f, stat.S_IRUSR | stat.S_IWUSR)
        extra["DASK_DISTRIBUTED__COMM__CUPY_POOLMEM__SECRET"] = str(f)
    dep = _Deployment(tmp_path)
    try:
        dep.scheduler()
        # Two commands, as a process manager starts them; each sees both GPUs (its
        # first one differs), so each runs two workers: a-0 on GPU 0, b-0 on GPU 1.
        g0, g1 = visible(2)  # this process's first two GPUs
        dep.cuda_worker("a", f"{g0},{g1}", **extra)
        dep.cuda_worker("b", f"{g1},{g0}", **extra)
        with Client(dep.address, timeout=TIMEOUT) as client:
            names = _by_name(client, 4)
            src, dst = names["a-0"], names["b-0"]
            gpus = client.run(_gpu, workers=[src, dst])
            assert gpus[src] != gpus[dst], gpus
            pids = client.run(os.getppid, workers=[src, dst])  # their nannies' commands
            before = _wait_met(client, [(dst, src)] if secret else [])
            assert _move(client, src, dst, 64 * MiB, 9) == _expected(64 * MiB, 9)
            after = client.run(_counters)
            sent = after[src]["sent_ipc"] - before[src]["sent_ipc"]
            fell = after[src]["fallback"].get("other-family", 0)
            if secret:
                assert sent == 1, (after[src], dep.logs())
                assert after[dst]["received_copy"] - before[dst]["received_copy"] == 1
                assert fell == 0, after[src]
                # The two commands' workers met through the secret's key, too.
                assert src in before[dst]["met_peers"], _meetings(before)
                assert _first_contacts(after[dst]) == 0, _meetings(after)
            else:
                assert sent == 0 and fell >= 1, after[src]
                assert after[dst]["received_copy"] == before[dst]["received_copy"]
            assert pids[src] != pids[dst], pids  # two commands indeed
    finally:
        dep.close()
