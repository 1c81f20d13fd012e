"""reward.type=judge: an LLM scores answers through any OpenAI-compatible endpoint.

`absolute`: one call per rollout with the rubric (`reward.judge.prompt`); the reply's
"Score: N" (else its last number), 0-10, becomes N / 10. `group`: the rollouts of one
row are scored together in one call (`group_prompt`), one "Candidate i: N" line each:
group-relative advantages only need their order, and a judge ranks better side by side.
A group's call starts once every rollout of the row that started has answered or
ended (`rollout()` spans the rollout, so the judge knows who is still coming).

Judgments are cached by a hash of (prompt, completion). A call that fails, times out
(`timeout_s`) or gives an unreadable reply is retried `retries` times with backoff;
after that the rollout gets `fallback_reward` (None: rejected), counted as
`reward_judge_failures`. A judge never stops the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from openai import AsyncOpenAI

from looprl.config import JudgeConfig
from looprl.rewards import Scorer

log = logging.getLogger(__name__)

_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_CANDIDATE = re.compile(r"candidate\s*#?\s*(\d+)\s*[:=\-]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_score(reply: str) -> float | None:
    """The reply's score in [0, 1] (its "Score: N", else its last number, over 10), or
    None when there is none in 0-10.

    >>> parse_score("The answer is right. Score: 8")
    0.8
    >>> parse_score("I would give it 10/10")
    1.0
    >>> parse_score("no idea"), parse_score("Score: 12")
    (None, None)
    """
    found = _SCORE.findall(reply) or _NUMBER.findall(reply)
    if not found:
        return None
    value = float(found[-1])
    return value / 10 if 0 <= value <= 10 else None


def parse_group_scores(reply: str, count: int) -> list[float] | None:
    """One score in [0, 1] per candidate 1..count from "Candidate i: N" lines, or None
    when one is missing or out of 0-10 (the last line for a candidate wins).

    >>> parse_group_scores("Candidate 1: 3\\nCandidate 2: 10", 2)
    [0.3, 1.0]
    >>> parse_group_scores("Candidate 1: 3", 2) is None
    True
    """
    scores: dict[int, float] = {}
    for index, value in _CANDIDATE.findall(reply):
        scores[int(index)] = float(value)
    values = [scores.get(i) for i in range(1, count + 1)]
    if any(v is None or not 0 <= v <= 10 for v in values):
        return None
    return [v / 10 for v in values]


def remote_endpoint(cfg: JudgeConfig) -> tuple[str, str]:
    """(base_url, api key) of a remote judge; the key from `cfg.api_key_env`."""
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise ValueError(
            f"reward.judge.base_url={cfg.base_url!r} needs an API key in the environment "
            f"variable {cfg.api_key_env!r} (reward.judge.api_key_env); it is not set"
        )
    return cfg.base_url, key


@dataclass
class _Group:
    """The rollouts of one row being judged together."""

    pending: int = 0  # started, neither answered nor ended
    entries: list[tuple[str, str, asyncio.Future]] = field(default_factory=list)


class JudgeReward:
    def __init__(
        self, cfg: JudgeConfig, *, base_url: str, api_key: str, model: str, answer_field: str
    ):
        self.cfg, self.model, self.answer_field = cfg, model, answer_field
        self.client = AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=cfg.timeout_s
        )
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._groups: dict[int, _Group] = {}  # by id(row): a group's rollouts share the row
        self._calls: set[asyncio.Task] = set()
        self._counts: Counter[str] = Counter()
        self._logged: set[str] = set()

    @contextlib.asynccontextmanager
    async def rollout(self, row: dict) -> AsyncIterator[Scorer]:
        if self.cfg.mode == "absolute":

            async def score(prompt: str, completion: str) -> float | None:
                return await self._absolute(prompt, completion, row)

            yield score
            return
        group = self._groups.setdefault(id(row), _Group())
        group.pending += 1
        answered = False

        async def score_in_group(prompt: str, completion: str) -> float | None:
            nonlocal answered
            future = asyncio.get_running_loop().create_future()
            group.entries.append((prompt, completion, future))
            answered = True
            self._leave(group, row)
            return await asyncio.shield(future)  # one member cancelled: the call goes on

        try:
            yield score_in_group
        finally:
            if not answered:
                self._leave(group, row)

    def _leave(self, group: _Group, row: dict) -> None:
        group.pending -= 1
        if group.pending == 0:
            if self._groups.get(id(row)) is group:
                del self._groups[id(row)]
            if group.entries:
                task = asyncio.create_task(self._judge_group(group.entries, row))
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)

    # ---- absolute ------------------------------------------------------------------

    async def _absolute(self, prompt: str, completion: str, row: dict) -> float | None:
        key = _key(prompt, completion)
        if key in self._cache:
            self._counts["reward_judge_cache_hits"] += 1
            return self._cached(key)
        text = self.cfg.prompt.format(
            question=prompt, answer=completion, reference=self._reference(row)
        )
        score = await self._call(text, parse_score)
        if score is None:
            self._counts["reward_judge_failures"] += 1
            return self.cfg.fallback_reward
        self._store(key, score)
        return score

    # ---- group ---------------------------------------------------------------------

    async def _judge_group(self, entries: list[tuple[str, str, asyncio.Future]], row) -> None:
        try:
            scores: dict[str, float] = {}
            todo: list[tuple[str, str, str]] = []  # (key, prompt, completion) to judge
            for prompt, completion, _ in entries:
                key = _key(prompt, completion)
                if key in self._cache:
                    self._counts["reward_judge_cache_hits"] += 1
                    scores[key] = self._cached(key)
                elif key not in {k for k, _, _ in todo}:
                    todo.append((key, prompt, completion))
            if todo:
                candidates = "\n\n".join(
                    f"Candidate {i}:\n{completion}" for i, (_, _, completion) in enumerate(todo, 1)
                )
                text = self.cfg.group_prompt.format(
                    question=todo[0][1], reference=self._reference(row), candidates=candidates
                )
                judged = await self._call(text, lambda reply: parse_group_scores(reply, len(todo)))
                for (key, _, _), score in zip(todo, judged or [], strict=False):
                    scores[key] = score
                    self._store(key, score)
            for prompt, completion, future in entries:
                score = scores.get(_key(prompt, completion))
                if score is None:
                    self._counts["reward_judge_failures"] += 1
                    score = self.cfg.fallback_reward
                if not future.done():
                    future.set_result(score)
        except BaseException as e:  # the waiting rollouts must hear of it
            for _, _, future in entries:
                if not future.done():
                    future.set_exception(e)
            raise

    # ---- the call ------------------------------------------------------------------

    async def _call(self, text: str, parse):
        """The parsed reply to `text`, retried with backoff; None after every try failed."""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self._counts["reward_judge_retries"] += 1
                await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            self._counts["reward_judge_calls"] += 1
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    response = await self.client.chat.completions.create(
                        model=self.model,
                        messages=[{"role": "user", "content": text}],
                        temperature=0.0,
                        max_tokens=self.cfg.max_tokens,
                    )
            except Exception as e:  # an endpoint's failure: retried, counted, never fatal
                self._log_once(type(e).__name__, f"{type(e).__name__}: {e}")
                continue
            reply = response.choices[0].message.content or ""
            parsed = parse(reply)
            if parsed is not None:
                return parsed
            self._log_once("unparseable", f"an unreadable reply {reply[:200]!r}")
        return None

    def _log_once(self, kind: str, what: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(
                "The judge call failed with %s; it is retried, and a judgment that fails "
                "every try gives reward.judge.fallback_reward=%s (later ones are counted)",
                what,
                self.cfg.fallback_reward,
            )

    def _reference(self, row: dict) -> str:
        return str(row.get(self.answer_field, ""))

    def _cached(self, key: str) -> float:
        self._cache.move_to_end(key)
        return self._cache[key]

    def _store(self, key: str, score: float) -> None:
        if self.cfg.cache_size:
            self._cache[key] = score
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)

    def take_stats(self) -> dict[str, int]:
        names = ["calls", "retries", "failures", "cache_hits"]
        stats = {f"reward_judge_{n}": self._counts[f"reward_judge_{n}"] for n in names}
        self._counts.clear()
        return stats

    async def aclose(self) -> None:
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        await self.client.close()

    def __repr__(self) -> str:
        return f"LLM judge ({self.cfg.mode}) at {self.client.base_url}"


def _key(prompt: str, completion: str) -> str:
    return hashlib.sha256(f"{len(prompt)}:{prompt}{completion}".encode()).hexdigest()
