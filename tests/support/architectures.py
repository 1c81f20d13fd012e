"""Small random-init models of each architecture the fused engine supports (Llama,
Mistral, Qwen2, Qwen3), built from the same SIZES: the fused and shared-prefix tests
compare their forwards against Hugging Face's."""

from __future__ import annotations

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SIZES = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=False)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=24)),
}
