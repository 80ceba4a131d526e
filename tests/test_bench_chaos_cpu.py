"""The chaos run's parts that need no GPU: options, scenarios, checks, leaks, summary line.

The run itself (``python -m cupy_poolmem bench chaos``) needs a GPU:
tests/test_bench_chaos_gpu.py runs a few rounds of it.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import subprocess
import sys

import numpy as np
import pytest

import cupy_poolmem
from cupy_poolmem.benchmarks import BENCHMARKS, DEFAULT, chaos

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))
NO_GPU = cupy_poolmem.device_count() == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, env=env
    )


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# -- options ---------------------------------------------------------------------------------------
def test_chaos_is_a_named_benchmark_not_a_default_one():
    assert BENCHMARKS["chaos"][0] == "chaos"
    assert "chaos" not in DEFAULT


def test_options_and_their_defaults():
    o = chaos.build_parser().parse_args([])
    assert (o.seed, o.rounds, o.time_cap, o.workers, o.first_round) == (1, 300, 900, 4, 0)
    o = chaos.build_parser().parse_args(["--seed", "7", "--rounds", "5", "--time-cap", "60"])
    assert (o.seed, o.rounds, o.time_cap) == (7, 5, 60)


def test_bench_forwards_the_chaos_options_it_was_given_and_no_others():
    from cupy_poolmem.__main__ import build_parser

    ns = build_parser().parse_args(["bench", "chaos", "--seed", "7", "--rounds", "20"])
    argv = chaos.forward_args(ns)
    assert argv == ["--seed", "7", "--rounds", "20"]
    o = chaos.build_parser().parse_args(argv)
    assert (o.seed, o.rounds, o.time_cap, o.workers) == (7, 20, 900, 4)
    assert chaos.forward_args(build_parser().parse_args(["bench", "alloc"])) == []


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--rounds", "0"], "--rounds: must be >= 1; got 0"),
        (["--seed", "-1"], "--seed: must be >= 0; got -1"),
        (["--workers", "1"], "--workers: must be >= 2; got 1"),
        (["--time-cap", "soon"], "'soon' is not an integer"),
    ],
)
def test_bad_option_values_are_one_line_errors(args, needle):
    one_line_error(run_cli("cupy_poolmem", "bench", "chaos", *args), needle)
    one_line_error(run_cli("cupy_poolmem.benchmarks.chaos", *args), needle)


def test_chaos_options_without_the_chaos_benchmark_are_refused():
    line = one_line_error(
        run_cli("cupy_poolmem", "bench", "alloc", "--seed", "3"), "--seed", "chaos"
    )
    assert "bench chaos --seed 3" in line


@pytest.mark.skipif(not NO_GPU, reason="checks the behaviour without a GPU")
def test_chaos_without_a_gpu_says_so():
    one_line_error(run_cli("cupy_poolmem", "bench", "chaos", "--rounds", "2"), "GPU")


# -- scenarios ---------------------------------------------------------------------------------------
def test_a_round_is_the_same_for_one_seed_and_differs_between_seeds():
    assert chaos.make_plan(1, 17, 4) == chaos.make_plan(1, 17, 4)
    plans = {chaos.make_plan(s, 17, 4) for s in range(20)}
    assert len(plans) > 15
    assert chaos.make_plan(1, 17, 4) != chaos.make_plan(1, 18, 4)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 12345])
def test_300_rounds_draw_every_event_kind(seed):
    seen: set[str] = set()
    for i in range(300):
        seen |= chaos.kinds_of(chaos.make_plan(seed, i, 4))
    assert seen == set(chaos.EVENT_KINDS), set(chaos.EVENT_KINDS) - seen


def test_every_forgery_is_drawn():
    fields = {
        e.detail for i in range(1000) for e in chaos.make_plan(1, i, 4).events if e.kind == "forge"
    }
    assert fields == set(chaos.FORGERIES)


@pytest.mark.parametrize("n_workers", [2, 4, 6])
def test_plans_only_name_what_exists_and_follow_their_rules(n_workers):
    for i in range(400):
        plan = chaos.make_plan(5, i, n_workers)
        assert plan.number == i and 1 <= len(plan.batches) <= 3
        slots = set(range(n_workers))
        producers = [b.producer for b in plan.batches]
        assert len(set(producers)) == len(producers)
        for b in plan.batches:
            assert b.producer in slots | {chaos.HUB}
            assert b.sizes and all(n in chaos.SIZES for n in b.sizes)
            assert b.then in ("hold", "drop", "recycle", "return", "close")
            if b.then == "close":
                assert b.producer == chaos.HUB and all(r.action == "hold" for r in b.routes)
            if b.then == "return":
                assert b.producer != chaos.HUB
            if b.then == "recycle":  # every copy goes, so that the block can recycle
                assert {(r.array, r.copy) for r in b.routes} == {
                    (a, c) for a in range(len(b.sizes)) for c in range(b.copies)
                }
            for r in b.routes:
                assert 0 <= r.array < len(b.sizes) and 0 <= r.copy < b.copies
                assert r.consumer in slots | {chaos.HUB} and r.action in chaos.ACTIONS
                assert r.forward_to in slots and r.forward_to != r.consumer
                if r.consumer == chaos.HUB:
                    assert b.producer != chaos.HUB and r.action in ("drop", "hold")
            assert {r.array for r in b.routes if r.copy == 0} == set(range(len(b.sizes)))
        for e in plan.events:
            assert e.kind in chaos.EVENT_KINDS
            assert e.target in slots | {chaos.HUB}
            if e.kind == "kill_producer":
                (b,) = [b for b in plan.batches if b.producer == e.target]
                assert b.then != "return"
            if e.kind == "forge":
                assert e.detail in chaos.FORGERIES
                assert any(b.then == "hold" for b in plan.batches)
            if e.kind == "replay_stale":
                assert any(b.then == "recycle" for b in plan.batches)


def test_pattern_bases_are_distinct_and_leave_room_for_every_index():
    keys = [
        (r, b, a, life) for r in range(50) for b in range(3) for a in range(3) for life in (0, 1)
    ]
    bases = [chaos.pattern_base(1, k) for k in keys]
    assert len(set(bases)) == len(bases)
    assert all(b % (1 << 20) == 0 and 0 < b < 2**61 for b in bases)
    assert max(chaos.SIZES) < 1 << 20  # base + i never reaches the next base
    assert chaos.pattern_base(1, keys[0]) == bases[0] != chaos.pattern_base(2, keys[0])


# -- checking what a receiver got ---------------------------------------------------------------------
def _sent(base=1 << 20, n=512):
    return np.arange(base, base + n, dtype=np.int64)


def test_a_plain_message_checks_every_element():
    x = _sent()
    assert chaos.verify(x, (8,), 0, x.nbytes, chaos.Plain(1 << 20, 512)) == ("ok", "")
    y = x.copy()
    y[300] += 1
    outcome, detail = chaos.verify(y, (8,), 0, x.nbytes, chaos.Plain(1 << 20, 512))
    assert outcome == "wrong" and "[300]" in detail and "1 of 512" in detail
    # another life's data of the same block: every element differs
    z = _sent(base=2 << 20)
    assert chaos.verify(z, (8,), 0, x.nbytes, chaos.Plain(1 << 20, 512))[0] == "wrong"
    assert chaos.verify(x[:10], (8,), 0, x.nbytes, chaos.Plain(1 << 20, 512))[0] == "wrong"
    assert (
        chaos.verify(x.view(np.float64), (8,), 0, x.nbytes, chaos.Plain(1 << 20, 512))[0] == "wrong"
    )


def _forged_view(x, offset, shape, strides, dtype="<i8"):
    """The bytes a receiver would see through a forged view of block ``x``."""
    v = np.ndarray(shape, np.dtype(dtype), buffer=x.tobytes(), offset=offset, strides=strides)
    return np.ascontiguousarray(v)


def test_a_forged_view_inside_the_block_must_show_the_block_bytes():
    x = _sent()
    expect = chaos.Forged(1 << 20, 512, 0, x.nbytes, "strides-reversed")
    rev = _forged_view(x, 8 * 511, (512,), (-8,))
    assert chaos.verify(rev, (-8,), 8 * 511, x.nbytes, expect) == ("ok", "")
    part = _forged_view(x, 80, (100,), (8,))
    assert chaos.verify(part, (8,), 80, x.nbytes, expect)[0] == "ok"
    as_float = _forged_view(x, 0, (512,), (8,), "<f8")  # NaN-safe: compared as bytes
    assert chaos.verify(as_float, (8,), 0, x.nbytes, expect)[0] == "ok"
    other = part.copy()
    other[5] = -1
    assert chaos.verify(other, (8,), 80, x.nbytes, expect)[0] == "wrong"


def test_a_forged_view_outside_or_past_the_block_is_wrong_data_whatever_it_shows():
    x = _sent()
    expect = chaos.Forged(1 << 20, 512, 0, x.nbytes, "size+shape")
    big = np.zeros(512 * 64, dtype=np.int64)
    outcome, detail = chaos.verify(big, (8,), 0, 64 * x.nbytes, expect)
    assert outcome == "wrong" and "outside its block" in detail
    past = np.zeros(512, dtype=np.int64)
    assert chaos.verify(past, (8,), 2 * x.nbytes, 64 * x.nbytes, expect)[0] == "wrong"
    before = np.zeros(2, dtype=np.int64)
    assert chaos.verify(before, (-8,), 0, x.nbytes, expect)[0] == "wrong"  # reads [-8, 8)
    # the array's own bytes, on memory that claims 64 times the block: mapped past it
    outcome, detail = chaos.verify(x, (8,), 0, 64 * x.nbytes, expect)
    assert outcome == "wrong" and "past its block" in detail


class _Unreadable:
    """A backend whose arrays must not be read (their geometry may be asked)."""

    def __init__(self, geometry):
        self.geo = geometry

    def geometry(self, arr):
        return self.geo

    def view(self, arr):
        raise AssertionError("read an array that reaches outside its block")


def test_an_array_reaching_outside_its_block_is_not_read():
    expect = chaos.Forged(1 << 20, 512, 0, 4096, "size+shape")
    past = _Unreadable(((512 * 64,), (8,), 8, 0, 64 * 4096))
    outcome, detail = chaos.worker.check_received(past, object(), expect)
    assert outcome == "wrong" and "outside its block" in detail
    before = _Unreadable(((4,), (-8,), 8, 8, 4096))
    assert chaos.worker.check_received(before, object(), expect)[0] == "wrong"
    assert chaos.outside((0,), (8,), 8, 1 << 30, 4096, expect) == ""  # empty: reads nothing
    assert chaos.outside((512,), (8,), 8, 0, 4096, expect) == ""


def test_a_forged_view_over_bytes_nobody_wrote_is_unchecked():
    # a 4096-byte block holding 4000 bytes of array
    expect = chaos.Forged(1 << 20, 500, 0, 4096, "shape-larger")
    v = np.zeros(512, dtype=np.int64)
    assert chaos.verify(v, (8,), 0, 4096, expect)[0] == "unchecked"
    empty = np.zeros(0, dtype=np.int64)
    assert chaos.verify(empty, (8,), 0, 4096, expect) == ("ok", "")


# -- forging and peeking at messages -------------------------------------------------------------------
def _descriptor():
    from cupy_poolmem._sharing import _wire

    return _wire.Descriptor(
        _wire.VERSION,
        "cupy",
        "/nonexistent/sharing-socket",
        "pool-uuid",
        "GPU-uuid",
        _wire.POOL_DEVICE,
        3,
        bytes(range(64)),
        4096,
        bytes(16),
        None,
        0,
        (512,),
        (8,),
        "<i8",
        2,
    )


def _message(d) -> bytes:
    from cupy_poolmem._sharing._reducers import rebuild

    return chaos.repickle(chaos.forging.Call(rebuild, (d,)))


def test_peek_reads_a_message_without_rebuilding_it():
    d = _descriptor()
    data = _message(d)
    with pytest.raises(cupy_poolmem.PoolmemError):  # unpickled for real: no GPU, or no exporter
        pickle.loads(data)
    call = chaos.peek(data)
    assert call.args == (d,) and call.func.__name__ == "rebuild"
    with pytest.raises(TypeError, match="not a zero-copy message"):
        chaos.peek(pickle.dumps(np.zeros(3)))


@pytest.mark.parametrize("field", chaos.FORGERIES)
def test_each_forgery_changes_only_its_fields_and_survives_pickling(field):
    d = _descriptor()
    f = chaos.forge(d, field, random.Random(0))
    changed = {k for k in d._fields if getattr(d, k) != getattr(f, k)}
    named = set(re.split(r"[+-]", field)) & set(d._fields)
    if field.startswith("strides-reversed") or field == "offset+shape":
        named |= {"offset"}
    assert changed and changed <= named | {"shape", "offset"}, (field, changed)
    assert chaos.peek(_message(f)).args[0] == f


def test_a_forgery_of_a_field_this_version_lacks_is_skipped():
    from typing import NamedTuple

    class Old(NamedTuple):
        version: int
        size: int

    assert chaos.forge(Old(1, 4096), "ticket", random.Random(0)) is None
    assert chaos.forge(Old(1, 4096), "version", random.Random(0)) == Old(2, 4096)


# -- leaks ------------------------------------------------------------------------------------------------
ZERO_SHARING = {
    "tickets_out": 0,
    "leases": 0,
    "limbo_blocks": 0,
    "limbo_bytes": 0,
    "imported_blocks": 0,
    "idle_mappings": 0,
    "peers": 0,
    "clients": 0,
    "imported_pools": 0,
    "opened_events": 0,
    "exported_blocks": 9,
    "recycled_blocks": 40,
}
BASE = chaos.Counters({"socket": 1, "pipe": 1, "other": 30}, 4, 0, 0, dict(ZERO_SHARING), 0)


def _now(fds=None, threads=4, used=0, held=0, procs=6, **sharing):
    s = dict(ZERO_SHARING, **sharing)
    f = fds or {"socket": 1 + procs, "pipe": 1 + 2 * procs, "other": 30}
    return chaos.Counters(f, threads, used, held, s, procs)


def test_nothing_leaked_when_live_workers_account_for_everything():
    assert chaos.leaks(BASE, BASE) == []
    assert chaos.leaks(BASE, _now()) == []
    # four workers connected both ways: a reader and a sender thread per connection, a
    # socket and a pidfd each, their imported pools and events, a few driver files
    now = _now(
        fds={"socket": 1 + 6 + 8, "pipe": 13, "pidfd": 8, "other": 30 + 16 + 4},
        threads=4 + 16,
        peers=4,
        clients=4,
        imported_pools=8,
        opened_events=4,
        exported_blocks=12,
        recycled_blocks=99,
    )
    assert chaos.leaks(BASE, now) == []


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"tickets_out": 1}, "tickets_out=1"),
        ({"leases": 2}, "leases=2"),
        ({"limbo_bytes": 4096, "limbo_blocks": 1}, "limbo_bytes=4096"),
        ({"imported_blocks": 1}, "imported_blocks=1"),
        ({"idle_mappings": 3}, "idle_mappings=3"),
        ({"peers": 7}, "peers=7 with 6 worker processes"),
        ({"clients": 7}, "clients=7"),
        ({"clients": 1, "imported_pools": 3}, "imported_pools=3"),
        ({"clients": 1, "opened_events": 5}, "opened_events=5"),
    ],
)
def test_each_sharing_counter_beyond_its_allowance_is_a_leak(change, needle):
    found = chaos.leaks(BASE, _now(**change))
    assert any(needle in f for f in found), found


def test_pool_bytes_threads_and_descriptors_beyond_their_allowance_are_leaks():
    assert any("used_bytes" in f for f in chaos.leaks(BASE, _now(used=512)))
    assert any("held_for_sharing" in f for f in chaos.leaks(BASE, _now(held=4096)))
    assert any("threads=6" in f for f in chaos.leaks(BASE, _now(threads=6, peers=0)))
    assert chaos.leaks(BASE, _now(threads=6, peers=1)) == []
    assert any("fds[pidfd]" in f for f in chaos.leaks(BASE, _now(fds={"pidfd": 1})))
    sockets = {"socket": 1 + 6 + 1, "pipe": 13, "other": 30}
    assert any("fds[socket]" in f for f in chaos.leaks(BASE, _now(fds=sockets)))
    pipes = {"socket": 7, "pipe": 14, "other": 30}  # spawn keeps two per process
    assert any("fds[pipe]" in f for f in chaos.leaks(BASE, _now(fds=pipes)))
    driver = {"socket": 7, "pipe": 13, "other": 30 + chaos.DEVICE_FD_SLACK}
    assert chaos.leaks(BASE, _now(fds=driver)) == []
    driver["other"] += 1
    assert any("fds[other]" in f for f in chaos.leaks(BASE, _now(fds=driver)))


def test_the_settle_limit_outlasts_an_unread_messages_ticket():
    # A message sent to a receiver killed before it read it pins its block until the
    # ticket expires (the janitor sweeps at least once a second): not a leak.
    assert chaos.SETTLE_S > chaos.HUB_SETTINGS["inflight_timeout"] + 1.0


def test_a_leak_report_says_what_the_hub_holds():
    text = chaos.holding(_now(tickets_out=2, leases=1), "used_bytes=4096")
    assert "tickets_out=2" in text and "leases=1" in text and "used_bytes=4096" in text
    assert "limbo_blocks" not in text  # zero counters are left out
    assert "all zero" in chaos.holding(_now(exported_blocks=0, recycled_blocks=0), "")


def test_descriptor_kinds():
    assert chaos.fd_kind("socket:[123]") == "socket"
    assert chaos.fd_kind("pipe:[9]") == "pipe"
    assert chaos.fd_kind("anon_inode:[pidfd]") == "pidfd"
    assert chaos.fd_kind("pidfd:[77]") == "pidfd"
    assert chaos.fd_kind("/dev/nvidiactl") == "other"
    kinds = chaos.open_fds()
    assert sum(kinds.values()) >= 3  # stdin, stdout, stderr at least


# -- the summary line and the exit status -----------------------------------------------------------------
SUMMARY = re.compile(
    r"^chaos: rounds=(\d+)/(\d+) seed=(\d+) wrong_data=(\d+) leaks=(\d+) hangs=(\d+) "
    r"errors=(\d+) refused_ok=(\d+) checked_ok=(\d+) unchecked=(\d+) kills=(\d+) "
    r"spawned=(\d+) recycled=(\d+) elapsed=([\d.]+)s device=(\S+)( capped=time)?"
    r"( aborted=\S+)?$"
)


def test_a_clean_run_says_zero_and_exits_0():
    r = chaos.Result(seed=1, rounds_asked=300, rounds=300, ok=5000, refused_ok=900, kills=80)
    r.elapsed, r.device = 241.3, "NVIDIA_H200"
    line = chaos.summary_line(r)
    m = SUMMARY.match(line)
    assert m, line
    assert m.group(1, 2, 3, 4, 5, 6, 7) == ("300", "300", "1", "0", "0", "0", "0")
    assert "elapsed=241.3s device=NVIDIA_H200" in line and "capped" not in line
    assert chaos.exit_status(r) == 0


@pytest.mark.parametrize("counter", ["wrong_data", "leaks", "hangs", "errors"])
def test_any_finding_fails_the_run_and_is_described(counter):
    r = chaos.Result(seed=1, rounds_asked=10, rounds=10)
    r.note(counter, 4, "what  was\nseen")
    assert getattr(r, counter) == 1 and r.details == [f"round 4: {counter}: what was seen"]
    assert f"{counter}=1" in chaos.summary_line(r)
    assert SUMMARY.match(chaos.summary_line(r))
    assert chaos.exit_status(r) == 1


def test_a_run_stopped_by_the_time_cap_or_aborted_fails():
    r = chaos.Result(seed=1, rounds_asked=300, rounds=120)
    line = chaos.summary_line(r)
    assert SUMMARY.match(line) and line.endswith("capped=time")
    assert chaos.exit_status(r) == 1
    r = chaos.Result(seed=1, rounds_asked=3, rounds=3, aborted="hub-stuck")
    assert chaos.summary_line(r).endswith("aborted=hub-stuck")
    assert chaos.exit_status(r) == 1


def test_details_are_bounded():
    r = chaos.Result()
    for i in range(500):
        r.note("errors", i, "x" * 2000)
    assert r.errors == 500 and len(r.details) == 200 and max(map(len, r.details)) < 700


# -- the whole run on the CPU stand-in of the GPU ------------------------------------------------------------
_RUN = """
import argparse, sys
from cupy_poolmem.benchmarks import chaos
ns = argparse.Namespace(seed=1, rounds={rounds}, time_cap=300, workers={workers},
                        first_round={first}, verbose=False, backend={backend!r})
r = chaos.run(ns)
for line in r.details[:20]:
    print(line, file=sys.stderr)
print(chaos.summary_line(r))
sys.exit(chaos.exit_status(r))
"""


def run_fake(backend: str, rounds: int, first: int = 0, workers: int = 3):
    """Rounds of the real hub and worker processes on ``chaos.FakeGPU``: the summary's
    counters, the exit status and what was said on stderr."""
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = _RUN.format(rounds=rounds, workers=workers, first=first, backend=backend)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )
    m = SUMMARY.match(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    assert m, (r.returncode, r.stdout, r.stderr[-3000:])
    names = ("rounds", "asked", "seed", "wrong_data", "leaks", "hangs", "errors", "refused_ok")
    names += ("checked_ok", "unchecked", "kills", "spawned", "recycled")
    counts = {k: int(v) for k, v in zip(names, m.groups())}
    return counts, r.returncode, r.stderr


def test_rounds_with_kills_forgeries_and_replays_count_nothing_when_promises_hold():
    plans = [chaos.make_plan(1, i, 3) for i in range(12)]
    kinds = set().union(*map(chaos.kinds_of, plans))
    assert {"kill_consumer", "kill_producer", "kill_forwarder", "killed_writer"} <= kinds
    assert {"forge", "replay_stale", "forward", "round_trip", "hub_load"} <= kinds
    # The hub holds its own arrays in some rounds: all let go before the leak check.
    assert any(b.producer == chaos.HUB and b.then == "hold" for p in plans for b in p.batches)
    counts, rc, err = run_fake("fake", 12)
    assert rc == 0, err[-3000:]
    assert counts["rounds"] == counts["asked"] == 12
    assert counts["wrong_data"] == counts["leaks"] == counts["hangs"] == counts["errors"] == 0
    assert counts["checked_ok"] > 50
    assert counts["kills"] >= 3  # and the killed workers were replaced (by the next round)
    assert counts["spawned"] > 3 + chaos.SPARES


def test_a_receiver_that_sees_other_data_is_counted_and_fails_the_run():
    counts, rc, err = run_fake("fake-corrupt", 3)
    assert rc == 1 and counts["wrong_data"] > 3 and counts["errors"] == 0, err[-2000:]
    assert "wrong_data" in err and "elements differ" in err


def test_a_hub_that_keeps_descriptors_is_counted_as_leaking_every_round():
    counts, rc, err = run_fake("fake-leaky", 3)
    assert rc == 1 and counts["leaks"] == 3 and counts["wrong_data"] == 0, err[-2000:]
    assert "fds[pipe]" in err and "pool used_bytes=" in err and "holding: sharing" in err


def test_refusals_are_typed_errors_counted_by_type_and_anything_else_is_an_error():
    from cupy_poolmem import CUDADriverError, SharingError

    assert chaos.worker.classify_exc(SharingError("stale"))[0] == "refused:SharingError"
    err = CUDADriverError("cuIpcOpenEventHandle", 1, "CUDA_ERROR_INVALID_VALUE")
    assert chaos.worker.classify_exc(err)[0] == "refused:CUDADriverError"
    outcome, detail = chaos.worker.classify_exc(ValueError("odd"))
    assert outcome == "error" and detail.startswith("ValueError: odd")
    r = chaos.Result()
    hub = chaos.Hub(chaos.build_parser().parse_args([]), r, chaos.FakeGPU())
    hub.outcome("refused:SharingError", "stale")
    hub.outcome("refused:SharingError", "gone")
    hub.outcome("refused:CUDADriverError", "x")
    hub.outcome("ok", "")
    hub.outcome("unchecked", "slack")
    hub.outcome("error", "ValueError: odd")
    hub.outcome("wrong", "[3] differs")
    assert (r.refused_ok, r.ok, r.unchecked, r.errors, r.wrong_data) == (3, 1, 1, 1, 1)
    assert r.refusals == {"SharingError": 2, "CUDADriverError": 1}
