"""End to end on the real default model (SmolLM2-135M): concurrent greedy chats through the server, with
batched n-gram speculation, equal single-request plain decoding."""
from __future__ import annotations

import asyncio

import openai
import pytest

from conftest import CHAT_PROMPTS
from server_util import ThreadServer
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_real_model_concurrent_chats_equal_plain_decoding(smollm_llm):
    srv = ThreadServer("smollm2-135m", "--dtype", "float32", "--threads", "1", "--max-model-len", "512",
                       "--speculative-method", "ngram", "--served-model-name", "smol")
    try:
        async def main():
            c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            return await asyncio.gather(*(c.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": p}], max_tokens=24, temperature=0)
                for p in CHAT_PROMPTS))

        got = asyncio.run(main())
        want = smollm_llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS],
                               SamplingParams(temperature=0, max_tokens=24))
        assert [r.choices[0].message.content for r in got] == [w.outputs[0].text for w in want]
        assert [r.usage.completion_tokens for r in got] == [len(w.outputs[0].token_ids) for w in want]
        srv.wait_idle()
    finally:
        srv.stop()
