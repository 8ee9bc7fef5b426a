"""The chat page at / in headless Chromium: it streams a reply and marks the drafter's accepted tokens.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
separated by NUL bytes on fds 3 and 4), so the test needs no extra Python package. `make browser`
installs Debian's chromium; without it the test is skipped.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse

import pytest

from server_util import ThreadServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (run `make browser`)")


class DevTools:
    """A minimal Chrome DevTools Protocol client over --remote-debugging-pipe."""

    def __init__(self, tmp_path):
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 f"--user-data-dir={tmp_path}", "--remote-debugging-pipe", "about:blank"]
        shell = f'exec "{CHROMIUM}" ' + " ".join(f"'{f}'" for f in flags) + f" 3<&{cmd_r} 4>&{resp_w}"
        self.proc = subprocess.Popen(["bash", "-c", shell], pass_fds=(cmd_r, resp_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r), os.close(resp_w)
        self._buf, self._id = b"", 0

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._resp_r, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(reply["error"])
                return reply["result"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        os.close(self._cmd_w), os.close(self._resp_r)


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ThreadServer(str(tiny_dir("llama")), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
                       "--speculative-method", "ngram", "--num-speculative-tokens", "4")  # a fixed k: drafts whatever
    # this machine's measured costs say (a compute-bound pricing of the tiny model kept n-gram off)
    yield srv
    srv.stop()


# what the tests read back from the page, by name: a JavaScript expression each (_probe)
PAGE_STATE = {
    "done": "document.body.dataset.done || ''",
    "history": "turns.map(m => m.role)",
    "users": "document.querySelectorAll('.msg.user').length",
    "box": "document.getElementById('input').value",
    "error": "(document.querySelector('.msg.error') || {}).textContent || ''",
    "sendDisabled": "document.getElementById('send').disabled",
    "drafted": "document.querySelectorAll('.msg.assistant span.draft').length",
    "pieces": "document.querySelectorAll('.msg.assistant > span').length",
    "text": "(document.querySelector('.msg.assistant') || {}).textContent || ''",
}


def _probe(*names: str) -> str:
    """A JSON.stringify expression of these PAGE_STATE entries, for _wait."""
    return "JSON.stringify({" + ", ".join(f"{n}: {PAGE_STATE[n]}" for n in names) + "})"


def _wait(browser, session, probe: str, until, seconds: float = 90) -> dict:
    """Evaluate `probe` (a JSON.stringify expression) until until(state) holds or time runs out."""
    state: dict = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        res = browser.call("Runtime.evaluate", session, expression=probe, returnByValue=True)
        value = res.get("result", {}).get("value")
        if value is not None:  # None: the page is still loading (no execution context to evaluate in yet)
            state = json.loads(value)
            if until(state):
                break
        time.sleep(0.25)
    return state


def _open(browser, url: str) -> str:
    target = browser.call("Target.createTarget", url=url)["targetId"]
    return browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]


def _ready(browser, session) -> None:
    """Wait until the page's script runs (under its Content-Security-Policy: a wrong hash stops it)."""
    state = _wait(browser, session, "JSON.stringify(typeof send)", lambda s: s == "function")
    assert state == "function", "the page's script did not run"


def _submit(browser, session) -> None:
    """Press Send once the page's script runs."""
    _ready(browser, session)
    browser.call("Runtime.evaluate", session, expression="document.getElementById('form').requestSubmit()")


def test_page_headers_allow_only_its_own_script(server):
    """/ runs its one inline script by hash, connects only to its server and cannot be framed elsewhere."""
    import base64
    import hashlib
    import re
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/") as resp:
        html, headers = resp.read().decode(), resp.headers
    (script,) = re.findall(r"<script>(.*?)</script>", html, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = headers["Content-Security-Policy"]
    assert f"script-src 'sha256-{digest}'" in csp and "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
    assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_page_streams_a_reply_and_colours_drafted_tokens(server, tmp_path):
    """?q= fills the box and sends nothing by itself (a link to the page cannot start a generation)."""
    query = urllib.parse.urlencode({"q": "sky tree sky tree sky tree sky tree", "maxTokens": "40"})
    browser = DevTools(tmp_path)
    try:
        session = _open(browser, f"{server.url}/?{query}")
        waiting = _wait(browser, session, _probe("box", "users"), lambda s: s.get("box"))
        assert waiting == {"box": "sky tree sky tree sky tree sky tree", "users": 0}, waiting
        _submit(browser, session)
        state = _wait(browser, session, _probe("done", "drafted", "pieces", "text"), lambda s: s["done"])
    finally:
        browser.close()
    assert state.get("done") == "1", state
    assert state["pieces"] >= 10 and "tokens in" in state["text"]
    assert state["drafted"] >= 1  # n-gram drafts of a repetitive reply were accepted and shown as such


def test_page_sends_one_turn_at_a_time_and_clear_aborts_it(server, tmp_path):
    """A message sent while a reply streams (Enter does not see the disabled button) waits in the box
    instead of interleaving two turns; Clear aborts the streaming turn, and what comes after starts a clean
    conversation (a late reply once landed first in the cleared history: a template needing alternating
    roles then refused every turn)."""
    browser = DevTools(tmp_path)
    probe = _probe("done", "history", "users", "box")
    try:
        session = _open(browser, f"{server.url}/?maxTokens=30")
        _ready(browser, session)
        browser.call("Runtime.evaluate", session, expression=(  # Send usable while a turn streams: a bug
            "window.sendUsableMidTurn = false; new MutationObserver(() => {"
            " if (!document.getElementById('send').disabled && inflight) window.sendUsableMidTurn = true; })"
            ".observe(document.getElementById('send'), {attributes: true})"))
        browser.call("Runtime.evaluate", session, expression=(
            "send('sky tree sky tree'); document.getElementById('input').value = 'second';"
            "document.getElementById('form').requestSubmit()"))
        state = _wait(browser, session, probe, lambda s: s["done"])
        assert state["done"] == "1" and state["history"] == ["user", "assistant"] and state["users"] == 1, state
        assert state["box"] == "second"  # kept for the user to send when the reply is done
        browser.call("Runtime.evaluate", session, expression=(
            "document.body.dataset.done = ''; send('cat mat cat mat'); document.getElementById('clear').click();"
            "send('moon river')"))
        state = _wait(browser, session, probe, lambda s: s["done"])
        assert state["done"] == "1" and state["history"] == ["user", "assistant"] and state["users"] == 1, state
        usable = browser.call("Runtime.evaluate", session, expression="window.sendUsableMidTurn", returnByValue=True)
        assert usable["result"]["value"] is False  # the aborted turn's late end left Send to the turn after it
    finally:
        browser.close()


def test_page_error_returns_the_message_to_the_box(server, tmp_path):
    """A refused turn (max_tokens beyond the context: 400) shows the error, leaves the conversation as it
    was (no unanswered user message in it or on screen) and puts the text back for a retry."""
    browser = DevTools(tmp_path)
    probe = _probe("done", "history", "users", "box", "error", "sendDisabled")
    try:
        session = _open(browser, f"{server.url}/?maxTokens=100000&q=hello")
        _submit(browser, session)
        state = _wait(browser, session, probe, lambda s: s["done"])
    finally:
        browser.close()
    assert state["done"] == "error" and state["error"].startswith("400"), state
    assert state["history"] == [] and state["users"] == 0 and state["box"] == "hello", state
    assert state["sendDisabled"] is False


def test_page_sends_the_api_key_field(tiny_dir, tmp_path):
    """A server with --api-key: the page's key field (pasted with a stray space) authorises the turn; a wrong
    key shows the 401 and leaves the message in the box for a retry."""
    srv = ThreadServer(str(tiny_dir("llama")), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
                       "--api-key", "sekret-key")
    browser = DevTools(tmp_path)
    probe = _probe("done", "box", "error")
    try:
        session = _open(browser, f"{srv.url}/?maxTokens=8&q=hello")
        _ready(browser, session)
        browser.call("Runtime.evaluate", session, expression="document.getElementById('apiKey').value = 'wrong'")
        _submit(browser, session)
        state = _wait(browser, session, probe, lambda s: s["done"])
        assert state["done"] == "error" and state["error"].startswith("401") and state["box"] == "hello", state
        browser.call("Runtime.evaluate", session, expression=(
            "document.body.dataset.done = ''; document.getElementById('apiKey').value = ' sekret-key ';"
            "document.getElementById('form').requestSubmit()"))
        state = _wait(browser, session, probe, lambda s: s["done"])
        assert state["done"] == "1", state
    finally:
        browser.close()
        srv.stop()
