"""CPU tests of same-host Dask transfers through pool IPC (``cupy_poolmem._dask_transfer``).

The decision, the handshake identity, the header schema, config, installation on a
worker, and the serializer wrappers running inside distributed's real serialization
(and over its real TCP comms and handshake), against a fake array type whose
export / mapping steps are stubbed.  The GPU side (mapping, device copies) is in
``test_dask_transfer_gpu.py``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle

import pytest

pytest.importorskip("dask", reason="dask is not installed (pip install 'cupy_poolmem[dask]')")
pytest.importorskip(
    "distributed", reason="distributed is not installed (pip install 'cupy_poolmem[dask]')"
)

import dask  # noqa: E402
from distributed.protocol import deserialize, serialize, to_serialize  # noqa: E402
from distributed.protocol.serialize import dask_deserialize, dask_serialize  # noqa: E402

import cupy_poolmem as cpm  # noqa: E402
import cupy_poolmem.dask as cdask  # noqa: E402
from cupy_poolmem import _dask_transfer as T  # noqa: E402
from cupy_poolmem._dask_transfer import _process, _receiver, _sender  # noqa: E402
from cupy_poolmem._dask_transfer._steps import GpuSteps  # noqa: E402
from cupy_poolmem._sharing import _wire  # noqa: E402
from cupy_poolmem._sharing._wire import ProtocolError  # noqa: E402

GPU_A, GPU_B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb"


class FakeArray:
    """Stands for a ``cupy.ndarray``: its bytes, and whether its pool is IPC-enabled."""

    def __init__(self, payload: bytes, shareable: bool = True, device: str = GPU_A) -> None:
        self.payload, self.shareable, self.device = payload, shareable, device

    @property
    def nbytes(self) -> int:
        return len(self.payload)


def _orig_serialize(x):
    return {"fake-original": True}, [memoryview(bytes(x.payload))]


def _orig_deserialize(header, frames):
    assert header.get("fake-original"), header
    return FakeArray(bytes(frames[0]))


def _descriptor(size: int = 4096, **kw) -> _wire.Descriptor:
    fields = dict(
        version=_wire.VERSION,
        kind="cupy",
        address="/tmp/cupy_poolmem-x/s",
        pool_uuid="pool-1",
        device_uuid=GPU_A,
        pool_kind=_wire.POOL_DEVICE,
        export_id=7,
        export_data=b"\x01" * 64,
        size=size,
        ticket=b"\x02" * 16,
        event=b"\x03" * 64,
        offset=0,
        shape=(size // 4,),
        strides=(4,),
        dtype="<f4",
        life=1,
    )
    fields.update(kw)
    return _wire.Descriptor(**fields)


class Path:
    """The installed path of one test: its state, and what the stubs saw."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.state = _process.TransferState()
        monkeypatch.setattr(_process.PROCESS, "current", self.state)
        # The GPU steps, stubbed: what the chunk's memory is, its export and its mapping.
        self.gpu = self.state.gpu = GpuSteps(self.state)
        self.state.orig_serialize = _orig_serialize
        self.state.orig_deserialize = _orig_deserialize
        self.state.config = T.TransferConfig(ipc=True, min_bytes=1024)
        self.state.identity = T.local_identity([GPU_A, GPU_B])
        self.state.address = "tcp://127.0.0.1:40001"
        self.exported: list[FakeArray] = []
        self.received: list[_wire.Descriptor] = []
        self.desc = _descriptor()
        self.receive_error: BaseException | None = None
        self.refetched: list[tuple[str, dict]] = []
        self.gpu.facts = lambda x: (x.shareable, x.device)
        self.gpu.contiguous = lambda x: x
        self.gpu.export = self._export
        self.gpu.receive = self._receive
        self.gpu.refetch = self._refetch

    def _export(self, x):
        self.exported.append(x)
        return tuple(self.desc)

    def _receive(self, d):
        if self.receive_error is not None:
            raise self.receive_error
        self.received.append(d)
        return FakeArray(b"mapped:" + d.ticket), "view"

    def _refetch(self, sender, header, cause):
        self.refetched.append((sender, header))
        return FakeArray(b"refetched")

    def recipient(self, **changes) -> dict:
        ident = dict(self.state.identity, **changes)
        return {"recipient": {T.HANDSHAKE_KEY: ident, "compression": None}}


dask_serialize.register(FakeArray, T.serialize)
dask_deserialize.register(FakeArray, T.deserialize)


@pytest.fixture
def path(monkeypatch):
    return Path(monkeypatch)


# -- the package -------------------------------------------------------------------------------
def test_the_package_reexports_its_parts_and_has_no_second_name_for_the_state():
    for name in T.__all__:
        obj = getattr(T, name)
        if callable(obj) and hasattr(obj, "__module__"):
            assert obj.__module__.startswith("cupy_poolmem._dask_transfer._"), name
    # The state has one owner, read at call time: a test gives _process.PROCESS another
    # state, and an alias on the package would keep the old one.
    assert not hasattr(T, "_state") and not hasattr(T, "_State")
    assert T.serialize is _sender.serialize and T.deserialize is _receiver.deserialize


# -- config --------------------------------------------------------------------------------
def test_config_defaults_are_in_dasks_config_under_distributed_comm():
    assert dask.config.get("distributed.comm.cupy-poolmem.ipc") is True
    assert dask.config.get("distributed.comm.cupy-poolmem.min-bytes") == "1MiB"
    cfg = T.TransferConfig.from_dask_config()
    assert (cfg.ipc, cfg.min_bytes, cfg.refetch_timeout) == (True, 2**20, 120.0)
    assert cdask.TRANSFER_CONFIG_DEFAULTS == T.CONFIG_DEFAULTS


@pytest.mark.parametrize(
    "value,expected", [(False, False), ("false", False), ("0", False), ("on", True), (1, True)]
)
def test_config_ipc_switch_reads_env_style_values(value, expected):
    with dask.config.set({"distributed.comm.cupy-poolmem.ipc": value}):
        assert T.TransferConfig.from_dask_config().ipc is expected


def test_config_keys_from_environment_variables_are_read_with_underscores(tmp_path):
    # DASK_DISTRIBUTED__COMM__CUPY_POOLMEM__MIN_BYTES gives the key "min_bytes"; Dask
    # treats it as "min-bytes", and so must we (it was refused as unknown).
    env = {
        "DASK_DISTRIBUTED__COMM__CUPY_POOLMEM__MIN_BYTES": "4MiB",
        "DASK_DISTRIBUTED__COMM__CUPY_POOLMEM__COUNTERS_DIR": str(tmp_path),
    }
    with dask.config.set(dask.config.collect_env(env)):
        cfg = T.TransferConfig.from_dask_config()
    assert cfg.min_bytes == 4 * 2**20
    assert cfg.counters_dir == str(tmp_path)
    with dask.config.set(
        {"distributed.comm.cupy-poolmem": {"min-bytes": "1MiB", "min_bytes": "8MiB"}}
    ):
        assert T.TransferConfig.from_dask_config().min_bytes == 8 * 2**20


def test_config_errors_name_the_key():
    with dask.config.set({"distributed.comm.cupy-poolmem.ipc": "maybe"}):
        with pytest.raises(cpm.OptionTypeError, match=r"cupy-poolmem\.ipc='maybe'"):
            T.TransferConfig.from_dask_config()
    with dask.config.set({"distributed.comm.cupy-poolmem.min-bytes": "lots"}):
        with pytest.raises(cpm.InvalidOptionError, match="min-bytes"):
            T.TransferConfig.from_dask_config()
    with dask.config.set({"distributed.comm.cupy-poolmem.refetch-timeout": -1}):
        with pytest.raises(cpm.InvalidOptionError, match="refetch-timeout"):
            T.TransferConfig.from_dask_config()
    with dask.config.set({"distributed.comm.cupy-poolmem.minbytes": 5}):
        with pytest.raises(cpm.InvalidOptionError, match="unknown dask config key"):
            T.TransferConfig.from_dask_config()
    cfg = T.TransferConfig(min_bytes="4MiB", refetch_timeout="2 minutes")
    assert (cfg.min_bytes, cfg.refetch_timeout) == (4 * 2**20, 120.0)


# -- identity --------------------------------------------------------------------------------
def test_identity_carries_host_user_family_and_devices_never_the_authkey():
    ident = T.local_identity([GPU_A])
    assert ident["proto"] == T.PROTOCOL and ident["devices"] == [GPU_A]
    assert ident["boot"] == T.boot_id() and len(ident["boot"]) >= 32  # Linux boot id
    key = bytes(multiprocessing.current_process().authkey)
    assert key.hex() not in repr(ident) and len(ident["family"]) == 32
    assert T.check_identity(ident) is ident


def test_identity_family_changes_with_the_authkey(monkeypatch):
    before = T.local_identity([])["family"]
    monkeypatch.setattr(multiprocessing.current_process(), "authkey", b"another family")
    assert T.local_identity([])["family"] != before


@pytest.mark.parametrize(
    "change",
    [
        {"proto": "1"},
        {"uid": True},
        {"boot": None},
        {"devices": "GPU-a"},
        {"devices": [1, 2]},
        {"family": b"x"},
    ],
)
def test_malformed_identities_are_refused(change):
    ident = dict(T.local_identity([GPU_A]), **change)
    assert T.check_identity(ident) is None
    assert T.check_identity(["not", "a", "dict"]) is None
    missing = T.local_identity([GPU_A])
    del missing["pid"]
    assert T.check_identity(missing) is None


# -- the decision ----------------------------------------------------------------------------
def _decide(me, ctx, nbytes=2**20, cfg=None, facts=(True, GPU_A)):
    called = []

    def f():
        called.append(1)
        return facts

    reason = T.decide(me, cfg or T.TransferConfig(), ctx, nbytes, f)
    return reason, bool(called)


def test_decide_takes_ipc_only_for_a_capable_same_host_peer():
    me = T.local_identity([GPU_A, GPU_B])
    ok = {"recipient": {T.HANDSHAKE_KEY: dict(me, pid=me["pid"] + 1, devices=[GPU_A])}}
    assert _decide(me, ok) == ("ipc", True)

    def peer(**c):
        return {"recipient": {T.HANDSHAKE_KEY: dict(me, **c)}}

    cases = [
        (None, ok, "disabled"),
        (me, None, "no-recipient"),
        (me, {"sender": {}}, "no-recipient"),
        (me, {"recipient": {"compression": None}}, "peer-without-plugin"),
        (me, {"recipient": {T.HANDSHAKE_KEY: {"proto": 1}}}, "bad-peer-identity"),
        (me, peer(proto=T.PROTOCOL + 1), "protocol-mismatch"),
        (me, peer(boot="another-boot-id"), "other-host"),
        (dict(me, boot=""), ok, "other-host"),  # this host's boot id unknown: never IPC
        (me, peer(uid=me["uid"] + 1), "other-user"),
        (me, peer(family="f" * 32), "other-family"),
    ]
    for who, ctx, want in cases:
        reason, asked = _decide(who, ctx)
        assert reason == want, (who, ctx)
        assert not asked, f"{want}: facts() was called before the peer check"
    assert _decide(me, ok, cfg=T.TransferConfig(ipc=False)) == ("disabled", False)
    assert _decide(me, ok, nbytes=1000, cfg=T.TransferConfig(min_bytes=1024)) == ("small", False)
    assert _decide(me, ok, nbytes=0, cfg=T.TransferConfig(min_bytes=0)) == ("small", False)
    assert _decide(me, ok, facts=(False, GPU_A)) == ("not-ipc-memory", True)
    assert _decide(me, ok, facts=(True, GPU_B)) == ("device-not-visible", True)
    assert _decide(me, {T.HANDSHAKE_KEY + "-refetch": True}) == ("refetch", False)
    assert set(T.REASONS) >= {c[2] for c in cases}


# -- the header ------------------------------------------------------------------------------
def _through_msgpack(obj):
    import msgpack
    from distributed.protocol.utils import msgpack_opts

    return msgpack.loads(msgpack.dumps(obj, use_bin_type=True), use_list=False, **msgpack_opts)


def test_header_round_trips_through_msgpack_and_is_checked():
    d = _descriptor()
    h = _through_msgpack(T.make_header(tuple(d), "tcp://10.1.2.3:4567"))
    d2, sender = T.parse_header(h)
    assert d2 == d and sender == "tcp://10.1.2.3:4567"
    # lists (msgpack's default) are read too
    h2 = T.make_header(tuple(d), "tcp://h:1")
    h2["desc"] = [list(v) if isinstance(v, tuple) else v for v in h2["desc"]]
    assert T.parse_header(h2)[0] == d


def test_contiguous_layouts_of_every_order_are_accepted():
    for offset, shape, strides in [
        (0, (4, 4), (4, 1)),
        (0, (4, 4), (1, 4)),
        (0, (4, 1, 2), (2, 99, 1)),  # an axis of length 1 may have any stride
        (0, (0, 3), (-5, 7)),  # empty
        (5, (), ()),
    ]:
        h = T.make_header(tuple(_descriptor()), "tcp://h:1")
        _layout(h, offset, shape, strides)
        assert T.parse_header(h)[0].strides == strides


def _layout(h, offset, shape, strides):
    h["desc"][11:14] = [offset, shape, strides]
    h["desc"][14] = "|u1"


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda h: h.update({T.HEADER_KEY: 99}), "protocol 99"),
        (lambda h: h.update({T.HEADER_KEY: True}), "protocol True"),
        (lambda h: h.pop("sender"), "sender=None"),
        (lambda h: h.update(sender="10.0.0.1:80"), "sender="),
        (lambda h: h.update(desc=h["desc"][:-1]), "15 fields"),
        (lambda h: h.update(desc="abc"), "desc of str"),
        (lambda h: h["desc"].__setitem__(9, b"short"), "ticket="),
        (lambda h: h["desc"].__setitem__(12, (10**9,)), "does not fit"),
        (lambda h: h["desc"].__setitem__(14, "|O"), "dtype="),
        (lambda h: h["desc"].__setitem__(15, -1), "life="),
        (lambda h: h["desc"].__setitem__(0, 1), "different cupy_poolmem version"),
        # (a host array on a device pool: check_descriptor refuses it first)
        (lambda h: h["desc"].__setitem__(1, "numpy"), "kind='numpy'"),
        (lambda h: h["desc"].__setitem__(4, ""), "not device memory"),
        # within the block, but not one run of bytes: the cross-GPU copy would misread it
        (lambda h: _layout(h, 10, (3,), (-1,)), "not a contiguous chunk"),
        (lambda h: _layout(h, 0, (4, 4), (8, 1)), "not a contiguous chunk"),
        (lambda h: _layout(h, 0, (8,), (2,)), "not a contiguous chunk"),
    ],
)
def test_malformed_headers_raise_protocol_errors_before_anything_is_mapped(mutate, match):
    h = T.make_header(tuple(_descriptor()), "tcp://h:1")
    mutate(h)
    with pytest.raises(ProtocolError, match=match):
        T.parse_header(h)
    with pytest.raises(ProtocolError, match="not a mapping"):
        T.parse_header(["x"])


# -- the serializers inside distributed's serialization --------------------------------------
def test_capable_peer_gets_a_descriptor_only(path):
    x = FakeArray(b"x" * 4096)
    header, frames = serialize(x, serializers=("dask", "pickle"), context=path.recipient())
    assert frames == [] and header["serializer"] == "dask"
    assert T.HEADER_KEY in header["sub-header"] and path.exported == [x]
    y = deserialize(header, frames)
    assert y.payload == b"mapped:" + path.desc.ticket and path.received == [path.desc]
    c = T.counters()
    assert (c["sent_ipc"], c["sent_ipc_bytes"], c["received_view"]) == (1, 4096, 1)
    assert c["fallback"] == {} and c["installed"] and c["ipc"]


@pytest.mark.parametrize(
    "context,reason",
    [
        (None, "no-recipient"),
        ({"recipient": {"compression": None}}, "peer-without-plugin"),
        ("boot", "other-host"),
        ("uid", "other-user"),
    ],
)
def test_everything_else_takes_dasks_own_path_with_the_data(path, context, reason):
    if context == "boot":
        context = path.recipient(boot="0" * 36)  # a peer that booted elsewhere
    elif context == "uid":
        context = path.recipient(uid=path.state.identity["uid"] + 1)
    x = FakeArray(b"abc" * 1000)
    header, frames = serialize(x, serializers=("dask", "pickle"), context=context)
    assert T.HEADER_KEY not in header["sub-header"] and path.exported == []
    assert deserialize(header, frames).payload == x.payload  # the original, unchanged
    assert path.received == []
    c = T.counters()
    assert c["sent_ipc"] == 0 and c["fallback"] == {reason: 1}


def test_memory_not_on_an_ipc_pool_and_small_chunks_fall_back(path):
    for x, reason in (
        (FakeArray(b"a" * 4096, shareable=False), "not-ipc-memory"),
        (FakeArray(b"a" * 100), "small"),
        (FakeArray(b"a" * 4096, device="GPU-other"), "device-not-visible"),
    ):
        header, frames = serialize(x, serializers=("dask",), context=path.recipient())
        assert deserialize(header, frames).payload == x.payload
        assert T.counters()["fallback"][reason] == 1
    assert path.exported == []


def test_a_failed_export_falls_back_to_dasks_path(path, monkeypatch):
    def boom(x):
        raise cpm.SharingError("exporter unavailable")

    monkeypatch.setattr(path.gpu, "export", boom)
    x = FakeArray(b"z" * 2048)
    header, frames = serialize(x, serializers=("dask",), context=path.recipient())
    assert deserialize(header, frames).payload == x.payload
    assert T.counters()["fallback"] == {"export-failed": 1}


def test_a_receiver_that_cannot_map_fetches_the_chunk_again(path):
    x = FakeArray(b"q" * 4096)
    header, frames = serialize(x, serializers=("dask",), context=path.recipient())
    path.receive_error = cpm.SharingError("the driver refused the mapping")
    y = deserialize(header, frames)
    assert y.payload == b"refetched"
    ((sender, sub),) = path.refetched
    assert sender == path.state.address and T.parse_header(sub)[0] == path.desc
    c = T.counters()
    assert c["refetched"] == 1 and c["received_view"] == 0


def test_a_malformed_header_is_not_refetched_but_refused(path):
    x = FakeArray(b"q" * 4096)
    header, frames = serialize(x, serializers=("dask",), context=path.recipient())
    header["sub-header"]["desc"] = header["sub-header"]["desc"][:3]
    with pytest.raises(ProtocolError, match="malformed"):
        deserialize(header, frames)
    assert path.refetched == [] and path.received == []


# -- over distributed's real TCP comms and handshake ------------------------------------------
async def _send_over_tcp(x, handshake_overrides):
    from distributed.comm import connect, listen

    async def handle(comm):  # the side that has the data writes on the accepted comm
        await comm.write({"op": "data", "data": {"k": to_serialize(x)}})
        await comm.read()
        await comm.close()

    listener = listen("tcp://127.0.0.1:0", handle)
    await listener.start()
    try:
        comm = await connect(listener.contact_address, handshake_overrides=handshake_overrides)
        try:
            msg = await comm.read()
            await comm.write("OK")
        finally:
            await comm.close()
    finally:
        listener.stop()
    return msg["data"]["k"]


def test_the_recipients_handshake_decides_over_real_tcp_comms(path):
    ident = dict(path.state.identity)
    x = FakeArray(b"w" * 8192)
    got = asyncio.run(_send_over_tcp(x, {T.HANDSHAKE_KEY: ident}))
    assert got.payload == b"mapped:" + path.desc.ticket
    assert T.counters()["sent_ipc"] == 1 and path.received == [path.desc]

    got = asyncio.run(_send_over_tcp(x, None))  # a connecting peer without the plugin
    assert got.payload == x.payload
    got = asyncio.run(_send_over_tcp(x, {T.HANDSHAKE_KEY: dict(ident, boot="elsewhere")}))
    assert got.payload == x.payload
    c = T.counters()
    assert c["sent_ipc"] == 1 and c["received_view"] == 1
    assert c["fallback"] == {"peer-without-plugin": 1, "other-host": 1}


# -- the refetch, against a real distributed Server -------------------------------------------
def test_refetch_reply_serves_the_senders_block_through_dasks_path(path, monkeypatch):
    held = FakeArray(b"r" * 4096)
    monkeypatch.setattr(path.gpu, "local_array", lambda d: held)
    reply = _sender.refetch_reply(T.make_header(tuple(path.desc), "tcp://h:1"))
    assert reply["status"] == "OK" and T.counters()["refetch_served"] == 1
    assert T.counters()["fallback"] == {"refetch": 1}  # never a second IPC attempt
    assert deserialize(reply["data"].header, reply["data"].frames).payload == held.payload
    monkeypatch.setattr(path.gpu, "local_array", lambda d: None)
    assert _sender.refetch_reply(T.make_header(tuple(path.desc), "tcp://h:1"))["status"] == "gone"


def test_refetch_over_a_real_server(path, monkeypatch):
    import contextlib

    from distributed.core import Server

    monkeypatch.setattr(path.gpu, "refetch", _receiver.refetch)
    monkeypatch.setattr(path.gpu, "worker_device", contextlib.nullcontext)
    held = FakeArray(b"s" * 5000)
    monkeypatch.setattr(path.gpu, "local_array", lambda d: held)
    header = T.make_header(tuple(path.desc), "tcp://unused:1")

    async def main():
        server = Server({T.REFETCH_OP: _sender.serve_refetch})
        await server.listen("tcp://127.0.0.1:0")
        try:
            return await asyncio.to_thread(
                _receiver.refetch, server.address, header, RuntimeError("map failed")
            )
        finally:
            await server.close()

    got = asyncio.run(main())
    assert got.payload == held.payload and T.counters()["refetch_served"] == 1


def test_refetch_from_a_gone_sender_raises_a_connection_error(path, monkeypatch):
    monkeypatch.setattr(path.gpu, "refetch", _receiver.refetch)
    path.state.config = T.TransferConfig(refetch_timeout=1)
    header = T.make_header(tuple(path.desc), "tcp://127.0.0.1:1")
    with pytest.raises(cpm.TransferError, match="could not be mapped .*map failed") as err:
        _receiver.refetch("tcp://127.0.0.1:1", header, RuntimeError("map failed"))
    assert isinstance(err.value, ConnectionError)  # Dask: the sender is unreachable


# -- installation on a worker ----------------------------------------------------------------
class FakeRpc:
    def __init__(self, connection_args):
        self.connection_args = connection_args


class FakeWorker:
    def __init__(self):
        self.address = "tcp://127.0.0.1:40002"
        self.connection_args = {"require_encryption": False}
        self.rpc = FakeRpc(self.connection_args)  # distributed shares the dict
        self.handlers = {"get_data": object()}


def test_install_adds_identity_handler_and_serializers_and_uninstall_removes_them(monkeypatch):
    import cupy  # the real registration: cupy imports without a GPU
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    monkeypatch.setattr(_process.PROCESS, "current", _process.TransferState())
    w = FakeWorker()
    w.connection_args["handshake_overrides"] = {"pickle-protocol": 4}
    orig_ser = dask_serialize.dispatch(cupy.ndarray)
    try:
        assert T.install(w, 0, T.TransferConfig(), devices=[GPU_A])
        assert T.install(w, 0, T.TransferConfig(), devices=[GPU_A])  # idempotent
        ho = w.rpc.connection_args["handshake_overrides"]
        assert ho["pickle-protocol"] == 4 and ho[T.HANDSHAKE_KEY]["devices"] == [GPU_A]
        assert w.handlers[T.REFETCH_OP] is _sender.serve_refetch
        assert dask_serialize.dispatch(cupy.ndarray) is T.serialize
        assert dask_deserialize.dispatch(cupy.ndarray) is T.deserialize
        assert _process.state().orig_serialize is orig_ser  # not ourselves, after two installs
        assert _process.state().address == w.address and T.counters()["installed"]

        T.uninstall(w)
        T.uninstall(w)
        assert w.connection_args["handshake_overrides"] == {"pickle-protocol": 4}
        assert T.REFETCH_OP not in w.handlers and "get_data" in w.handlers
        assert dask_serialize.dispatch(cupy.ndarray) is orig_ser
        # the reader stays: a comm made while the path was advertised may still bring one
        assert dask_deserialize.dispatch(cupy.ndarray) is T.deserialize
        assert not T.counters()["installed"]
    finally:
        dask_serialize.register(cupy.ndarray, orig_ser)


def test_install_with_ipc_off_installs_nothing(monkeypatch):
    monkeypatch.setattr(_process.PROCESS, "current", _process.TransferState())
    w = FakeWorker()
    assert not T.install(w, 0, T.TransferConfig(ipc=False), devices=[GPU_A])
    assert "handshake_overrides" not in w.connection_args and T.REFETCH_OP not in w.handlers
    assert T.counters() == dict(T.Counters().to_dict(), installed=False, ipc=False, met_peers=[])


def test_plugin_teardown_uninstalls_the_transfer_path(monkeypatch):
    calls = []
    monkeypatch.setattr(T, "install", lambda w, dev: calls.append(("install", w, dev)) or True)
    monkeypatch.setattr(T, "uninstall", lambda w: calls.append(("uninstall", w)))
    plugin = cdask.PoolmemPlugin()
    w = FakeWorker()
    plugin._restore(w)  # teardown path, no pools: the transfer path still goes
    assert calls == [("uninstall", w)]


# -- the exporter reads a block whose ticket a receiver gave back ------------------------------
@pytest.fixture
def world(sharing_world):
    return sharing_world


def test_hold_live_reads_a_live_block_after_a_drop(world):
    from cupy_poolmem._sharing._reducers import describe

    a, b = world.proc("a"), world.proc("b")
    blk = a.pool().alloc(256, payload="chunk")
    d = describe(a.ctx, blk, "cupy", 0, (256,), (1,), "|u1")
    b.importer.give_back(d)  # the receiver could not take it: Drop
    assert _wait(lambda: a.stats()["tickets_out"] == 0)
    with pytest.raises(cpm.SharingError):
        a.exporter.take_local(d.export_id, d.ticket)
    hold = a.exporter.hold_live(d.export_id, d.export_data, d.life)
    assert hold is not None and a.read(hold)[1] == "chunk"
    assert a.exporter.hold_live(d.export_id, b"\x09" * 64, d.life) is None  # another record
    assert a.exporter.hold_live(d.export_id + 1, d.export_data, d.life) is None
    assert a.exporter.hold_live(d.export_id, d.export_data, d.life + 1) is None  # other life
    del hold


def _wait(cond, timeout=5.0):
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_fake_array_is_picklable_by_reference():
    # distributed's "type-serialized" pickles the class by reference
    assert pickle.loads(pickle.dumps(FakeArray)) is FakeArray
