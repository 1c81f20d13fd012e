"""Debian's Chromium for Playwright (its own browser download is unreachable here): where
it is, and the flags a closed network needs. Shared by the viewer's tests and bench."""

from __future__ import annotations

import shutil

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium keeps calling home, which a closed network answers slowly.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def find_chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(candidate)
        if found:
            return found
    return None
