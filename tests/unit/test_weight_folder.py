"""WeightFolder: real files, loaded back with Hugging Face's own loader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from looprl.engines.servers.weight_folder import WeightFolder
from looprl.models import load_tokenizer
from looprl.types import LoraAdapter
from tests.conftest import tiny_llama_config


@pytest.fixture
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _tied_model(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(tokenizer, tie_word_embeddings=True)).eval()


def _logits(model, ids=(1, 5, 9, 200, 7)) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits


def test_a_version_is_a_complete_model_folder_with_its_version(tmp_path, tokenizer):
    model = _tied_model(tokenizer)
    folder = WeightFolder.for_model(tmp_path / "weights", model, tokenizer, "float32")
    path = folder.write(model.state_dict(), 3)

    assert path == tmp_path / "weights" / "v000003"
    assert json.loads((path / "version.json").read_text()) == {"version": 3}
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (path / name).is_file()
    assert (path / "tokenizer_config.json").is_file()
    # tied weights are stored twice and the config unties them (see the module docstring)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(path / "model.safetensors", "pt") as f:
        assert torch.equal(
            f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
        )
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert torch.equal(_logits(loaded), _logits(model))
    assert model.config.tie_word_embeddings  # the caller's config is left alone


def test_bfloat16_versions_hold_bfloat16_tensors(tmp_path, tokenizer):
    model = _tied_model(tokenizer)
    folder = WeightFolder.for_model(tmp_path, model, tokenizer, "bfloat16")
    path = folder.write(model.state_dict(), 0)
    with safe_open(path / "model.safetensors", "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118
    assert dtypes == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (_logits(loaded) - _logits(model)).abs().max() < 0.1


def test_newest_versions_are_kept_and_nothing_half_written_is_left(tmp_path, tokenizer):
    model = _tied_model(tokenizer)
    folder = WeightFolder.for_model(tmp_path, model, tokenizer, "float32")  # keeps 2
    for version in range(4):
        with torch.no_grad():
            model.model.norm.weight.fill_(version)
        folder.write(model.state_dict(), version)
    assert folder.versions() == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".files", "v000002", "v000003"]

    # writing a version again replaces it (a resumed run writes its version once more)
    with torch.no_grad():
        model.model.norm.weight.fill_(7)
    folder.write(model.state_dict(), 3)
    with safe_open(folder.path(3) / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.norm.weight").unique().tolist() == [7.0]
    # a new folder on the same root starts empty, so an earlier run's higher versions
    # cannot outrank (and prune) the first version this run writes
    again = WeightFolder.for_model(tmp_path, model, tokenizer, "float32")
    assert again.versions() == []
    again.write(model.state_dict(), 0)
    assert again.versions() == [0]
    again.remove()
    assert not tmp_path.exists()


def test_a_lower_version_written_last_is_kept_and_adapters_are_pruned_alike(tmp_path, tokenizer):
    model = _tied_model(tokenizer)
    folder = WeightFolder.for_model(tmp_path, model, tokenizer, "float32")  # keeps 2
    for version in (1, 2, 3, 1):  # a lower version written again, e.g. by a bench
        path = folder.write(model.state_dict(), version)
    assert path.is_dir() and folder.versions() == [1, 3]  # 2 was the oldest write
    a = torch.zeros(4, model.config.hidden_size)
    b = torch.zeros(model.config.hidden_size, 4)
    name = "model.layers.0.self_attn.o_proj"
    adapter = LoraAdapter(
        {f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b},
        rank=4,
        alpha=8,
        target_modules=("o_proj",),
    )
    for version in (1, 2, 3, 1):
        written = folder.write_adapter(adapter, version)
    assert written.is_dir() and (written / "adapter_config.json").is_file()
    assert sorted(p.name for p in tmp_path.glob("lora-v*")) == ["lora-v000001", "lora-v000003"]


def test_options_are_checked(tmp_path, tokenizer):
    model = _tied_model(tokenizer)
    with pytest.raises(ValueError, match="engine dtype='float16'"):
        WeightFolder.for_model(tmp_path, model, tokenizer, "float16")
    folder = WeightFolder.for_model(tmp_path, model, tokenizer, "float32")
    with pytest.raises(ValueError, match="version=-1"):
        folder.write(model.state_dict(), -1)
