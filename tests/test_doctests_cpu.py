"""The docstring examples that need no GPU run as doctests (the others carry ``+SKIP``)."""

from __future__ import annotations

import doctest
import importlib

import pytest

# module -> fewest examples that must really run (not skipped) in it
MODULES = {
    "cupy_poolmem": 1,
    "cupy_poolmem._sizes": 6,
    "cupy_poolmem._errors": 5,
    "cupy_poolmem._guard": 5,
    "cupy_poolmem._device": 1,
    "cupy_poolmem._retire": 10,
    "cupy_poolmem._block_cache": 6,
    "cupy_poolmem._cli": 2,
    "cupy_poolmem.report._read": 4,
    "cupy_poolmem.report._summary": 20,
    "cupy_poolmem.report._plot": 5,
    "cupy_poolmem.stats": 12,
    "cupy_poolmem._poolstats": 2,
    "cupy_poolmem.dask": 3,
    "cupy_poolmem._dask_transfer._config": 3,
    "cupy_poolmem._dask_transfer._identity": 3,
    "cupy_poolmem._dask_transfer._decide": 4,
    "cupy_poolmem._dask_transfer._header": 2,
    "cupy_poolmem.benchmarks.churn": 6,
    "cupy_poolmem.benchmarks._churn_variants": 6,
    "cupy_poolmem.benchmarks._step_ipc": 3,
    "cupy_poolmem.benchmarks.pinned_bandwidth": 1,
    "cupy_poolmem.benchmarks._paired": 12,
    "cupy_poolmem.benchmarks.alloc": 3,
    "cupy_poolmem.benchmarks._common": 5,
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_docstring_examples(name, tmp_path, monkeypatch):
    if name == "cupy_poolmem.dask" or name.startswith("cupy_poolmem._dask_transfer."):
        pytest.importorskip("distributed")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    module = importlib.import_module(name)
    import cupy_poolmem

    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    ran = 0
    for test in finder.find(module, extraglobs={"cupy_poolmem": cupy_poolmem}):
        out: list[str] = []
        result = runner.run(test, out=out.append)
        assert result.failed == 0, "".join(out)[-4000:]
        ran += sum(1 for ex in test.examples if not ex.options.get(doctest.SKIP))
    assert ran >= MODULES[name], f"{name}: {ran} examples ran, expected >= {MODULES[name]}"
