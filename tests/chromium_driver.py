"""A headless Chromium driven over the DevTools protocol on a pipe (no websocket client needed).

``--remote-debugging-pipe`` makes Chromium read protocol messages from fd 3
and write them to fd 4, each a JSON object ended by a NUL byte.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def ensure_chromium() -> tuple[str | None, str]:
    """(path, "") when a Chromium is available, installing Debian's package as root; else (None, why)."""
    path = find_chromium()
    if path:
        return path, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "no chromium on PATH, and apt-get install needs root on a Debian system"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env,
                       capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"installing Debian's chromium package failed: {exc}"
    path = find_chromium()
    return (path, "") if path else (None, "apt-get installed chromium but it is not on PATH")


class Chromium:
    """One headless browser with one page; ``evaluate`` runs JS in it and returns the value."""

    def __init__(self, path: str, width: int = 1400, height: int = 1000) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")

        def wire_fds() -> None:  # in the child: the protocol pipe on fds 3 and 4
            a = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [
            path, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
            f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank",
        ]
        self.proc = subprocess.Popen(args, pass_fds=(3, 4), preexec_fn=wire_fds,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable", session=True)
        self.send("Runtime.enable", session=True)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message:
                    with self._cond:
                        self._replies[message["id"]] = message
                        self._cond.notify_all()

    def send(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 60.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._next_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"chromium did not answer {method}")
                self._cond.wait(left)
            reply = self._replies.pop(self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, session=True)

    def evaluate(self, expression: str, timeout: float = 30.0):
        result = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=True, timeout=timeout,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0, poll: float = 0.2):
        """Polls ``expression`` until it is truthy (a JS error counts as false); returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:  # e.g. the page is still loading: document.body is null
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s: {expression}")
            time.sleep(poll)

    def hover(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y}, session=True)

    def screenshot(self, path: str) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (TimeoutError, RuntimeError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        shutil.rmtree(self._profile, ignore_errors=True)
