"""What a GuessTheNumber held-out success means: the success of scripted players on the
games `examples/envs/guess_the_number.yaml` holds out, played by TextArena itself through
looprl's adapter (looprl/envs/textarena.py).

    python bench/guess_the_number_baselines.py [MAX_NUMBER MAX_TURNS]

Prints, on the 100 held-out seeds (1,000,000 + i, as task.name=env draws them for
task.seed 0), with numbers 1..MAX_NUMBER and the game's max_turns MAX_TURNS (the yaml's 10
and 3 unless given; TextArena ends the game after the guess *past* max_turns, so a player
has MAX_TURNS + 1 guesses), the success rate of three players (20 games per seed, seeded):
- uniform over the range: any number, a repeat included (TextArena rejects a repeat;
  two rejected replies in a row end the game);
- uniform among the numbers not yet excluded (not guessed, and on the side the hints
  point to);
- binary search: the middle of what is not yet excluded, the best player.
Each game is cut after 2 x (MAX_TURNS + 1) replies, as the yaml's env.max_turns cuts them.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

from looprl.envs.base import InvalidAction
from looprl.envs.textarena import TextArenaEnv
from looprl.tasks.env_seeds import HELD_OUT_OFFSET

SEEDS = [HELD_OUT_OFFSET + i for i in range(100)]
GAMES_PER_SEED = 20

# A player maps (lowest and highest number not yet excluded, numbers guessed) to a guess.
Player = Callable[[int, int, set[int]], int]


def play(env: TextArenaEnv, seed: int, player: Player, replies: int) -> bool:
    """Whether `player` finds the number of game `seed` within `replies` replies."""
    env.reset(seed)
    game = env.env.state.game_state
    low, high = env.env.min_number, env.env.max_number
    guessed: set[int] = set()
    for _ in range(replies):
        guess = player(low, high, guessed)
        try:
            _, _, done, info = env.step(f"[{guess}]")
        except InvalidAction:  # a repeat, within the game's error allowance
            continue
        if done:
            return info["success"]
        guessed.add(guess)
        number, hint = game["guess_history"][-1]
        low, high = (number + 1, high) if hint == "higher" else (low, number - 1)
    return False


def main(max_number: int, max_turns: int) -> None:
    env = TextArenaEnv(
        "GuessTheNumber-v0", min_number=1, max_number=max_number, max_turns=max_turns
    )
    rng = random.Random(0)  # the players' own: TextArena reseeds the module's at each reset
    players: dict[str, Player] = {
        "uniform over the range": lambda low, high, guessed: rng.randint(1, max_number),
        "uniform among numbers not yet excluded": lambda low, high, guessed: rng.choice(
            [n for n in range(low, high + 1) if n not in guessed]
        ),
        "binary search": lambda low, high, guessed: (low + high) // 2,
    }
    guesses = max_turns + 1
    print(f"GuessTheNumber 1..{max_number}, {guesses} guesses, {len(SEEDS)} held-out seeds:")
    for name, player in players.items():
        games = [
            play(env, seed, player, 2 * guesses) for seed in SEEDS for _ in range(GAMES_PER_SEED)
        ]
        print(f"  {name}: {sum(games) / len(games):.1%}")


if __name__ == "__main__":
    max_number, max_turns = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (10, 3)
    main(max_number, max_turns)
