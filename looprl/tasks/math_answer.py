"""Math word problems (GSM8K style) scored by `math-verify`.

The reference answer is the text after `####` when present (GSM8K's format), else the
whole field. The model's answer is its last `\\boxed{...}`, else the text after its last
`####`, else its last number; `math-verify` decides equality (so 1,000 == 1000 and
1/2 == 0.5).
"""

from __future__ import annotations

from math_verify import parse, verify

from looprl.tasks.arithmetic import last_number


def extract_reference(answer: str) -> str:
    """GSM8K answers end with '#### 72'; return what follows the last '####'."""
    return answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer.strip()


def extract_prediction(completion: str) -> str | None:
    if "\\boxed" in completion:
        return completion[completion.rfind("\\boxed") :]
    if "####" in completion:
        return completion.rsplit("####", 1)[-1].strip()
    value = last_number(completion)
    return None if value is None else f"{value:g}"


def math_reward(prompt: str, completion: str, *, answer: str | int | float, **_) -> float:
    """1.0 if the completion's final answer equals the reference, else 0.0.

    >>> math_reward("", "She pays 3 * 24 = 72 dollars.\\n#### 72", answer="... #### 72")
    1.0
    >>> math_reward("", "The answer is \\\\boxed{\\\\frac{1}{2}}", answer="0.5")
    1.0
    >>> math_reward("", "I think 71.", answer="#### 72")
    0.0
    """
    prediction = extract_prediction(completion)
    if prediction is None:
        return 0.0
    gold = parse(extract_reference(str(answer)), parsing_timeout=None)
    guess = parse(prediction, parsing_timeout=None)
    return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=None) else 0.0
