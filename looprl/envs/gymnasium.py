"""Gymnasium environments in words: `env.name=gymnasium:ID`.

The toy-text environments get a describing function a small model can act on and named
actions (the first action word of the reply is taken):

- FrozenLake-v1, FrozenLake8x8-v1: where you are, the goal, what lies left/down/right/up;
  actions left, down, right, up; success: the goal reached.
- Taxi-v4: the taxi, the passenger, the destination, the walls beside the taxi; actions
  south, north, east, west, pickup, dropoff; success: the passenger delivered.
- Blackjack-v1: your sum, a usable ace, the dealer's card; actions stick, hit; success:
  the hand won.
- CliffWalking-v1: where you are, the goal, the cliff; actions up, right, down, left;
  success: the goal reached.

Two simulators keep a pole upright on a cart, read as the cart's place and speed and the
pole's lean and tipping speed in metres and degrees, left or right; actions left, right
(push the cart that way); reward 1 per step; success: the pole still up when the episode
ends (by env.max_turns or the env's own step limit):

- CartPole-v1 (classic control; renders with pygame): falls past 12 degrees or when the
  cart leaves its 2.4 m track.
- InvertedPendulum-v5 (MuJoCo): its continuous force is played as a push of
  INVERTED_PENDULUM_FORCE either way (a bang-bang controller can balance it); falls past
  0.2 rad (11.5 degrees); the cart's rail ends 1 m either side.

Rows and columns count from 1. FrozenLake is not slippery unless `is_slippery: true`
(learnable by a small model), and `random_map_size: N` draws a new N x N map per seed
(gymnasium's generate_random_map), so held-out seeds are unseen maps. FrozenLake's
`distance_reward: c` adds a per-step reward: c for a move that shortens the walk to the
goal around the holes (breadth-first), -c for one that lengthens it, -2c for falling
in a hole (a shortest walk still earns the most, so the best
policy stays the same; success still means the goal reached). `info["success"]` is on
every step: whether the episode succeeded were it cut there. Any other ID with a
Discrete action space plays with numbered actions and the observation as JSON.
`kwargs` go to `gymnasium.make`; `render()` returns the env's frame (built with
render_mode="rgb_array", as env.frames_every does).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from looprl.envs.base import StepResult, or_list, parse_action


@dataclass(frozen=True)
class TextView:
    """How one Gymnasium env reads as text."""

    actions: tuple[str, ...]  # action words, in the env's action order
    describe: Callable[[Any, Any], str]  # (unwrapped env, observation) -> text
    success: Callable[[float, bool], bool]  # (last reward, terminated) -> success
    controls: tuple[Any, ...] = ()  # a continuous env's action per word (else Discrete)


def _reply_with(actions: tuple[str, ...]) -> str:
    return f"Reply with one word: {or_list(actions)}."


FROZEN_LAKE_ACTIONS = ("left", "down", "right", "up")
_TILES = {b"S": "ice", b"F": "ice", b"H": "hole", b"G": "goal"}


def describe_frozen_lake(env, observation: int) -> str:
    """Where the player is on the lake, where the goal is, and each neighbouring tile."""
    rows, cols = env.desc.shape
    row, col = divmod(int(observation), cols)
    goal_row, goal_col = (int(i[0]) for i in np.nonzero(env.desc == b"G"))
    around = []
    for word, (dr, dc) in zip(FROZEN_LAKE_ACTIONS, ((0, -1), (1, 0), (0, 1), (-1, 0)), strict=True):
        r, c = row + dr, col + dc
        tile = _TILES[env.desc[r, c]] if 0 <= r < rows and 0 <= c < cols else "edge"
        around.append(f"{word.capitalize()}: {tile}.")
    return (
        f"You are at row {row + 1}, column {col + 1} of a {rows}x{cols} frozen lake. "
        f"The goal is at row {goal_row + 1}, column {goal_col + 1}. {' '.join(around)} "
        + _reply_with(FROZEN_LAKE_ACTIONS)
    )


def walking_distances(desc: np.ndarray) -> dict[tuple[int, int], int]:
    """Steps from each tile to the goal, walking around the holes (breadth-first); tiles
    that cannot reach it are absent.

    >>> d = walking_distances(np.array([list(b"SF"), list(b"HG")]))
    >>> d[(0, 0)], d[(0, 1)], (1, 0) in d
    (2, 1, False)
    """
    rows, cols = desc.shape
    goal = tuple(int(i[0]) for i in np.nonzero(desc == b"G"))
    distances, frontier = {goal: 0}, [goal]
    while frontier:
        nearer = []
        for row, col in frontier:
            for r, c in ((row + 1, col), (row - 1, col), (row, col + 1), (row, col - 1)):
                inside = 0 <= r < rows and 0 <= c < cols
                if inside and (r, c) not in distances and desc[r, c] != b"H":
                    distances[(r, c)] = distances[(row, col)] + 1
                    nearer.append((r, c))
        frontier = nearer
    return distances


TAXI_ACTIONS = ("south", "north", "east", "west", "pickup", "dropoff")
_TAXI_STOPS = "RGYB"


def describe_taxi(env, observation: int) -> str:
    """The taxi's cell, the passenger (at a stop or aboard), the destination, and the
    moves a wall or the edge blocks."""
    row, col, passenger, destination = env.decode(int(observation))
    desc = env.desc.astype(str)

    def stop(i: int) -> str:
        r, c = env.locs[i]
        return f"row {r + 1}, column {c + 1} ({_TAXI_STOPS[i]})"

    where = "is in your taxi" if passenger == 4 else f"waits at {stop(passenger)}"
    blocked = [
        word
        for word, wall in (
            ("south", row == 4),
            ("north", row == 0),
            ("east", desc[1 + row][2 * col + 2] == "|"),
            ("west", desc[1 + row][2 * col] == "|"),
        )
        if wall
    ]
    walls = f" You cannot drive {or_list(tuple(blocked))}." if blocked else ""
    return (
        f"You drive a taxi at row {row + 1}, column {col + 1} of a 5x5 town. The passenger "
        f"{where}; the destination is {stop(destination)}.{walls} " + _reply_with(TAXI_ACTIONS)
    )


BLACKJACK_ACTIONS = ("stick", "hit")


def describe_blackjack(env, observation: tuple[int, int, int]) -> str:
    """Your sum (and whether an ace counts 11), the dealer's face-up card."""
    total, dealer, usable_ace = (int(x) for x in observation)
    ace = ", with an ace counted as 11" if usable_ace else ""
    card = "an ace" if dealer == 1 else f"a {dealer}"
    return f"Your cards add up to {total}{ace}. The dealer shows {card}. " + _reply_with(
        BLACKJACK_ACTIONS
    )


CLIFF_ACTIONS = ("up", "right", "down", "left")


def describe_cliff_walking(env, observation: int) -> str:
    """Where the player is, the goal, and the cliff along the bottom row."""
    rows, cols = env.shape
    row, col = divmod(int(observation), cols)
    return (
        f"You are at row {row + 1}, column {col + 1} of a {rows}x{cols} grid. The goal is "
        f"at row {rows}, column {cols}. The cliff covers row {rows}, columns 2 to "
        f"{cols - 1}: stepping on it costs 100 and sends you back to row {rows}, column 1. "
        + _reply_with(CLIFF_ACTIONS)
    )


POLE_ACTIONS = ("left", "right")
# A tenth of its [-3, 3]: pushing the way the pole leans then keeps it up ~170 steps (at
# full force it overshoots and falls in ~5), and a constant push topples it in 7, as in
# CartPole (9).
INVERTED_PENDULUM_FORCE = 0.3


def _side(value: float) -> str:
    return "left" if value < 0 else "right"


def describe_pole(
    position_m: float,
    track_m: float,
    velocity_m_s: float,
    angle_rad: float,
    fall_deg: float,
    angular_velocity_rad_s: float,
) -> str:
    """A cart and its pole in words; positive is right (x, and the pole's lean)."""
    angle_deg = float(np.degrees(angle_rad))
    turn_deg_s = float(np.degrees(angular_velocity_rad_s))
    return (
        "You balance a pole on a cart by pushing the cart left or right. The cart is "
        f"{abs(position_m):.2f} m {_side(position_m)} of the centre of its track (which "
        f"ends {track_m:g} m either side) and moves {_side(velocity_m_s)} at "
        f"{abs(velocity_m_s):.2f} m/s. The pole leans {abs(angle_deg):.1f} degrees "
        f"{_side(angle_deg)} (it falls at {fall_deg:g} degrees) and tips {_side(turn_deg_s)} "
        f"at {abs(turn_deg_s):.1f} degrees per second. " + _reply_with(POLE_ACTIONS)
    )


def describe_cart_pole(env, observation) -> str:
    """CartPole: observation (x, x', theta, theta'), theta > 0 leaning right."""
    x, velocity, angle, turn = (float(v) for v in observation)
    fall_deg = round(float(np.degrees(env.theta_threshold_radians)))
    return describe_pole(x, env.x_threshold, velocity, angle, fall_deg, turn)


def describe_inverted_pendulum(env, observation) -> str:
    """InvertedPendulum: observation (x, theta, x', theta'), theta > 0 leaning right (+x)."""
    x, angle, velocity, turn = (float(v) for v in observation)
    track_m = float(env.model.jnt_range[0][1])  # the slider joint's limit
    return describe_pole(x, track_m, velocity, angle, 11.5, turn)


VIEWS = {
    "FrozenLake": TextView(FROZEN_LAKE_ACTIONS, describe_frozen_lake, lambda r, t: r > 0),
    "FrozenLake8x8": TextView(FROZEN_LAKE_ACTIONS, describe_frozen_lake, lambda r, t: r > 0),
    "Taxi": TextView(TAXI_ACTIONS, describe_taxi, lambda r, t: t),
    "Blackjack": TextView(BLACKJACK_ACTIONS, describe_blackjack, lambda r, t: r > 0),
    "CliffWalking": TextView(CLIFF_ACTIONS, describe_cliff_walking, lambda r, t: t),
    "CartPole": TextView(POLE_ACTIONS, describe_cart_pole, lambda r, t: not t),
    "InvertedPendulum": TextView(
        POLE_ACTIONS,
        describe_inverted_pendulum,
        lambda r, t: not t,
        controls=(
            np.array([-INVERTED_PENDULUM_FORCE], np.float32),
            np.array([INVERTED_PENDULUM_FORCE], np.float32),
        ),
    ),
}


def plain(value: Any) -> Any:
    """`value` as JSON-ready data (numpy arrays and scalars to lists and numbers)."""
    return json.loads(json.dumps(value, default=lambda v: np.asarray(v).tolist()))


class GymnasiumEnv:
    """One Gymnasium env behind looprl's contract (see the module docstring)."""

    def __init__(
        self,
        env_id: str,
        random_map_size: int | None = None,
        distance_reward: float = 0.0,
        **kwargs: Any,
    ):
        family = env_id.split("-v")[0]
        if family.startswith("FrozenLake"):
            kwargs.setdefault("is_slippery", False)
        else:
            if random_map_size is not None:
                raise ValueError(f"env.kwargs.random_map_size is for FrozenLake, not {env_id!r}")
            if distance_reward:
                raise ValueError(f"env.kwargs.distance_reward is for FrozenLake, not {env_id!r}")
        self.env_id, self.kwargs, self.random_map_size = env_id, kwargs, random_map_size
        self.distance_reward = float(distance_reward)
        self.distances: dict[tuple[int, int], int] = {}
        self.env = gymnasium.make(env_id, **kwargs)
        self.view = VIEWS.get(family) or self._numbered_view()

    def _numbered_view(self) -> TextView:
        space = self.env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            raise ValueError(
                f"gymnasium:{self.env_id} has a {space} action space; the text adapter plays "
                "Discrete actions only: wrap it in your own env (env.name=module:factory)"
            )
        actions = tuple(str(int(space.start) + i) for i in range(int(space.n)))

        def describe(env, observation) -> str:
            return f"Observation: {json.dumps(plain(observation))}. " + _reply_with(actions)

        return TextView(actions, describe, lambda r, t: r > 0)

    def reset(self, seed: int, options: dict | None = None) -> str:
        if self.random_map_size is not None:
            desc = generate_random_map(self.random_map_size, seed=seed)
            self.env = gymnasium.make(self.env_id, desc=desc, **self.kwargs)
        observation, _ = self.env.reset(seed=seed, options=options)
        if self.distance_reward:
            self.distances = walking_distances(self.env.unwrapped.desc)
        self.state = observation
        return self.view.describe(self.env.unwrapped, observation)

    def step(self, action_text: str) -> StepResult:
        index = parse_action(action_text, self.view.actions)
        if self.view.controls:
            action = self.view.controls[index]
        else:
            action = int(self.env.action_space.start) + index  # a Discrete may not start at 0
        observation, reward, terminated, truncated, info = self.env.step(action)
        # Whether the episode succeeded were it to end here, on every step: env.max_turns
        # may end it before the env does. Judged on the env's own reward, not the shaped.
        success = bool(self.view.success(float(reward), bool(terminated)))
        if self.distance_reward:
            reward = float(reward) + self.shaping(self.state, observation)
        self.state = observation
        info = {**plain(info), "action": self.view.actions[index], "success": success}
        done = bool(terminated or truncated)
        return self.view.describe(self.env.unwrapped, observation), float(reward), done, info

    def shaping(self, before: int, after: int) -> float:
        """FrozenLake's distance_reward for a move from tile `before` to tile `after`: c per
        step nearer the goal, -c per step farther, -2c into a hole (0 into the edge)."""
        cols = self.env.unwrapped.desc.shape[1]
        start, end = divmod(int(before), cols), divmod(int(after), cols)
        if start not in self.distances:  # cut off from the goal: nothing to steer towards
            return 0.0
        if end not in self.distances:  # a hole (or a tile cut off from the goal)
            return -2 * self.distance_reward
        return self.distance_reward * (self.distances[start] - self.distances[end])

    def render(self) -> Any:
        """The env's frame: an (H, W, 3) uint8 array when built with render_mode="rgb_array"."""
        return self.env.render()


def make(env_id: str, **kwargs: Any) -> GymnasiumEnv:
    return GymnasiumEnv(env_id, **kwargs)
