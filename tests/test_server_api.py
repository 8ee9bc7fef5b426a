"""The OpenAI-compatible server on a loopback port, driven by the `openai` client and raw HTTP (tiny model).

32 concurrent greedy streams (with batched n-gram speculation, k fixed at 4 so it runs on any machine) must equal single-request plain
decoding; every bad input gets its status and the OpenAI error shape; a full queue gives 429; a wrong
key 401; a client that disconnects or times out leaves no KV block behind.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace

import httpx
import openai
import pytest

from server_util import ThreadServer
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

KEY = "test-key-123"
WORDS = ["cat", "mat", "robot", "river", "sky", "tree", "code", "moon"]


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ThreadServer(str(tiny_dir("llama")), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
                       "--speculative-method", "ngram", "--num-speculative-tokens", "4", "--api-key", KEY, "--served-model-name", "tiny",
                       "--max-num-seqs", "16", "--max-queued-requests", "64", "--block-size", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=256, progress=False, num_threads=1)


def client(server, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, **kw)


def headers() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def test_concurrent_greedy_streams_equal_single_request(server, plain):
    prompts = [f"{WORDS[i % 8]} {WORDS[(i * 3) % 8]} {WORDS[i % 8]} {WORDS[(i * 3) % 8]} number {i}" for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [plain.generate(p, params)[0].outputs[0].text for p in prompts]

    async def one(c, p):
        stream = await c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        c = client(server)
        return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(main())
    assert [t for t, _ in got] == want
    assert all(f == "length" for _, f in got)
    server.wait_idle()
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r"specdec:spec_decode_num_draft_tokens_total\{[^}]*\} [1-9]", metrics)


BAD = [
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 300}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "speculative": "no-such-method"}, "speculative"),
    ("/v1/completions", {"prompt": "hi", "speculative": "qdraft"}, "speculative"),  # valid, not enabled
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    # automata that would take minutes and gigabytes to build: refused before compiling (regex_size)
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "regex", "regex": "(a|b)*c{1000000}"}},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "maxLength": 1000000}}}}, "response_format"),
    # under the verbose flag the compiler skips whitespace: a{1 0 0 0 0 0 0} repeats a million times
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "regex", "regex": "(?x)a{1 0 0 0 0 0 0}"}},
     "response_format"),
    # whitespace in a count: the compiler reads a{ 1000000} as a repetition of a million too
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "regex", "regex": "a{ 1000000}"}},
     "response_format"),
    # 100 optional properties of any JSON: a 70 MB regex (the grammar worker refuses it; it held the GIL)
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {f"p{i}": {} for i in range(100)}}}}},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format"),  # (an AttributeError: a 500)
    # 4 prompts x 200 tokens x n 16 x 21 logprobs: 268,800 entries, each decoded into the answer
    ("/v1/completions", {"prompt": [[5] * 200] * 4, "n": 16, "prompt_logprobs": 20, "max_tokens": 1},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 2000]}, "stop"),  # streaming would hold all text back
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1], "min_tokens": 2}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**8]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-38}, "repetition_penalty"),  # logits / 1e-38: inf
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 1},
     "allowed_token_ids"),  # nothing could be sampled before min_tokens
    ("/v1/completions", {"prompt": ["a"] * 5, "n": 16}, "n"),  # 80 sequences > the queue's 64: never, not 429
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),  # (lax ints read them as token ids 1 and 0)
    ("/v1/completions", {"prompt": [[5.0, 6]]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 7*7 }}"},
     "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5},
     "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [10**8]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 300}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1100)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "suffix": " the end"}, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                              "tool_calls": [{"id": "1", "type": "function"}]}]}, "messages.1.tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                              "continue_final_message": True}, "continue_final_message"),
]


def test_penalties_and_bias_with_speculation_equal_plain(server, plain):
    """Batched n-gram speculation (k = 4) with penalties and a logit bias: each stream equals plain
    decoding with the same penalties (verify rows are penalized after the drafts before them)."""
    prompts = [f"{WORDS[i]} {WORDS[i + 1]} {WORDS[i]} {WORDS[i + 1]} {WORDS[i]}" for i in range(6)]
    bias = {"7": -5.0, "11": 2.5}
    allowed = list(range(3000))
    penalties = dict(frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logit_bias={7: -5.0, 11: 2.5},
                            allowed_token_ids=allowed, **penalties)
    want = [plain.generate(p, params)[0].outputs[0].text for p in prompts]
    assert want != [plain.generate(p, replace(params, logit_bias=(), frequency_penalty=0, presence_penalty=0,
                                              repetition_penalty=1.0, allowed_token_ids=None))[0].outputs[0].text
                    for p in prompts]

    async def main():
        c = client(server)
        return await asyncio.gather(*(c.completions.create(
            model="tiny", prompt=p, max_tokens=24, temperature=0, logit_bias=bias, frequency_penalty=1.2,
            presence_penalty=0.4, extra_body={"min_tokens": 24, "repetition_penalty": 1.3, "allowed_token_ids": allowed})
            for p in prompts))

    got = asyncio.run(main())
    assert [r.choices[0].text for r in got] == want
    server.wait_idle()
    assert server.engine.blocks.num_used == 0


def test_streamed_text_offsets_equal_the_whole_responses(server):
    """A stop string makes the stream hold back text (it could be the string's start); text_offset still
    counts every token's text, as the whole response does (it counted the text sent, which fell behind)."""
    body = {"prompt": "moon sky moon sky moon", "max_tokens": 12, "temperature": 0, "logprobs": 1,
            "ignore_eos": True, "stop": ["never appears here"]}
    whole = httpx.post(server.url + "/v1/completions", json=body, headers=headers(), timeout=30).json()
    offsets, text = [], ""
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers(),
                      timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                offsets += (choice["logprobs"] or {}).get("text_offset", [])
    assert text == whole["choices"][0]["text"]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"] and len(offsets) == 12


def test_echo_with_logprobs_and_prompt_logprobs(server, plain):
    """The completions API's echo (as lm-evaluation-harness scores with: echo, logprobs, max_tokens 1)
    and vLLM's prompt_logprobs: the prompt's tokens' logprobs equal the offline decoder's, streamed or not."""
    prompt = "robot river robot river robot sky tree"
    ids = plain.tokenizer.encode(prompt)
    want = plain.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=1,
                                                                    prompt_logprobs=1, ignore_eos=True))[0]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1, "ignore_eos": True}
    c = httpx.post(server.url + "/v1/completions", json=body, headers=headers(), timeout=30).json()["choices"][0]
    assert c["text"] == plain.tokenizer.decode(ids) + want.outputs[0].text
    lp = c["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][1:] == [x["logprob"] for x in want.prompt_logprobs[1:] + want.outputs[0].logprobs]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][len(ids)] == len(plain.tokenizer.decode(ids))

    async def streamed():
        stream = await client(server).completions.create(model="tiny", stream=True, **{k: body[k] for k in (
            "prompt", "max_tokens", "temperature", "echo", "logprobs")}, extra_body={"ignore_eos": True})
        text, lps = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            lps += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
        return text, lps

    assert asyncio.run(streamed()) == (c["text"], lp["token_logprobs"])
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2},
                   headers=headers(), timeout=30)
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    assert pl[1][str(ids[1])]["logprob"] == want.prompt_logprobs[1]["logprob"] and len(pl[1]) in (2, 3)
    server.wait_idle()
    assert server.engine.blocks.num_used == 0


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_gets_400_in_openai_shape(server, path, body, param):
    r = httpx.post(server.url + path, json=body, headers=headers(), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert server.engine.blocks.num_used == 0  # refused before any block was taken


def test_lone_surrogates_and_internal_errors_get_the_error_shape(server, monkeypatch):
    """JSON may spell a lone UTF-16 surrogate, which no tokenizer encodes: a 400 naming where it is (it was
    a 500 from inside the tokenizer), at any nesting depth. A bug past validation is a 500 in the OpenAI error shape, not
    starlette's plain text, and the server goes on."""
    for path, raw, param in (
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
            ("/v1/completions", '{"prompt": ["ok", "\\udc00"]}', "prompt.1"),
            ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"]}', "stop.0")):
        r = httpx.post(server.url + path, content=raw.encode(), headers={**headers(), "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # the walk that finds them is iterative: nesting that the JSON parser still reads (~960 deep) made a
    # RecursionError of the recursive one, a 500; deeper, the parser refuses it (a 400 of its own)
    for depth in range(900, 1040):
        raw = '{"prompt": "hi", "temperature": 5, "x": ' + "[" * depth + "]" * depth + "}"
        r = httpx.post(server.url + "/v1/completions", content=raw.encode(),
                       headers={**headers(), "Content-Type": "application/json"})
        assert r.status_code == 400, (depth, r.text)
    from specdec.serve.responses import ResponseBuilder

    def broken(self, body):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ResponseBuilder, "chat_prompt", broken)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                   headers=headers(), timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    monkeypatch.undo()
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.engine.blocks.num_used == 0


def test_starlettes_own_errors_get_the_error_shape(server):
    """An unknown route, a wrong method and a body the JSON parser gives up on (nesting deeper than its
    recursion) are starlette's HTTPExceptions: answered in the OpenAI shape, not {"detail": ...}."""
    for r, status in ((httpx.get(server.url + "/v1/nothing", headers=headers()), 404),
                      (httpx.get(server.url + "/v1/completions", headers=headers()), 405),
                      (httpx.post(server.url + "/v1/completions", content=b"[" * 200_000,
                                  headers={**headers(), "Content-Type": "application/json"}), 400)):
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_request_that_cannot_go_on_fails_alone(server, plain):
    """A grammar whose match is complete leaves only EOS, which min_tokens masks: nothing can be sampled.
    That request gets a 400 in the OpenAI shape; a stream decoding beside it in the same batches is
    untouched (it was aborted with the whole batch before), and no block is left. A temperature below
    1e-5 decodes greedily (dividing logits by 1e-40 overflowed to NaN, which failed the batch too)."""
    prompt = "moon tree moon tree moon tree"
    want = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text

    async def main():
        c = client(server)
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=1e-40,
                                            stream=True, extra_body={"ignore_eos": True})
        first = await stream.__anext__()
        async with httpx.AsyncClient(timeout=60) as h:
            bad = await h.post(server.url + "/v1/completions", headers=headers(), json={
                "prompt": "my number is", "max_tokens": 8, "min_tokens": 8, "temperature": 0,
                "response_format": {"type": "regex", "regex": "[0-9]{1,2}"}})
        text = first.choices[0].text + "".join([ch.choices[0].text async for ch in stream if ch.choices])
        return bad, text

    bad, text = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    assert "no token can be sampled" in bad.json()["error"]["message"]
    assert text == want
    server.wait_idle()
    assert server.engine.blocks.num_used == 0


def test_malformed_json_body_and_size_limits(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={**headers(),
                   "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * (2 << 20)}, headers=headers())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/health", headers={"X-Big": "y" * (20 << 10)})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=h)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key
    assert httpx.get(server.url + "/v1/models", headers=headers()).json()["data"][0]["id"] == "tiny"


def test_queue_full_answers_429_with_retry_after(server):
    sched = server.engine.scheduler
    saved = sched.config
    sched.config = replace(saved, max_num_seqs=1)  # one running sequence: the rest must queue
    server.state.max_queued_requests = 2

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": "count with me", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(c.post(server.url + "/v1/completions", json=body, headers=headers())
                                          for _ in range(8)))

    try:
        rs = asyncio.run(main())
    finally:
        server.state.max_queued_requests = 64
        sched.config = saved
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2, codes
    limited = next(r for r in rs if r.status_code == 429)
    assert limited.headers["retry-after"] and limited.json()["error"]["type"] == "rate_limit_error"
    server.wait_idle()
    assert server.engine.blocks.num_used == 0


def test_disconnect_and_timeout_abort_and_free_blocks(server):
    body = {"prompt": "a long story", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body, headers=headers()) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
        # the response is closed after one chunk: the server must abort the request
    body["stream"] = False
    engine, step = server.engine, server.engine.step

    def slow_step():  # the client must time out before the request can finish, on any machine
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, headers=headers(), timeout=0.5)
        server.wait_idle()
    finally:
        del engine.step
    assert server.engine.blocks.num_used == 0


def test_chat_stream_sources_usage_and_spec_metrics(server):
    body = {"messages": [{"role": "user", "content": "sky tree sky tree sky tree"}], "max_tokens": 30,
            "temperature": 0, "stream": True, "return_token_sources": True, "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers(), timeout=60)
    events = [json.loads(l[5:]) for l in r.text.split("\n\n") if l.startswith("data:") and "[DONE]" not in l]
    assert r.text.rstrip().endswith("data: [DONE]")
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    pieces = [p for e in events if e["choices"] for p in e["choices"][0].get("token_sources", [])]
    assert "".join(t for t, _ in pieces) == content and {s for _, s in pieces} <= {"draft", "target"}
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 30 and usage["total_tokens"] == usage["prompt_tokens"] + 30
    spec = events[-1]["metrics"]["speculative_decoding"]
    assert spec["method"] == "ngram" and 0 <= spec["draft_acceptance_rate"] <= 1
    by_match = spec.get("lookup_by_match_length", {})  # every n-gram draft, by the match that found it
    assert sum(row["drafts"] for row in by_match.values()) == spec["num_spec_steps"]
    # the same request with speculation off: same text, no speculative metrics
    off = httpx.post(server.url + "/v1/chat/completions", headers=headers(), timeout=60,
                     json={**body, "stream": False, "speculative": "off"}).json()
    assert off["choices"][0]["message"]["content"] == content
    assert off["metrics"]["speculative_decoding"] is None


def test_chat_without_generation_prompt(server):
    """add_generation_prompt false (vLLM's field) renders the conversation without the assistant header: the
    prompt is shorter by exactly that header's tokens."""
    messages = [{"role": "user", "content": "Name a color."}]
    usage = {}
    for flag in (True, False):
        r = httpx.post(server.url + "/v1/chat/completions", headers=headers(), timeout=60,
                       json={"messages": messages, "max_tokens": 2, "temperature": 0, "add_generation_prompt": flag})
        assert r.status_code == 200, r.text
        usage[flag] = r.json()["usage"]["prompt_tokens"]
    tok = server.engine.tokenizer
    header = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    without = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False), add_special_tokens=False)
    assert usage[True] == len(header) and usage[False] == len(without) < len(header)


def test_n_seed_stop_logprobs_and_exact_usage(server, plain):
    async def main():
        c = client(server)
        return await c.completions.create(model="tiny", prompt="moon river moon", max_tokens=12, temperature=0.9,
                                          n=3, seed=5, logprobs=2, extra_body={"ignore_eos": True})

    r = asyncio.run(main())
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = plain.tokenizer.encode("moon river moon")
    ref = plain.generate(ids, SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert [c.text for c in r.choices] == [o.text for o in ref.outputs]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 36
    assert all(len(c.logprobs.tokens) == 12 and len(c.logprobs.top_logprobs[0]) == 2 for c in r.choices)
    greedy = plain.generate(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].text
    stop = greedy[5:9]
    rs = httpx.post(server.url + "/v1/completions", headers=headers(), json={
        "prompt": "moon river moon", "max_tokens": 20, "temperature": 0, "stop": [stop], "ignore_eos": True}).json()
    assert rs["choices"][0]["text"] == greedy[:greedy.index(stop)] and rs["choices"][0]["finish_reason"] == "stop"


def test_json_schema_response_format(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "color": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers(), timeout=60, json={
        "messages": [{"role": "user", "content": "give me json"}], "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    obj = json.loads(r.json()["choices"][0]["message"]["content"])
    assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")


def test_per_request_method_and_k(server, plain):
    """A request picks its own drafter and k (the server runs n-gram at k = 4), or the server's drafter at
    its own k (no method named: it was read as off): same greedy text, and its metrics name the method it got."""
    prompt = "tree code tree code tree code tree"
    want = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].text
    for choice in ("suffix", {"method": "ngram", "num_speculative_tokens": 2}, {"num_speculative_tokens": 2}):
        r = httpx.post(server.url + "/v1/completions", headers=headers(), timeout=60, json={
            "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "speculative": choice})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == want
        spec = body["metrics"]["speculative_decoding"]
        assert spec["method"] == (choice if isinstance(choice, str) else choice.get("method", "ngram"))
        if isinstance(choice, dict):  # k = 2: no step drafts more than two tokens
            assert len(spec["drafted_by_position"]) <= 2 and spec["num_draft_tokens"] > 0
    assert server.engine.blocks.num_used == 0


def test_a_request_picks_only_the_methods_the_server_built(server, tiny_dir):
    """The page's menu and /v1/models list what a request may name (the server's own method and
    --request-speculative-methods); another valid method is a 400 that names them, and with
    --request-speculative-methods none only the server's own and off are left."""
    enabled = ["ngram", "suffix"]
    assert sorted(server.engine.request_proposers) == enabled
    select = re.search(r'<select id="spec">(.*?)</select>', httpx.get(server.url + "/").text, re.S).group(1)
    assert re.findall(r'<option value="([^"]*)">', select) == ["", "off", *enabled]
    models = httpx.get(server.url + "/v1/models", headers=headers()).json()
    assert models["data"][0]["speculative_methods"] == enabled
    r = httpx.post(server.url + "/v1/completions", headers=headers(), timeout=60,
                   json={"prompt": "hi", "max_tokens": 2, "speculative": "qdraft"})
    assert r.status_code == 400 and "not enabled on this server (enabled: off, ngram, suffix" in r.text
    srv = ThreadServer(str(tiny_dir("llama")), "--dtype", "float32", "--threads", "1", "--max-model-len", "128",
                       "--speculative-method", "ngram", "--request-speculative-methods", "none")
    try:
        assert sorted(srv.engine.request_proposers) == ["ngram"]
        bodies = [{"prompt": "hi", "max_tokens": 2, "speculative": s} for s in ("suffix", "ngram", "off")]
        codes = [httpx.post(srv.url + "/v1/completions", json=b, timeout=60).status_code for b in bodies]
        assert codes == [400, 200, 200]
    finally:
        srv.stop()


def test_a_failed_drafter_is_reported_not_hidden(server, monkeypatch):
    """A request whose drafter raised decodes on without it (plain decoding's text); its metrics name the method
    and what the drafter raised (they read as "speculation off" before), and /metrics counts the failure."""
    def broken(state, cap):
        raise RuntimeError("drafter broke")

    monkeypatch.setattr(server.engine.request_proposers["suffix"], "propose_lookup", broken)
    before = re.search(r"^specdec:spec_decode_drafter_failures_total\{[^}]*\} (\S+)$",
                       httpx.get(server.url + "/metrics").text, re.M)
    r = httpx.post(server.url + "/v1/completions", headers=headers(), timeout=60, json={
        "prompt": "tree code tree code", "max_tokens": 8, "temperature": 0, "speculative": "suffix"})
    assert r.status_code == 200, r.text
    spec = r.json()["metrics"]["speculative_decoding"]
    assert spec["method"] == "suffix" and spec["drafter_error"] == "RuntimeError: drafter broke"
    for _ in range(50):  # (the engine's stats reach the registry after its step)
        after = re.search(r"^specdec:spec_decode_drafter_failures_total\{[^}]*\} (\S+)$",
                          httpx.get(server.url + "/metrics").text, re.M)
        if after and float(after.group(1)) >= (float(before.group(1)) if before else 0) + 1:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the drafter failure was not counted")


def test_regex_response_format(server):
    r = httpx.post(server.url + "/v1/completions", headers=headers(), timeout=60, json={
        "prompt": "my phone number is", "max_tokens": 20, "temperature": 0,
        "response_format": {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"])


def test_metrics_count_a_requests_prompt_once_and_time_from_its_arrival(server):
    """n = 2 counts the prompt's tokens once (it counted them per sequence); TTFT counts from the server's
    receipt of the request (tokenizing and queueing included, as vLLM's), not from when the engine took it."""
    def total(name: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(m) for m in re.findall(rf"^specdec:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))

    server.wait_idle()
    before = total("prompt_tokens")
    r = httpx.post(server.url + "/v1/completions", headers=headers(), timeout=60,
                   json={"prompt": "sky tree sky", "max_tokens": 3, "n": 2, "temperature": 0.5, "seed": 1})
    assert r.status_code == 200, r.text
    server.wait_idle()
    assert total("prompt_tokens") - before == r.json()["usage"]["prompt_tokens"]
    import time as _time

    from specdec.serve.responses import ResponseBuilder

    def seconds_of_ttft() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(m) for m in re.findall(r"^specdec:time_to_first_token_seconds_sum\{[^}]*\} ([0-9.e+]+)$",
                                                text, re.M))

    before, slow = seconds_of_ttft(), ResponseBuilder.completion_prompts

    def tokenizing_slowly(self, body):  # what the server does before the engine sees the request
        _time.sleep(0.5)
        return slow(self, body)

    ResponseBuilder.completion_prompts = tokenizing_slowly
    try:
        r = httpx.post(server.url + "/v1/completions", headers=headers(), timeout=60,
                       json={"prompt": "sky tree", "max_tokens": 2, "temperature": 0})
    finally:
        ResponseBuilder.completion_prompts = slow
    assert r.status_code == 200, r.text
    server.wait_idle()
    assert seconds_of_ttft() - before >= 0.5


def test_a_messages_name_reaches_the_chat_template():
    """OpenAI's messages[].name (a participant's name) was dropped before the template; vLLM passes it on.
    A name that is not a string is a 400 naming the field."""
    from types import SimpleNamespace

    import pydantic

    from specdec.serve.protocol import ChatRequest
    from specdec.serve.responses import ResponseBuilder

    seen = []
    tok = SimpleNamespace(encode_chat=lambda messages, add_generation_prompt: seen.extend(messages) or [1, 2, 3])
    state = SimpleNamespace(tokenizer=tok, max_model_len=64,
                            engine=SimpleNamespace(engine=SimpleNamespace(model=SimpleNamespace(
                                config=SimpleNamespace(vocab_size=10)))))
    body = ChatRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi", "name": "ada"}]})
    assert ResponseBuilder(state).chat_prompt(body) == [1, 2, 3]
    assert seen == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ada"}]
    with pytest.raises(pydantic.ValidationError, match="name"):  # (the server answers it as a 400: pydantic_error)
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "Hi", "name": 7}]})


@pytest.mark.parametrize("field,want", [
    (None, None), (True, None), ({}, None), ("off", {"method": None}), (False, {"method": None}),
    ({"method": None}, {"method": None, "num_speculative_tokens": None}),  # an explicit null: off, as before
    ({"method": "off", "num_speculative_tokens": 2}, {"method": None, "num_speculative_tokens": 2}),
    ({"num_speculative_tokens": 2}, {"num_speculative_tokens": 2}),  # the server's own method at k = 2
    ("suffix", {"method": "suffix"}),
])
def test_the_speculative_field_reads_as_the_engine_takes_it(field, want):
    from specdec.serve.protocol import CompletionRequest
    assert CompletionRequest(prompt="hi", speculative=field).speculative_choice() == want
