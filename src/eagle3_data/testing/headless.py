"""Headless Chromium for tests: load a page, run JavaScript in it and in its frames, take screenshots.

Chromium is driven through its DevTools protocol over ``--remote-debugging-pipe`` (JSON messages separated by
NUL on file descriptors 3 and 4, the transport Puppeteer uses): no websocket client or browser-driver package is
needed, only the ``chromium`` binary (Debian: ``apt-get install chromium``). ``--dump-dom`` alone cannot do what
the report-page test needs: it prints the top document once, before any click, and never the documents of
iframes, where Snakemake's report shows HTML results.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

#: flags that work in a sandbox-less container with no network and no GPU
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
]


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


def _above_9(fd: int) -> int:
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return new


class Browser:
    """One headless Chromium with one page. ``with Browser() as b: b.goto(url); b.eval("1 + 1")``."""

    def __init__(self, exe: str | None = None, *, width: int = 1400, height: int = 900, timeout: float = 60.0):
        self.exe = exe or find_chromium()
        if not self.exe:
            raise FileNotFoundError("no chromium on PATH")
        self.width, self.height, self.timeout = width, height, timeout
        self._next_id = 0
        self._buf = b""
        self._events: list[dict] = []

    # -- process and transport ---------------------------------------------------------------------------
    def __enter__(self) -> Browser:
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # the child's ends move above 9 so that placing them on 3 and 4 never closes one of them (bash: dash
        # takes one-digit descriptors only)
        to_chrome_r, from_chrome_w = (_above_9(fd) for fd in (to_chrome_r, from_chrome_w))
        args = FLAGS + [
            f"--user-data-dir={self._profile}",
            "--remote-debugging-pipe",
            f"--window-size={self.width},{self.height}",
            "about:blank",
        ]
        # fd 3: commands to Chromium, fd 4: its replies
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, self.exe, *args],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        try:
            target = self.send("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.send("Page.enable", session=True)
            self.send("Runtime.enable", session=True)
            self.send(
                "Emulation.setDeviceMetricsOverride",
                session=True,
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.poll() is not None else ""
                raise CDPError(f"chromium closed the pipe (exit {self.proc.poll()}): {err}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, *, session: bool = False, timeout: float | None = None, **params) -> dict:
        """Send a DevTools command (to the page's session when ``session``); its result. Raises CDPError."""
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def wait_event(self, method: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for i, ev in enumerate(self._events):
                if ev["method"] == method:
                    return self._events.pop(i)
            self._events.append(self._read_message(deadline))

    # -- page -----------------------------------------------------------------------------------------------
    def goto(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self._events.clear()
        self.send("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str, *, context_id: int | None = None):
        """Value of a JavaScript expression in the page (or in the execution context ``context_id``)."""
        params = {"expression": expression, "returnByValue": True, "awaitPromise": True}
        if context_id is not None:
            params["contextId"] = context_id
        res = self.send("Runtime.evaluate", session=True, **params)
        if "exceptionDetails" in res:
            raise CDPError(f"{expression[:80]}: {res['exceptionDetails'].get('exception', res['exceptionDetails'])}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None, *, context_id: int | None = None):
        """Poll ``expression`` until it is truthy; its value. TimeoutError otherwise."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            value = self.eval(expression, context_id=context_id)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout or self.timeout}s: {expression[:120]}")
            time.sleep(0.2)

    def child_frames(self) -> list[dict]:
        """The page's child frames (``{"id", "url", ...}``), iframes included."""
        tree = self.send("Page.getFrameTree", session=True)["frameTree"]
        out, todo = [], list(tree.get("childFrames", []))
        while todo:
            node = todo.pop(0)
            out.append(node["frame"])
            todo += node.get("childFrames", [])
        return out

    def frame_context(self, frame_id: str) -> int:
        """An execution context in frame ``frame_id`` (works for cross-origin frames, e.g. ``data:`` iframes)."""
        return self.send("Page.createIsolatedWorld", session=True, frameId=frame_id, worldName="test")[
            "executionContextId"
        ]

    def screenshot(self, path) -> Path:
        """PNG of the viewport written to ``path``."""
        data = self.send("Page.captureScreenshot", session=True, format="png")["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path
