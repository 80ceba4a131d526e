"""Benchmark figures come from saved benchmark output: ``bench --save`` writes what a run
printed as JSON, ``tools/render_figures.py`` renders docs/_measured.rst and README.md's
figures from it, and the committed docs are what the committed results render to."""

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
    spec.loader.exec_module(mod)
    return mod


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
    for path, text in want.items():
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
    figure = re.compile(
        r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b|\bGB/s\b|\b\d+(?:\.\d+)? ?(?:us|µs|ms)\b"
        r"|\b(?:[AHBL]\d{2,3}|RTX ?\d{4})\b"
    )
    found = [m.group() for m in figure.finditer(before + after)]
    assert not found, f"figures outside the generated block of README.md: {found}"


def test_the_sdist_carries_the_results_and_the_script():
    manifest = os.path.join(ROOT, "MANIFEST.in")
    if not os.path.exists(manifest):
        pytest.skip("needs the source checkout's MANIFEST.in")
    text = open(manifest, encoding="utf-8").read()
    # The sdist's tests render from its own copy of the results and the script.
    assert "benchmarks/results" in text and "tools" in text
