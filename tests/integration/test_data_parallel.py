"""DataParallelTrainer on two real gloo ranks against the one-process Trainer.

The rank functions live here, at module level, so spawned ranks import them by name.
The test process builds each batch once and saves it; every rank loads that same file.

Tolerances, float32 weights without autocast: the ranks pack rows into other
micro-batches than one process does, and sum the gradients in another order, so results
agree to float32 rounding, not bitwise. Measured maxima (largest gradient entry ~1):
gradients 1.4e-6 apart (0 where both pack every row alone), logprobs 1e-6, stats 6e-6
relative, weights 8e-7 after one optimizer step and 6.3e-5 after four (a few entries whose
gradient is near AdamW's eps, where Adam amplifies rounding). Asserted: gradients and
logprobs within atol=1e-5, rtol=1e-5; stats within rel=1e-4; weights within atol=1e-4, a
tenth of one lr=1e-3 Adam step. Averaged instead of summed gradients, or a loss normalized
by a rank's own rows, miss by about half of each gradient.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from looprl.config import LoraConfig, TrainConfig
from looprl.models import load_model, load_tokenizer
from looprl.runs.checkpoint import load_tree, save_tree
from looprl.training.batch import TrainBatch, micro_batch_indices, split_mini_batches
from looprl.training.distributed import DataParallelTrainer, balanced_shards
from looprl.training.trainer import Trainer
from tests.conftest import tiny_llama_config
from tests.support.batches import toy_batch
from tests.support.ranks import Rank, launch_ranks

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test

ATOL, RTOL = 1e-5, 1e-5  # gradients, logprobs
STATS_REL = 1e-4
WEIGHTS_ATOL = 1e-4
# (length, prompt tokens) of each sequence.
SHAPES = {
    # FFD in 16 tokens: rank 0 gets 3 micro-batches, rank 1 gets 4 (one placeholder pass).
    "uneven": [(9, 4), (12, 4), (7, 4), (10, 5), (6, 5), (11, 5), (15, 3), (5, 2)],
    # One long row alone on rank 0 (1 micro-batch), three short ones on rank 1 (2).
    "unbalanced": [(60, 10), (6, 2), (5, 2), (4, 2)],
    # Fewer rows than ranks: rank 1 has no row and runs placeholder passes only.
    "one_row": [(14, 4)],
}
# name -> (TrainConfig fields, batch, model). All with compute_dtype="float32".
CASES = {
    "token_mean": (dict(loss_agg="token_mean", max_tokens_per_mb=16), "uneven", "tiny"),
    "seq_mean_token_mean": (
        dict(loss_agg="seq_mean_token_mean", max_tokens_per_mb=16),
        "uneven",
        "tiny",
    ),
    # Four optimizer steps: proximal logprobs recomputed, reference logprobs for the KL.
    "ppo_epochs_mini_batches_kl": (
        dict(max_tokens_per_mb=24, ppo_epochs=2, mini_batches=2, kl_coef=0.1),
        "uneven",
        "tiny",
    ),
    "unbalanced": (
        dict(loss_agg="seq_mean_token_sum_norm", max_tokens_per_mb=16),
        "unbalanced",
        "tiny",
    ),
    "one_row": (dict(max_tokens_per_mb=16), "one_row", "tiny"),
    "tied_embeddings": (dict(max_tokens_per_mb=16), "uneven", "tied"),
}
# Stats that depend on the split into micro-batches or on time, not on the update.
SPLIT_STATS = {"num_micro_batches", "tokens_per_s", "train_time_s"}


def _config(case: str) -> TrainConfig:
    fields, _, _ = CASES[case]
    return TrainConfig(compute_dtype="float32", lr=1e-3, **fields)


def _trainer(cls, case: str, model_dirs: dict[str, Path]) -> Trainer:
    cfg = _config(case)
    model_dir = model_dirs[CASES[case][2]]
    ref_model = load_model(model_dir) if cfg.kl_coef > 0 else None
    return cls(load_model(model_dir), cfg, ref_model=ref_model)


def _run_case(trainer: Trainer, batch: TrainBatch) -> dict:
    """Gradients of the whole batch before any step, then one train_step."""
    trainer.optimizer.zero_grad(set_to_none=True)
    grad_stats = trainer.accumulate_gradients(batch)
    grads = trainer.full_gradients()
    logprobs = trainer.compute_logprobs(batch)
    step_stats = trainer.train_step(batch)
    weights = trainer.state_dict_for_engine()
    return dict(
        grad_stats=grad_stats,
        grads=grads,
        logprobs=logprobs,
        step_stats=step_stats,
        weights={k: v.clone() for k, v in weights.items()},
    )


def on_two_ranks(rank: Rank, model_dirs: dict[str, Path], out: Path) -> None:
    """Everything this module checks on two ranks, in one launch: starting the ranks
    (spawn, imports, process group) takes ~10 s of the 2-core test machine."""
    train_cases(rank, model_dirs, out)
    checkpoint_round_trip(rank, model_dirs["tiny"], out)
    different_batches(rank, model_dirs["tiny"], out)
    lora_steps(rank, model_dirs["tiny"], out)


def train_cases(rank: Rank, model_dirs: dict[str, Path], out: Path) -> None:
    batches = _batches(out)
    for case in CASES:
        trainer = _trainer(DataParallelTrainer, case, model_dirs)
        result = _run_case(trainer, batches[CASES[case][1]])
        if rank.rank != 0:  # other ranks keep what must be identical on every rank
            result = {key: result[key] for key in ("grad_stats", "step_stats", "logprobs")}
        torch.save(result, out / f"{case}-rank{rank.rank}.pt")
        rank.watchdog.beat()


def checkpoint_round_trip(rank: Rank, model_dir: Path, out: Path) -> None:
    """Step, save, step (rank 0 records the weights); then a fresh trainer loads the save
    and steps once more. With one rank it only loads the save of two and steps."""
    batch = _batches(out)["uneven"]
    cfg = TrainConfig(compute_dtype="float32", lr=1e-3, warmup_steps=2, max_tokens_per_mb=16)
    saved = out / "checkpoint"  # the trainer state as recover checkpoints write it
    if rank.world_size == 2:
        trainer = DataParallelTrainer(load_model(model_dir), cfg)
        trainer.train_step(batch)
        state = trainer.state_dict()
        if rank.rank == 0:
            saved.mkdir()
            save_tree(state, saved, "trainer")
        else:
            assert state["model"] == {} and state["optimizer"] == {}
        trainer.train_step(batch)
        _save_weights(trainer, out / "continued.pt")
        torch.distributed.barrier()  # the save is complete
    restored = DataParallelTrainer(load_model(model_dir), cfg)
    restored.load_state_dict(load_tree(saved, "trainer"))
    assert restored.version == 1
    restored.train_step(batch)
    _save_weights(restored, out / f"restored-on-{rank.world_size}.pt")


def different_batches(rank: Rank, model_dir: Path, out: Path) -> None:
    """Rank 1 is given one row less: every rank raises, none waits forever."""
    batch = _batches(out)["uneven"]
    if rank.rank == 1:
        batch = batch.select(torch.arange(1, batch.num_sequences))
    trainer = DataParallelTrainer(load_model(model_dir), TrainConfig(compute_dtype="float32"))
    with pytest.raises(ValueError) as caught:
        trainer.train_step(batch)
    (out / f"different-batches-rank{rank.rank}.txt").write_text(str(caught.value))


def lora_steps(rank: Rank | None, model_dir: Path, out: Path) -> dict:
    """Two steps of a LoRA trainer (the adapters of the same seed), its adapter as engines
    get it and its state for a checkpoint; then a fresh trainer loads that state. With
    `rank` None, in this process with the one-process Trainer."""
    batch = _batches(out)["uneven"]
    cfg = TrainConfig(compute_dtype="float32", lr=1e-3, max_tokens_per_mb=16)
    cls = Trainer if rank is None else DataParallelTrainer
    torch.manual_seed(0)  # peft's lora_A init
    trainer = cls(load_model(model_dir), cfg, lora=LoraConfig(rank=4))
    for _ in range(2):
        trainer.train_step(batch)
    result = {"adapter": trainer.adapter_for_engine().tensors, "state": trainer.state_dict()}
    state = [result["state"]]
    if rank is not None:  # every rank loads rank 0's state, as the driver gives it
        torch.distributed.broadcast_object_list(state, src=0)
    restored = cls(load_model(model_dir), cfg, lora=LoraConfig(rank=4))
    restored.load_state_dict(state[0])
    result["restored"] = restored.adapter_for_engine().tensors
    if rank is not None and rank.rank == 0:
        torch.save(result, out / "lora-rank0.pt")
    return result


def _batches(folder: Path) -> dict[str, TrainBatch]:
    return torch.load(folder / "batches.pt", weights_only=False)  # written by this module


def _save_weights(trainer: Trainer, path: Path) -> None:
    weights = trainer.state_dict_for_engine()
    if trainer.rank == 0:
        torch.save(weights, path)


def _batch(model, shapes: list[tuple[int, int]], seed: int) -> TrainBatch:
    """Random tokens in groups of two, reward 0; random advantages and behavior logprobs
    the model's own plus noise (`toy_batch`'s `noisy`)."""
    rows = [(length, prompt, 0.0, str(i // 2)) for i, (length, prompt) in enumerate(shapes)]
    return toy_batch(rows, seed=seed, model=model, noisy=True)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    tied = tmp_path_factory.mktemp("tied-llama")
    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    config = tiny_llama_config(tokenizer, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tied)
    return {"tiny": tiny_model_dir, "tied": tied}


@pytest.fixture(scope="module")
def batch_dir(model_dirs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data-parallel")
    model = load_model(model_dirs["tiny"])
    batches = {
        name: _batch(model, shapes, seed) for seed, (name, shapes) in enumerate(SHAPES.items())
    }
    torch.save(batches, out / "batches.pt")
    return out


@pytest.fixture(scope="module")
def two_ranks(model_dirs, batch_dir) -> Path:
    """The folder of `on_two_ranks`' results, run once for the tests of this module."""
    launch_ranks(on_two_ranks, 2, run_dir=batch_dir, backend="gloo", args=(model_dirs, batch_dir))
    return batch_dir


def _assert_stats_close(got: dict[str, float], expected: dict[str, float]) -> None:
    assert got.keys() == expected.keys()
    for key in expected.keys() - SPLIT_STATS:
        assert got[key] == pytest.approx(expected[key], rel=STATS_REL), key


def _rank_micro_batches(case: str, batch: TrainBatch) -> list[list[int]]:
    """Micro-batches of each rank, per optimizer step (placeholders not counted)."""
    cfg = _config(case)
    return [
        [
            len(micro_batch_indices(mini.lengths[shard], cfg.max_tokens_per_mb))
            for shard in balanced_shards(mini.lengths, 2)
        ]
        for _ in range(cfg.ppo_epochs)
        for mini in split_mini_batches(batch, cfg.mini_batches)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(case, two_ranks, model_dirs):
    batch = _batches(two_ranks)[CASES[case][1]]
    got = torch.load(two_ranks / f"{case}-rank0.pt")
    other = torch.load(two_ranks / f"{case}-rank1.pt")
    expected = _run_case(_trainer(Trainer, case, model_dirs), batch)

    # The test's premise: the ranks run different numbers of real micro-batches.
    per_step = _rank_micro_batches(case, batch)
    assert any(a != b for a, b in per_step), per_step

    assert max(float(g.abs().max()) for g in expected["grads"].values()) > 1e-2
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, atol=ATOL, rtol=RTOL)
    real = batch.attention_mask.bool()  # padding's logprobs depend on the micro-batch width
    torch.testing.assert_close(
        got["logprobs"][real], expected["logprobs"][real], atol=ATOL, rtol=RTOL
    )
    _assert_stats_close(got["grad_stats"], expected["grad_stats"])
    _assert_stats_close(got["step_stats"], expected["step_stats"])
    assert got["weights"].keys() == expected["weights"].keys()
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, atol=WEIGHTS_ATOL, rtol=0)

    # Global stats, the same on every rank; micro-batches summed over ranks.
    assert other["grad_stats"] == got["grad_stats"]
    assert {k: v for k, v in other["step_stats"].items() if k not in SPLIT_STATS} == {
        k: v for k, v in got["step_stats"].items() if k not in SPLIT_STATS
    }
    assert torch.equal(other["logprobs"], got["logprobs"])
    assert got["step_stats"]["num_micro_batches"] == sum(map(sum, per_step))
    for key in ("loss", "grad_norm", "entropy", "clip_frac", "mismatch_corrected_frac"):
        assert math.isfinite(got["step_stats"][key]), key


@pytest.mark.slow
def test_state_dict_round_trip_on_two_ranks_and_one(two_ranks, model_dirs):
    """A fresh trainer that loads the state saved after step 1 steps like the one that went
    on: exactly on two ranks, to float32 rounding on one."""
    out, model_dir = two_ranks, model_dirs["tiny"]
    launch_ranks(checkpoint_round_trip, 1, run_dir=out, backend="gloo", args=(model_dir, out))
    continued = torch.load(out / "continued.pt")
    assert continued.keys() == load_model(model_dir).state_dict().keys()
    on_two = torch.load(out / "restored-on-2.pt")
    assert on_two.keys() == continued.keys()
    assert all(torch.equal(on_two[name], weight) for name, weight in continued.items())
    on_one = torch.load(out / "restored-on-1.pt")  # packs rows otherwise: float32 rounding
    assert on_one.keys() == continued.keys()
    for name, weight in continued.items():
        torch.testing.assert_close(on_one[name], weight, atol=WEIGHTS_ATOL, rtol=0)


def test_lora_on_two_ranks_gathers_the_adapter_only_and_matches_one_process(two_ranks, model_dirs):
    got = torch.load(two_ranks / "lora-rank0.pt")
    expected = lora_steps(None, model_dirs["tiny"], two_ranks)
    # 2 layers x 7 projections x (A, B), under the adapted modules' own names
    assert len(got["adapter"]) == 28 and got["adapter"].keys() == expected["adapter"].keys()
    assert all(".lora_" in name and "default" not in name for name in got["adapter"])
    moved = max(float(t.abs().max()) for n, t in expected["adapter"].items() if "lora_B" in n)
    assert moved > 1e-4  # two steps moved lora_B off its zero init
    for name, tensor in expected["adapter"].items():
        torch.testing.assert_close(got["adapter"][name], tensor, atol=WEIGHTS_ATOL, rtol=0)
    # the checkpoint holds the adapter (and its optimizer state), not the frozen base
    assert got["state"]["model"].keys() == expected["state"]["model"].keys()
    assert all("lora_" in name for name in got["state"]["model"])
    for name, tensor in got["adapter"].items():
        assert torch.equal(got["restored"][name], tensor), name


@pytest.mark.slow
def test_ranks_given_different_batches_raise(two_ranks):
    for rank in (0, 1):
        message = (two_ranks / f"different-batches-rank{rank}.txt").read_text()
        assert "got different batches on different ranks" in message
        assert "rank 0: [8, 15," in message and "rank 1: [7, 15," in message
        assert message.endswith("give every rank the same full TrainBatch")


def test_without_a_process_group_the_error_says_where_to_build_it(model_dirs):
    with pytest.raises(RuntimeError, match="build it in a trainer rank"):
        DataParallelTrainer(load_model(model_dirs["tiny"]), TrainConfig(compute_dtype="float32"))


def test_balanced_shards_longest_first_to_the_lightest_rank():
    # 12 -> r0 (12); 11 -> r1 (11); 10 -> r1 (21); 9 -> r0 (21); 7 -> r0 (tie, 28); 6 -> r1 (27)
    lengths = torch.tensor([9, 12, 7, 10, 6, 11])
    assert [s.tolist() for s in balanced_shards(lengths, 2)] == [[0, 1, 2], [3, 4, 5]]
    assert [s.tolist() for s in balanced_shards(lengths, 1)] == [[0, 1, 2, 3, 4, 5]]
    assert [s.tolist() for s in balanced_shards(torch.tensor([5]), 3)] == [[0], [], []]
