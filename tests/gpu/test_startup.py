"""Start-up's device decision (`run.device`) on the CUDA devices torch really sees."""

from __future__ import annotations

import pytest
import torch

from looprl.startup import cuda_devices, decide_device

pytestmark = pytest.mark.gpu


def test_auto_takes_the_first_gpu(device):
    found = cuda_devices()
    assert found or device.type == "cpu"
    chosen, why = decide_device("auto", found)
    assert chosen == (torch.device("cuda", 0) if found else torch.device("cpu"))
    assert "run.device=auto" in why
    assert decide_device("cpu", found)[0] == torch.device("cpu")


def test_a_gpu_index_past_the_last_names_those_there_are(device):
    found = cuda_devices()
    with pytest.raises(ValueError, match=rf"run\.device=cuda:{len(found)}") as raised:
        decide_device(f"cuda:{len(found)}", found)
    for index, name in enumerate(found):
        assert f"cuda:{index} ({name})" in str(raised.value)
    if found:
        assert decide_device(f"cuda:{len(found) - 1}", found)[0] == torch.device(
            "cuda", len(found) - 1
        )
        assert decide_device("cuda", found)[0].type == "cuda"
