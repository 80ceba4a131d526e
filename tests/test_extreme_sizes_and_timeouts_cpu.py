"""CPU tests of inputs at their edges: sizes beyond floats, non-finite timeouts, guard sizes."""

from __future__ import annotations

import pytest

from cupy_poolmem import GuardOptions, parse_bytes
from cupy_poolmem._errors import InvalidOptionError, OptionTypeError, PoolmemError
from cupy_poolmem._sharing._settings import SharingSettings


@pytest.mark.parametrize(
    "text,expected",
    [
        ("12345678901234567891", 12345678901234567891),  # above 2**53: a float rounds it
        ("9007199254740993", 2**53 + 1),
        ("18446744073709551615", 2**64 - 1),
        ("1.5GB", 1_500_000_000),
        ("1.1kB", 1100),  # 1.1 * 1000 as a float is 1100.0000000000002
        ("0.3KiB", 307),  # floor of 307.2
        ("1e-999999999kB", 0),
        ("1e9", 10**9),
        ("4.398046511104e12", 4398046511104),
    ],
)
def test_parse_bytes_is_exact(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "value",
    ["1e999", "1e400GB", "18446744073709551616", "1" * 5000, "20000PB", 2**64],
    ids=["1e999", "1e400GB", "2**64", "5000 digits", "20000PB", "int 2**64"],
)
def test_parse_bytes_too_large_is_a_typed_error(value):
    with pytest.raises(InvalidOptionError, match="too large.*2\\*\\*64 - 1") as ei:
        parse_bytes(value)
    assert isinstance(ei.value, PoolmemError) and isinstance(ei.value, ValueError)
    assert len(str(ei.value)) < 300  # one readable line, even for 5000 digits


@pytest.mark.parametrize("text", ["1e-999999999", "1e999999999%", "1e-99999999999999999999999999"])
def test_parse_bytes_extreme_exponents_answer_quickly(text):
    with pytest.raises(InvalidOptionError):
        parse_bytes(text, total=1000)


def test_guard_env_with_a_huge_quarantine_is_a_typed_error():
    with pytest.raises(InvalidOptionError, match="quarantine_bytes='1e400GB' is too large"):
        GuardOptions.from_env("warn,quarantine_bytes=1e400GB")
    with pytest.raises(InvalidOptionError, match="red_zone must be an integer"):
        GuardOptions.from_env("warn,red_zone=" + "9" * 5000)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "1e400", "NaN"])
@pytest.mark.parametrize("var", ["CUPY_POOLMEM_EXIT_TIMEOUT", "CUPY_POOLMEM_INFLIGHT_TIMEOUT"])
def test_non_finite_timeouts_from_the_environment_are_refused(monkeypatch, var, raw):
    monkeypatch.setenv(var, raw)
    with pytest.raises(InvalidOptionError, match=f"{var}='{raw}'.*finite number of seconds"):
        SharingSettings()


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -0.5, 10**400], ids=["nan", "inf", "-0.5", "10**400"]
)
def test_non_finite_timeouts_set_in_code_are_refused(value):
    s = SharingSettings()
    with pytest.raises(InvalidOptionError, match="finite number of seconds"):
        s.exit_timeout = value
    with pytest.raises(InvalidOptionError, match="finite number of seconds"):
        s.inflight_timeout = value
    s.exit_timeout = 2.5
    s.inflight_timeout = None
    assert (s.exit_timeout, s.inflight_timeout) == (2.5, None)


def test_parse_bytes_takes_numpy_integers_as_ints():
    np = pytest.importorskip("numpy")
    assert parse_bytes(np.int64(4096)) == 4096 and type(parse_bytes(np.int64(1))) is int
    assert parse_bytes(np.uint64(2**64 - 1)) == 2**64 - 1
    assert parse_bytes(np.prod([2, 1024], dtype=np.int32), name="max_size") == 2048
    with pytest.raises(InvalidOptionError, match="max_size must be >= 0 bytes; got -1"):
        parse_bytes(np.int8(-1), name="max_size")
    with pytest.raises(OptionTypeError):
        parse_bytes(np.bool_(True))
    assert parse_bytes(np.float64(0.5), total=1000) == 500  # a float: a fraction, as before
