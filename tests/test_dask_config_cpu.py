"""CPU tests of the configuration-only route into Dask workers, the per-host secret,
the meeting of same-host peers at start, and the transfer timings.

* ``cupy_poolmem_dask`` in ``distributed.nanny.preload`` reaches workers whose
  preload list is given explicitly (as dask-cuda gives it), and
  ``distributed.worker.preload`` reaches ``dask worker``'s; a worker that cannot set
  the plugin up comes up without it and logs why; the client and scheduler import
  no CUDA library because of it (subprocesses, real clusters, no GPU needed).
* The secret file: created private, refused unless private; its key authenticates
  the sharing sockets (the fake-GPU world's real Unix sockets).
* Meeting peers, against fake workers and the stubbed receive of
  ``test_dask_transfer_cpu``'s kind.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

pytest.importorskip("dask", reason="dask is not installed (pip install 'cupy_poolmem[dask]')")
pytest.importorskip(
    "distributed", reason="distributed is not installed (pip install 'cupy_poolmem[dask]')"
)

import dask  # noqa: E402

import cupy_poolmem as cpm  # noqa: E402
import cupy_poolmem_dask  # noqa: E402
from cupy_poolmem import _dask_transfer as T  # noqa: E402
from cupy_poolmem._dask_transfer import _process, _receiver, _secret, _warm  # noqa: E402
from cupy_poolmem._dask_transfer._steps import GpuSteps  # noqa: E402
from cupy_poolmem._sharing import _wire  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the package under test (and cupy_poolmem_dask beside it) is imported from.
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cpm.__file__)))
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
NO_GPU = cpm.device_count() == 0


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    for k in [k for k in env if k.startswith("DASK_")]:
        del env[k]
    env.update(extra)
    return env


CONFIGURED = {
    "DASK_DISTRIBUTED__NANNY__PRELOAD": '["cupy_poolmem_dask"]',
    "DASK_DISTRIBUTED__WORKER__PRELOAD": '["cupy_poolmem_dask"]',
}


# -- the nanny hook ------------------------------------------------------------------------------
class _Nanny:
    def __init__(self, preload, argv):
        self.preload, self.preload_argv = preload, argv


@pytest.mark.parametrize(
    "preload, argv, want_preload, want_argv",
    [
        (["dask_cuda.initialize"], ["--create-cuda-context"], None, ["--create-cuda-context"]),
        (("a", "b"), [["-x"], ["-y"]], None, [["-x"], ["-y"], []]),
        ("a", [], None, []),
        ([], [], None, []),
        (None, None, None, None),
    ],
)
def test_the_nanny_hook_adds_the_worker_preload_and_keeps_the_others(
    preload, argv, want_preload, want_argv
):
    n = _Nanny(preload, argv)
    assert cupy_poolmem_dask.add_worker_preload(n)
    before = [preload] if isinstance(preload, str) else list(preload or [])
    assert n.preload == [*before, "cupy_poolmem.dask"]
    assert n.preload_argv == want_argv
    assert not cupy_poolmem_dask.add_worker_preload(n)  # once only
    assert n.preload.count("cupy_poolmem.dask") == 1


@pytest.mark.parametrize("name", ["cupy_poolmem.dask", "cupy_poolmem_dask"])
def test_the_nanny_hook_leaves_a_preload_that_brings_cupy_poolmem_alone(name):
    n = _Nanny(["x", name], [])
    assert not cupy_poolmem_dask.add_worker_preload(n)
    assert n.preload == ["x", name]


@pytest.mark.parametrize(
    "value, expected",
    [(True, True), (False, False), ("off", False), ("YES", True), (0, False), ("1", True)],
)
def test_enabled_reads_booleans_and_their_spellings(value, expected):
    with dask.config.set({"cupy-poolmem.enabled": value}):
        assert cupy_poolmem_dask.enabled() is expected


def test_enabled_refuses_other_values_naming_the_key():
    with dask.config.set({"cupy-poolmem.enabled": "maybe"}):
        with pytest.raises(ValueError, match="cupy-poolmem.enabled='maybe'"):
            cupy_poolmem_dask.enabled()


def test_the_preload_module_imports_no_cuda_library():
    code = "import sys, cupy_poolmem_dask; print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_poolmem', 'numba', 'rmm', 'cuda')))"
    r = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_a_nanny_started_hook_is_off_when_disabled():
    n = _Nanny(["dask_cuda.initialize"], [])
    from distributed import Nanny

    class FakeNanny(Nanny):
        def __init__(self):  # no server: only the attributes the hook reads
            self.preload, self.preload_argv = ["dask_cuda.initialize"], []

    nanny = FakeNanny()
    with dask.config.set({"cupy-poolmem.enabled": False}):
        asyncio.run(cupy_poolmem_dask.dask_setup(nanny))
    assert nanny.preload == ["dask_cuda.initialize"]
    asyncio.run(cupy_poolmem_dask.dask_setup(nanny))
    assert nanny.preload == ["dask_cuda.initialize", "cupy_poolmem.dask"]
    assert n.preload == ["dask_cuda.initialize"]  # another object: untouched


# -- real clusters configured by environment alone ------------------------------------------------
_CLUSTER_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    from distributed import Client, LocalCluster

    records = []

    class Keep(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())

    if __name__ == "__main__":
        kw = json.loads(sys.argv[1])
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                          dashboard_address=None, **kw) as cluster, Client(cluster) as c:
            def look(dask_worker):
                import sys
                return {
                    "preloads": [p.name for p in dask_worker.preloads._preloads],
                    "plugins": sorted(dask_worker.plugins),
                    "cupy_poolmem": "cupy_poolmem.dask" in sys.modules,
                }
            (w,) = c.run(look).values()
            out = {
                "worker": w,
                "client_modules": sorted(m for m in sys.modules
                                         if m.split(".")[0] in ("cupy", "cupy_poolmem", "rmm")),
                "sum": c.submit(sum, [1, 2, 3]).result(timeout=60),
            }
        print("RESULT " + json.dumps(out))
    """
)


def _run_cluster(tmp_path, env: dict[str, str], **kw) -> tuple[dict, str]:
    script = tmp_path / "cluster.py"
    script.write_text(_CLUSTER_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), json.dumps(kw)],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout + r.stderr
    return json.loads(line[0][7:]), r.stderr


@pytest.mark.skipif(not NO_GPU, reason="reads the warning of a worker without a GPU")
def test_nanny_preload_reaches_a_worker_whose_preloads_are_given_explicitly(tmp_path):
    # An explicit worker preload list, as dask-cuda's LocalCUDACluster and
    # `dask cuda worker` pass one: it replaces distributed.worker.preload.
    stand_in = "import os  # stands for dask_cuda.initialize"
    got, err = _run_cluster(tmp_path, CONFIGURED, preload=[stand_in])
    assert got["worker"]["preloads"] == [stand_in, "cupy_poolmem.dask"], got
    assert got["worker"]["cupy_poolmem"] and got["sum"] == 6
    # No GPU here: the worker comes up without the plugin and says why.
    assert "runs without cupy_poolmem: NoGPUError" in err, err[-3000:]
    assert "cupy-poolmem" not in got["worker"]["plugins"]
    # The nanny lives in the client's process: no CUDA library came with the hook.
    assert got["client_modules"] == [], got["client_modules"]


def test_without_the_nanny_key_an_explicit_preload_list_leaves_cupy_poolmem_out(tmp_path):
    # What the issue saw: distributed.worker.preload alone does nothing under dask-cuda.
    stand_in = "import os  # stands for dask_cuda.initialize"
    env = {"DASK_DISTRIBUTED__WORKER__PRELOAD": '["cupy_poolmem_dask"]'}
    got, _ = _run_cluster(tmp_path, env, preload=[stand_in])
    assert got["worker"]["preloads"] == [stand_in] and not got["worker"]["cupy_poolmem"]


@pytest.mark.skipif(not NO_GPU, reason="reads the warning of a worker without a GPU")
def test_both_keys_on_a_plain_cluster_preload_cupy_poolmem_once(tmp_path):
    got, err = _run_cluster(tmp_path, CONFIGURED)
    assert got["worker"]["preloads"] == ["cupy_poolmem_dask"], got
    assert err.count("runs without cupy_poolmem") == 1, err[-3000:]
    assert got["client_modules"] == []


def test_enabled_false_leaves_configured_workers_alone(tmp_path):
    stand_in = "import os  # stands for dask_cuda.initialize"
    got, err = _run_cluster(
        tmp_path, dict(CONFIGURED, DASK_CUPY_POOLMEM__ENABLED="false"), preload=[stand_in]
    )
    assert got["worker"]["preloads"] == [stand_in] and not got["worker"]["cupy_poolmem"]
    assert "runs without cupy_poolmem" not in err


_TYPE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from distributed import Client, LocalCluster, wait

    TOPS = ("cudalike", "cupy", "cupy_backends", "cupy_poolmem", "cuda", "rmm", "numba")

    def make():
        import cudalike
        return cudalike.Array()

    def mods():
        return sorted(m for m in sys.modules if m.split(".")[0] in TOPS)

    if __name__ == "__main__":
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                          dashboard_address=None) as cluster, Client(cluster) as c:
            c.wait_for_workers(1, timeout=60)
            started = mods()
            f = c.submit(make, pure=False)
            wait(f, timeout=60)
            held = mods()
        print("RESULT " + json.dumps({"started": started, "held": held}))
    """
)


@pytest.mark.parametrize("configured", [False, True], ids=["plain", "configured"])
def test_a_client_holding_futures_imports_their_types_module_plugin_or_not(tmp_path, configured):
    """Why the GPU deployment test compares the client's modules with a run without
    the preload keys: distributed's client unpickles the type of each of its futures'
    results (the scheduler's ``key-in-memory`` message), so a client holding futures
    of CuPy arrays imports CuPy whatever the workers run.  ``cudalike`` stands for
    CuPy here: a module only the task imports."""
    (tmp_path / "cudalike.py").write_text("class Array:\n    pass\n")
    script = tmp_path / "holding.py"
    script.write_text(_TYPE_SCRIPT)
    extra = dict(CONFIGURED) if configured else {}
    env = _env(**extra, PYTHONPATH=os.pathsep.join([str(tmp_path), PKG_PARENT]))
    r = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout + r.stderr[-3000:]
    got = json.loads(line[0][7:])
    # The nanny hook and the worker preload brought nothing to the client ...
    assert got["started"] == [], got
    # ... the future of a cudalike.Array did, and nothing else did.
    assert got["held"] == ["cudalike"], got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            out, _ = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate(timeout=10)
        outs.append(out or "")
    return outs


@pytest.mark.skipif(not NO_GPU, reason="reads the warning of a worker without a GPU")
def test_dask_worker_command_reads_the_worker_key_and_scheduler_imports_nothing(tmp_path):
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    env = _env(**CONFIGURED)
    dask_cli = [sys.executable, "-m", "distributed.cli.dask_worker"]
    sched = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", str(port), "--no-dashboard"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path),
    )  # fmt: skip
    procs = [sched]
    try:
        worker = subprocess.Popen(
            [*dask_cli, addr, "--nthreads", "1", "--no-dashboard"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=str(tmp_path),
        )  # fmt: skip
        procs.append(worker)
        from distributed import Client

        with Client(addr, timeout=60) as c:
            c.wait_for_workers(1, timeout=60)

            def look(dask_worker):
                return [p.name for p in dask_worker.preloads._preloads]

            (pre,) = c.run(look).values()
            sched_mods = c.run_on_scheduler(
                lambda: sorted(
                    m for m in sys.modules if m.split(".")[0] in ("cupy", "cupy_poolmem")
                )
            )
            assert c.submit(sum, [1, 2]).result(timeout=60) == 3
        assert pre == ["cupy_poolmem_dask"], pre
        assert sched_mods == [], sched_mods
    finally:
        outs = _stop(procs)
    assert "runs without cupy_poolmem: NoGPUError" in outs[1], outs[1][-3000:]


# -- the secret --------------------------------------------------------------------------------
def test_auto_secret_is_created_private_and_read_back_the_same(tmp_path):
    d = str(tmp_path / "rt")
    s1 = _secret.load_secret("auto", base_dir=d)
    s2 = _secret.load_secret("AUTO", base_dir=d)
    assert s1 == s2 and len(s1) >= 32
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    f = os.path.join(d, _secret.FILE_NAME)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert os.listdir(d) == [_secret.FILE_NAME]  # no temporary file left


def test_workers_creating_the_secret_at_once_all_read_one_secret(tmp_path):
    d = str(tmp_path / "rt")
    got: list[bytes] = []
    errors: list[BaseException] = []

    def go():
        try:
            got.append(_secret.load_secret("auto", base_dir=d))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(got) == 8 and len(set(got)) == 1


@pytest.mark.parametrize(
    "mode, match", [(0o644, "mode 0644.*chmod 600"), (0o640, "mode 0640"), (0o604, "mode 0604")]
)
def test_a_secret_file_others_can_read_is_refused(tmp_path, mode, match):
    f = tmp_path / "s"
    f.write_text("x" * 40)
    os.chmod(f, mode)
    with pytest.raises(cpm.InvalidOptionError, match=match):
        _secret.load_secret(str(f))
    os.chmod(f, 0o600)
    assert _secret.load_secret(str(f)) == b"x" * 40


def test_short_missing_linked_and_foreign_secrets_are_refused(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    os.chmod(short, 0o600)
    with pytest.raises(cpm.InvalidOptionError, match="holds 3 bytes"):
        _secret.load_secret(str(short))
    with pytest.raises(cpm.InvalidOptionError, match="cannot read the secret file"):
        _secret.load_secret(str(tmp_path / "missing"))
    good = tmp_path / "good"
    good.write_text("y" * 32)
    os.chmod(good, 0o600)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(cpm.InvalidOptionError, match="symbolic link"):
        _secret.load_secret(str(link))
    with pytest.raises(cpm.OptionTypeError):
        _secret.load_secret(42)  # type: ignore[arg-type]
    if os.getuid() == 0:  # only root can give a file away
        os.chown(good, 4242, -1)
        with pytest.raises(cpm.InvalidOptionError, match="belongs to uid 4242"):
            _secret.load_secret(str(good))


def test_auto_refuses_a_runtime_directory_others_can_enter(tmp_path):
    d = tmp_path / "rt"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(cpm.InvalidOptionError, match="chmod 700"):
        _secret.load_secret("auto", base_dir=str(d))
    link = tmp_path / "rt-link"
    link.symlink_to(d)
    with pytest.raises(cpm.InvalidOptionError, match="not a directory"):
        _secret.load_secret("auto", base_dir=str(link))


def test_default_dir_takes_a_private_xdg_runtime_dir_only(tmp_path):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    os.chmod(xdg, 0o700)
    assert _secret.default_dir({"XDG_RUNTIME_DIR": str(xdg)}) == str(xdg / "cupy_poolmem")
    os.chmod(xdg, 0o755)
    assert _secret.default_dir({"XDG_RUNTIME_DIR": str(xdg)}).endswith(f"-{os.getuid()}")


def test_the_secrets_key_differs_per_secret_and_hides_it():
    a, b = _secret.authkey_from_secret(b"a" * 32), _secret.authkey_from_secret(b"b" * 32)
    assert a != b and b"a" * 16 not in a and len(a) == 32


# -- the sharing key ----------------------------------------------------------------------------
@pytest.fixture
def world(sharing_world):
    return sharing_world


def test_processes_with_one_secret_share_and_others_are_refused(world):
    key = _secret.authkey_from_secret(b"s" * 32)
    a, b, c, d = (world.proc(n) for n in "abcd")
    for p in (a, b):
        p.ctx.use_authkey(key)
    c.ctx.use_authkey(_secret.authkey_from_secret(b"t" * 32))  # another secret
    # d keeps the process family's key (the multiprocessing authkey)
    blk = a.pool().alloc(256, payload="chunk")
    got = b.recv(a.send(blk))
    assert b.read(got)[1] == "chunk"
    for other in (c, d):
        with pytest.raises(cpm.SharingError):
            other.recv(a.send(blk))
    del got


def test_the_key_cannot_change_once_the_process_has_shared(world):
    a = world.proc("a")
    blk = a.pool().alloc(64, payload=1)
    a.send(blk)  # the exporter (and its listener) exist now, with the family key
    a.ctx.use_authkey(None)  # the same key: allowed
    with pytest.raises(cpm.SharingError, match="different authentication key"):
        a.ctx.use_authkey(b"k" * 32)
    assert a.ctx.authkey == bytes(__import__("multiprocessing").current_process().authkey)


def test_install_with_a_secret_keys_the_context_and_says_so_in_the_identity(tmp_path, monkeypatch):
    from cupy_poolmem._sharing._context import SharingContext
    from cupy_poolmem._sharing._settings import SharingSettings

    monkeypatch.setattr(_process.PROCESS, "current", _process.TransferState())
    f = tmp_path / "secret"
    f.write_text("z" * 32)
    os.chmod(f, 0o600)
    ctx = SharingContext(SharingSettings())
    w = types.SimpleNamespace(address="tcp://127.0.0.1:1", connection_args={}, handlers={})
    try:
        assert T.install(w, 0, T.TransferConfig(secret=str(f), warm=False), [GPU_A], sharing=ctx)
        assert ctx.authkey == _secret.authkey_from_secret(b"z" * 32)
        ident = w.connection_args["handshake_overrides"][T.HANDSHAKE_KEY]
        assert ident["auth"] == "secret"
        assert ident["family"] == T.local_identity([], authkey=ctx.authkey)["family"]
        assert w.handlers[T.WARM_OP] is _warm.serve
    finally:
        T.uninstall(w)
    assert T.WARM_OP not in w.handlers
    os.chmod(f, 0o644)
    ctx2 = SharingContext(SharingSettings())
    with pytest.raises(cpm.InvalidOptionError, match="chmod 600"):
        T.install(w, 0, T.TransferConfig(secret=str(f), warm=False), [GPU_A], sharing=ctx2)
    assert "handshake_overrides" not in w.connection_args  # nothing installed


def test_config_secret_and_warm_keys_come_from_dasks_config():
    with dask.config.set(
        {"distributed.comm.cupy-poolmem.secret": "auto", "distributed.comm.cupy-poolmem.warm": "0"}
    ):
        cfg = T.TransferConfig.from_dask_config()
    assert cfg.secret == "auto" and cfg.warm is False
    assert T.TransferConfig(secret="null").secret is None
    with pytest.raises(cpm.OptionTypeError, match="secret"):
        T.TransferConfig(secret=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mine, theirs, reason",
    [
        (None, None, "other-family"),
        (b"k" * 32, None, "no-secret"),
        (None, b"k" * 32, "no-secret"),
        (b"k" * 32, b"j" * 32, "other-secret"),
    ],
)
def test_peers_of_other_keys_fall_back_with_the_reason(mine, theirs, reason, monkeypatch):
    me = T.local_identity([GPU_A], authkey=mine)
    same = T.local_identity([GPU_A], authkey=mine)
    assert T.peer_reason(me, same) == "ipc"
    if mine is None and theirs is None:
        import multiprocessing

        monkeypatch.setattr(multiprocessing.current_process(), "authkey", b"another family")
    peer = T.local_identity([GPU_A], authkey=theirs)
    assert T.peer_reason(me, peer) == reason
    ctx = {"recipient": {T.HANDSHAKE_KEY: peer}}
    assert T.decide(me, T.TransferConfig(), ctx, 2**20, lambda: (True, GPU_A)) == reason


# -- meeting peers ------------------------------------------------------------------------------
def _header(ticket: bytes = b"\x02" * 16) -> dict:
    d = _wire.Descriptor(
        _wire.VERSION, "cupy", "/tmp/cupy_poolmem-x/s", "pool-1", GPU_A, _wire.POOL_DEVICE,
        7, b"\x01" * 64, 4096, ticket, b"\x03" * 64, 0, (1024,), (4,), "<f4", 1,
    )  # fmt: skip
    return T.make_header(tuple(d), "tcp://127.0.0.1:40001")


class _Rpc:
    def __init__(self, replies: dict, calls: list, address: str = "") -> None:
        self.replies, self.calls, self.address = replies, calls, address

    def __call__(self, address: str) -> _Rpc:
        return _Rpc(self.replies, self.calls, address)

    async def cupy_poolmem_warm(self, **kw):
        self.calls.append((self.address, kw))
        r = self.replies[self.address]
        if isinstance(r, BaseException):
            raise r
        return r


class _Worker:
    def __init__(self, replies: dict, workers: dict | None = None) -> None:
        from distributed.core import Status

        self.calls: list = []
        self.rpc = _Rpc(replies, self.calls)
        self.address = "tcp://10.0.0.1:4001"
        self.status = Status.running
        workers = workers or {}

        class Sched:
            async def identity(self):
                return {"workers": workers}

        self.scheduler = Sched()


@pytest.fixture
def state(monkeypatch):
    st = _process.TransferState()
    monkeypatch.setattr(_process.PROCESS, "current", st)
    st.config = T.TransferConfig()
    st.identity = T.local_identity([GPU_A])
    st.address = "tcp://10.0.0.1:4001"
    st.device_uuid = GPU_A
    received: list = []
    steps: list = []

    def receive(d, step="receive"):
        received.append(d)
        steps.append(step)
        return types.SimpleNamespace(nbytes=d.size), "view"

    st.gpu = GpuSteps(st)
    st.gpu.receive = receive  # the mapping, stubbed
    st.received = received
    st.steps = steps  # the timing prefix each receive was given
    return st


def test_meeting_a_peer_maps_its_blocks_and_counts_it(state):
    peer = dict(state.identity, pid=state.identity["pid"] + 1)
    w = _Worker({"tcp://10.0.0.1:4002": {"status": "OK", "identity": peer, "headers": [_header()]}})
    state.worker = w
    assert asyncio.run(_warm.meet(w, "tcp://10.0.0.1:4002")) == "met"
    assert [d.ticket for d in state.received] == [b"\x02" * 16]
    (addr, kw), = w.calls  # fmt: skip
    assert kw["identity"] is state.identity and kw["reciprocate"] is True
    c = T.counters()
    assert c["warm"] == {"met": 1} and c["timings"]["warm"]["n"] == 1
    assert c["received_view"] == 0  # meetings are not chunks
    assert c["met_peers"] == ["tcp://10.0.0.1:4002"]
    # Its receives are timed as warm.<kind>: receive.<kind> stays the chunks'.
    assert state.steps == ["warm"]


def test_a_chunks_receive_is_timed_as_receive(state):
    state.orig_deserialize = lambda h, f: None
    T.deserialize(_header(), [])
    assert state.steps == ["receive"] and T.counters()["met_peers"] == []


@pytest.mark.parametrize(
    "reply, outcome",
    [
        (ValueError("No handler cupy_poolmem_warm found in Worker"), "peer-without-plugin"),
        (OSError("Timed out trying to connect"), "unreachable"),
        ({"status": "skip", "reason": "other-family"}, "other-family"),
        ("garbage", "refused"),
    ],
)
def test_a_meeting_that_does_not_happen_says_why_and_maps_nothing(state, reply, outcome):
    w = _Worker({"tcp://10.0.0.1:4002": reply})
    assert asyncio.run(_warm.meet(w, "tcp://10.0.0.1:4002")) == outcome
    assert state.received == [] and T.counters()["warm"] == {outcome: 1}
    assert T.counters()["met_peers"] == []


def test_a_peer_answering_with_another_identity_is_not_mapped(state):
    other = dict(state.identity, uid=state.identity["uid"] + 1)
    w = _Worker({"a": {"status": "OK", "identity": other, "headers": [_header()]}})
    assert asyncio.run(_warm.meet(w, "a")) == "other-user"
    assert state.received == []


def test_a_failed_mapping_during_a_meeting_is_counted_not_raised(state, monkeypatch):
    def fail(d):
        raise cpm.SharingError("refused")

    monkeypatch.setattr(state.gpu, "receive", fail)
    w = _Worker({"a": {"status": "OK", "identity": state.identity, "headers": [_header()]}})
    assert asyncio.run(_warm.meet(w, "a")) == "failed"
    assert T.counters()["warm"] == {"failed": 1} and T.counters()["met_peers"] == []


def test_a_worker_meets_the_workers_of_its_host_only(state):
    peer = dict(state.identity, pid=1)
    ok = {"status": "OK", "identity": peer, "headers": []}
    workers = {
        "tcp://10.0.0.1:4001": {"host": "10.0.0.1"},  # itself
        "tcp://10.0.0.1:4002": {"host": "10.0.0.1"},
        "tcp://10.0.0.1:4003": {"host": "10.0.0.1"},
        "tcp://10.0.0.2:4001": {"host": "10.0.0.2"},  # another host: never called
    }
    w = _Worker({"tcp://10.0.0.1:4002": ok, "tcp://10.0.0.1:4003": ok}, workers)
    out = asyncio.run(_warm.meet_peers(w))
    assert sorted(out) == ["met", "met"]
    assert sorted(a for a, _ in w.calls) == ["tcp://10.0.0.1:4002", "tcp://10.0.0.1:4003"]


def test_meeting_waits_for_registration_and_gives_up_on_a_closing_worker(state):
    from distributed.core import Status

    w = _Worker({}, {"tcp://10.0.0.1:4002": {"host": "10.0.0.1"}})
    w.status = Status.closing
    assert asyncio.run(_warm.meet_peers(w, poll=0.001)) == []
    assert w.calls == []


def test_serving_a_meeting_exports_blocks_and_meets_the_caller_back(state, monkeypatch):
    monkeypatch.setattr(state.gpu, "export_blocks", lambda: [_header(b"\x09" * 16)])
    w = _Worker(
        {"tcp://10.0.0.1:4009": {"status": "OK", "identity": state.identity, "headers": []}}
    )
    state.worker = w
    caller = dict(state.identity, pid=99)

    async def go():
        r = await _warm.serve(identity=caller, address="tcp://10.0.0.1:4009")
        await asyncio.gather(*list(state.tasks))
        return r

    r = asyncio.run(go())
    assert r["status"] == "OK" and r["identity"] is state.identity
    assert [h["desc"][9] for h in r["headers"]] == [b"\x09" * 16]
    (addr, kw), = w.calls  # fmt: skip
    assert addr == "tcp://10.0.0.1:4009" and kw["reciprocate"] is False  # no ping-pong
    assert T.counters()["warm"] == {"served": 1, "met": 1}


def test_the_served_side_has_met_the_caller_only_once_its_meeting_back_mapped(state, monkeypatch):
    """Serving a meeting counts ``served`` at once; the caller's blocks are mapped by
    the meeting back, later.  A wait on ``warm`` alone returns before it (a chunk
    from the caller then makes the first contact); ``met_peers`` says when it is done."""
    monkeypatch.setattr(state.gpu, "export_blocks", lambda: [])
    caller, addr = dict(state.identity, pid=99), "tcp://10.0.0.1:4009"

    async def go():
        gate = asyncio.Event()

        class Rpc:  # the caller's handler, answering once the gate opens
            def __init__(self, address):
                assert address == addr

            async def cupy_poolmem_warm(self, **kw):
                await gate.wait()
                return {"status": "OK", "identity": caller, "headers": [_header()]}

        state.worker = types.SimpleNamespace(rpc=Rpc)
        assert (await _warm.serve(identity=caller, address=addr))["status"] == "OK"
        served = T.counters()
        gate.set()
        await asyncio.gather(*list(state.tasks))
        return served, T.counters()

    served, done = asyncio.run(go())
    assert served["warm"] == {"served": 1} and served["met_peers"] == []
    assert state.steps == ["warm"]  # mapped by the meeting back, after the gate
    assert done["warm"] == {"served": 1, "met": 1} and done["met_peers"] == [addr]


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"uid": -5}, "other-user"),
        ({"boot": "another-boot"}, "other-host"),
        ({"devices": ["GPU-other"]}, "device-not-visible"),
        ({"proto": 999}, "protocol-mismatch"),
        ({"pid": "x"}, "bad-peer-identity"),
    ],
)
def test_serving_refuses_callers_that_could_not_map_our_blocks(state, monkeypatch, change, reason):
    exported = []
    monkeypatch.setattr(state.gpu, "export_blocks", lambda: exported.append(1) or [])
    state.worker = _Worker({})
    caller = dict(state.identity, **change)
    r = asyncio.run(_warm.serve(identity=caller, address="tcp://x:1"))
    assert r == {"status": "skip", "reason": reason} and exported == []


def test_serving_without_the_path_installed_refuses(state):
    state.identity = None
    assert asyncio.run(_warm.serve(identity={}, address="tcp://x:1"))["reason"] == "disabled"


# -- timings ------------------------------------------------------------------------------------
def test_first_steps_say_what_a_receive_will_cost():
    d = types.SimpleNamespace(address="/s/a", pool_uuid="p", export_data=b"e")
    imp = types.SimpleNamespace(clients={}, pools={}, maps={})
    ctx = types.SimpleNamespace(_exporter=None, _importer=None)
    assert _receiver.first_steps(ctx, d) == "first-contact"
    ctx._importer = imp
    assert _receiver.first_steps(ctx, d) == "first-contact"
    imp.clients["/s/a"] = object()
    assert _receiver.first_steps(ctx, d) == "pool-import"
    imp.maps[("p", b"e")] = object()  # a mapped block of a mapped or expandable pool:
    assert _receiver.first_steps(ctx, d) == "mapped"  # mapped, though no pool is imported
    del imp.maps[("p", b"e")]
    imp.pools["p"] = object()
    assert _receiver.first_steps(ctx, d) == "claim"
    imp.maps[("p", b"e")] = object()
    assert _receiver.first_steps(ctx, d) == "mapped"
    ctx._exporter = types.SimpleNamespace(own_address="/s/a")
    assert _receiver.first_steps(ctx, d) == "own"


def test_a_block_that_travels_as_steps_costs_a_claim_and_no_pool_import():
    """A block of a mapped or expandable pool has no CUDA pool to import: its claim's
    reply carries the steps, so once connected a fresh one is one claim round trip."""
    d = types.SimpleNamespace(address="/s/a", pool_uuid="p", export_data=b"e")
    imp = types.SimpleNamespace(clients={"/s/a": object()}, pools={}, maps={})
    ctx = types.SimpleNamespace(_exporter=None, _importer=imp)
    assert _receiver.first_steps(ctx, d, steps=True) == "claim"
    assert _receiver.first_steps(ctx, d, steps=False) == "pool-import"  # a CUDA pool's
    imp.maps[("p", b"e")] = object()
    assert _receiver.first_steps(ctx, d, steps=True) == "mapped"
    imp.clients.clear()
    assert _receiver.first_steps(ctx, d, steps=True) == "first-contact"


def test_counters_sum_timings_per_step():
    c = T.Counters()
    c.timed("copy", 0.5)
    c.timed("copy", 0.25)
    c.warmed("met")
    out = c.to_dict()
    assert out["timings"]["copy"] == {"n": 2, "total_s": 0.75, "max_s": 0.5}
    assert out["warm"] == {"met": 1}
    c.reset()
    assert c.to_dict()["timings"] == {} and c.to_dict()["warm"] == {}


def test_a_received_chunk_records_its_transit_and_where_it_was_deserialized(state):
    state.orig_deserialize = lambda h, f: None
    h = _header()
    h["sent"] = time.monotonic() - 0.25
    T.deserialize(h, [])
    t = T.counters()["timings"]
    assert t["transit"]["n"] == 1 and t["transit"]["total_s"] >= 0.25
    assert t["deserialize.thread"]["n"] == 1

    async def on_loop():
        T.deserialize(_header(), [])

    asyncio.run(on_loop())
    assert T.counters()["timings"]["deserialize.event-loop"]["n"] == 1
    assert T.counters()["timings"]["transit"]["n"] == 1  # no stamp: no transit


def test_a_chunk_off_the_plugins_pool_after_the_allocator_was_replaced_says_so(
    state, monkeypatch, caplog
):
    import cupy

    from cupy_poolmem import _runtime

    class Chunk:
        nbytes = 2 << 20

    state.orig_serialize = lambda x: ({"orig": True}, [])
    monkeypatch.setattr(state.gpu, "facts", lambda x: (False, GPU_A))
    monkeypatch.setitem(
        _runtime.INSTALLED_ALLOCATORS, "device", object()
    )  # the plugin's, not CuPy's
    ctx = {"recipient": {T.HANDSHAKE_KEY: dict(state.identity, pid=1)}}
    assert cupy.cuda.get_allocator() is not _runtime.installed_allocator("device")
    for _ in range(2):
        assert T.serialize(Chunk(), context=ctx) == ({"orig": True}, [])
    assert T.counters()["fallback"] == {"allocator-replaced": 2}
    warned = [r for r in caplog.records if "not cupy_poolmem's pool" in r.getMessage()]
    assert len(warned) == 1  # once per process
    monkeypatch.setitem(_runtime.INSTALLED_ALLOCATORS, "device", cupy.cuda.get_allocator())
    T.serialize(Chunk(), context=ctx)
    assert T.counters()["fallback"]["not-ipc-memory"] == 1


def test_a_meeting_over_real_comms_brings_descriptors_intact(state, monkeypatch):
    """Two real distributed servers in this process: one serves the meeting, the other
    meets it through a real rpc; the descriptors survive msgpack and are mapped."""
    from distributed.core import Server, rpc

    sent = _header(b"\x07" * 16)
    monkeypatch.setattr(state.gpu, "export_blocks", lambda: [sent])

    async def main():
        server = Server({T.WARM_OP: _warm.serve})
        await server.listen("tcp://127.0.0.1:0")
        state.worker = types.SimpleNamespace(rpc=None)  # serves; never meets back here
        try:
            async with rpc(server.address) as r:
                worker = types.SimpleNamespace(rpc=lambda addr: r)
                return await _warm.meet(worker, server.address, reciprocate=False)
        finally:
            await server.close()

    assert asyncio.run(main()) == "met"
    (d,) = state.received
    assert d.ticket == b"\x07" * 16 and d.export_data == b"\x01" * 64 and d.shape == (1024,)
    assert T.counters()["warm"] == {"served": 1, "met": 1}


def test_a_meeting_with_a_server_without_the_handler_says_so():
    from distributed.core import Server, rpc

    st = _process.TransferState()
    st.identity = T.local_identity([GPU_A])

    async def main():
        server = Server({})
        await server.listen("tcp://127.0.0.1:0")
        try:
            async with rpc(server.address) as r:
                worker = types.SimpleNamespace(rpc=lambda addr: r)
                return await _warm.meet(worker, server.address)
        finally:
            await server.close()

    old, _process.PROCESS.current = _process.PROCESS.current, st
    try:
        assert asyncio.run(main()) == "peer-without-plugin"
    finally:
        _process.PROCESS.current = old


def test_a_worker_writes_its_counters_where_configured_when_it_closes(tmp_path, monkeypatch):
    from cupy_poolmem._sharing._context import SharingContext
    from cupy_poolmem._sharing._settings import SharingSettings

    monkeypatch.setattr(_process.PROCESS, "current", _process.TransferState())
    w = types.SimpleNamespace(address="tcp://127.0.0.1:7", connection_args={}, handlers={})
    d = tmp_path / "counters"
    cfg = T.TransferConfig(warm=False, counters_dir=str(d))
    ctx = SharingContext(SharingSettings())
    assert T.install(w, 0, cfg, [GPU_A], sharing=ctx)
    _process.state().counters.timed("receive.claim", 0.002)
    T.uninstall(w)
    T.uninstall(w)  # once only: the path is gone
    (f,) = list(d.iterdir())
    got = json.loads(f.read_text())
    assert got["address"] == "tcp://127.0.0.1:7" and got["pid"] == os.getpid()
    assert got["timings"]["receive.claim"]["n"] == 1 and got["installed"] is True
    from cupy_poolmem.benchmarks.dask_cuda_local import _read_counters, render_counters

    assert "receive.claim" in render_counters(_read_counters(str(d)))
    with dask.config.set({"distributed.comm.cupy-poolmem.counters-dir": str(d)}):
        assert T.TransferConfig.from_dask_config().counters_dir == str(d)
