"""`session_client`: the OpenAI client looprl's own workflows (RLVR, env, verifiers) use
to call a gateway session.

No read timeout: `rollout.timeout_s` bounds a rollout as a whole, and a generation on a
loaded 2-core CPU can take minutes. A 60 s connect timeout: openai's default (5 s)
fired on a 2-core machine whose cores were busy (a rollout lost to APITimeoutError in
the default job). No retries: a failed call fails the rollout, which the controller
counts, instead of sampling twice. Connections are reused: httpx drops an idle one
after 5 s, well before the gateway does (75 s), so a reused one is never being closed.
"""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI

SESSION_TIMEOUT = httpx.Timeout(None, connect=60.0)


def session_client(base_url: str, api_key: str) -> AsyncOpenAI:
    """An AsyncOpenAI client on a gateway session (use it as `async with`)."""
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=SESSION_TIMEOUT)
