"""The trainer on a real (tiny, random-init) Llama with SmolLM2's tokenizer."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from looprl.config import TrainConfig
from looprl.diagnostics.oom import PhaseOutOfMemory
from looprl.models import load_model
from looprl.training.batch import TrainBatch, build_batch
from looprl.training.trainer import Trainer, lr_factor, sampled_logprobs
from looprl.types import Trajectory
from tests.support.batches import PAD, toy_batch, with_own_logprobs

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test

# (length, prompt tokens, reward, group): two groups of three with mixed rewards.
SHAPES = [(9, 4, 1.0, "a"), (12, 4, 0.0, "a"), (7, 4, 0.0, "a"),
          (10, 5, 1.0, "b"), (6, 5, 1.0, "b"), (11, 5, 0.0, "b")]  # fmt: skip


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_compute_logprobs_matches_a_manual_log_softmax_gather(model):
    batch = toy_batch(SHAPES, model=model)
    trainer = Trainer(
        model, TrainConfig(max_tokens_per_mb=24, compute_dtype="float32"), temperature=0.7
    )
    got = trainer.compute_logprobs(batch)  # several micro-batches, scattered back
    assert got.dtype == torch.float32 and got.shape == batch.input_ids.shape
    for i in range(batch.num_sequences):
        n = int(batch.lengths[i])
        ids = batch.input_ids[i, :n]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0] / 0.7  # (n, V)
        expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1)
        assert got[i, 0] == 0
        torch.testing.assert_close(got[i, 1:n], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "turn_token_mean"]
)
def test_gradients_do_not_depend_on_the_micro_batch_split(model, agg):
    batch = toy_batch(SHAPES, model=model)
    if agg == "turn_token_mean":  # rows alternate between rollouts' first and second calls
        batch = replace(batch, turn=torch.tensor([1, 2] * (batch.num_sequences // 2)))
    # float64 weights: in float32 the summation order alone moves gradients by ~6e-7
    # (~6e-6 of their largest entry); in float64 by ~1e-16, so any gap left is the split's.
    model = copy.deepcopy(model).double()
    ref_model = copy.deepcopy(model)
    # Perturb proximal and reference logprobs so some tokens are clipped, some behavior
    # weights are capped and the KL term is not zero.
    gen = torch.Generator().manual_seed(1)
    noise = 0.5 * torch.randn(batch.input_ids.shape, generator=gen)
    batch = replace(
        batch,
        proximal_logprobs=batch.behavior_logprobs + noise,
        ref_logprobs=batch.behavior_logprobs - noise.abs(),
    )
    grads, counts = [], []
    # One micro-batch; then lengths [9, 12, 7, 10, 6, 11] in 16 tokens: 12 | 11 | 10 | 9 | 7, 6
    for budget in (4096, 16):
        cfg = TrainConfig(compute_dtype="float32", loss_agg=agg, max_tokens_per_mb=budget,
                          kl_coef=0.1, mismatch_cap=1.5)  # fmt: skip
        trainer = Trainer(model, cfg, ref_model=ref_model)
        model.zero_grad(set_to_none=True)
        stats = trainer.accumulate_gradients(batch)
        counts.append(stats["num_micro_batches"])
        grads.append([p.grad.clone() for p in trainer.params])
    assert counts == [1, 5]
    assert stats["clip_frac"] > 0 and stats["mismatch_corrected_frac"] > 0 and stats["kl"] > 0
    assert max(float(g.abs().max()) for g in grads[0]) > 1e-2
    diff = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
    assert diff < 1e-9


def test_train_step_raises_logprobs_of_positive_advantage_tokens(model):
    model = copy.deepcopy(model)
    batch = toy_batch(SHAPES, model=model)
    trainer = Trainer(
        model, TrainConfig(compute_dtype="float32", lr=1e-3, ppo_epochs=2, mini_batches=2)
    )
    before_weights = {k: v.clone() for k, v in trainer.state_dict_for_engine().items()}
    before = trainer.compute_logprobs(batch)
    stats = trainer.train_step(batch)
    after = trainer.compute_logprobs(batch)

    assert trainer.version == 1 and stats["version"] == 1
    assert stats["optimizer_steps"] == 4 and stats["num_micro_batches"] == 4
    for key in ("loss", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr", "tokens_per_s"):
        assert math.isfinite(stats[key]), key
    assert stats["lr"] == 1e-3
    weights = trainer.state_dict_for_engine()
    assert any(not torch.equal(weights[k], before_weights[k]) for k in weights)
    assert all(not v.requires_grad for v in weights.values())

    gain = ((after - before) * batch.loss_mask).sum(dim=1)  # (N,) summed over sampled tokens
    positive, negative = batch.advantages > 0, batch.advantages < 0
    assert bool((gain[positive] > 0).all()), gain
    assert bool((gain[negative] < 0).all()), gain


def test_bf16_autocast_step_keeps_float32_logprobs(model):
    model = copy.deepcopy(model)
    batch = toy_batch(SHAPES, model=model)
    trainer = Trainer(model, TrainConfig(compute_dtype="bfloat16"))
    assert trainer.compute_logprobs(batch).dtype == torch.float32
    stats = trainer.train_step(batch)
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    assert next(model.parameters()).dtype == torch.float32


def test_state_dict_round_trip(model):
    model = copy.deepcopy(model)
    batch = toy_batch(SHAPES, model=model)
    cfg = TrainConfig(compute_dtype="float32", lr=1e-3, warmup_steps=2)
    trainer = Trainer(model, cfg)
    trainer.train_step(batch)
    state = copy.deepcopy(trainer.state_dict())
    trainer.train_step(batch)
    expected = trainer.compute_logprobs(batch)

    restored = Trainer(copy.deepcopy(model), cfg)
    restored.load_state_dict(state)
    assert restored.version == 1
    assert restored.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # warmup step 2 of 2
    restored.train_step(batch)
    torch.testing.assert_close(restored.compute_logprobs(batch), expected)


def test_reference_model_errors(model):
    with pytest.raises(ValueError, match="train.kl_coef=0.1 needs a reference model"):
        Trainer(model, TrainConfig(compute_dtype="float32", kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_model is the policy model itself"):
        Trainer(model, TrainConfig(compute_dtype="float32", kl_coef=0.1), ref_model=model)


def test_lr_schedule():
    cfg = TrainConfig(compute_dtype="float32", warmup_steps=2, total_steps=6, lr_schedule="cosine")
    # warmup 1/2, 1; then cosine over 4 steps: progress 0, .25, .5, .75 -> 1, .853553, .5, .146447
    got = [lr_factor(step, cfg) for step in range(6)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447], abs=1e-6)
    linear = cfg.model_copy(update={"lr_schedule": "linear"})
    assert [lr_factor(s, linear) for s in (2, 4, 9)] == pytest.approx([1.0, 0.5, 0.0])


def test_single_update_takes_proximal_logprobs_from_the_training_forward(model):
    """With one optimizer step per batch, proximal = the forward's own logprobs (detached):
    the gradient equals the one computed with a separate proximal pass."""
    batch = toy_batch(SHAPES, model=model)
    grads = []
    for proximal in (None, "separate pass"):
        trainer = Trainer(model, TrainConfig(compute_dtype="float32", max_tokens_per_mb=24))
        filled = trainer.compute_logprobs(batch) if proximal else None
        model.zero_grad(set_to_none=True)
        stats = trainer.accumulate_gradients(replace(batch, proximal_logprobs=filled))
        assert stats["clip_frac"] == 0.0 and abs(stats["ratio_mean"] - 1.0) < 1e-6
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
    assert grads[0].abs().sum() > 0


def test_a_forced_oom_names_its_phase_and_max_tokens_per_mb(model, monkeypatch):
    """Fault injection: a real out-of-memory error would take this machine down."""
    batch = toy_batch(SHAPES, model=model)
    trainer = Trainer(
        copy.deepcopy(model), TrainConfig(compute_dtype="float32", max_tokens_per_mb=512)
    )

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "_sampled_logits", out_of_memory)
    with pytest.raises(PhaseOutOfMemory) as caught:
        trainer.train_step(batch)
    message = str(caught.value)
    assert message.startswith("Out of memory during training (train.max_tokens_per_mb=512")
    assert "Tried to allocate 2.00 GiB" in message
    assert "lower train.max_tokens_per_mb" in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)

    monkeypatch.setattr(trainer, "_logits", out_of_memory)
    with pytest.raises(PhaseOutOfMemory, match="during logprob recomputation"):
        trainer.compute_logprobs(batch)

    # Not every error is an OOM: others pass through unchanged.
    monkeypatch.setattr(trainer, "_logits", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        trainer.compute_logprobs(batch)


def _shared_prompt_batch(model, rewards: dict[str, list[float]]) -> TrainBatch:
    """Per group, its rows: one 24-token prompt shared by the group, then 3-12 sampled
    tokens each; the rewards given (a group with equal rewards gets zero advantage);
    behavior logprobs from the model itself."""
    gen = torch.Generator().manual_seed(2)
    trajectories = []
    for group, group_rewards in rewards.items():
        prompt = torch.randint(3, 1000, (24,), generator=gen)
        for reward in group_rewards:
            sampled = torch.randint(3, 1000, (int(torch.randint(3, 13, (), generator=gen)),))
            ids = torch.cat([prompt, sampled])
            loss_mask = torch.arange(len(ids)) >= len(prompt)
            trajectories.append(
                Trajectory(
                    ids,
                    loss_mask,
                    torch.where(loss_mask, -3.0, 0.0),
                    torch.where(loss_mask, 0, -1),
                    reward,
                    group_id=group,
                )  # fmt: skip
            )
    batch = build_batch(trajectories, "grpo", PAD)[0]
    return with_own_logprobs(batch, Trainer(model, TrainConfig(compute_dtype="float32")))


def _gradients(trainer: Trainer, batch: TrainBatch) -> tuple[list[torch.Tensor], dict]:
    trainer.model.zero_grad(set_to_none=True)
    stats = trainer.accumulate_gradients(batch)
    return [p.grad.clone() for p in trainer.params], stats


def test_a_groups_shared_prompt_runs_once_with_the_same_gradients(model, monkeypatch):
    """Packed (each prompt once, no padding between rows) vs the plain padded forward,
    in float64: the same loss gradients, from fewer tokens through the decoder."""
    from looprl.training import shared_prefix

    batch = _shared_prompt_batch(model, {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.0, 1.0, 1.0]})
    trainer = Trainer(copy.deepcopy(model).double(), TrainConfig(compute_dtype="float32"))
    packed, _ = _gradients(trainer, batch)
    forwards = []
    real_hidden = trainer._hidden
    monkeypatch.setattr(trainer, "_hidden", lambda m, mb: forwards.append(mb) or real_hidden(m, mb))
    monkeypatch.setattr(shared_prefix, "supports", lambda model: False)
    plain, _ = _gradients(trainer, batch)
    assert max(float(g.abs().max()) for g in plain) > 1e-2
    for a, b in zip(packed, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=0)
    assert forwards  # the plain run went through the padded forward


def test_rows_with_zero_advantage_are_left_out_with_the_same_gradients(model, monkeypatch):
    """Group "b"'s rewards are all equal: its rows add nothing to the gradient, so they
    are not run; the loss is still normalized over every row's tokens."""
    from looprl.training import trainer as trainer_module

    batch = _shared_prompt_batch(model, {"a": [1.0, 0.0, 0.0], "b": [1.0, 1.0, 1.0, 1.0]})
    assert (batch.advantages[3:] == 0).all() and (batch.advantages[:3] != 0).all()
    trainer = Trainer(copy.deepcopy(model).double(), TrainConfig(compute_dtype="float32"))
    skipped, skipped_stats = _gradients(trainer, batch)
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "_rows_with_gradient", lambda b: torch.arange(len(b.lengths)))
        every, every_stats = _gradients(trainer, batch)
    assert skipped_stats["num_tokens"] == int(batch.lengths[:3].sum())
    assert every_stats["num_tokens"] == batch.num_tokens
    # Llama's RMSNorm computes in float32 even in a float64 model, and the packed rows'
    # widths differ between the runs: ~1e-7 of the largest value apart.
    assert skipped_stats["loss"] == pytest.approx(every_stats["loss"], rel=1e-6)
    assert max(float(g.abs().max()) for g in every) > 1e-2
    for a, b in zip(skipped, every, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=0)


def test_a_batch_with_no_advantage_still_gives_every_parameter_a_zero_gradient(model):
    """AdamW steps every parameter that has a gradient (momentum, weight decay); a batch
    of all-equal rewards must leave them as the whole batch would: zero, not None."""
    batch = _shared_prompt_batch(model, {"a": [1.0, 1.0], "b": [0.0, 0.0, 0.0]})
    trainer = Trainer(copy.deepcopy(model), TrainConfig(compute_dtype="float32"))
    grads, stats = _gradients(trainer, batch)
    assert stats["num_tokens"] == int(batch.lengths.min())
    assert len(grads) == len(trainer.params) and all((g == 0).all() for g in grads)


def test_mismatch_metrics_cover_the_tokens_of_the_trainers_version(model):
    """The engine's logprobs are the model's own plus 0.1 on tokens of version 0 (the
    trainer's) and minus 1 on tokens of an older version 7: the metrics see only the
    former, and say which share of the tokens that was."""
    batch = toy_batch(SHAPES, model=model)
    stale = torch.zeros_like(batch.loss_mask)
    stale[:2] = batch.loss_mask[:2]  # rows 0 and 1 were sampled by version 7
    fresh = batch.loss_mask & ~stale
    behavior = batch.behavior_logprobs + 0.1 * fresh - 1.0 * stale
    batch = replace(
        batch, behavior_logprobs=behavior, versions=torch.where(stale, 7, batch.versions)
    )
    trainer = Trainer(model, TrainConfig(compute_dtype="float32"))
    model.zero_grad(set_to_none=True)
    stats = trainer.accumulate_gradients(batch)
    model.zero_grad(set_to_none=True)
    # r = trainer - engine = -0.1 on every fresh token (to float32 rounding):
    # |r| 0.1, k3 = exp(-0.1) - 1 + 0.1 = 0.0048374, ratio 0.905 inside [0.5, 2].
    assert stats["mismatch_tokens_frac"] == pytest.approx(
        int(fresh.sum()) / batch.num_sampled_tokens
    )
    assert stats["mismatch_logprob_abs_mean"] == pytest.approx(0.1, abs=1e-5)
    assert stats["mismatch_kl_k3"] == pytest.approx(0.0048374, abs=1e-5)
    assert stats["mismatch_ratio_outside_frac"] == 0.0  # exp(1) = 2.7 on stale tokens


def test_sampled_logprobs_under_top_k_and_top_p_by_hand():
    # One position, probabilities [0.4, 0.3, 0.15, 0.1, 0.05].
    logits = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]).log().requires_grad_(True)

    def logprob(picked, **truncation):
        return float(sampled_logprobs(logits, torch.tensor([picked]), **truncation).detach())

    assert logprob(1) == pytest.approx(math.log(0.3))  # full softmax
    assert logprob(1, top_k=2) == pytest.approx(math.log(0.3 / 0.7))  # {0, 1}
    # top_p 0.8: mass before each token 0, .4, .7, .85, .95: {0, 1, 2} (0.85) kept
    assert logprob(2, top_p=0.8) == pytest.approx(math.log(0.15 / 0.85))
    # top_k 3 then top_p 0.6 of the renormalized [.47, .35, .18]: mass before .47, .82: {0, 1}
    assert logprob(0, top_k=3, top_p=0.6) == pytest.approx(math.log(0.4 / 0.7))
    # The sampled token stays in the set even where these logits would drop it: {0, 3}
    assert logprob(3, top_k=1) == pytest.approx(math.log(0.1 / 0.5))
    # Gradient: 1[j = picked] - p_j over the kept set, 0 off it
    sampled_logprobs(logits, torch.tensor([1]), top_k=2).sum().backward()
    expected = torch.tensor([[-0.4 / 0.7, 1 - 0.3 / 0.7, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(logits.grad, expected)


def test_compute_logprobs_and_the_training_forward_truncate_alike(model):
    """With top_k / top_p the proximal pass and the training forward renormalize over
    the same set: the single-update gradient equals the one with a separate pass."""
    batch = toy_batch(SHAPES, model=model)
    full = Trainer(model, TrainConfig(compute_dtype="float32")).compute_logprobs(batch)
    trainer = Trainer(model, TrainConfig(compute_dtype="float32"), top_k=50, top_p=0.9)
    truncated = trainer.compute_logprobs(batch)
    mask = batch.loss_mask
    # Renormalized over fewer tokens: every sampled token's logprob rises.
    assert bool((truncated[mask] > full[mask] + 1e-3).all())
    assert torch.equal(truncated[~mask], full[~mask])  # prompt positions untouched
    grads = []
    for proximal in (None, truncated):
        model.zero_grad(set_to_none=True)
        stats = trainer.accumulate_gradients(replace(batch, proximal_logprobs=proximal))
        assert abs(stats["ratio_mean"] - 1.0) < 1e-5
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
def test_every_objective_trains_and_a_batch_left_out_gives_zero_gradients(model, objective):
    """On-policy (one update) every objective's gradient is REINFORCE's: the same for all
    three. A batch whose every sample was left out of the loss (truncated) trains on
    nothing: finite stats, zero gradients."""
    batch = toy_batch(SHAPES, model=model)
    cfg = TrainConfig(compute_dtype="float32", objective=objective)
    trainer = Trainer(copy.deepcopy(model), cfg)
    grads, stats = _gradients(trainer, batch)
    ppo, _ = _gradients(Trainer(copy.deepcopy(model), TrainConfig(compute_dtype="float32")), batch)
    for a, b in zip(grads, ppo, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # Off-policy the objectives differ: GSPO's ratio is per sequence, CISPO keeps
    # clipped tokens' gradients.
    noise = 0.5 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    noisy = replace(batch, proximal_logprobs=batch.behavior_logprobs + noise)
    moved, _ = _gradients(trainer, noisy)
    ppo_moved, _ = _gradients(
        Trainer(copy.deepcopy(model), TrainConfig(compute_dtype="float32")), noisy
    )
    differs = max(float((a - b).abs().max()) for a, b in zip(moved, ppo_moved, strict=True))
    assert (differs > 1e-4) == (objective != "ppo")

    left_out = replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))
    grads, stats = _gradients(trainer, replace(left_out, advantages=torch.zeros(6)))
    assert all((g == 0).all() for g in grads)
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert stats["loss"] == 0


def test_distillation_from_itself_gives_zero_advantages_and_leaves_the_weights(model):
    student = copy.deepcopy(model)
    batch = toy_batch(SHAPES, algorithm="distill", model=student)
    assert bool((batch.advantages == 0).all())
    cfg = TrainConfig(compute_dtype="float32", lr=1e-2, algorithm="distill", teacher_path="t")
    trainer = Trainer(student, cfg, teacher_model=copy.deepcopy(model))
    before = {k: v.clone() for k, v in trainer.state_dict_for_engine().items()}
    stats = trainer.train_step(batch)
    assert stats["distill_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(0.0, abs=1e-6)
    after = trainer.state_dict_for_engine()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_distillation_moves_the_students_logprobs_toward_the_teachers(model):
    student = copy.deepcopy(model)
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    batch = toy_batch(SHAPES, algorithm="distill", model=student)
    target = Trainer(copy.deepcopy(teacher), TrainConfig(compute_dtype="float32"))
    target = target.compute_logprobs(batch)
    cfg = TrainConfig(compute_dtype="float32", lr=1e-4, algorithm="distill", teacher_path="t")
    trainer = Trainer(student, cfg, teacher_model=teacher)
    gaps, kls, expected_kls = [], [], []
    for _ in range(5):
        logprobs = trainer.compute_logprobs(batch)
        gaps.append(float((logprobs - target).abs()[batch.loss_mask].mean()))
        expected_kls.append(float((logprobs - target)[batch.loss_mask].mean()))
        kls.append(trainer.train_step(batch)["distill_kl"])
    # the k1 estimate of KL(student || teacher) on the sampled tokens, before each update
    assert kls == pytest.approx(expected_kls, abs=1e-4)
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:], strict=False)), gaps
    assert gaps[-1] < 0.7 * gaps[0], gaps


def test_distillation_needs_its_teacher(model):
    with pytest.raises(ValueError, match="teacher"):
        Trainer(
            copy.deepcopy(model),
            TrainConfig(compute_dtype="float32", algorithm="distill", teacher_path="t"),
        )
    with pytest.raises(ValueError, match="teacher"):
        Trainer(copy.deepcopy(model), TrainConfig(compute_dtype="float32"), teacher_model=model)


def test_activation_checkpointing_gives_the_same_gradients(model):
    """...while the decoder keeps a fraction of its activations for the backward pass."""
    batch = toy_batch(SHAPES, model=model)
    grads, saved = [], []
    for checkpointing in (False, True):
        cfg = TrainConfig(compute_dtype="float32", activation_checkpointing=checkpointing)
        trainer = Trainer(copy.deepcopy(model), cfg)
        trainer.model.train()
        trainer.accumulate_gradients(batch)
        grads.append(trainer.full_gradients())
        numel = [0]

        def count(tensor, numel=numel):
            numel[0] += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
            trainer.model.get_decoder()(input_ids=batch.input_ids, use_cache=False)
        saved.append(numel[0])
    assert saved[1] < 0.3 * saved[0], saved
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_a_single_update_records_its_forwards_logprobs_for_the_trajectory_files(model):
    """step_logprobs under one optimizer step: the training forward's own (the weights
    before the update) at each row it ran, NaN at the rows it left out (zero advantage)."""
    batch = toy_batch(SHAPES, model=model)
    batch = replace(batch, advantages=torch.where(torch.arange(6) == 2, 0.0, batch.advantages))
    trainer = Trainer(copy.deepcopy(model), TrainConfig(compute_dtype="float32"))
    before = trainer.compute_logprobs(batch)
    trainer.train_step(batch)
    recorded = trainer.step_logprobs
    ran = batch.advantages != 0
    assert not bool(ran[2]) and int(ran.sum()) == 5
    mask = batch.loss_mask
    torch.testing.assert_close(recorded[ran][mask[ran]], before[ran][mask[ran]], atol=1e-5, rtol=0)
    assert bool(recorded[2].isnan().all())
    assert bool(recorded[~mask].isnan().all())  # nothing off the mask


def test_distillation_advantages_are_the_teacher_gap_minus_the_batch_mean(model, monkeypatch):
    """A_t = (log pi_teacher - log pi) - b, b the batch's mean gap over sampled tokens
    (against the engine's logprobs, here the student's own): they sum to 0."""
    student, teacher = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    batch = toy_batch(SHAPES, algorithm="distill", model=student)
    teacher_logprobs = Trainer(copy.deepcopy(teacher), TrainConfig(compute_dtype="float32"))
    gap = teacher_logprobs.compute_logprobs(batch) - batch.behavior_logprobs  # (N, T)
    expected = torch.where(batch.loss_mask, gap - gap[batch.loss_mask].mean(), 0.0)
    seen = []
    import looprl.training.trainer as trainer_module

    def recording(logprobs, proximal, advantages, mask, **kw):
        seen.append(advantages.detach())
        return losses_policy_loss(logprobs, proximal, advantages, mask, **kw)

    losses_policy_loss = trainer_module.policy_loss
    monkeypatch.setattr(trainer_module, "policy_loss", recording)
    cfg = TrainConfig(compute_dtype="float32", algorithm="distill", teacher_path="t")
    Trainer(student, cfg, teacher_model=teacher).train_step(batch)
    assert len(seen) == 1  # one micro-batch: every row, as the batch is small
    torch.testing.assert_close(seen[0], expected[:, : seen[0].shape[1]], atol=2e-5, rtol=0)
