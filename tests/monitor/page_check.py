"""Open a run page in headless Chromium and read what a user sees: text, boxes, a screenshot.

Chromium is driven over the DevTools protocol (a websocket to its page target), so a test can
ask the laid-out page where each summary value and tile sits, not only what the DOM holds.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WIDTH, HEIGHT = 1400, 1000  # a laptop browser window
SHOT_DIR = Path(__file__).resolve().parents[2] / "test-out"  # git-ignored


def fmt_full(v: float | int) -> str:
    """The page's ``fmtFull``: whole numbers in full, others to 4 significant digits."""
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    a = abs(v)
    if a >= 1e4:
        return f"{math.floor(v + 0.5):,}"  # JavaScript's Math.round: halves up
    if a >= 1e-3:
        return f"{float(f'{v:.4g}'):g}"
    mantissa, exp = f"{v:.3e}".split("e")
    return f"{mantissa}e{int(exp):+d}"


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=30))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.eval(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        """The whole page (not only the window) as a PNG."""
        height = int(self.eval("document.documentElement.scrollHeight"))
        self.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=height,
                  deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        self.call("Emulation.clearDeviceMetricsOverride")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


@contextlib.contextmanager
def open_page(url: str, profile: Path) -> Iterator[Page]:
    """Chromium showing ``url`` at WIDTH x HEIGHT; stopped on exit."""
    assert CHROMIUM is not None
    profile.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(profile)})
    try:
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Chromium gave no DevTools port (exit {proc.poll()})")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
            yield Page(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Each summary row and tile: its text, whether its text's box lies inside its card's box, and
# whether it is what a user sees at its centre (not covered, clipped or scrolled away).
BOXES_JS = r"""
(() => {
  function box(el, card) {
    const range = document.createRange();
    range.selectNodeContents(el);
    const r = range.getBoundingClientRect(), c = card.getBoundingClientRect();
    el.scrollIntoView({block: "center", inline: "center"});
    const r2 = range.getBoundingClientRect();
    const hit = document.elementFromPoint(r2.left + r2.width / 2, r2.top + r2.height / 2);
    return {
      text: el.textContent,
      rect: [r.left, r.top, r.right, r.bottom], card: [c.left, c.top, c.right, c.bottom],
      inside: r.width > 0 && r.height > 0 && r.left >= c.left && r.right <= c.right &&
              r.top >= c.top && r.bottom <= c.bottom,
      seen: !!hit && (el === hit || el.contains(hit)),
    };
  }
  const summary = {};
  for (const tr of document.querySelectorAll("#summary tr[data-key]")) {
    summary[tr.dataset.key] = box(tr.querySelector("td"), tr.closest(".card"));
  }
  const tiles = {};
  for (const t of document.querySelectorAll("#tiles .tile")) {
    tiles[t.dataset.tile] = {...box(t.querySelector(".v"), t), scope: t.dataset.scope,
                             value: t.dataset.value};
  }
  const evalDots = document.querySelectorAll(
    '[data-chart="reward"] circle.pt[data-series="eval reward"]').length;
  const evalLine = !!document.querySelector(
    '[data-chart="reward"] path[data-series="eval reward"]');
  const note = document.querySelector('[data-chart="reward"] .chart-note');
  window.scrollTo(0, 0);
  return {summary, tiles, evalDots, evalLine, note: note ? note.textContent : null,
          pageWidth: document.documentElement.scrollWidth, viewWidth: window.innerWidth};
})()
"""


def read_page(page: Page) -> dict[str, Any]:
    """What BOXES_JS reports about the page."""
    return page.eval(BOXES_JS)
