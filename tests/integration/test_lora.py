"""LoRA: the trainer trains adapters only, engines serve base + adapter, folders load back.

On the tiny random Llama with SmolLM2's tokenizer. An adapter fresh from peft is a
no-op (lora_B starts at zero), so tests give it random lora_B first.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from looprl import adapters
from looprl.config import LoraConfig, TrainConfig
from looprl.engines.base import EngineError
from looprl.engines.local.engine import LocalEngine
from looprl.models import load_model, load_tokenizer
from looprl.training import lora
from looprl.training.batch import build_batch
from looprl.training.trainer import Trainer
from looprl.types import LoraAdapter, SamplingParams, Trajectory
from tests.support.batches import toy_batch, with_own_logprobs

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test

LORA = LoraConfig(rank=4, alpha=8)
F32 = TrainConfig(compute_dtype="float32", lr=1e-2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def lora_trainer(model_dir, cfg=F32, lora_cfg=LORA, seed=0) -> Trainer:
    trainer = Trainer(load_model(model_dir), cfg, lora=lora_cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # an adapter that does something
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return trainer


# (length, prompt tokens, reward, group): two groups of two with mixed rewards.
SHAPES = [(9, 4, 1.0, "a"), (12, 4, 0.0, "a"), (7, 3, 0.5, "b"), (10, 3, 0.0, "b")]


def test_only_the_adapters_train_and_the_base_is_frozen_in_the_compute_dtype(tiny_model_dir):
    trainer = lora_trainer(tiny_model_dir, F32.model_copy(update={"compute_dtype": "bfloat16"}))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    # 2 layers x 7 projections ("all-linear" leaves the LM head alone) x (A, B)
    assert len(trainable) == 28 and all("lora_" in n for n in trainable)
    assert {p.dtype for n, p in trainer.model.named_parameters() if n in trainable} == {
        torch.float32
    }
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16}  # held once, in the compute dtype
    assert sum(p.numel() for p in trainer.params) == sum(
        trainer.model.get_parameter(n).numel() for n in trainable
    )
    assert len(trainer.optimizer.param_groups[0]["params"]) == 28


def test_a_step_moves_the_adapters_and_leaves_the_base_bitwise_alone(tiny_model_dir):
    trainer = lora_trainer(tiny_model_dir)
    b = with_own_logprobs(toy_batch(SHAPES), trainer)
    base_before = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad
    }
    adapter_before = {n: t.clone() for n, t in trainer.adapter_for_engine().tensors.items()}
    stats = trainer.train_step(b)
    assert stats["grad_norm"] > 0
    for n, p in trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n
    after = trainer.adapter_for_engine().tensors
    assert any(not torch.equal(after[n], adapter_before[n]) for n in after)
    # the optimizer holds state for the adapters only
    assert len(trainer.optimizer.state) == 28


def test_checkpoint_state_is_the_adapter_only_and_resumes_exactly(tiny_model_dir):
    trainer = lora_trainer(tiny_model_dir)
    b = with_own_logprobs(toy_batch(SHAPES), trainer)
    trainer.train_step(b)
    state = trainer.state_dict()
    assert set(state["model"]) and all("lora_" in k for k in state["model"])
    base_numel = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad)
    assert sum(t.numel() for t in state["model"].values()) < base_numel / 50

    fresh = lora_trainer(tiny_model_dir, seed=9)  # other adapter values
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.compute_logprobs(b), trainer.compute_logprobs(b))
    # both take the same next step
    s1, s2 = trainer.train_step(b), fresh.train_step(b)
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)

    full = Trainer(load_model(tiny_model_dir), F32)
    with pytest.raises(ValueError, match="does not match model.lora"):
        fresh.load_state_dict(full.state_dict())


def test_the_kl_reference_is_the_base_with_adapters_off(tiny_model_dir):
    cfg = F32.model_copy(update={"kl_coef": 0.1})
    trainer = lora_trainer(tiny_model_dir, cfg)
    b = toy_batch(SHAPES)
    base = Trainer(load_model(tiny_model_dir), F32).compute_logprobs(b)
    torch.testing.assert_close(trainer._reference_logprobs(b), base)
    assert not torch.allclose(trainer.compute_logprobs(b), base, atol=1e-3)  # adapter is on
    stats = trainer.train_step(with_own_logprobs(b, trainer))
    assert stats["kl"] > 0


@pytest.mark.parametrize("impl,layout", [("fused", "packed"), ("fused", "plain"), ("hf", "plain")])
async def test_engine_with_adapter_samples_what_the_merged_model_samples(
    tiny_model_dir, tokenizer, impl, layout
):
    trainer = lora_trainer(tiny_model_dir)
    adapter = trainer.adapter_for_engine()
    base = load_model(tiny_model_dir)
    merged = load_model(tiny_model_dir)
    merged.load_state_dict(adapters.merge(base.state_dict(), adapter))

    def engine(model):
        return LocalEngine(
            model,
            eos_token_ids=[tokenizer.eos_token_id],
            dtype="float32",
            impl=impl,
            weight_layout=layout,
        )

    with_adapter, reference = engine(base), engine(merged)
    await with_adapter.update_adapter(adapter, version=3)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    sampling = SamplingParams(max_new_tokens=12, seed=5)
    try:
        got = await with_adapter.generate(prompt, sampling)
        want = await reference.generate(prompt, sampling)
    finally:
        await with_adapter.stop()
        await reference.stop()
    assert got.output_ids == want.output_ids
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0
    )
    assert got.versions == [3] * len(got.output_ids)
    # and they are the trainer's own logprobs of those tokens (peft's forward)
    ids = torch.tensor(prompt + got.output_ids)
    row = Trajectory(
        input_ids=ids,
        loss_mask=torch.arange(len(ids)) >= len(prompt),
        behavior_logprobs=torch.zeros(len(ids)),
        versions=torch.zeros(len(ids), dtype=torch.int64),
        reward=0.0,
    )
    trained = trainer.compute_logprobs(build_batch([row], "grpo", 2)[0])[0, len(prompt) :]
    torch.testing.assert_close(trained, torch.tensor(got.logprobs), atol=1e-4, rtol=0)


async def test_a_bad_adapter_is_refused_whole_and_the_engine_keeps_the_last_one(
    tiny_model_dir, tokenizer
):
    trainer = lora_trainer(tiny_model_dir)
    good = trainer.adapter_for_engine()
    engine = LocalEngine(
        load_model(tiny_model_dir), eos_token_ids=[tokenizer.eos_token_id], dtype="float32"
    )
    prompt = tokenizer.encode("Hello there")
    sampling = SamplingParams(max_new_tokens=6, temperature=0)
    try:
        await engine.update_adapter(good, version=1)
        before = await engine.generate(prompt, sampling)
        hidden = load_model(tiny_model_dir).config.hidden_size
        vocab = len(tokenizer)
        bad = LoraAdapter(
            {
                **good.tensors,
                "lm_head.lora_A.weight": torch.zeros(4, hidden),
                "lm_head.lora_B.weight": torch.zeros(vocab, 4),
            },
            rank=4,
            alpha=8,
            target_modules=(*good.target_modules, "lm_head"),
        )
        with pytest.raises(EngineError, match=r"lm_head.*fused forward does not apply"):
            await engine.update_adapter(bad, version=2)
        assert engine.version == 1
        after = await engine.generate(prompt, sampling)
    finally:
        await engine.stop()
    assert after.output_ids == before.output_ids and after.versions[0] == 1


def test_adapter_folder_loads_in_peft_and_as_a_merged_model(tiny_model_dir, tokenizer, tmp_path):
    trainer = lora_trainer(tiny_model_dir)
    out = lora.save_outputs(
        trainer.adapter_for_engine(), lora.base_path(trainer.model), tokenizer, tmp_path / "model"
    )
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("adapter_")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    ids = torch.tensor([tokenizer.encode("The answer is 42, or so")])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(load_model(tiny_model_dir), out)
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-4, rtol=0)
        # looprl's own loader takes the adapter folder as base + merged adapter
        torch.testing.assert_close(load_model(out)(input_ids=ids).logits, want, atol=1e-4, rtol=0)
        adapter, base = trainer.adapter_for_engine(), lora.base_path(trainer.model)
        merged_dir = lora.save_merged(adapter, base, tokenizer, tmp_path / "merged")
        torch.testing.assert_close(
            load_model(merged_dir)(input_ids=ids).logits, want, atol=1e-4, rtol=0
        )
    assert load_tokenizer(out).encode("hi") == tokenizer.encode("hi")
