"""Who may call the gateway: the FastAPI dependencies that check a request's key.

Owns: reading the key a client sent (`Authorization: Bearer <key>`, or `x-api-key` as
Anthropic's clients send it), comparing it in constant time with the session's
`api_key` (model calls) or `reward_key` (the reward route), or with the sessionless
routes' key, and the one 401 for a wrong key and a session that is not open, so a caller
cannot probe which sessions exist. Does not own the keys (sessions.py makes them) nor
the routes (app.py).
"""

from __future__ import annotations

import secrets

from fastapi import Header

from looprl.gateway.errors import APIError
from looprl.gateway.sessions import Session, SessionStore

_NO_SESSION_KEY = secrets.token_urlsafe(32)  # what a key for an unknown session is compared to


class Keys:
    """The key checks of one app: sessions from `store`; the sessionless routes need
    `sessionless_api_key` when one is given."""

    def __init__(self, store: SessionStore, sessionless_api_key: str | None):
        self.store = store
        self.sessionless_api_key = sessionless_api_key

    def session_for(
        self,
        session_id: str,
        authorization: str | None = Header(None),
        x_api_key: str | None = Header(None),
    ) -> Session:
        """The open session whose api_key was sent (model calls)."""
        return self._authorized(session_id, _sent_key(authorization, x_api_key), "api_key")

    def reward_session_for(
        self, session_id: str, authorization: str | None = Header(None)
    ) -> Session:
        """The open session whose reward_key was sent (the reward route)."""
        return self._authorized(session_id, _sent_key(authorization, None), "reward_key")

    def sessionless(
        self, authorization: str | None = Header(None), x_api_key: str | None = Header(None)
    ) -> None:
        """None (no session) when the sessionless routes' key was sent or none is needed."""
        if self.sessionless_api_key is None:
            return None
        key = _sent_key(authorization, x_api_key) or ""
        if not secrets.compare_digest(key.encode(), self.sessionless_api_key.encode()):
            raise APIError(
                401,
                "wrong or missing API key: send `Authorization: Bearer <key>` (or "
                "`x-api-key: <key>`) with the key the server was started with (--api-key)",
                type="authentication_error",
            )
        return None

    def _authorized(self, session_id: str, key: str | None, key_name: str) -> Session:
        """The open session whose `key_name` key was sent; else the 401."""
        session = self.store.get(session_id)
        # Compared even for an unknown session, so timing does not tell which exist.
        expected = getattr(session, key_name) if session is not None else _NO_SESSION_KEY
        matches = secrets.compare_digest((key or "").encode(), expected.encode())
        if session is None or not matches:
            raise APIError(
                401,
                "this session is not open (never opened, or closed when its rollout "
                f"ended) or the key is wrong: send `Authorization: Bearer <{key_name}>` "
                f"(or `x-api-key: <{key_name}>`) with the {key_name} the session was "
                "opened with",
                type="authentication_error",
            )
        return session


def _sent_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key sent as `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's
    clients given an API key), None when neither."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() == "bearer":
        return key.strip()
    return x_api_key
