"""What the browser tests share: the system Chromium, screenshots, offline pages.

Playwright cannot download its own browser here, so the tests drive the system's
Chromium (`apt-get install chromium`; .ci/run installs it when it is missing). Without
one, the browser tests are skipped on a developer's machine and fail under CI."""

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "_build" / "screenshots"


def chromium() -> str:
    "The path of the system Chromium, or skip (fail under CI, which must have one)"
    names = ["chromium", "chromium-browser", "google-chrome"]
    found = os.environ.get("CHROMIUM") or next(
        filter(None, map(shutil.which, names)), None
    )
    if found is None:
        message = "no Chromium on this machine (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the browser tests")
        pytest.skip(message)
    pytest.importorskip("playwright", reason="pip install playwright")
    return found


def block_outside(page, allowed: tuple[str, ...]) -> list[str]:
    "Abort every request not to `allowed` prefixes; the list of those aborted"
    outside = []

    def route(request_route):
        url = request_route.request.url
        if url.startswith(allowed):
            return request_route.continue_()
        outside.append(url)
        return request_route.abort()

    page.route("**/*", route)
    return outside
