"""AsyncEngine: the engine on its own thread, feeding asyncio consumers. A step's outputs reach the event
loop in one hand-off; streams equal single-request decoding; a refused request fails alone."""
from __future__ import annotations

import asyncio

import pytest

from specdec.engine.async_engine import AsyncEngine
from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

PROMPTS = ["The cat sat on the mat. The cat sat on the", "1 2 3 4 5 6 7 8", "Once upon a time there was"]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=128, progress=False, num_threads=1)


async def _collect(engine: AsyncEngine, req: EngineRequest) -> list[int]:
    ids = []
    async for out in engine.generate(req):
        ids += out.token_ids
    return ids


def test_outputs_reach_the_loop_once_per_step_and_equal_single_requests(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [EngineRequest(str(i), llm.tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)]
    engine = Engine(llm, EngineConfig(max_num_seqs=4, block_size=8))
    steps = []
    real_step = engine.step
    engine.step = lambda: steps.append(real_step()) or steps[-1]
    handoffs = []

    async def main():
        loop = asyncio.get_running_loop()
        real_call = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **kw: handoffs.append(a) or real_call(*a, **kw)
        runner = AsyncEngine(engine)
        runner.start()
        try:
            return await asyncio.gather(*(_collect(runner, r) for r in reqs))
        finally:
            runner.shutdown()

    got = asyncio.run(main())
    for r, ids in zip(reqs, got):
        assert ids == llm.generate({"prompt_token_ids": r.prompt_ids}, params)[0].outputs[0].token_ids
    # one hand-off per step that had outputs, however many requests it served (it was one per output)
    with_outputs = sum(1 for outs in steps if outs)
    assert len(handoffs) == with_outputs
    assert sum(len(outs) for outs in steps) > with_outputs  # steps did serve several requests at once
    assert engine.blocks.num_used == 0


def test_a_refused_request_fails_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = Engine(llm, EngineConfig(max_num_seqs=4, block_size=8))
    good = EngineRequest("good", llm.tokenizer.encode(PROMPTS[0]), params)
    too_long = EngineRequest("long", [5] * 200, params)  # over max_model_len: add_request refuses it

    async def main():
        runner = AsyncEngine(engine)
        runner.start()
        try:
            ok = asyncio.create_task(_collect(runner, good))
            with pytest.raises(RuntimeError, match="prompt"):
                await _collect(runner, too_long)
            return await ok
        finally:
            runner.shutdown()

    assert len(asyncio.run(main())) == 6
    assert engine.blocks.num_used == 0


def test_an_unexpected_error_handling_a_request_or_stats_fails_only_that(llm):
    """An add that raises something other than the engine's ValueError, or a stats callback that raises,
    once ended the engine thread: every later request then waited forever. Now the request fails alone."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = Engine(llm, EngineConfig(max_num_seqs=4, block_size=8))
    real_add = engine.add_request

    def add(req):
        if req.request_id == "bad":
            raise RuntimeError("a bug in add_request")
        return real_add(req)

    engine.add_request = add
    calls = []

    def stats(_):
        calls.append(1)
        raise KeyError("a bug in the metrics")

    async def main():
        runner = AsyncEngine(engine, on_stats=stats)
        runner.start()
        try:
            with pytest.raises(RuntimeError, match="a bug in add_request"):
                await asyncio.wait_for(_collect(runner, EngineRequest("bad", [5, 6, 7], params)), 30)
            good = EngineRequest("good", llm.tokenizer.encode(PROMPTS[0]), params)
            return await asyncio.wait_for(_collect(runner, good), 60), runner.alive
        finally:
            runner.shutdown()

    ids, alive = asyncio.run(main())
    assert len(ids) == 6 and alive and calls
    assert engine.blocks.num_used == 0


def test_a_request_still_in_the_inbox_when_the_loop_ends_fails(llm):
    """The loop ended (shutdown, or run_here's while_true turning false) with an add not yet taken: its
    generate() waited forever. It now fails."""
    engine = Engine(llm, EngineConfig(max_num_seqs=4, block_size=8))
    params = SamplingParams(temperature=0, max_tokens=4)

    async def main():
        runner = AsyncEngine(engine, own_thread=False)
        task = asyncio.ensure_future(_collect(runner, EngineRequest("late", [5, 6, 7], params)))
        await asyncio.sleep(0.05)  # the add is in the inbox
        await asyncio.get_running_loop().run_in_executor(None, runner.run_here, lambda: False)
        with pytest.raises(RuntimeError, match="shutting down"):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
