"""support.gpus.visible: the GPUs a test's cluster starts on are the ones this process
sees (a child's CUDA_VISIBLE_DEVICES names the host's GPUs, not this process's ordinals)."""

from __future__ import annotations

import pytest
from support.gpus import visible


def test_names_the_gpus_this_process_sees():
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}  # .ci/gpu's two-GPU run on a four-GPU host
    assert visible(2, env) == ["2", "3"]
    assert visible(1, env) == ["2"]
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb,GPU-cc"}
    assert visible(2, uuids) == ["GPU-aa", "GPU-bb"]


def test_unset_means_the_first_gpus():
    assert visible(2, {}) == ["0", "1"]


def test_fewer_than_asked_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='1' names fewer than 2"):
        visible(2, {"CUDA_VISIBLE_DEVICES": "1"})
