"""A short chaos run on the GPU: ``python -m cupy_poolmem bench chaos`` for a few rounds.

The full run (300 rounds) is a benchmark, not a test; these rounds draw every event
kind once (checked below on the scenario, which needs no GPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import cupy_poolmem
from cupy_poolmem.benchmarks import chaos

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))
SEED, ROUNDS = 100, 8  # the first 8 rounds of seed 100 draw every event kind


def test_the_rounds_run_draw_every_event_kind():  # (no GPU needed)
    kinds = set().union(*(chaos.kinds_of(chaos.make_plan(SEED, i, 4)) for i in range(ROUNDS)))
    assert kinds == set(chaos.EVENT_KINDS)


@pytest.mark.gpu
def test_a_short_chaos_run_sees_no_wrong_data_leak_hang_or_error():
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["bench", "chaos", "--seed", str(SEED), "--rounds", str(ROUNDS), "--time-cap", "240"]
    r = subprocess.run(
        [sys.executable, "-m", "cupy_poolmem", *args],
        capture_output=True,
        text=True,
        timeout=480,
        env=env,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("chaos: ")]
    assert lines, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    line = lines[-1]
    counts = dict(re.findall(r"(\w+)=([\w./]+)", line))
    assert counts["rounds"] == f"{ROUNDS}/{ROUNDS}", line
    found = {k: counts[k] for k in ("wrong_data", "leaks", "hangs", "errors")}
    assert found == dict.fromkeys(found, "0"), f"{line}\n{r.stderr[-6000:]}"
    assert int(counts["checked_ok"]) > 20 and int(counts["kills"]) >= 1, line
    assert r.returncode == 0, (line, r.stderr[-3000:])
