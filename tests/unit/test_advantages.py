import pytest
import torch

from looprl.training.advantages import compute_advantages, dr_grpo, grpo, reinforce_pp, rloo

# Two interleaved groups. Group 3 = [1, 0, 0, 0]: mean 0.25, centred [.75, -.25, -.25, -.25],
# squared sum .5625 + 3 * .0625 = .75. Group 7 = [0.1, 0.1]: degenerate, advantage exactly 0.
REWARDS = torch.tensor([1.0, 0.0, 0.1, 0.0, 0.1, 0.0])
GROUPS = torch.tensor([3, 3, 7, 3, 7, 3])


def _check(estimator, expected):
    adv, stats = estimator(REWARDS, GROUPS)
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert adv[2] == 0 and adv[4] == 0  # exactly
    assert stats["num_groups"] == 2 and stats["degenerate_groups"] == 1


def test_grpo_divides_by_unbiased_group_std():
    # unbiased std = sqrt(.75 / 3) = .5 -> centred / .5
    _check(grpo, [1.5, -0.5, 0.0, -0.5, 0.0, -0.5])


def test_dr_grpo_only_centres():
    _check(dr_grpo, [0.75, -0.25, 0.0, -0.25, 0.0, -0.25])


def test_rloo_subtracts_mean_of_the_others():
    # 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3
    _check(rloo, [1.0, -1 / 3, 0.0, -1 / 3, 0.0, -1 / 3])


def test_reinforce_pp_divides_by_batch_population_std():
    # centred over the batch: [.75, -.25, 0, -.25, 0, -.25]; population var = .75 / 6 = .125,
    # std = .353553 -> .75 / .353553 = 2.121320, -.25 / .353553 = -.707107
    _check(reinforce_pp, [2.121320, -0.707107, 0.0, -0.707107, 0.0, -0.707107])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_singleton_and_constant_groups_get_exactly_zero(name):
    rewards = torch.tensor([0.3, 0.1, 0.1, 0.1])  # group 0 is a singleton; 0.1 * 3 / 3 != 0.1
    adv, stats = compute_advantages(name, rewards, torch.tensor([0, 1, 1, 1]))
    assert torch.equal(adv, torch.zeros(4))
    assert stats["degenerate_groups"] == 2


def test_dispatcher_names_the_bad_algorithm():
    with pytest.raises(ValueError, match="train.algorithm='ppo'"):
        compute_advantages("ppo", REWARDS, GROUPS)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match=r"\(6,\) and \(2,\)"):
        grpo(REWARDS, torch.tensor([0, 1]))
