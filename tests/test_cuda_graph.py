"""The CUDA-graph wrapper (model/cuda_graph.py): its static pass against the eager forward, and its
bookkeeping (buckets, padding, the owned cache, fallbacks) through whole requests. On the CPU the same
static pass runs uncaptured; the capture itself is tested only where a GPU exists."""
import pytest
import torch

from specdec.model.cuda_graph import MIN_KEYS, TOKEN_BUCKETS, CapturedCalls, GraphedModel, bucket_of, key_span
from specdec.model.loader import load_model
from specdec.spec.tree import tree_mask, tree_positions

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PROMPT = [1, 504, 3458, 282, 4649, 314, 1345, 30, 216, 378, 901, 77, 5000, 3, 17]


def _prefilled(model, prompt=PROMPT):
    graphed = GraphedModel(model)
    cache = graphed.new_cache(64)
    n = len(prompt)
    graphed(torch.tensor([prompt]), torch.arange(n)[None], cache, num_logits=1, prefill=True)
    return graphed, cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_pass_equals_eager_forward_chain_and_tree(tiny_dir, arch):
    model = load_model(tiny_dir(arch), torch.float32)
    graphed, cache = _prefilled(model)
    n = len(PROMPT)
    parents = [-1, 0, 0, 1, 2]  # root, then 5 drafted nodes: 1 -> (2, 3), 2 -> 4, 3 -> 5
    blocks = {"chain": (torch.arange(n, n + 7), None, [7, 8, 9, 10, 11, 12, 13]),  # padded to 8
              "tree": (n + tree_positions(parents), tree_mask(parents), [7, 8, 9, 10, 11, 12])}
    for name, (positions, block, tokens) in blocks.items():
        ids = torch.tensor([tokens])
        eager = model(ids, positions[None], cache, block_mask=block, output_layers=(1, 2))
        cache.rollback(n)
        static = graphed(ids, positions[None], cache, block_mask=block, output_layers=(1, 2))
        assert cache.length == n + len(tokens), name
        torch.testing.assert_close(static.logits, eager.logits, atol=2e-5, rtol=1e-4)
        assert static.row_argmax == eager.logits[0].argmax(-1).tolist()
        for i in (1, 2):
            torch.testing.assert_close(static.layer_hidden[i], eager.layer_hidden[i], atol=2e-5, rtol=1e-4)
        # the k/v it wrote are the eager pass's: the next token's logits agree too
        nxt = model(torch.tensor([[5]]), torch.tensor([[n + len(tokens)]]), cache)
        cache.rollback(n)
        model(ids, positions[None], cache, block_mask=block)
        ref = model(torch.tensor([[5]]), torch.tensor([[n + len(tokens)]]), cache)
        torch.testing.assert_close(nxt.logits, ref.logits, atol=2e-5, rtol=1e-4)
        cache.rollback(n)
    assert graphed.stats()["replays"] == 2 and set(k[0] for k in graphed.calls.entries) == {8, 6}


def test_a_wrong_mask_is_caught(tiny_dir):
    """Negative control: the comparison above sees a block that attends one slot too far."""
    model = load_model(tiny_dir("llama"), torch.float32)
    graphed, cache = _prefilled(model)
    n = len(PROMPT)
    ids, positions = torch.tensor([[7, 8, 9]]), torch.arange(n, n + 3)[None]
    eager = model(ids, positions, cache)
    cache.rollback(n)
    leaky = torch.ones(3, 3, dtype=torch.bool)  # every token sees the later ones
    static = graphed(ids, positions, cache, block_mask=leaky)
    assert not torch.allclose(static.logits[0, :2], eager.logits[0, :2], atol=1e-3)


def test_eager_fallbacks_and_buckets(tiny_dir):
    model = load_model(tiny_dir("llama"), torch.float32)
    graphed, cache = _prefilled(model)
    assert graphed.stats()["eager_passes"] == 1  # the prompt
    other = model.new_cache(64)
    graphed(torch.tensor([[1]]), torch.tensor([[0]]), other)  # another cache: eager
    wide = TOKEN_BUCKETS[-1] + 1
    n = cache.length
    graphed(torch.ones(1, wide, dtype=torch.long), torch.arange(n, n + wide)[None], cache)  # over the buckets
    graphed(torch.ones(1, 1, dtype=torch.long), torch.tensor([[cache.length]]), cache, layers=[0, 1])
    assert graphed.stats()["eager_passes"] == 4 and graphed.stats()["replays"] == 0
    assert key_span(1, 4096) == MIN_KEYS and key_span(MIN_KEYS + 1, 4096) == 2 * MIN_KEYS
    assert key_span(600, 700) == 700 and key_span(701, 700) is None
    assert bucket_of(7) == 8 and bucket_of(TOKEN_BUCKETS[-1] + 1) is None
    assert graphed.new_cache(8) is cache and cache.length == 0  # one owned cache, emptied per request
    assert graphed.config is model.config and graphed.max_len == model.max_len


def _graphed_llm(method: dict | None, max_model_len: int | None = None):
    """The real model behind a GraphedModel, built as LLM builds it on a GPU (proposer included), on the CPU."""
    from specdec import LLM
    from specdec.config import SpeculativeConfig
    from specdec.spec.decoder import SpeculativeDecoder
    from specdec.spec.proposer import ProposerContext, make_proposer

    llm = LLM("smollm2-135m", dtype="float32", progress=False, max_model_len=max_model_len)
    graphed = GraphedModel(llm.model)
    config = SpeculativeConfig.from_dict(method)
    proposer = None if config is None else make_proposer(ProposerContext(
        graphed, llm.tokenizer, config, llm.source.directory, llm.dtype, llm.model.max_len, llm._load_aux))
    llm.decoder = SpeculativeDecoder(graphed, llm.tokenizer, proposer, config)
    return llm, graphed, proposer


def _recorded(proposer) -> list:
    """Every proposal the proposer makes from now on, as (tokens, parents), appended to the list returned."""
    seen = []
    if proposer is None:
        return seen
    propose = proposer.propose_batch

    def record(states, ks, trees=False):
        out = propose(states, ks, trees)
        seen.extend((p.tokens, p.parents) for p in out)
        return out
    proposer.propose_batch = record
    return seen


@pytest.mark.parametrize("method", [None, {"method": "ngram", "num_speculative_tokens": 4},
                                    {"method": "eagle3", "num_steps": 4, "adaptive": False},
                                    {"method": "eagle3", "num_steps": 4, "eagle_topk": 2, "num_draft_tokens": 8,
                                     "adaptive": False},
                                    {"method": "eagle3", "num_steps": 3, "lookup": "ngram", "adaptive": False}])
def test_requests_through_the_wrapper_equal_eager(method):
    """Whole requests on the real model (fp32): greedy outputs token for token, speculation included; the
    EAGLE head's own passes go through its GraphedHead, and draft what the eager head drafts."""
    from specdec import LLM, SamplingParams
    from tests.conftest import CHAT_PROMPTS

    params = SamplingParams(temperature=0.0, max_tokens=40)
    chat = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    # (no prefix cache: the graphed model keeps none, and an EAGLE head drafts from the features of the rows
    # a prompt pass computed, which a reused prefix skips)
    eager_llm = LLM("smollm2-135m", dtype="float32", progress=False, speculative_config=method,
                    enable_prefix_caching=False)
    eager_drafts = _recorded(eager_llm.proposer)
    eager = [eager_llm.chat(c, params)[0].outputs[0] for c in chat]
    llm, graphed, proposer = _graphed_llm(method)
    drafts = _recorded(proposer)
    outs = [llm.chat(c, params)[0].outputs[0] for c in chat]
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert drafts == eager_drafts  # every proposal: its tokens and, for a tree, its shape
    # every decode and verify pass replayed (and adaptive k's cost profile), the prompts alone ran eagerly
    stats = graphed.stats()
    assert stats["replays"] >= sum(o.metrics["target_forward_passes"] - 1 for o in outs) > 0
    assert stats["eager_passes"] == len(CHAT_PROMPTS)
    proposer = getattr(proposer, "model", proposer)  # a pairing's head
    if method is not None and method["method"] == "eagle3":
        assert proposer.graphed is not None and proposer.graphed.stats()["replays"] > 0
        # eager: each prompt's first digest alone (up to PROMPT_WINDOW rows, wider than every bucket)
        assert proposer.graphed.stats()["eager_passes"] == len(CHAT_PROMPTS)
        # a whole proposal (digest + chain or tree) is one replay
        kinds = {k[0] for k in proposer.graphed.calls.entries if isinstance(k[0], str)}
        assert kinds == {"chain" if method.get("eagle_topk", 1) == 1 else "tree"}


def test_pass_width_pads_every_pass(tiny_dir):
    """pass_width: a one-token step runs in the same bucket as a wide verify (the same kernels on a GPU),
    with the same logits as eager; an out-of-range width is a clear error before anything loads."""
    from specdec import LLM
    from specdec.config import ConfigError

    model = load_model(tiny_dir("llama"), torch.float32)
    graphed = GraphedModel(model, pass_width=8)
    cache = graphed.new_cache(64)
    n = len(PROMPT)
    graphed(torch.tensor([PROMPT]), torch.arange(n)[None], cache, num_logits=1, prefill=True)
    eager = model(torch.tensor([[7]]), torch.tensor([[n]]), cache)
    cache.rollback(n)
    padded = graphed(torch.tensor([[7]]), torch.tensor([[n]]), cache)
    torch.testing.assert_close(padded.logits, eager.logits, atol=2e-5, rtol=1e-4)
    assert [k[0] for k in graphed.calls.entries] == [8] and padded.logits.shape[1] == 1
    for width in (0, TOKEN_BUCKETS[-1] + 1):
        with pytest.raises(ConfigError, match="pass_width"):
            LLM(str(tiny_dir("llama")), pass_width=width, progress=False)


def test_the_serving_engine_refuses_a_graphed_target(tiny_dir):
    """The engine's rows would share the wrapper's one cache (and an EAGLE head's): a clear error instead."""
    from specdec import LLM
    from specdec.config import ConfigError
    from specdec.engine.engine import Engine

    llm = LLM(str(tiny_dir("llama")), progress=False)
    llm.model = GraphedModel(llm.model)
    with pytest.raises(ConfigError, match="enforce_eager"):
        Engine(llm)


def test_cost_profile_through_the_wrapper(tiny_dir):
    """Adaptive k's cost profile runs through the graphs (host inputs, the owned cache) before a request's
    cache is handed out, so a request after it starts from an empty cache."""
    from specdec.spec.adaptive import CostModel

    graphed = GraphedModel(load_model(tiny_dir("llama"), torch.float32))
    cost = CostModel(5)
    cost.profile(graphed)
    assert cost.profiled and all(cost.seconds[T] > 0 for T in range(1, 6))
    assert graphed.stats()["replays"] == 3 * 5 and graphed.new_cache(8).length == 0


@cuda
def test_cuda_graph_replays_equal_eager(tiny_dir):
    from specdec import LLM, SamplingParams
    d = str(tiny_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=32)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    eager = LLM(d, device="cuda", dtype="float32", progress=False, enforce_eager=True, speculative_config=spec)
    graphed = LLM(d, device="cuda", dtype="float32", progress=False, speculative_config=spec)
    assert isinstance(graphed.model, GraphedModel)
    prompt = "one two three one two three one two"
    assert graphed.generate(prompt, params)[0].outputs[0].token_ids == \
        eager.generate(prompt, params)[0].outputs[0].token_ids
    stats = graphed.model.stats()
    assert stats["capture_failure"] is None and stats["graphs"] >= 1 and stats["replays"] > 0


@cuda
def test_cuda_graph_data_generation_equals_uncaptured(tiny_dir):
    from specdec.train.generate import StaticGenerator

    model = load_model(tiny_dir("llama"), torch.float32, 512, "cuda")
    prompts = [[1, 504, 3458, 282], list(range(100, 130)), [7, 8, 9, 10, 11, 12]]
    graphed, plain = StaticGenerator(model), StaticGenerator(model, graphs=False)
    got = graphed.generate(prompts, 24, {2}, (0, 2))
    ref = plain.generate(prompts, 24, {2}, (0, 2))
    assert [s.tokens for s in got] == [s.tokens for s in ref] and graphed.calls.num_graphs >= 1
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.hidden, b.hidden)


def test_graphed_head_on_a_short_prompt_and_at_the_end_of_its_rotary_table():
    """A prompt whose rows fit one bucket (no chat template: a few tokens) reached the graphed head before
    any digest had set the draft's last output (a KeyError on the GPU); near the end of the context, a draft
    whose num_steps would run past the head's rotary table falls back to the eager head, which stops at k,
    instead of indexing past the table (a device-side assert in a replay)."""
    from specdec import LLM, SamplingParams
    from specdec.model.layers import Rotary

    plain = LLM("smollm2-135m", dtype="float32", progress=False, max_model_len=64)
    llm, graphed, proposer = _graphed_llm({"method": "eagle3", "num_steps": 6, "adaptive": False}, max_model_len=64)
    cfg = proposer.head.cfg
    proposer.head.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, 64).to(
        proposer.head.rotary.cos.device)  # the context's length, on the head's device
    ids = llm.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of")
    params = SamplingParams(temperature=0.0, max_tokens=64 - len(ids), ignore_eos=True)  # to the context's end
    want = plain.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    out = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    assert out.token_ids == want and proposer.graphed.stats()["replays"] > 0


def test_a_failed_capture_runs_its_shape_eagerly_and_keeps_the_others(monkeypatch):
    """A capture that fails (out of memory for one wide key span, say) sends that shape to the eager path
    for good and leaves every other key's graph in use (one failure turned every graph off); the failure is
    still reported. The capture is emulated on the CPU: its warm-up run, then success or failure."""
    calls = CapturedCalls(torch.device("cpu"))
    calls.enabled, captures = True, []

    def capture(entry, fn):
        captures.append(1)
        fn(*entry.bufs)  # the warm-up's side effects are the call's own
        return "RuntimeError: CUDA out of memory" if len(captures) == 2 else None
    monkeypatch.setattr(calls, "_capture", capture)

    def call(key, value):
        return calls(key, lambda: (torch.zeros(1),), lambda bufs: bufs[0].fill_(value), lambda x: x * 2)

    with pytest.warns(UserWarning, match="running this shape eagerly"):
        assert float(call("a", 1)[0]) == 2 and call("b", 1) is None
    assert float(call("a", 3)[0]) == 6 and call("b", 3) is None and float(call("c", 4)[0]) == 8
    assert len(captures) == 3 and calls.failure == "RuntimeError: CUDA out of memory"


def test_requests_equal_eager_when_a_capture_fails(monkeypatch):
    """Whole requests through the wrapper with the second shape's capture failing: greedy outputs equal the
    eager model's (the failed shape's passes run eagerly on the same cache, after the warm-up's writes)."""
    from specdec import LLM, SamplingParams

    method = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    params = SamplingParams(temperature=0.0, max_tokens=32)
    prompt = [{"role": "user", "content": "Repeat after me: one two three one two three one two three."}]
    want = LLM("smollm2-135m", dtype="float32", progress=False, speculative_config=method,
               enable_prefix_caching=False).chat(prompt, params)[0].outputs[0].token_ids
    llm, graphed, _ = _graphed_llm(method)
    graphed.calls.enabled, captures = True, []

    def capture(entry, fn):
        captures.append(1)
        fn(*entry.bufs)
        return "RuntimeError: CUDA out of memory" if len(captures) == 2 else None
    monkeypatch.setattr(graphed.calls, "_capture", capture)
    with pytest.warns(UserWarning, match="running this shape eagerly"):
        assert llm.chat(prompt, params)[0].outputs[0].token_ids == want
    assert len(graphed.calls.failed) == 1 and graphed.stats()["replays"] > 0
    assert graphed.stats()["eager_passes"] > 1  # the prompt's, and the failed shape's passes


def test_capture_runs_on_the_models_device(monkeypatch):
    """The capture goes on a stream of the model's device with that device current: given no stream, torch
    captures on a stream of the current device, and a model on another GPU (cuda:1) ran outside the capture,
    leaving an empty graph whose replays returned stale outputs. torch.cuda is faked: no GPU here."""
    import contextlib
    from types import SimpleNamespace

    seen = {}

    class Stream:
        def __init__(self, device):
            self.device = device

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def current(name, value):
        seen.setdefault(name, []).append(value)
        yield

    def graph(g, pool=None, stream=None):
        seen["capture_stream"] = stream
        return current("captured_in", stream)

    fake = SimpleNamespace(Stream=Stream, current_stream=lambda d=None: Stream(d), CUDAGraph=lambda: SimpleNamespace(
        pool=lambda: "pool"), graph=graph, stream=lambda s: current("stream", s),
        device=lambda d: current("device", d))
    monkeypatch.setattr(torch, "cuda", fake)
    calls = CapturedCalls(torch.device("cuda", 1))
    entry = SimpleNamespace(bufs=(), out=None, graph=None)
    assert calls._capture(entry, lambda: "out") is None and entry.out == "out"
    assert seen["device"] == [torch.device("cuda", 1)]
    assert seen["capture_stream"].device == torch.device("cuda", 1)
