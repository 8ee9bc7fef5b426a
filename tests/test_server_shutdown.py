"""SIGTERM drains: the request in flight finishes, new work is refused, the process exits 0, no KV leak."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server_util import ProcessServer


@pytest.fixture
def proc_server(tiny_dir):
    srv = ProcessServer(str(tiny_dir("llama")), "--dtype", "float32", "--threads", "1", "--max-model-len", "512",
                        "--speculative-method", "ngram", "--shutdown-timeout", "60")
    yield srv
    srv.stop()


def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(proc_server):
    url = proc_server.url
    body = {"prompt": "one two three", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    got: dict = {"text": "", "finish": None, "done": False, "first": threading.Event()}

    def consume():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                got["first"].set()
                if line.strip() == "data: [DONE]":
                    got["done"] = True
                    continue
                choice = json.loads(line[5:])["choices"][0]
                got["text"] += choice["text"]
                got["finish"] = choice["finish_reason"] or got["finish"]

    t = threading.Thread(target=consume)
    t.start()
    assert got["first"].wait(60)
    proc_server.terminate()
    time.sleep(0.5)
    try:  # the listening socket is closed (refused) or, on a kept-alive path, 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503
    except httpx.TransportError:
        pass
    t.join(120)
    assert got["done"] and got["finish"] == "length" and got["text"]
    assert proc_server.proc.wait(60) == 0
