"""`session_client`: the OpenAI client looprl's own workflows (RLVR, env, verifiers) use
to call a gateway session.

No read timeout: `rollout.timeout_s` bounds a rollout as a whole, and a generation on a
loaded 2-core CPU can take minutes. A 60 s connect timeout: openai's default (5 s)
fired on a 2-core machine whose cores were busy (a rollout lost to APITimeoutError in
the default job). No retries: a failed call fails the rollout, which the controller
counts, instead of sampling twice. Connections are reused: httpx drops an idle one
after 5 s, well before the gateway does (75 s), so a reused one is never being closed.

One TLS context for every client: httpx builds one per client by default, loading the
CA bundle, ~25 ms of CPU under the GIL each time. With a client per rollout that was the
driver thread's largest cost after decoding (py-spy, asynchronous RL: 64 rollouts a
step cost ~1.6 s, taken from the trainer thread), though a gateway on loopback is plain
HTTP. Each session still gets its own client, closed with it.
"""

from __future__ import annotations

import functools
import ssl

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

SESSION_TIMEOUT = httpx.Timeout(None, connect=60.0)


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CA bundle, SSL_CERT_FILE honoured), built
    once per process and shared: an SSLContext may serve many connections."""
    return httpx.create_ssl_context()


def session_client(base_url: str, api_key: str) -> AsyncOpenAI:
    """An AsyncOpenAI client on a gateway session (use it as `async with`)."""
    # The timeout goes to AsyncOpenAI, which applies it per request: openai's transport
    # is httpx2, whose client takes no httpx.Timeout.
    http = DefaultAsyncHttpxClient(verify=shared_ssl_context())
    return AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
        timeout=SESSION_TIMEOUT,
        http_client=http,
    )
