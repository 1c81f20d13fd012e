import math

import pytest
import torch

from looprl.training import losses
from looprl.training.losses import (
    entropy_from_logits,
    kl_penalty,
    loss_normalizer,
    mismatch_metrics,
    policy_loss,
)

# A 2x3 example, eps_clip = .2, eps_clip_high = .28, proximal logprobs 0, so ratio = exp(logprobs).
# Token loss = max(-A r, -A clip(r, .8, 1.28)).
#   seq 0, A = +1, ratios [1.5, 0.5, 1.0]:  [-1.28 (clipped high), -0.5, -1.0]   sum -2.78
#   seq 1, A = -1, ratios [0.5, 2.0, pad]:  [ 0.8 (clipped low),    2.0]         sum  2.8
# 5 sampled tokens, 2 clipped.
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [0.5, 2.0, 7.0]])
LOGPROBS = RATIOS.log()
PROXIMAL = torch.zeros(2, 3)
ADVANTAGES = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[True, True, True], [True, True, False]])
# Behavior weights exp(prox - behav) = [[1, 2, .25], [1, 10, pad]]; with cap 5 the 10 is
# dropped. Weighted token losses: seq 0 [-1.28, -1.0, -0.25] sum -2.53; seq 1 [0.8, 0] sum 0.8.
WEIGHTS = torch.tensor([[1.0, 2.0, 0.25], [1.0, 10.0, 1e6]])
BEHAVIOR = PROXIMAL - WEIGHTS.log()


def _loss(agg, rows=slice(None), normalizer=None, **kw):
    normalizer = loss_normalizer(MASK, agg) if normalizer is None else normalizer
    behavior = kw.pop("behavior", None)
    return policy_loss(
        LOGPROBS[rows],
        PROXIMAL[rows],
        ADVANTAGES[rows],
        MASK[rows],
        eps_clip=0.2,
        eps_clip_high=0.28,
        agg=agg,
        normalizer=normalizer,
        behavior_logprobs=None if behavior is None else behavior[rows],
        **kw,
    )


@pytest.mark.parametrize(
    ("agg", "normalizer", "expected"),
    [
        # (-2.78 + 2.8) / 5 tokens
        ("token_mean", 5.0, 0.02 / 5),
        # (-2.78 / 3 + 2.8 / 2) / 2 sequences = (-0.926667 + 1.4) / 2
        ("seq_mean_token_mean", 2.0, (-2.78 / 3 + 1.4) / 2),
        # (-2.78 + 2.8) / (2 sequences x 3, the longest sampled span)
        ("seq_mean_token_sum_norm", 6.0, 0.02 / 6),
    ],
)
def test_clipped_loss_per_aggregation(agg, normalizer, expected):
    assert loss_normalizer(MASK, agg) == normalizer
    loss, stats = _loss(agg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 0.5 + 2.0) / 5)


AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
MIS_5 = {"mismatch_correction": "mis", "mismatch_cap": 5.0}  # the default correction


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token_mean", (-2.53 + 0.8) / 5),  # the masked token still counts in the 5
        ("seq_mean_token_mean", (-2.53 / 3 + 0.8 / 2) / 2),
        ("seq_mean_token_sum_norm", (-2.53 + 0.8) / 6),
    ],
)
def test_masked_importance_sampling_weights_and_masks(agg, expected):
    loss, stats = _loss(agg, behavior=BEHAVIOR, **MIS_5)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["mismatch_corrected_frac"] == pytest.approx(1 / 5)
    assert stats["behavior_weight_mean"] == pytest.approx((1 + 2 + 0.25 + 1 + 10) / 5)


def test_no_mismatch_correction_leaves_the_loss_unweighted():
    # The weights are still measured, not applied: the loss is the plain clipped one.
    loss, stats = _loss("token_mean", behavior=BEHAVIOR, mismatch_correction="none")
    assert loss.item() == pytest.approx(0.02 / 5, abs=1e-6)
    assert stats["behavior_weight_mean"] == pytest.approx((1 + 2 + 0.25 + 1 + 10) / 5)
    assert stats["mismatch_corrected_frac"] == 0


def test_an_uncapped_weight_keeps_the_heavy_token():
    # seq 1 token 1 adds 2.0 x 10: (-2.53 + 0.8 + 20) / 5
    loss, stats = _loss(
        "token_mean", behavior=BEHAVIOR, mismatch_correction="tis", mismatch_cap=100
    )
    assert loss.item() == pytest.approx((-2.53 + 0.8 + 20) / 5, abs=1e-5)
    assert stats["mismatch_corrected_frac"] == 0


def test_truncated_importance_sampling_lowers_the_heavy_token_to_the_cap():
    # seq 1 token 1: 2.0 x min(10, 5) = 10 instead of being left out: (-2.53 + 0.8 + 10) / 5
    loss, stats = _loss("token_mean", behavior=BEHAVIOR, mismatch_correction="tis", mismatch_cap=5)
    assert loss.item() == pytest.approx((-2.53 + 0.8 + 10) / 5, abs=1e-5)
    assert stats["mismatch_corrected_frac"] == pytest.approx(1 / 5)
    assert stats["behavior_weight_mean"] == pytest.approx((1 + 2 + 0.25 + 1 + 5) / 5)


def test_masked_importance_sampling_floor_drops_light_tokens_too():
    # Floor 0.5, cap 5: seq 0's 0.25 and seq 1's 10 are left out. Weighted token losses:
    # seq 0 [-1.28 x 1, -0.5 x 2, out] = -2.28; seq 1 [0.8 x 1, out] = 0.8.
    loss, stats = _loss("token_mean", behavior=BEHAVIOR, **MIS_5, mismatch_floor=0.5)
    assert loss.item() == pytest.approx((-2.28 + 0.8) / 5, abs=1e-6)
    assert stats["mismatch_corrected_frac"] == pytest.approx(2 / 5)


# Sequence level: each sequence's weight is the product of its tokens', on all its tokens:
# seq 0: 1 x 2 x 0.25 = 0.5, seq 1: 1 x 10 = 10. Unweighted sums: -2.78 and 2.8.
# Geometric level: the geometric means, seq 0 (0.5)^(1/3) = 2^(-1/3) ~ 0.794, seq 1
# 10^(1/2) ~ 3.16.
GEO0, GEO1 = 2 ** (-1 / 3), math.sqrt(10)


@pytest.mark.parametrize(
    ("level", "correction", "cap", "floor", "expected", "corrected", "weight_mean"),
    [
        # tis: seq 1 truncated to 5
        ("sequence", "tis", 5.0, 0.0, (-2.78 * 0.5 + 2.8 * 5) / 5, 2 / 5, (3 * 0.5 + 2 * 5) / 5),
        # mis: all of seq 1 left out (its weight 10 > 5)
        ("sequence", "mis", 5.0, 0.0, -2.78 * 0.5 / 5, 2 / 5, (3 * 0.5 + 2 * 10) / 5),
        # mis with a floor: seq 0 (0.5 < 0.6) left out, seq 1 kept with its 10
        ("sequence", "mis", 20.0, 0.6, 2.8 * 10 / 5, 3 / 5, (3 * 0.5 + 2 * 10) / 5),
        ("geometric", "mis", 5.0, 0.0, (-2.78 * GEO0 + 2.8 * GEO1) / 5, 0.0, None),
        ("geometric", "mis", 3.0, 0.0, -2.78 * GEO0 / 5, 2 / 5, None),
        ("geometric", "tis", 3.0, 0.0, (-2.78 * GEO0 + 2.8 * 3.0) / 5, 2 / 5, None),
        ("geometric", "mis", 5.0, 0.8, 2.8 * GEO1 / 5, 3 / 5, None),  # 0.794 < 0.8
    ],
)
def test_sequence_and_geometric_level_weights(
    level, correction, cap, floor, expected, corrected, weight_mean
):
    loss, stats = _loss(
        "token_mean",
        behavior=BEHAVIOR,
        mismatch_correction=correction,
        mismatch_cap=cap,
        mismatch_floor=floor,
        mismatch_level=level,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    assert stats["mismatch_corrected_frac"] == pytest.approx(corrected)
    if weight_mean is not None:
        assert stats["behavior_weight_mean"] == pytest.approx(weight_mean)


def test_an_overflowing_sequence_weight_is_masked_without_nan_gradients():
    # seq 1's tokens have log weights 60 + 60: exp(120) overflows float32 to inf. Masked,
    # it must add nothing, not inf x 0 = NaN, to the gradient.
    behavior = BEHAVIOR.clone()
    behavior[1, :2] = -60.0
    logprobs = LOGPROBS.clone().requires_grad_(True)
    loss, stats = policy_loss(
        logprobs,
        PROXIMAL,
        ADVANTAGES,
        MASK,
        eps_clip=0.2,
        eps_clip_high=0.28,
        agg="token_mean",
        normalizer=5.0,
        behavior_logprobs=behavior,
        mismatch_correction="mis",
        mismatch_cap=5.0,
        mismatch_level="sequence",
    )
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    # seq 0 alone, weighted 0.5: token losses [-1.28, -0.5, -1] x 0.5
    assert loss.item() == pytest.approx(-2.78 * 0.5 / 5, abs=1e-6)
    assert logprobs.grad[1].abs().sum() == 0


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_losses_sum_to_the_batch_loss(agg):
    whole, _ = _loss(agg, behavior=BEHAVIOR, **MIS_5)
    normalizer = loss_normalizer(MASK, agg)
    parts = [
        _loss(agg, rows, normalizer, behavior=BEHAVIOR, **MIS_5)[0]
        for rows in (slice(0, 1), slice(1, 2))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


# ---- turn_token_mean on a hand-built two-turn batch ----------------------------------------
# Three two-turn rollouts concatenated (first reply, masked follow-up, last reply) and one
# one-call rollout, one row each; each token's call position from the loss mask's runs:
#   row 0: first reply 4 tokens, last reply 1     advantage +1
#   row 1: first reply 4 tokens, last reply 1     advantage -1
#   row 2: first reply 2 tokens, last reply 2     advantage +1
#   row 3: one call of 3 tokens                   advantage -1
# Calls at position 1: n1 = 4 holding T1 = 13 tokens; at 2: n2 = 3 holding T2 = 4; N = 7.
# A token's weight is n_k / (N x T_k): position 1 4/91, position 2 3/28, summing to 1.
TWO_TURN_MASK = torch.tensor(
    [
        [0, 1, 1, 1, 1, 0, 0, 1],
        [0, 1, 1, 1, 1, 0, 0, 1],
        [0, 1, 1, 0, 0, 1, 1, 0],
        [0, 1, 1, 1, 0, 0, 0, 0],
    ],
    dtype=torch.bool,
)
TWO_TURN_ADV = torch.tensor([1.0, -1.0, 1.0, -1.0])


def _two_turn_positions():
    from looprl.training.batch import call_positions

    return call_positions(TWO_TURN_MASK, torch.ones(4, dtype=torch.int64))


def test_turn_token_mean_weighs_each_turn_by_its_calls_not_its_tokens():
    positions = _two_turn_positions()
    assert positions[2].tolist() == [0, 1, 1, 0, 0, 2, 2, 0]
    norm = loss_normalizer(TWO_TURN_MASK, "turn_token_mean", positions)
    assert norm.tolist() == pytest.approx([1.0, 7 * 13 / 4, 7 * 4 / 3])
    # At ratio 1 (logprobs = proximal = 0) the PPO token loss is -A: the loss is
    # -sum A x weight = -(4 x 4/91 - 4 x 4/91 + 2 x 4/91 - 3 x 4/91) - (3/28 - 3/28 + 2 x 3/28)
    zeros = torch.zeros(4, 8, requires_grad=True)
    loss, _ = policy_loss(
        zeros,
        torch.zeros(4, 8),
        TWO_TURN_ADV,
        TWO_TURN_MASK,
        eps_clip=0.2,
        eps_clip_high=0.2,
        agg="turn_token_mean",
        normalizer=norm,
        positions=positions,
    )
    assert loss.item() == pytest.approx(4 / 91 - 6 / 28)
    loss.backward()
    # d loss / d logprob = -A x weight: a last-reply token of row 0 weighs 3/28, its first
    # reply's tokens 4/91 each; under token_mean every one of the 20 tokens weighs 1/20.
    assert zeros.grad[0].tolist() == pytest.approx([0] + [-4 / 91] * 4 + [0, 0, -3 / 28])
    assert zeros.grad[3].tolist() == pytest.approx([0] + [4 / 91] * 3 + [0] * 4)
    # The last replies' 4 tokens hold 4 x 3/28 = 3/7 of the weight, the share of the calls
    # they are (3 of 7), where token_mean gives them 4/17, their share of the tokens.
    weight = torch.where(TWO_TURN_MASK, 1 / norm[positions], 0.0)
    assert float(weight.sum()) == pytest.approx(1.0)
    assert float(weight[positions == 2].sum()) == pytest.approx(3 / 7)


def test_turn_token_mean_is_token_mean_with_one_call_per_rollout():
    positions = torch.where(MASK, 1, 0)
    norm = loss_normalizer(MASK, "turn_token_mean", positions)
    assert norm.tolist() == [1.0, 5.0]
    loss, _ = _loss("turn_token_mean", normalizer=norm, positions=positions)
    assert loss.item() == pytest.approx(_loss("token_mean")[0].item(), abs=1e-7)


def test_turn_token_mean_micro_batches_add_up_and_it_needs_positions():
    positions = _two_turn_positions()
    norm = loss_normalizer(TWO_TURN_MASK, "turn_token_mean", positions)
    values = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    whole = losses.aggregate(values, TWO_TURN_MASK, "turn_token_mean", norm, positions)
    parts = sum(
        losses.aggregate(values[r], TWO_TURN_MASK[r], "turn_token_mean", norm, positions[r])
        for r in (slice(0, 1), slice(1, 3), slice(3, 4))
    )
    assert parts.item() == pytest.approx(whole.item())
    with pytest.raises(ValueError, match="turn_token_mean needs each token's call position"):
        loss_normalizer(TWO_TURN_MASK, "turn_token_mean")


def test_loss_gradient_is_zero_on_clipped_and_masked_tokens():
    logprobs = LOGPROBS.clone().requires_grad_(True)
    loss, _ = policy_loss(
        logprobs,
        PROXIMAL,
        ADVANTAGES,
        MASK,
        eps_clip=0.2,
        eps_clip_high=0.28,
        agg="token_mean",
        normalizer=5.0,
    )
    loss.backward()
    # d/dlogp of -A r / 5 = -A r / 5 where unclipped: seq 0 [0, -0.1, -0.2], seq 1 [0, 0.4, 0]
    expected = torch.tensor([[0.0, -0.1, -0.2], [0.0, 0.4, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_kl_estimators():
    logprobs = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    # k1 = logp - ref_logp = [log 2, -log 2]
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([0.693147, -0.693147]))
    # k3 = (r - 1) - log r with r = ref / p = [0.5, 2]: [-0.5 + 0.693147, 1 - 0.693147]
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"), torch.tensor([0.193147, 0.306853]))


def test_entropy_from_logits():
    # uniform over 2: log 2; probs [.25, .75]: -(.25 ln .25 + .75 ln .75) = .346574 + .215762
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[0.693147, 0.562335]]))


def test_rows_left_out_of_the_loss_do_not_count_in_the_normalizer():
    # Row 1 has no sampled token (a truncated sample left out): 2 tokens, 1 sequence,
    # 1 x 2; with nothing sampled at all, 1, so the loss is 0 rather than 0 / 0.
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert [loss_normalizer(mask, agg) for agg in AGGS] == [2.0, 1.0, 2.0]
    assert [loss_normalizer(torch.zeros_like(mask), agg) for agg in AGGS] == [1.0, 1.0, 1.0]


def test_bad_aggregation_is_named():
    with pytest.raises(ValueError, match="train.loss_agg='sum'"):
        loss_normalizer(MASK, "sum")


# ---- GSPO and CISPO ----------------------------------------------------------------------
# Three sequences, advantages [+1, -1, +1], row 1 and 2 padded at position 2 (its
# logprob 7 is garbage that must not count). Clip range [0.8, 1.28] (eps 0.2 / 0.28).
#   seq 0: token ratios [4, 0.25, 1]: geometric mean s0 = 1      (PPO would clip the 4)
#   seq 1: token ratios [2, 2]:       s1 = 2, A < 0: unclipped   (max(2, 1.28) = 2)
#   seq 2: token ratios [3, 0.75]:    s2 = sqrt(2.25) = 1.5 > 1.28, A > 0: clipped
OBJ_RATIOS = torch.tensor([[4.0, 0.25, 1.0], [2.0, 2.0, 1.0], [3.0, 0.75, 1.0]])
OBJ_ADV = torch.tensor([1.0, -1.0, 1.0])
OBJ_MASK = torch.tensor([[True, True, True], [True, True, False], [True, True, False]])
# CISPO's loss uses log pi itself: logprobs L, proximal L - log r.
OBJ_LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, 7.0], [-0.1, -4.0, 7.0]])
OBJ_PROXIMAL = OBJ_LOGPROBS - OBJ_RATIOS.log()


def _objective(objective, agg="token_mean", proximal=OBJ_PROXIMAL, **kw):
    """Loss and d loss / d logprobs (3, 3) of `objective` on the batch above."""
    logprobs = OBJ_LOGPROBS.clone().requires_grad_(True)
    loss, stats = policy_loss(
        logprobs,
        proximal,
        OBJ_ADV,
        OBJ_MASK,
        eps_clip=kw.pop("eps_clip", 0.2),
        eps_clip_high=kw.pop("eps_clip_high", 0.28),
        agg=agg,
        normalizer=loss_normalizer(OBJ_MASK, agg),
        objective=objective,
        **kw,
    )
    loss.backward()
    return loss.item(), logprobs.grad, stats


# GSPO, token_mean over 7 tokens. Token losses -A s_i, or -A clip(s_i) where that wins:
#   seq 0 [-1, -1, -1]; seq 1 [2, 2]; seq 2 [-1.28, -1.28]  -> (-3 + 4 - 2.56) / 7
# Gradient of s_it = sg[s_i] pi_t / sg[pi_t] w.r.t. log pi_t is s_i, so d loss / d log pi_t
# = -A s_i / 7 where unclipped: seq 0 -1/7 each, seq 1 +2/7 each, seq 2 0 (clipped), pads 0.
GSPO_LOSS = (-3 + 4 - 2.56) / 7
GSPO_GRAD = torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]) / 7
# seq_mean_token_mean (the paper's): per-sequence means [-1, 2, -1.28] over 3 sequences;
# gradient -A s_i / (n_i x 3): seq 0 -1/9 each, seq 1 2/6 each.
GSPO_SEQ_LOSS = (-1 + 2 - 1.28) / 3
GSPO_SEQ_GRAD = torch.tensor([[-1 / 9, -1 / 9, -1 / 9], [1 / 3, 1 / 3, 0], [0, 0, 0]])


def test_gspo_loss_and_gradient_by_hand():
    loss, grad, stats = _objective("gspo")
    assert loss == pytest.approx(GSPO_LOSS, abs=1e-6)
    torch.testing.assert_close(grad, GSPO_GRAD)
    assert stats["clip_frac"] == pytest.approx(2 / 7)  # seq 2's two tokens, as one
    assert stats["ratio_mean"] == pytest.approx((3 * 1 + 2 * 2 + 2 * 1.5) / 7)
    loss, grad, _ = _objective("gspo", "seq_mean_token_mean")
    assert loss == pytest.approx(GSPO_SEQ_LOSS, abs=1e-6)
    torch.testing.assert_close(grad, GSPO_SEQ_GRAD)


# CISPO, clip range [0.5, 2] (eps_low 0.5, eps_high 1): weights w = clip(r), detached.
#   seq 0: r [4, 0.25, 1] -> w [2, 0.5, 1]; token loss -w A L = [2, 1, 0.5]
#   seq 1: r [1.5, 1.5]   -> w [1.5, 1.5];              w L = [-1.5, -4.5]
#   seq 2: r [3, 0.75]    -> w [2, 0.75];          -w L   = [0.2, 3]
# token_mean: (3.5 - 6 + 3.2) / 7 = 0.1. Gradient -w A / 7 on every token, clipped or not:
# seq 0 [-2, -0.5, -1] / 7, seq 1 [1.5, 1.5] / 7, seq 2 [-2, -0.75] / 7. 3 of 7 truncated.
CISPO_RATIOS = torch.tensor([[4.0, 0.25, 1.0], [1.5, 1.5, 1.0], [3.0, 0.75, 1.0]])
CISPO_LOSS = 0.1
CISPO_GRAD = torch.tensor([[-2.0, -0.5, -1.0], [1.5, 1.5, 0.0], [-2.0, -0.75, 0.0]]) / 7


def _cispo(**kw):
    proximal = OBJ_LOGPROBS - CISPO_RATIOS.log()
    return _objective("cispo", eps_clip=0.5, eps_clip_high=1.0, proximal=proximal, **kw)


def test_cispo_loss_and_gradient_by_hand():
    loss, grad, stats = _cispo()
    assert loss == pytest.approx(CISPO_LOSS, abs=1e-6)
    torch.testing.assert_close(grad, CISPO_GRAD)
    assert stats["clip_frac"] == pytest.approx(3 / 7)


def test_gspo_and_cispo_compose_with_the_behavior_weight_like_ppo():
    # Token weights pi_prox / pi_behav [[1, 2, 4], [0.5, 1, pad], [1, 1, pad]], tis cap 2:
    # [[1, 2, 2], [0.5, 1], [1, 1]] multiply each token's loss and gradient.
    weights = torch.tensor([[1.0, 2.0, 4.0], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    capped = torch.tensor([[1.0, 2.0, 2.0], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    tis = {"mismatch_correction": "tis", "mismatch_cap": 2.0}
    # GSPO: seq 0 [-1, -2, -2], seq 1 [1, 2], seq 2 [-1.28, -1.28]
    loss, grad, stats = _objective("gspo", behavior_logprobs=OBJ_PROXIMAL - weights.log(), **tis)
    assert loss == pytest.approx((-5 + 3 - 2.56) / 7, abs=1e-6)
    torch.testing.assert_close(grad, GSPO_GRAD * capped)
    assert stats["mismatch_corrected_frac"] == pytest.approx(1 / 7)
    # CISPO: token losses [2, 2, 1], [-0.75, -4.5], [0.2, 3] -> 2.95 / 7
    behavior = OBJ_LOGPROBS - CISPO_RATIOS.log() - weights.log()
    loss, grad, _ = _cispo(behavior_logprobs=behavior, **tis)
    assert loss == pytest.approx(2.95 / 7, abs=1e-6)
    torch.testing.assert_close(grad, CISPO_GRAD * capped)


def _gspo_token_sum(logprobs, proximal, advantages, mask, eps_low, eps_high):
    log_ratio = torch.where(mask, logprobs - proximal, 0.0)
    own = torch.where(mask, logprobs, 0.0)
    ratio = (log_ratio.sum(dim=1).detach()[:, None] + own - own.detach()).exp()
    return losses._clipped_surrogate(ratio, advantages, eps_low, eps_high)


def _gspo_mean_over_padding(logprobs, proximal, advantages, mask, eps_low, eps_high):
    log_ratio = torch.where(mask, logprobs - proximal, 0.0)
    own = torch.where(mask, logprobs, 0.0)
    ratio = (log_ratio.mean(dim=1).detach()[:, None] + own - own.detach()).exp()
    return losses._clipped_surrogate(ratio, advantages, eps_low, eps_high)


def _cispo_without_stop_gradient(logprobs, proximal, advantages, mask, eps_low, eps_high):
    ratio = torch.where(mask, logprobs - proximal, 0.0).exp()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -advantages[:, None] * weight * logprobs, weight != ratio, ratio


@pytest.mark.parametrize(
    ("objective", "broken"),
    [
        ("gspo", _gspo_token_sum),  # s_i from the sum of log ratios, not their mean
        ("gspo", losses.ppo_token_loss),  # per-token ratios
        ("gspo", _gspo_mean_over_padding),  # the mean over the padded width
        ("cispo", _cispo_without_stop_gradient),  # gradient through the weight as well
        ("cispo", losses.ppo_token_loss),  # PPO's clipped surrogate
    ],
)
def test_the_hand_computed_cases_catch_broken_variants(monkeypatch, objective, broken):
    # The hand-computed figures hold for the real objective (tests above) and not for
    # these plausible mistakes: swapped in, the loss or its gradient must differ.
    monkeypatch.setattr(losses, f"{objective}_token_loss", broken)
    loss, grad, _ = _objective("gspo") if objective == "gspo" else _cispo()
    expected_loss, expected_grad = (
        (GSPO_LOSS, GSPO_GRAD) if objective == "gspo" else (CISPO_LOSS, CISPO_GRAD)
    )
    assert abs(loss - expected_loss) > 1e-3 or (grad - expected_grad).abs().max() > 1e-3


def test_unknown_objective_is_named():
    with pytest.raises(ValueError, match="train.objective='reinforce'"):
        _objective("reinforce")


# ---- mismatch metrics --------------------------------------------------------------------


def test_mismatch_metrics_by_hand():
    # r = trainer - engine on 5 tokens: [0.1, -0.2, ln 3], [-ln 4, 0, (pad: 99)]
    engine = torch.zeros(2, 3)
    trainer = torch.tensor([[0.1, -0.2, math.log(3)], [-math.log(4), 0.0, 99.0]])
    figures = mismatch_metrics(trainer, engine, MASK)
    # mean |r| = (0.1 + 0.2 + 1.098612 + 1.386294 + 0) / 5
    assert figures["mismatch_logprob_abs_mean"] == pytest.approx(2.784906 / 5, abs=1e-6)
    # k3 = exp(r) - 1 - r: 0.005171 + 0.018731 + 0.901388 + 0.636294 + 0
    assert figures["mismatch_kl_k3"] == pytest.approx(1.561584 / 5, abs=1e-6)
    # ratios [1.105, 0.819, 3, 0.25, 1]: 3 and 0.25 are outside [0.5, 2]
    assert figures["mismatch_ratio_outside_frac"] == pytest.approx(2 / 5)
    nothing = mismatch_metrics(trainer, engine, torch.zeros(2, 3, dtype=torch.bool))
    assert nothing == {key: 0.0 for key in figures}


# Per-token advantages (distillation's), on the 2x3 example (ratios [[1.5, .5, 1], [.5, 2]],
# clip [.8, 1.28]): token loss max(-A_t r, -A_t clip(r)):
#   seq 0, A [1, -1, 2]:  [-1.28 (clipped), 0.8 (clipped), -2]
#   seq 1, A [.5, -2]:    [-0.25, 4]
# token_mean (1.27) / 5; gradient -A_t r on unclipped tokens: [[0, 0, -2], [-.25, 4]] / 5.
TOKEN_ADVANTAGES = torch.tensor([[1.0, -1.0, 2.0], [0.5, -2.0, 9.0]])


def test_per_token_advantages_by_hand():
    logprobs = LOGPROBS.clone().requires_grad_(True)
    loss, stats = policy_loss(
        logprobs,
        PROXIMAL,
        TOKEN_ADVANTAGES,
        MASK,
        eps_clip=0.2,
        eps_clip_high=0.28,
        agg="token_mean",
        normalizer=5.0,
    )
    loss.backward()
    assert float(loss) == pytest.approx(1.27 / 5, abs=1e-6)
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[0.0, 0.0, -2.0], [-0.25, 4.0, 0.0]]) / 5
    )
    assert stats["clip_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
def test_a_sequence_advantage_equals_the_same_value_on_each_token(objective):
    def run(advantages):
        logprobs = LOGPROBS.clone().requires_grad_(True)
        loss, _ = policy_loss(
            logprobs,
            PROXIMAL,
            advantages,
            MASK,
            eps_clip=0.2,
            eps_clip_high=0.28,
            agg="token_mean",
            normalizer=5.0,
            objective=objective,
        )
        loss.backward()
        return float(loss), logprobs.grad

    loss, grad = run(ADVANTAGES)
    loss_tokens, grad_tokens = run(ADVANTAGES[:, None].expand(2, 3))
    assert loss == pytest.approx(loss_tokens)
    torch.testing.assert_close(grad, grad_tokens)
