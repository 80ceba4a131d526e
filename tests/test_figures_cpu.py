"""Benchmark figures come from saved benchmark output: ``bench --save`` writes what a run
printed as JSON, ``tools/render_figures.py`` renders docs/_measured.rst, the guide
pages' figures (docs/_figures/, each included by its page) and README.md's figures from
it, and the committed docs are what the committed results render to."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest

from cupy_poolmem.benchmarks import _common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "render_figures.py")

DOCS = os.path.join(ROOT, "docs")

#: What looks like a measured figure: a ratio, a bandwidth, a time, a GPU model.
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b|\b[GM]i?B/s\b|\b\d+(?:\.\d+)? ?(?:ns|us|µs|ms)\b"
    r"|\b(?:[AHBL]\d{2,3}|RTX ?\d{4})\b"
)

needs_script = pytest.mark.skipif(
    not os.path.exists(SCRIPT), reason="needs the source checkout's tools/render_figures.py"
)

ENV = {
    "title": "allocation benchmark: microseconds per op (ratio to cupy MemoryPool)",
    "device": "NVIDIA Test GPU 80GB",
    "n_gpus": 1,
    "driver": "13.0",
    "cupy": "14.2.0",
    "cuda_core": "1.2.0",
    "hotpath": "cython",
}


@pytest.fixture(scope="module")
def render():
    spec = importlib.util.spec_from_file_location("render_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _fake_run(bench: str = "alloc", env: dict | None = None) -> _common.Recorder:
    """A run as a benchmark's main prints it (header, tables, goal lines), recorded."""
    rec = _common.Recorder(bench, ["--quick"])
    with _common.recording(rec):
        if env is not None:
            rec.header("== fake header ==\ndevice: ...", env)
            print("== fake header ==\ndevice: ...")
        print(
            _common.table(
                ["allocator", "empty 1KiB"],
                [
                    ["cupy MemoryPool (baseline)", "   1.92 us (1.00x)"],
                    ["DevicePool", "2.12 us (1.10x)"],
                ],
            )
        )
        print("goal: DevicePool at most 1.00x MemoryPool: 1.10x -> missed")
        print()
        print("the pool alone: microseconds per malloc(n) + free")
        print(_common.table(["pool", "1 KiB"], [["DevicePool.malloc", "0.81 us (0.70x)"]]))
        _common.table(["never", "printed"], [["x", "y"]])  # built, not printed: not saved
        print("(run took 12 s)")
    return rec


def test_recorder_keeps_every_table_row_and_line(capsys):
    rec = _fake_run(env=ENV)
    r = rec.result()
    assert r["bench"] == "alloc" and r["argv"] == ["--quick"]
    assert r["title"] == ENV["title"] and r["environment"]["device"] == ENV["device"]
    assert [t["columns"] for t in r["tables"]] == [["allocator", "empty 1KiB"], ["pool", "1 KiB"]]
    assert r["tables"][0]["rows"][0] == ["cupy MemoryPool (baseline)", "1.92 us (1.00x)"]
    assert r["tables"][0]["before"] == []  # the header is not a table's text
    assert r["tables"][1]["before"] == [
        "goal: DevicePool at most 1.00x MemoryPool: 1.10x -> missed",
        "the pool alone: microseconds per malloc(n) + free",
    ]
    assert r["after"] == ["(run took 12 s)"]
    # What was recorded was printed too, unchanged.
    assert "1.92 us (1.00x)" in capsys.readouterr().out


def test_save_names_the_file_by_bench_and_device(tmp_path):
    path = _fake_run(env=ENV).save(str(tmp_path / "results"))
    assert os.path.basename(path) == "alloc-nvidia-test-gpu-80gb.json"
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    assert data["format"] == _common.RESULTS_FORMAT
    assert data["environment"]["device"] == "NVIDIA Test GPU 80GB"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"])


def test_run_with_save_writes_json_and_without_writes_nothing(tmp_path, monkeypatch, capsys):
    seen = []

    def main(argv):
        seen.append(list(argv))
        print(_common.table(["a", "b"], [["1", "2"]]))

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["prog", "--quick", "--save", str(out)])
    _common.run(main, "pinned")
    assert seen[-1] == ["--quick"]  # --save DIR is not the benchmark's
    (saved,) = out.iterdir()
    assert saved.name == "pinned-unknown-device.json"  # no header: no device known
    assert json.loads(saved.read_text())["tables"][0]["rows"] == [["1", "2"]]
    assert "results saved to" in capsys.readouterr().err

    monkeypatch.setattr(sys, "argv", ["prog", "--quick"])
    _common.run(main, "pinned")
    assert seen[-1] == ["--quick"] and len(list(out.iterdir())) == 1


def test_save_without_a_directory_is_an_error():
    with pytest.raises(SystemExit, match="--save needs a directory"):
        _common.split_save(["--save"])


@needs_script
def test_rendered_docs_carry_every_figure_and_name_the_device(tmp_path, render):
    results = tmp_path / "results"
    _fake_run(env=ENV).save(str(results))
    _fake_run("pinned", dict(ENV, title="pinned bandwidth", device="NVIDIA Other GPU")).save(
        str(results)
    )
    loaded = render.load_results(str(results))
    assert [r["bench"] for r in loaded] == ["alloc", "pinned"]  # ORDER, not file names
    rst = render.render_measured(loaded)
    for cell in ("1.92 us (1.00x)", "2.12 us (1.10x)", "0.81 us (0.70x)", "(run took 12 s)"):
        assert cell in rst
    assert "NVIDIA Test GPU 80GB" in rst and "NVIDIA Other GPU" in rst
    assert "python -m cupy_poolmem bench alloc --quick" in rst
    assert "never" not in rst
    md = render.render_readme_block(loaded)
    assert md.startswith(render.START) and md.endswith(render.END)
    assert "goal: DevicePool at most 1.00x MemoryPool: 1.10x -> missed" in md
    assert md.count("NVIDIA Test GPU 80GB") == 1 and "NVIDIA Other GPU" in md


@needs_script
def test_rendered_rst_builds_without_warnings(tmp_path, render):
    pytest.importorskip("docutils")
    from docutils.core import publish_doctree
    from docutils.utils import Reporter

    results = tmp_path / "results"
    _fake_run(env=dict(ENV, device="GPU *with* `markup` | and_ [chars]")).save(str(results))
    rst = render.render_measured(render.load_results(str(results)))
    doctree = publish_doctree(
        rst, settings_overrides={"report_level": Reporter.WARNING_LEVEL, "halt_level": 5}
    )
    messages = [
        node.astext()
        for node in doctree.findall()
        if node.tagname == "system_message" and node["level"] >= Reporter.WARNING_LEVEL
    ]
    assert not messages, messages
    assert "GPU *with* `markup` | and_ [chars]" in doctree.astext()


@needs_script
def test_no_results_means_no_figures(tmp_path, render):
    rst = render.render_measured([])
    md = render.render_readme_block([])
    assert "No benchmark output is committed yet" in rst
    assert "No benchmark output is committed yet" in md
    assert not re.search(r"\d+\.\d+ ?(x|us|ms|GB/s)", rst + md)


@needs_script
def test_check_fails_on_a_figure_typed_between_the_markers(tmp_path, render):
    results = tmp_path / "results"
    _fake_run(env=ENV).save(str(results))
    readme, measured = tmp_path / "README.md", tmp_path / "_measured.rst"
    readme.write_text(f"# x\n\n{render.START}\n{render.END}\n\nrest\n")
    measured.write_text("")
    args = ["--results", str(results), "--readme", str(readme), "--measured", str(measured)]
    args += ["--figures", str(tmp_path / "_figures")]
    assert render.main(args) == 0  # writes them
    assert render.main(["--check", *args]) == 0
    text = readme.read_text()
    assert text.endswith("\n\nrest\n") and "NVIDIA Test GPU 80GB" in text
    # A figure typed by hand between the markers has no source: the check fails.
    readme.write_text(text.replace(render.END, "- DevicePool 0.92x on an H100\n" + render.END))
    assert render.main(["--check", *args]) == 1
    # So does a hand edit of the generated tables.
    render.main(args)
    measured.write_text(measured.read_text().replace("2.12 us (1.10x)", "2.02 us (1.05x)"))
    assert render.main(["--check", *args]) == 1
    # And a results file changed after rendering.
    (path,) = results.iterdir()
    data = json.loads(path.read_text())
    data["tables"][0]["rows"][1][1] = "9.99 us (4.70x)"
    path.write_text(json.dumps(data))
    render.main(args)
    assert render.main(["--check", *args]) == 0
    assert "9.99 us (4.70x)" in measured.read_text()


@needs_script
@pytest.mark.parametrize(
    "content,error",
    [
        ("{not json", "not readable JSON"),
        ('{"format": 1}', "not a benchmark results file"),
        (None, "names no device"),
    ],
)
def test_bad_results_files_are_named(tmp_path, render, content, error):
    results = tmp_path / "results"
    if content is None:
        _fake_run(env=dict(ENV, device="")).save(str(results))
    else:
        results.mkdir()
        (results / "alloc-x.json").write_text(content)
    with pytest.raises(render.ResultsError, match=error) as info:
        render.load_results(str(results))
    assert ".json" in str(info.value)


@needs_script
def test_missing_markers_are_an_error(tmp_path, render):
    with pytest.raises(render.ResultsError, match="needs the markers"):
        render.replace_block("# README without markers\n", "block")


@needs_script
def test_committed_docs_are_what_the_committed_results_render_to(render, tmp_path):
    """docs/_measured.rst and README.md's figures have a source: the committed
    benchmarks/results/*.json (none yet: then they say nothing is measured)."""
    for path in (render.README, render.MEASURED):
        if not os.path.exists(path):
            pytest.skip(f"needs the source checkout's {os.path.basename(path)}")
    want = render.rendered()
    assert any(os.path.dirname(p) == render.FIGURES_DIR for p in want)
    for path, text in want.items():
        assert text is not None, f"{os.path.relpath(path, ROOT)}: no figure renders it"
        assert os.path.exists(path), f"{os.path.relpath(path, ROOT)} is missing"
        with open(path, encoding="utf-8") as f:
            assert f.read() == text, (
                f"{os.path.relpath(path, ROOT)} differs from what benchmarks/results/ "
                "renders to: run python tools/render_figures.py (and commit the JSON "
                "the figures come from)"
            )


@needs_script
def test_readme_quotes_no_figure_outside_the_generated_block(render):
    """A measured figure in README.md outside the markers has no source."""
    with open(render.README, encoding="utf-8") as f:
        text = f.read()
    before, rest = text.split(render.START, 1)
    _, after = rest.split(render.END, 1)
    found = [m.group() for m in FIGURE.finditer(before + after)]
    assert not found, f"figures outside the generated block of README.md: {found}"


def test_the_sdist_carries_the_results_and_the_script():
    manifest = os.path.join(ROOT, "MANIFEST.in")
    if not os.path.exists(manifest):
        pytest.skip("needs the source checkout's MANIFEST.in")
    text = open(manifest, encoding="utf-8").read()
    # The sdist's tests render from its own copy of the results and the script.
    assert "benchmarks/results" in text and "tools" in text


# -- the guide's figures (docs/_figures/) ---------------------------------------------------
def _fake_churn() -> _common.Recorder:
    """A churn run as churn.main prints it: the allocator table, its lines, a second table."""
    rec = _common.Recorder("churn", ["--quick"])
    with _common.recording(rec):
        rec.header("== churn ==", dict(ENV, title="churn trace"))
        print("trace: 5000 steps")
        rows = [
            ["cupy MemoryPool (baseline)", "10.00 us (1.00x)", "2048.0 MiB (1.00x)"],
            ["cupy_poolmem DevicePool (default)", "11.00 us (1.10x)", "2007.0 MiB (0.98x)"],
            ["cupy_poolmem DevicePool small_pool=None", "10.50 us (1.05x)", "2334.7 MiB (1.14x)"],
            ["cupy_poolmem DevicePool reuse_cache=0", "12.00 us (1.20x)", "1863.7 MiB (0.91x)"],
            [
                "cupy_poolmem DevicePool large_blocks='mapped'",
                "41.00 us (4.10x)",
                "1597.4 MiB (0.78x)",
            ],
            ["torch caching allocator", "9.00 us (0.90x)", "2100.0 MiB (1.03x)"],
        ]
        print(_common.table(["allocator", "time per step (median)", "reserved peak"], rows))
        print("time over MemoryPool's, paired replays: default: 1.11x")
        print("goal (reserved <= 0.8x MemoryPool, time <= 1.05x): default missed (0.98x, 1.11x)")
        print()
        print("the same trace straight on CUDA pools")
        print(_common.table(["variant", "reserved peak"], [["one CUDA pool", "3.3 GiB (1.64x)"]]))
    return rec


def _figure(render, name):
    (fig,) = [f for f in render.FIGURES if f.name == name]
    return fig


@needs_script
def test_a_figure_quotes_its_rows_columns_and_lines(tmp_path, render):
    _fake_churn().save(str(tmp_path))
    results = render.load_results(str(tmp_path))
    small = render.render_figure(_figure(render, "device_pool-small_pool"), results)
    assert "NVIDIA Test GPU 80GB" in small and "bench churn --quick" in small
    for cell in ("2007.0 MiB (0.98x)", "2334.7 MiB (1.14x)", "1863.7 MiB (0.91x)"):
        assert cell in small
    assert "us (" not in small  # only the reserved peak column
    assert "mapped" not in small and "torch" not in small  # only its rows
    assert "goal" not in small and "one CUDA pool" not in small
    large = render.render_figure(_figure(render, "device_pool-large_blocks"), results)
    assert "41.00 us (4.10x)" in large and "torch caching allocator" in large
    assert "small\\_pool=None" not in large and "small_pool=None" not in large
    assert "goal (reserved <= 0.8x MemoryPool" in large
    assert "time over MemoryPool's, paired replays" in large
    # Another benchmark's figure is untouched by a churn result.
    pinned = render.render_figure(_figure(render, "pinned_pool-bandwidth"), results)
    assert "No committed measurement of this yet" in pinned and "bench pinned" in pinned
    assert not FIGURE.search(pinned)


@needs_script
def test_a_figure_whose_table_the_run_lacks_says_so(tmp_path, render):
    _fake_run(env=ENV).save(str(tmp_path))  # an alloc run without the peer-access table
    text = render.render_figure(
        _figure(render, "device_pool-peer_access"), render.load_results(str(tmp_path))
    )
    assert "NVIDIA Test GPU 80GB" in text and "has no table" in text
    assert "1.92 us" not in text


@needs_script
def test_rendered_figures_build_without_warnings(tmp_path, render):
    pytest.importorskip("docutils")
    from docutils.core import publish_doctree
    from docutils.utils import Reporter

    _fake_churn().save(str(tmp_path))
    results = render.load_results(str(tmp_path))
    for fig in render.FIGURES:
        for res in (results, []):
            doctree = publish_doctree(
                render.render_figure(fig, res),
                settings_overrides={"report_level": Reporter.WARNING_LEVEL, "halt_level": 5},
            )
            bad = [
                n.astext()
                for n in doctree.findall()
                if n.tagname == "system_message" and n["level"] >= Reporter.WARNING_LEVEL
            ]
            assert not bad, (fig.name, bad)


@needs_script
def test_check_fails_on_a_figure_file_typed_by_hand(tmp_path, render):
    results = tmp_path / "results"
    _fake_churn().save(str(results))
    readme, figures = tmp_path / "README.md", tmp_path / "_figures"
    readme.write_text(f"{render.START}\n{render.END}\n")
    args = ["--results", str(results), "--readme", str(readme)]
    args += ["--measured", str(tmp_path / "_measured.rst"), "--figures", str(figures)]
    assert render.main(args) == 0
    assert render.main(["--check", *args]) == 0
    path = figures / "device_pool-small_pool.rst"
    assert "2334.7 MiB (1.14x)" in path.read_text()
    path.write_text(path.read_text().replace("2334.7 MiB (1.14x)", "2100.0 MiB (1.03x)"))
    assert render.main(["--check", *args]) == 1
    render.main(args)
    # A figure file no figure renders (typed by hand) fails too, and is removed.
    (figures / "typed.rst").write_text("Measured on an H100: 0.92x.\n")
    assert render.main(["--check", *args]) == 1
    assert render.main(args) == 0 and not (figures / "typed.rst").exists()
    # A figure file missing fails.
    path.unlink()
    assert render.main(["--check", *args]) == 1


#: Text on the guide's pages that looks like a figure and is not a measurement.
NOT_MEASURED = {
    "cli.rst": [  # the goals each benchmark checks
        "DevicePool at most 1.00x MemoryPool per ``cupy.empty`` + free",
        "at most 1.3x, 2x and 4x the plain pool per ``cupy.empty`` + free",
        "a reserved peak at most 0.8x MemoryPool's, at equal speed (at most 1.05x its time "
        "per step)",
        "a re-sent array within 0.06 ms of the floor, a fresh array at most 2x the floor",
    ],
    "compatibility.rst": ["R580 (H100, H200)"],  # the GPUs the release was tested on
    "dask.rst": [
        "the goals (1 GiB in 20 ms or less, 64 MiB within 2x the floor)",
        "at least 5x faster",  # a goal of bench dask-cuda
    ],
    "device_pool.rst": [
        "driver 580 (H100) does not survive it",  # a crash, not a figure
        "the retirement thread checks every 50 ms",  # a setting
    ],
    "observability.rst": [
        "the goals are at most 1.3x the plain pool inside ``statistics()``, 2x with a log "
        "and 4x with a tracked log"
    ],
}


def _pages() -> list[str]:
    if not os.path.isdir(DOCS):
        pytest.skip("needs the source checkout's docs/")
    return sorted(
        name for name in os.listdir(DOCS) if name.endswith(".rst") and not name.startswith("_")
    )


@needs_script
def test_every_figure_is_included_by_a_page_once(render):
    included: list[str] = []
    for name in _pages():
        with open(os.path.join(DOCS, name), encoding="utf-8") as f:
            included += re.findall(r"^\s*\.\. include:: _figures/(\S+)\.rst\s*$", f.read(), re.M)
    names = [fig.name for fig in render.FIGURES]
    assert sorted(included) == sorted(names)
    assert len(set(names)) == len(names)
    for fig in render.FIGURES:
        assert fig.bench in render.ORDER, fig


def test_the_guide_quotes_no_figure_outside_the_generated_files():
    """A measured figure typed into a docs page has no source: figures are quoted by
    including docs/_figures/*.rst, which tools/render_figures.py renders."""
    found = []
    for name in _pages():
        with open(os.path.join(DOCS, name), encoding="utf-8") as f:
            text = " ".join(f.read().split())
        for allowed in NOT_MEASURED.get(name, []):
            assert allowed in text, f"{name} no longer says {allowed!r}: update NOT_MEASURED"
            text = text.replace(allowed, "")
        found += [f"{name}: {m.group()!r}" for m in FIGURE.finditer(text)]
    assert not found, "figures typed into the docs (quote them from docs/_figures/):\n" + (
        "\n".join(found)
    )


def test_a_figure_typed_into_a_page_is_found():
    """The pattern the check above scans with catches the figures it was written for."""
    for typed in ("0.98x", "4.0-4.6x", "55 GB/s", "165 us", "43 µs", "0.19 ms", "H100"):
        assert FIGURE.search(f"measured: {typed} here"), typed
    for fine in ("1 MiB", "8 MiB", "max_size=2", "CUDA 13", "R580"):
        assert not FIGURE.search(fine), fine
