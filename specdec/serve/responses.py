"""Turns engine outputs into OpenAI completion / chat responses and SSE chunks.

Prompts of a request (completions accept a list) each become one engine request of n choices;
choice index = prompt_index * n + choice. `usage` is exact: prompt tokens of every prompt, completion
tokens of every choice, and cached_tokens = prompt tokens served by the prefix cache. A response
also carries `metrics.speculative_decoding` (this request's acceptance figures, as vLLM's
per-request metrics) and, when asked with return_token_sources, each text piece with "draft" (a
drafted token the target accepted) or "target" (a token the target produced itself).
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing

from specdec.config import ConfigError
from specdec.engine.request import EngineRequest, SeqOutput
from specdec.serve.protocol import APIError
from specdec.spec.metrics import SpecMetrics, match_length_table


def _event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def spec_summary(metrics: list[SpecMetrics], method: str | None, drafter_errors=()) -> dict | None:
    """A request's speculative metrics (None: it ran without speculation); drafter_errors: what its choices'
    drafters raised, if they failed (the choice decoded on without drafts)."""
    if method is None:
        return None
    errors = [e for e in drafter_errors if e]
    m = SpecMetrics()
    for x in metrics:
        m.merge(x)
    return {"method": method, "num_spec_steps": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
            "num_accepted_draft_tokens": m.num_accepted_tokens, "draft_acceptance_rate": round(m.acceptance_rate, 4),
            "mean_acceptance_length": round(m.mean_acceptance_length, 4),
            "acceptance_rate_by_position": [round(x, 4) for x in m.acceptance_by_position],
            "accepted_by_position": list(m.accepted_per_pos), "drafted_by_position": list(m.drafted_per_pos),
            "target_forward_passes": m.target_passes,
            **({"lookup_by_match_length": match_length_table(m.by_match_length)} if m.by_match_length else {}),
            **({"drafter_error": errors[0]} if errors else {})}


class ResponseBuilder:
    def __init__(self, state):
        self.st = state
        self.tok = state.tokenizer

    # --- prompts --------------------------------------------------------------------------------
    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        if len(ids) >= self.st.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                           f"{self.st.max_model_len}", param, "context_length_exceeded")
        vocab = self.st.engine.engine.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param)
        return ids

    def completion_prompts(self, body) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or len(p) > 16:
            raise APIError(400, "prompt must hold 1 to 16 prompts", "prompt")
        return [self._check_ids(self.tok.encode(x) if isinstance(x, str) else list(x), "prompt") for x in p]

    def chat_prompt(self, body) -> list[int]:
        messages = [m.for_template() for m in body.messages]
        try:
            ids = self.tok.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
        except ConfigError as e:
            raise APIError(400, str(e), "messages") from None
        return self._check_ids(ids, "messages")

    # --- running --------------------------------------------------------------------------------
    async def _outputs(self, reqs: list[EngineRequest]):
        """(prompt index, SeqOutput) from all of a request's engine requests, as they come."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: EngineRequest):
            try:
                async with aclosing(self.st.engine.generate(req)) as it:
                    async for out in it:
                        q.put_nowait((i, out))
                q.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if isinstance(item, Exception):
                    raise APIError(getattr(item, "status", 500), str(item))
                if item is None:
                    left -= 1
                    continue
                if item.finished:
                    self.st.metrics.on_finished(item)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def _token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, logprobs: list[dict] | None, chat: bool, offset: int) -> dict | None:
        """Engine logprobs ({"token_id", "logprob", "top": [(id, logprob)]}) in the endpoint's format."""
        if logprobs is None:
            return None
        dec = self._token_text
        if chat:
            return {"content": [{"token": dec(lp["token_id"]), "logprob": lp["logprob"],
                                 "bytes": list(dec(lp["token_id"]).encode()),
                                 "top_logprobs": [{"token": dec(t), "logprob": v, "bytes": list(dec(t).encode())}
                                                  for t, v in lp["top"]]} for lp in logprobs]}
        tokens = [dec(lp["token_id"]) for lp in logprobs]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp["logprob"] for lp in logprobs],
                "top_logprobs": [{dec(t): v for t, v in lp["top"]} for lp in logprobs], "text_offset": offsets}

    def _echoed(self, prompt_ids: list[int], prompt_lps: list | None, lp: dict | None) -> tuple[str, dict | None]:
        """A completion's echo: the prompt's text, and its tokens put before the completion's logprobs
        (the first token has none, as OpenAI's)."""
        text = self.tok.decode(prompt_ids)
        if lp is None:
            return text, None
        first = self._token_text(prompt_ids[0])
        rest = self._logprobs((prompt_lps or [None])[1:], False, len(first))  # prompt tokens 1..: engine entries
        return text, {"tokens": [first] + rest["tokens"] + lp["tokens"],
                      "token_logprobs": [None] + rest["token_logprobs"] + lp["token_logprobs"],
                      "top_logprobs": [None] + rest["top_logprobs"] + lp["top_logprobs"],
                      "text_offset": [0] + rest["text_offset"] + [o + len(text) for o in lp["text_offset"]]}

    def _vllm_prompt_logprobs(self, prompt_lps: list | None) -> list | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, decoded_token}}
        for the token itself and the top n."""
        if prompt_lps is None:
            return None
        dec = self._token_text
        return [None] + [{str(t): {"logprob": v, "decoded_token": dec(t)}
                          for t, v in [(x["token_id"], x["logprob"])] + list(x["top"])} for x in prompt_lps[1:]]

    @staticmethod
    def _usage(finals: list[SeqOutput], prompt_lens: dict[int, int]) -> dict:
        prompt = sum(prompt_lens.values())
        completion = sum(o.num_output_tokens for o in finals)
        per_prompt: dict[str, int] = {}  # a prompt counts once: its cached tokens are those all its n choices found
        for o in finals:
            per_prompt[o.request_id] = min(per_prompt.get(o.request_id, o.num_cached_tokens), o.num_cached_tokens)
        cached = sum(per_prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def _sources(out: SeqOutput) -> list:
        return [[text, "draft" if d else "target"] for text, d in out.pieces]

    async def complete(self, reqs: list[EngineRequest], body, chat: bool) -> dict:
        n = body.n
        texts: dict[int, str] = {}
        lps: dict[int, list] = {}
        sources: dict[int, list] = {}
        finals: dict[int, SeqOutput] = {}
        prompt_lps: dict[int, list] = {}
        async with aclosing(self._outputs(reqs)) as outs:
            results = [x async for x in outs]
        for i, out in results:
            idx = i * n + out.index
            if out.prompt_logprobs is not None:
                prompt_lps[idx] = out.prompt_logprobs
            texts[idx] = texts.get(idx, "") + out.text
            lps.setdefault(idx, []).extend(out.logprobs or [])
            sources.setdefault(idx, []).extend(self._sources(out))
            if out.finished:
                finals[idx] = out
        choices = []
        for idx in sorted(finals):
            f = finals[idx]
            lp = self._logprobs(lps[idx] if f.logprobs is not None else None, chat, 0)
            text = texts[idx]
            if getattr(body, "echo", False):
                prompt_text, lp = self._echoed(reqs[idx // n].prompt_ids, prompt_lps.get(idx), lp)
                text = prompt_text + text
            c = {"index": idx, "finish_reason": f.finish_reason, "stop_reason": f.stop_reason, "logprobs": lp}
            c.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            if body.prompt_logprobs is not None:
                c["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_lps.get(idx))
            if body.return_token_sources:
                c["token_sources"] = sources[idx]
            choices.append(c)
        first = finals[min(finals)] if finals else None
        return {"id": reqs[0].request_id.rsplit("-", 1)[0], "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.st.model_name, "choices": choices,
                "usage": self._usage(list(finals.values()), {i: len(r.prompt_ids) for i, r in enumerate(reqs)}),
                "metrics": {"speculative_decoding": spec_summary([f.metrics for f in finals.values() if f.metrics],
                                                                 first.method if first else None,
                                                                 [f.drafter_error for f in finals.values()])}}

    def _chunk(self, head: dict, idx: int, out: SeqOutput, chat: bool, body, offsets: dict[int, int],
               echo: tuple[list[int], list | None] | None = None) -> dict:
        """echo: (prompt ids, prompt logprobs) to put before this first chunk of a choice."""
        lp, text = self._logprobs(out.logprobs, chat, offsets.get(idx, 0)), out.text
        # a completion's text_offset counts its tokens' texts, as the whole response's does: not the text
        # sent so far, which leaves out what a possible stop string holds back
        advance = 0 if chat or lp is None else sum(map(len, lp["tokens"]))
        if echo is not None:
            prompt_text, lp = self._echoed(*echo, lp)
            text, advance = prompt_text + text, advance + len(prompt_text)
        choice = {"index": idx, "logprobs": lp, "finish_reason": out.finish_reason if out.finished else None}
        offsets[idx] = offsets.get(idx, 0) + advance
        choice.update({"delta": {"content": text} if text else {}} if chat else {"text": text})
        if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
        if body.return_token_sources:
            choice["token_sources"] = self._sources(out)
        chunk = {**head, "choices": [choice]}
        if out.finished:
            choice["stop_reason"] = out.stop_reason
            chunk["metrics"] = {"speculative_decoding": spec_summary([out.metrics] if out.metrics else [], out.method,
                                                                     [out.drafter_error])}
        return chunk

    async def stream(self, reqs: list[EngineRequest], body, chat: bool):
        n, rid, created = body.n, reqs[0].request_id.rsplit("-", 1)[0], int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": created, "model": self.st.model_name}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        finals: list[SeqOutput] = []
        offsets: dict[int, int] = {}
        try:
            if chat:
                for idx in range(n * len(reqs)):
                    yield _event({**head, "choices": [{"index": idx, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
            echo = {i * n + j: (r.prompt_ids, None) for i, r in enumerate(reqs) for j in range(n)} \
                if getattr(body, "echo", False) else {}
            async with aclosing(self._outputs(reqs)) as outs:
                async for i, out in outs:
                    idx = i * n + out.index
                    if idx in echo and out.prompt_logprobs is not None:
                        echo[idx] = (echo[idx][0], out.prompt_logprobs)
                    if out.text or out.finished or (out.logprobs and out.token_ids) or idx in echo:
                        if out.finished:
                            finals.append(out)
                        yield _event(self._chunk(head, idx, out, chat, body, offsets, echo.pop(idx, None)))
            if include_usage:
                yield _event({**head, "choices": [], "usage": self._usage(finals, {
                    i: len(r.prompt_ids) for i, r in enumerate(reqs)}), "metrics": {"speculative_decoding": spec_summary(
                        [f.metrics for f in finals if f.metrics], finals[0].method if finals else None,
                        [f.drafter_error for f in finals])}})
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _event(e.body())
            yield "data: [DONE]\n\n"
