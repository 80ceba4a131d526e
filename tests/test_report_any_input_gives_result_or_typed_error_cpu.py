"""Fuzz tests (Hypothesis): any bytes into the log reader, any text into ``parse_bytes``.

The promise tested: a clean result or an error of the package's own hierarchy
(:class:`~cupy_poolmem.PoolmemError`), never another exception, and never a number
JSON cannot hold.  Small example counts keep them to a few seconds in CI.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cupy_poolmem import parse_bytes, report  # noqa: E402
from cupy_poolmem._errors import PoolmemError  # noqa: E402
from cupy_poolmem.report import _summary as summary  # noqa: E402
from cupy_poolmem.report._export import rmm_rows, torch_snapshots  # noqa: E402
from cupy_poolmem.report._plot import sample_series  # noqa: E402
from cupy_poolmem.report._read import BadRows, iter_events  # noqa: E402
from cupy_poolmem.stats import LOG_COLUMNS  # noqa: E402

FUZZ = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
_DIR = tempfile.mkdtemp(prefix="cupy_poolmem-fuzz-")


def _check_reads(data: bytes) -> None:
    """Summarise, format, export and sample ``data`` as a log: clean, or a package error."""
    path = os.path.join(_DIR, "fuzz.csv")
    with open(path, "wb") as f:
        f.write(data)
    try:
        loaded = report.load(path)
        s = summary.summarize_loaded(loaded, 5, None)
    except PoolmemError:
        return
    text = json.dumps(s.to_dict(), allow_nan=False)  # ValueError on a non-finite float
    text.encode("utf-8")  # no lone surrogates
    printed = s.format(top=5)
    assert not any(c in printed for c in "\x1b\x07\r\x00")
    events = list(loaded.events())
    assert len(events) == s.n_events
    chunked = BadRows()  # many logs are read a few rows at a time: the same rows
    assert list(iter_events(loaded.sources[0], chunked, chunk=2)) == events
    assert (chunked.n, chunked.first) == (s.n_bad_lines, s.first_bad_line)
    torch_snapshots(events)
    list(rmm_rows(events))
    if s.series:
        keys = [(x.pid, x.device) for x in s.series[:2]]
        for panel in sample_series(events, keys, [], s.start_time, s.end_time, n_buckets=4):
            assert len(panel.moments) <= 8


@FUZZ
@given(st.binary(max_size=600))
def test_any_bytes(data):
    _check_reads(data)


@FUZZ
@given(st.binary(max_size=400))
def test_any_bytes_after_a_real_header(data):
    _check_reads((",".join(LOG_COLUMNS) + "\n").encode() + data)


def _junk():
    return st.one_of(
        st.text(max_size=12),
        st.sampled_from(
            [
                "",
                "nan",
                "inf",
                "-inf",
                "-1",
                "1e32",
                "9" * 400,
                "0x",
                "0x1g",
                "1e999",
                "-0",
                "0x" + "f" * 17,
                "\ufeff1",
                " 5",
                "1_000",
            ]
        ),  # fmt: skip
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
    )


def _column(name):
    valid = {
        "time": st.floats(0, 2e9).map(lambda t: f"{t:.6f}"),
        "pid": st.integers(0, 2**32).map(str),
        "thread": st.text(max_size=8),
        "device": st.integers(-1, 3).map(str),
        "stream": st.integers(0, 2**64 - 1).map(hex),
        "op": st.sampled_from(["alloc", "free", "guard:double_free", "guard:"]),
        "pointer": st.integers(0, 2**64 - 1).map(hex),
        "size": st.integers(0, 2**64 - 1).map(str),
        "tag": st.text(max_size=10),
        "callsite": st.one_of(st.just(""), st.text(max_size=10), st.just("a.py:3 in f")),
        "used": st.one_of(st.just(""), st.integers(0, 2**64 - 1).map(str)),
        "reserved": st.one_of(st.just(""), st.integers(0, 2**64 - 1).map(str)),
    }[name]
    return st.one_of(valid, valid, valid, _junk())


_ROW = st.tuples(*[_column(c) for c in LOG_COLUMNS]).map(list)


@FUZZ
@given(
    rows=st.lists(st.one_of(_ROW, _ROW, st.lists(st.text(max_size=5), max_size=14)), max_size=25),
    bom=st.booleans(),
    header_again=st.booleans(),
)
def test_csv_like_logs_of_the_real_columns(rows, bom, header_again):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(LOG_COLUMNS)
    for i, r in enumerate(rows):
        w.writerow(r)
        if header_again and i == 1:
            w.writerow(LOG_COLUMNS)
    data = buf.getvalue().encode("utf-8", "surrogatepass")
    _check_reads((b"\xef\xbb\xbf" if bom else b"") + data)


@settings(max_examples=300, deadline=None, database=None)
@given(_ROW)
def test_the_quick_row_parse_agrees_with_the_checked_one(row):
    """Rows as the writer writes them take a quick path; any row gets the same event
    or is refused, whichever path reads it."""
    from cupy_poolmem.report._read import _checked_event, _event

    def outcome(fn, arg):
        try:
            return fn(*arg)
        except ValueError:
            return ValueError

    fields = tuple(row)
    assert outcome(_event, (row, tuple)) == outcome(_checked_event, (fields,))


# -- parse_bytes --------------------------------------------------------------------------
_NUMBERISH = st.from_regex(
    r"\A\s?[0-9]{0,30}(\.[0-9]{0,10})?([eE][+-]?[0-9]{1,12})?\s?"
    r"(|b|B|k|kB|KiB|M|MB|MiB|G|GB|GiB|T|TB|TiB|P|PB|PiB|%|EiB|x)\Z",
    fullmatch=True,
)


@FUZZ
@given(
    st.one_of(
        _NUMBERISH,
        st.text(max_size=20),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        st.none(),
        st.booleans(),
    ),
    st.one_of(st.none(), st.integers(0, 2**50)),
)
def test_parse_bytes_returns_a_size_or_a_typed_error(value, total):
    try:
        n = parse_bytes(value, total=total)
    except PoolmemError:
        return
    assert type(n) is int and 0 <= n <= 2**64 - 1


@FUZZ
@given(st.integers(0, 2**64 - 1))
def test_parse_bytes_reads_integers_exactly(n):
    assert parse_bytes(str(n)) == n and parse_bytes(f"{n} B") == n
