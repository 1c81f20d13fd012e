"""ensure_venv: an existing venv is reused untouched; a failed install leaves nothing behind."""

from __future__ import annotations

import pytest

from looprl.engines.servers.venvs import VenvError, ensure_venv


def test_an_existing_venv_is_returned_without_installing(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert ensure_venv(tmp_path / "venv", ["no-such-package-is-installed"]) == python


def test_a_failed_install_removes_the_half_built_venv(tmp_path):
    venv = tmp_path / "venv"
    with pytest.raises(VenvError, match="not a requirement!!"):
        ensure_venv(venv, ["not a requirement!!"])  # pip rejects it without the network
    assert not venv.exists()
