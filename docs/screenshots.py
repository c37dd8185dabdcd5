"""Take the documentation's screenshots (docs/img/*.png) of a real `ampwatch demo` on a temporary SQLite file.

Run from the repository root with the `dev` extra and torch installed, and Debian's chromium:

    python docs/screenshots.py

It starts `ampwatch demo` on a free loopback port, waits for the training to end, then opens the pages in
headless Chromium (Playwright) and saves one PNG per page. Nothing is mocked: the pictures show what the
demo's run really recorded and diagnosed.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

IMG = Path(__file__).resolve().parent / "img"
VIEWPORT = {"width": 1280, "height": 800}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_demo(db: Path, port: int, steps: int) -> tuple[subprocess.Popen[str], str]:
    """Start the demo; return it and its run page's URL once training has ended (the server keeps serving)."""
    command = [sys.executable, "-m", "ampwatch._cli", "demo", "--db", f"sqlite:///{db}", "--port", str(port)]
    command += ["--steps", str(steps), "--step-delay", "0"]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert demo.stdout is not None
    for line in demo.stdout:
        print(line, end="")
        if line.startswith("Run page: "):
            return demo, line.split(": ", 1)[1].strip()
    raise SystemExit(f"the demo ended without a run page (exit code {demo.wait()})")


def _load(page: Any, url: str, ready: str) -> None:
    page.goto(url)
    page.wait_for_selector(ready, timeout=30_000)
    time.sleep(1.0)  # Plotly animates its first draw; a picture taken mid-draw shows half a chart


def _shoot(page: Any, url: str, name: str, ready: str, selector: str | None = None) -> None:
    page.set_viewport_size(VIEWPORT)
    _load(page, url, ready)
    path = IMG / name
    if selector:
        page.locator(selector).screenshot(path=str(path))
    else:
        page.screenshot(path=str(path))
    print(f"wrote {path.relative_to(IMG.parent.parent)} ({path.stat().st_size // 1024} KiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="the demo's training steps (default 600)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    IMG.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        demo, run_url = _start_demo(Path(tmp) / "demo.db", port, args.steps)
        base = f"http://127.0.0.1:{port}"
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                context = browser.new_context(viewport=VIEWPORT)
                page = context.new_page()
                _shoot(page, run_url, "run-page.png", "#charts[data-loaded='true']")
                _shoot(page, run_url, "run-charts.png", "#charts[data-loaded='true']", "#charts")
                _shoot(page, run_url, "run-timeline.png", "#charts[data-loaded='true']", "#timeline")
                _shoot(page, f"{base}/", "runs.png", "table", "main")
                _shoot(page, f"{base}/alerts", "alerts.png", "main")
                _shoot(page, f"{base}/alerts/rules", "alert-rules.png", "main")
                run_id = run_url.rstrip("/").rsplit("/", 1)[1]
                _shoot(page, f"{base}/compare?run={run_id}&series=grad_norm", "compare.png", ".js-plotly-plot")
                browser.close()
        finally:
            demo.terminate()
            demo.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
