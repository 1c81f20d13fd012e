"""The gateway: OpenAI-compatible HTTP endpoints that record every call per session."""

from looprl.gateway.app import create_app
from looprl.gateway.errors import APIError
from looprl.gateway.server import GatewayServer, SessionHandle, serve_sessionless
from looprl.gateway.sessions import Session, SessionStore

__all__ = [
    "APIError",
    "GatewayServer",
    "Session",
    "SessionHandle",
    "SessionStore",
    "create_app",
    "serve_sessionless",
]
