"""The environment contract, the adapters' words, and the credit math (looprl/envs/)."""

from __future__ import annotations

import numpy as np
import pytest

from looprl.config import ConfigError, load_config
from looprl.envs.base import InvalidAction, make_env, parse_action
from looprl.envs.gymnasium import GymnasiumEnv, describe_blackjack, describe_cart_pole
from looprl.rollout.outcome import RolloutOutcome, check_reward, summarize
from looprl.tasks import load_task
from looprl.types import EpisodeReward
from looprl.workflows.env import EnvWorkflow, returns_to_go

LAKE = ["SFH", "FFF", "HFG"]


# ---- the contract and make_env ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("FrozenLake-v1", "must look like 'gymnasium:ID'"),
        ("gymnasium:", "must look like 'gymnasium:ID'"),
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        ("tests.support.envs:NoSuchEnv", "has no 'NoSuchEnv'"),
    ],
)
def test_make_env_errors_name_the_env(name, says):
    with pytest.raises(ValueError, match=says) as info:
        make_env(name, {})
    assert repr(name) in str(info.value) or name in str(info.value)


def test_make_env_names_the_kwargs_a_factory_refuses():
    with pytest.raises(ValueError, match=r"env.name='tests.support.envs:GuessEnv'.*colour"):
        make_env("tests.support.envs:GuessEnv", {"colour": "red"})


def test_an_unknown_gymnasium_id_fails_in_gymnasium():
    with pytest.raises(Exception, match="NoSuchLake"):
        make_env("gymnasium:NoSuchLake-v1", {})


def test_a_skyrl_gym_style_env_plugs_in_by_module_path():
    env = make_env("tests.support.envs:GuessEnv", {"high": 4})
    assert env.reset(seed=7) == "Guess my number from 1 to 4. Reply with the number."
    target = env.target
    wrong = 1 if target != 1 else 2
    observation, reward, done, info = env.step(f"I say {wrong}")
    assert (reward, done) == (-0.25, False) and f"{wrong} is wrong" in observation
    assert env.step(f"{target}") == ("Right!", 1.0, True, {"success": True})
    with pytest.raises(InvalidAction, match="reply with a number from 1 to 4"):
        env.step("no idea")


# ---- parsing -----------------------------------------------------------------------


def test_the_first_action_word_is_taken_case_ignored():
    moves = ("left", "down", "right", "up")
    assert parse_action("Up", moves) == 3
    assert parse_action("I go RIGHT, not left", moves) == 2
    assert parse_action("downstairs then left", moves) == 0  # whole words only


def test_a_reply_without_an_action_word_says_what_is_allowed():
    with pytest.raises(InvalidAction) as info:
        parse_action("The ice is thin", ("left", "down", "right", "up"))
    assert str(info.value) == (
        "'The ice is thin' is not a move. Reply with one word: left, down, right or up."
    )
    with pytest.raises(InvalidAction, match="an empty reply"):
        parse_action("  ", ("stick", "hit"))


# ---- the toy-text envs in words ------------------------------------------------------


def test_frozen_lake_reads_position_goal_and_neighbours():
    env = GymnasiumEnv("FrozenLake-v1", desc=LAKE)
    assert env.reset(seed=0) == (
        "You are at row 1, column 1 of a 3x3 frozen lake. The goal is at row 3, column 3. "
        "Left: edge. Down: ice. Right: ice. Up: edge. "
        "Reply with one word: left, down, right or up."
    )
    # not slippery by default: every move goes where it says
    observation, reward, done, info = env.step("right")
    assert observation.startswith("You are at row 1, column 2 ")
    assert "Left: ice. Down: ice. Right: hole. Up: edge." in observation
    assert (reward, done, info["action"]) == (0.0, False, "right")
    with pytest.raises(InvalidAction, match="left, down, right or up"):
        env.step("stay")
    env.step("down")  # row 2, column 2; the rejected reply changed nothing
    env.step("down")  # row 3, column 2
    observation, reward, done, info = env.step("right")
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert "row 3, column 3" in observation


def test_frozen_lake_hole_ends_the_episode_without_success():
    env = GymnasiumEnv("FrozenLake-v1", desc=LAKE)
    env.reset(seed=0)
    env.step("right")
    _, reward, done, info = env.step("right")  # (1, 3) is a hole
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_frozen_lake_distance_reward_by_hand():
    # LAKE's walks to the goal at (3, 3), around the holes at (1, 3) and (3, 1):
    # (1, 1) 4 steps, (1, 2) 3, (2, 1) 3, (2, 2) 2, (2, 3) 1, (3, 2) 1
    env = GymnasiumEnv("FrozenLake-v1", desc=LAKE, distance_reward=0.25)
    env.reset(seed=0)
    moves = [("right", 0.25), ("left", -0.25), ("up", 0.0), ("down", 0.25), ("down", -0.5)]
    for move, reward in moves:  # a bump into the edge stays put: 0; the hole: -2c
        _, got, done, info = env.step(move)
        assert got == pytest.approx(reward), move
        assert info["success"] is False  # on every step: a positive step is not the goal
    assert done
    env.reset(seed=1)  # a new episode on the same map: nearer each move, then the goal's 1
    steps = [env.step(move) for move in ("right", "down", "right", "down")]
    assert [step[1] for step in steps] == pytest.approx([0.25, 0.25, 0.25, 1.25])
    assert [step[3]["success"] for step in steps] == [False, False, False, True]
    with pytest.raises(ValueError, match="distance_reward is for FrozenLake, not 'Taxi-v4'"):
        GymnasiumEnv("Taxi-v4", distance_reward=0.25)


def test_frozen_lake_random_maps_are_one_per_seed():
    env = GymnasiumEnv("FrozenLake-v1", random_map_size=3)
    maps = {}
    for seed in range(12):
        env.reset(seed)
        maps[seed] = env.env.unwrapped.desc.tobytes()
        assert env.env.unwrapped.desc.shape == (3, 3)
    env.reset(5)
    assert env.env.unwrapped.desc.tobytes() == maps[5]
    assert len(set(maps.values())) > 3


def test_random_map_size_is_for_frozen_lake_only():
    with pytest.raises(ValueError, match="random_map_size is for FrozenLake, not 'Taxi-v4'"):
        GymnasiumEnv("Taxi-v4", random_map_size=3)


def test_taxi_reads_taxi_passenger_destination_and_walls():
    env = GymnasiumEnv("Taxi-v4")
    text = env.reset(seed=0)
    row, col, passenger, destination = env.env.unwrapped.decode(env.env.unwrapped.s)
    assert (row, col, passenger, destination) == (3, 0, 3, 2)  # gymnasium's seed 0
    assert text == (
        "You drive a taxi at row 4, column 1 of a 5x5 town. The passenger waits at row 5, "
        "column 4 (B); the destination is row 5, column 1 (Y). You cannot drive east or "
        "west. Reply with one word: south, north, east, west, pickup or dropoff."
    )
    observation, reward, done, _ = env.step("pickup")  # not at the passenger
    assert (reward, done) == (-10.0, False)
    observation, reward, done, _ = env.step("north")
    assert reward == -1.0 and "row 3, column 1" in observation
    assert "You cannot drive west." in observation  # no wall east of row 3, column 1


def test_blackjack_reads_sums_ace_and_dealer():
    assert describe_blackjack(None, (14, 10, 0)) == (
        "Your cards add up to 14. The dealer shows a 10. Reply with one word: stick or hit."
    )
    assert describe_blackjack(None, (17, 1, 1)) == (
        "Your cards add up to 17, with an ace counted as 11. The dealer shows an ace. "
        "Reply with one word: stick or hit."
    )
    env = GymnasiumEnv("Blackjack-v1")
    env.reset(seed=0)
    _, reward, done, info = env.step("stick")
    assert done and info["success"] == (reward > 0)


def test_cliff_walking_reads_position_goal_and_cliff():
    env = GymnasiumEnv("CliffWalking-v1")
    assert env.reset(seed=0) == (
        "You are at row 4, column 1 of a 4x12 grid. The goal is at row 4, column 12. The "
        "cliff covers row 4, columns 2 to 11: stepping on it costs 100 and sends you back "
        "to row 4, column 1. Reply with one word: up, right, down or left."
    )
    observation, reward, done, _ = env.step("right")  # onto the cliff
    assert (reward, done) == (-100.0, False) and "at row 4, column 1 " in observation
    observation, reward, _, _ = env.step("up")
    assert reward == -1.0 and "at row 3, column 1 " in observation


def test_cart_pole_reads_the_cart_and_the_pole_in_words():
    env = GymnasiumEnv("CartPole-v1", max_episode_steps=3)
    env.reset(seed=0)
    state = np.array([-0.5, 0.25, 0.1, -0.2])  # x m, x' m/s, theta rad, theta' rad/s
    assert describe_cart_pole(env.env.unwrapped, state) == (
        "You balance a pole on a cart by pushing the cart left or right. The cart is 0.50 m "
        "left of the centre of its track (which ends 2.4 m either side) and moves right at "
        "0.25 m/s. The pole leans 5.7 degrees right (it falls at 12 degrees) and tips left "
        "at 11.5 degrees per second. Reply with one word: left or right."
    )
    rewards = [env.step(move)[1:] for move in ("left", "right", "Left!")]
    assert rewards[:2] == [  # the pole is up: the episode would succeed were it cut here
        (1.0, False, {"action": "left", "success": True}),
        (1.0, False, {"action": "right", "success": True}),
    ]
    assert rewards[2] == (1.0, True, {"action": "left", "success": True})  # truncated, up
    env = GymnasiumEnv("CartPole-v1")
    env.reset(seed=0)
    for _ in range(30):  # pushed one way, the pole falls: no success
        _, reward, done, info = env.step("right")
        if done:
            break
    assert done and reward == 1.0 and info["success"] is False


def test_other_discrete_gymnasium_envs_play_numbered_actions():
    env = GymnasiumEnv("MountainCar-v0")
    assert env.reset(seed=0).endswith("Reply with one word: 0, 1 or 2.")
    _, reward, _, info = env.step("1")
    assert reward == -1.0 and info["action"] == "1"


def test_textarena_guess_the_number_through_the_contract():
    env = make_env("textarena:GuessTheNumber-v0", {})
    first = env.reset(seed=3)
    assert "guess the number between 1 and 20" in first
    assert env.reset(seed=3) == first  # a reset starts a new game, history and all
    observation, reward, done, _ = env.step("[10]")
    assert (reward, done) == (0.0, False) and "[10]" in observation
    assert "The target number is lower." in observation  # seed 3's number is 8
    with pytest.raises(InvalidAction, match="did not respond with valid"):
        env.step("hello")  # TextArena's own rule: once within its error allowance
    _, reward, done, info = env.step("[8]")
    assert (reward, done, info["success"]) == (1.0, True, True)


# ---- credit --------------------------------------------------------------------------


def test_returns_to_go_by_hand():
    # r = [0, -0.1, 1], discount 0.5: G2 = 1, G1 = -0.1 + 0.5 = 0.4, G0 = 0 + 0.2 = 0.2
    assert returns_to_go([0.0, -0.1, 1.0], 0.5) == pytest.approx([0.2, 0.4, 1.0])
    assert returns_to_go([1.0, 1.0, 1.0], 1.0) == [3.0, 2.0, 1.0]
    assert returns_to_go([], 0.9) == []


def test_history_turns_keeps_the_last_turns():
    workflow = EnvWorkflow.__new__(EnvWorkflow)  # no workers: messages only
    workflow.cfg = load_config(None, ["env.name=x:y", "env.history_turns=1"]).env
    turns = [("obs0", "a0"), ("obs1", "a1")]
    assert workflow.messages(turns, "obs2") == [
        {"role": "user", "content": "obs1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "obs2"},
    ]
    workflow.cfg = load_config(None, ["env.name=x:y", "env.system_prompt=Play."]).env
    assert workflow.messages(turns, "obs2") == [
        {"role": "system", "content": "Play."},
        {"role": "user", "content": "obs2"},
    ]


def test_an_episode_reward_is_checked_and_kept_whole():
    reward, error = check_reward(EpisodeReward({"a": 0.5, "b": 1.0}, 1.0, success=True))
    assert error is None and reward == EpisodeReward({"a": 0.5, "b": 1.0}, 1.0, True)
    _, error = check_reward(EpisodeReward({"a": float("nan")}, 1.0))
    assert error.startswith("InvalidReward: reward for completion 'a'")
    _, error = check_reward(EpisodeReward({"a": 1.0}, float("inf")))
    assert "non-finite" in error and "EpisodeReward.total" in error


def test_accuracy_counts_success_where_a_workflow_gives_it():
    outcomes = [
        RolloutOutcome("g", "completed", reward=0.9, success=True),  # -0.1 penalty, then goal
        RolloutOutcome("g", "completed", reward=1.0, success=False),
        RolloutOutcome("g", "completed", reward=1.0),  # no success given: reward >= 1
        RolloutOutcome("g", "completed", reward=0.5),
    ]
    assert summarize(outcomes, 1.0)["accuracy"] == 0.5


# ---- config and rows -------------------------------------------------------------------


def test_env_name_makes_the_env_task_and_workflow_the_defaults(tmp_path):
    cfg = load_config(None, ["env.name=gymnasium:FrozenLake-v1"])
    assert (cfg.task.name, cfg.workflow.path) == ("env", "looprl.workflows:EnvWorkflow")
    assert load_config(str(cfg.save(tmp_path)), []) == cfg


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["task.name=env"], "task.name=env plays episodes of env.name, which is not set"),
        (["env.name=x:y", "task.name=arithmetic"], "not on task.name=arithmetic rows"),
        (["env.name=x:y", "workflow.path=looprl.workflows:RLVRWorkflow"], "cannot play"),
        (["env.name=x:y", "env.max_turns=0"], "env.max_turns=0"),
        (["env.name=x:y", "env.discount=1.5"], "env.discount=1.5"),
        (["env.name=x:y", "env.workers=0"], "env.workers=0"),
    ],
)
def test_env_config_errors_name_the_field(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)


def test_env_rows_are_seeds_and_held_out_seeds_are_unseen():
    cfg = load_config(
        None, ["env.name=x:y", "task.seed=3", "task.train_size=4", "task.eval_size=2"]
    )
    task = load_task(cfg.task)
    assert task.train == [{"id": f"seed-{6_000_000 + i}", "seed": 6_000_000 + i} for i in range(4)]
    assert [r["seed"] for r in task.eval] == [7_000_000, 7_000_001]
    with pytest.raises(ValueError, match=r"task.train_size=1000001"):
        load_task(load_config(None, ["env.name=x:y", "task.train_size=1000001"]).task)
