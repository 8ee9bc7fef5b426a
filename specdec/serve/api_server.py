"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine thread.

    specdec serve smollm2-135m --speculative-method ngram --port 8000 --api-key secret
    curl localhost:8000/v1/chat/completions -H 'Authorization: Bearer secret' \
      -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/models, /health, /metrics,
and / (a chat page). Limits: bodies over --max-body-bytes get 413, headers over --max-header-bytes are
answered 431, more than --max-queued-requests waiting sequences get 429 + Retry-After,
/v1 needs the --api-key (checked with hmac.compare_digest), a client that disconnects aborts its
request, and SIGTERM stops new work (503) while in-flight requests finish.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specdec.config import ConfigError
from specdec.engine.async_engine import AsyncEngine
from specdec.engine.grammar import CompilerBusy, GrammarCompiler
from specdec.engine.request import EngineRequest
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import APIError, ChatRequest, CompletionRequest, pydantic_error
from specdec.serve.responses import ResponseBuilder

STATIC = Path(__file__).with_name("static")


def chat_page(methods: list[str] = ()) -> tuple[str, dict[str, str]]:
    """The page at / and its headers: a Content-Security-Policy that runs only the page's own script (by its
    hash), connects only to this server and lets no other site frame it. Its speculation menu offers the
    server default, off, and `methods` (what a request may pick)."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    options = "".join(f'<option value="{escape(m)}">{escape(m)}</option>' for m in methods)
    html = re.sub(r'(<select id="spec">.*?<option value="off">off</option>).*?(</select>)',
                  lambda m: m.group(1) + options + m.group(2), html, count=1, flags=re.S)
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    hashes = " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()
                      for s in scripts) or "'none'"
    csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
           "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                  "Referrer-Policy": "no-referrer"}


# prompt logprobs a request may ask for (prompt tokens x (prompt_logprobs + 1) x n), each decoded into the
# answer on the event loop: one prompt of the whole context at 20 fits; 64 sequences of 8k tokens (11M
# entries, a body of hundreds of MB) did not
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_key: str | None = None
    max_queued_requests: int = 64
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10
    draining: bool = False
    inflight_seqs: int = 0  # sequences admitted whose responses are not finished (event-loop side)
    metrics: ServerMetrics = None
    grammars: GrammarCompiler = None
    started: float = field(default_factory=time.time)
    vocab_size: int = 0  # the model's (from the engine)
    speculative_methods: list[str] = field(init=False, default_factory=list)  # what a request's `speculative` may name

    def __post_init__(self):
        eng = self.engine.engine
        self.tokenizer, self.max_model_len = eng.tokenizer, eng.max_model_len
        self.vocab_size = eng.model.config.vocab_size
        self.speculative_methods = sorted(eng.request_proposers)
        self.metrics = self.metrics or ServerMetrics(self.model_name)
        self.grammars = self.grammars or GrammarCompiler(eng.tokenizer, eng.model.config.vocab_size)

    def queued(self) -> int:
        """Admitted sequences not yet in the running batch (engine queue, inbox, about to be sent)."""
        return max(0, self.inflight_seqs - len(self.engine.engine.scheduler.running))


class LimitsMiddleware:
    """Pure ASGI: header size (431), body size (413), API key on /v1 (401), draining (503).

    The body is buffered (it is bounded) and replayed to the app; later receive() calls go to the
    client connection, so the app still hears of a disconnect."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, path = self.state, scope["path"]
        if sum(len(k) + len(v) for k, v in scope["headers"]) > st.max_header_bytes:
            return await _send_error(send, APIError(431, f"the request headers exceed {st.max_header_bytes} bytes"))
        headers = dict(scope["headers"])
        if path.startswith("/v1/"):
            if st.api_key is not None:
                auth = headers.get(b"authorization", b"")
                token = auth[7:] if auth[:7].lower() == b"bearer " else b""
                if not hmac.compare_digest(token, st.api_key.encode()):
                    return await _send_error(send, APIError(401, "invalid or missing API key"))
            if st.draining and scope["method"] == "POST":
                st.metrics.rejected.labels(model_name=st.model_name, reason="draining").inc()
                return await _send_error(send, APIError(503, "the server is shutting down", headers={
                    "Retry-After": "5", "Connection": "close"}))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > st.max_body_bytes):
            return await _send_error(send, APIError(413, f"the request body exceeds {st.max_body_bytes} bytes"))
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # disconnected while sending the body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > st.max_body_bytes:
                return await _send_error(send, APIError(413, f"the request body exceeds {st.max_body_bytes} bytes"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _send_error(send, err: APIError) -> None:
    resp = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    await resp({"type": "http"}, None, send)


class AbortingStream(StreamingResponse):
    """Closes its body iterator however the response ends, so a disconnect aborts the request."""

    def __init__(self, *args, on_close=None, **kw):
        super().__init__(*args, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            if self.on_close is not None:
                self.on_close()


def build_app(st: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        if not st.engine.alive:
            st.engine.start()
        yield
        st.engine.shutdown()
        st.grammars.close()  # (its grammar worker's child process)

    app = FastAPI(title="specdec", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.server = st
    app.add_middleware(LimitsMiddleware, state=st)
    rb = ResponseBuilder(st)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        err = pydantic_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):  # starlette's own: unknown route, method, unreadable body
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc):  # a bug: the client gets the error shape, the log the traceback
        err = APIError(500, "internal server error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        ok = st.engine.alive and not st.draining
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": int(st.started),
                                            "owned_by": "specdec", "max_model_len": st.max_model_len,
                                            "speculative_methods": st.speculative_methods}]}

    page, page_headers = chat_page(st.speculative_methods)

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page, headers=page_headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.monotonic()  # TTFT and e2e count from here (as vLLM's), tokenizing and queueing included
        # tokenizing (and rendering a chat template) a 1 MiB body takes ~1 s: off the event loop, so that
        # streams, /health and /metrics go on meanwhile
        prompts = await asyncio.to_thread(rb.completion_prompts, body)
        return await _serve(request, body, prompts, chat=False, arrival=arrival)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        arrival = time.monotonic()
        prompts = [await asyncio.to_thread(rb.chat_prompt, body)]
        return await _serve(request, body, prompts, chat=True, arrival=arrival)

    async def _serve(request: Request, body, prompts: list[list[int]], chat: bool, arrival: float):
        if body.model is not None and body.model != st.model_name:
            raise APIError(400, f"the model {body.model!r} does not exist; this server serves {st.model_name!r}",
                           "model", "model_not_found")
        body.check_unsupported()
        if len(prompts) * body.n > st.max_queued_requests:  # would never fit: a 429 would have it retry forever
            raise APIError(400, f"the request asks for {len(prompts) * body.n} sequences (prompts x n); this server "
                           f"queues at most {st.max_queued_requests}", "n")
        asked = body.prompt_logprobs_asked(None if chat else body.logprobs)
        entries = 0 if asked is None else sum(map(len, prompts)) * (asked + 1) * body.n
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:  # (each one decoded, on the event loop, into the answer)
            raise APIError(400, f"the request asks for {entries} prompt logprob entries (prompt tokens x "
                           f"(prompt_logprobs + 1) x n); at most {MAX_PROMPT_LOGPROB_ENTRIES}", "prompt_logprobs")
        reqs = await _engine_requests(body, prompts, chat, arrival)
        queued, new = st.queued(), sum(r.params.n for r in reqs)
        if queued + new > st.max_queued_requests:
            st.metrics.rejected.labels(model_name=st.model_name, reason="queue_full").inc()
            raise APIError(429, f"the server is busy ({queued} sequences queued); retry later",
                           headers={"Retry-After": "1"})
        st.inflight_seqs += new  # counted now, before any await: a burst of requests sees its own size

        def release():
            st.inflight_seqs -= new

        if body.stream:
            return AbortingStream(rb.stream(reqs, body, chat), media_type="text/event-stream", on_close=release,
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.ensure_future(rb.complete(reqs, body, chat))
        try:
            while not task.done():  # a client that leaves aborts its request (the task's cleanup frees it)
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
            return JSONResponse(task.result())
        finally:
            release()

    async def _engine_requests(body, prompts: list[list[int]], chat: bool, arrival: float) -> list[EngineRequest]:
        logprobs = (body.top_logprobs or 0 if body.logprobs else None) if chat else body.logprobs
        spec = body.speculative_choice()
        if spec is not None:
            try:  # one of the methods built with the engine, or a 400 (a request never builds one)
                st.engine.engine.resolve_spec(spec)
            except ConfigError as e:
                raise APIError(400, str(e), "speculative") from None
        grammar = None
        if body.response_format is not None:
            try:
                grammar = await asyncio.get_running_loop().run_in_executor(
                    None, st.grammars.compile, body.response_format)
            except ConfigError as e:
                raise APIError(400, str(e), "response_format") from None
            except CompilerBusy as e:
                raise APIError(429, str(e), headers={"Retry-After": "1"}) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        reqs = []
        for i, ids in enumerate(prompts):
            max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
            room = st.max_model_len - len(ids)
            if max_tokens is not None and max_tokens > room:
                raise APIError(400, f"this model's maximum context length is {st.max_model_len} tokens; the prompt "
                               f"has {len(ids)} and max_tokens is {max_tokens} (at most {room})", "max_tokens")
            params = body.sampling_params(max_tokens or room, logprobs, st.vocab_size, st.tokenizer.eos_token_ids)
            reqs.append(EngineRequest(f"{rid}-{i}", ids, params, spec, body.cache_salt, grammar, arrival))
        return reqs

    return app
