"""session_client: the OpenAI client of looprl's workflows shares one TLS context, and
each request keeps the session's timeout (no read timeout, a 60 s connect timeout) and
no retries."""

from __future__ import annotations

from openai._models import FinalRequestOptions

from looprl.workflows.client import session_client, shared_ssl_context


def test_clients_share_one_tls_context_and_close_on_their_own():
    a = session_client("http://127.0.0.1:9/v1", "key-a")
    b = session_client("http://127.0.0.1:9/v1", "key-b")
    # httpx builds a context per client unless given one (~25 ms of CPU each).
    pool_a, pool_b = a._client._transport._pool, b._client._transport._pool
    assert pool_a._ssl_context is shared_ssl_context()
    assert pool_b._ssl_context is shared_ssl_context()
    assert a._client is not b._client  # a session's client is still its own


def test_each_request_has_the_session_timeout_and_no_retries():
    client = session_client("http://127.0.0.1:9/v1", "key")
    options = FinalRequestOptions.construct(method="post", url="/chat/completions", json_data={})
    request = client._build_request(options)
    assert request.extensions["timeout"] == {
        "connect": 60.0,
        "read": None,
        "write": None,
        "pool": None,
    }
    assert request.headers["authorization"] == "Bearer key"
    assert client.max_retries == 0
