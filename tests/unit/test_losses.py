import math

import pytest
import torch

from looprl.training.losses import (
    entropy_from_logits,
    kl_penalty,
    loss_normalizer,
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
    normalizer = normalizer or loss_normalizer(MASK, agg)
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


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token_mean", (-2.53 + 0.8) / 5),  # the capped token still counts in the 5
        ("seq_mean_token_mean", (-2.53 / 3 + 0.8 / 2) / 2),
        ("seq_mean_token_sum_norm", (-2.53 + 0.8) / 6),
    ],
)
def test_decoupled_loss_weights_and_caps(agg, expected):
    loss, stats = _loss(agg, behavior=BEHAVIOR, behavior_weight_cap=5.0)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["behavior_capped_frac"] == pytest.approx(1 / 5)
    assert stats["behavior_weight_mean"] == pytest.approx((1 + 2 + 0.25 + 1 + 10) / 5)


def test_uncapped_decoupled_loss_keeps_the_heavy_token():
    # seq 1 token 1 adds 2.0 x 10: (-2.53 + 0.8 + 20) / 5
    loss, _ = _loss("token_mean", behavior=BEHAVIOR)
    assert loss.item() == pytest.approx((-2.53 + 0.8 + 20) / 5, abs=1e-5)


def test_truncated_behavior_weight_lowers_the_heavy_token_to_the_cap():
    # seq 1 token 1: 2.0 x min(10, 5) = 10 instead of being left out: (-2.53 + 0.8 + 10) / 5
    loss, stats = _loss(
        "token_mean", behavior=BEHAVIOR, behavior_weight_cap=5.0, behavior_weight_mode="truncate"
    )
    assert loss.item() == pytest.approx((-2.53 + 0.8 + 10) / 5, abs=1e-5)
    assert stats["behavior_capped_frac"] == pytest.approx(1 / 5)
    assert stats["behavior_weight_mean"] == pytest.approx((1 + 2 + 0.25 + 1 + 5) / 5)


# Sequence level: seq 0's weight is the geometric mean (1 x 2 x 0.25)^(1/3) = 2^(-1/3), seq 1's
# (1 x 10)^(1/2) = sqrt(10) ~ 3.16, each on all its tokens. Unweighted sums: -2.78 and 2.8.
SEQ0, SEQ1 = 2 ** (-1 / 3), math.sqrt(10)


@pytest.mark.parametrize(
    ("cap", "mode", "expected", "capped"),
    [
        (5.0, "mask", (-2.78 * SEQ0 + 2.8 * SEQ1) / 5, 0.0),  # both under the cap
        (3.0, "mask", (-2.78 * SEQ0) / 5, 2 / 5),  # all of seq 1 left out
        (3.0, "truncate", (-2.78 * SEQ0 + 2.8 * 3.0) / 5, 2 / 5),  # seq 1 weighted 3
    ],
)
def test_sequence_level_behavior_weight(cap, mode, expected, capped):
    loss, stats = _loss(
        "token_mean",
        behavior=BEHAVIOR,
        behavior_weight_cap=cap,
        behavior_weight_mode=mode,
        behavior_weight_level="sequence",
    )
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    assert stats["behavior_capped_frac"] == pytest.approx(capped)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_losses_sum_to_the_batch_loss(agg):
    whole, _ = _loss(agg, behavior=BEHAVIOR, behavior_weight_cap=5.0)
    normalizer = loss_normalizer(MASK, agg)
    parts = [
        _loss(agg, rows, normalizer, behavior=BEHAVIOR, behavior_weight_cap=5.0)[0]
        for rows in (slice(0, 1), slice(1, 2))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


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


def test_bad_aggregation_is_named():
    with pytest.raises(ValueError, match="train.loss_agg='sum'"):
        loss_normalizer(MASK, "sum")
