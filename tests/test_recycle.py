"""Token Recycling (proposers/recycle.py): the static tree order, the tree read out of the adjacency
matrix, the matrix filled from every pass's logits; greedy equality with plain decoding is checked
with the other drafters in test_proposers.py (tiny models, the real model, fixed and adaptive k)."""
import pytest
import torch

from specdec import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.proposers.recycle import RANK_SHARE, WIDTH, TokenRecyclingProposer, path_share, tree_order
from specdec.spec.proposer import Proposal, ProposerContext, RequestState, TargetOutput

from conftest import drain_engine


class _Config:
    vocab_size = 10


class _Target:
    config = _Config()
    lm_head = torch.nn.Linear(3, 10, bias=False)  # hidden size 3


class _Forward:
    def __init__(self, logits, hidden=None):
        self.logits, self.hidden = logits, hidden


def proposer(k=6):
    cfg = SpeculativeConfig(method="recycle", num_speculative_tokens=k)
    return TokenRecyclingProposer(ProposerContext(_Target(), None, cfg))


def state(tokens):
    return RequestState(tokens[:-1], SamplingParams(temperature=0), output_ids=tokens[-1:])


def test_tree_order_is_prefix_closed_and_best_first():
    order = tree_order(40)
    assert order[:5] == [(0,), (0, 0), (1,), (2,), (0, 0, 0)]
    assert len(set(order)) == 40
    for i, path in enumerate(order):  # every path's parent comes before it: any first k form a tree
        assert len(path) == 1 or order.index(path[:-1]) < i
        assert all(0 <= r < WIDTH for r in path)


def test_propose_reads_the_tree_out_of_the_matrix():
    p = proposer(k=5)
    p.candidates[3] = torch.tensor([5, 6, 7, -1])  # after 3: 5, then 6, then 7
    p.candidates[5] = torch.tensor([8, 9, -1, -1])
    p.candidates[8] = torch.tensor([1, 2, -1, -1])
    got = p.propose(state([0, 3]), 5)
    # order (0) (0 0) (1) (2) (0 0 0): 5, 5->8, 6, 7, 5->8->1
    assert got.tokens == [5, 8, 6, 7, 1]
    assert got.parents == [-1, 0, -1, -1, 1]
    assert p.propose(state([0, 3]), 2).tokens == [5, 8]  # cut to k nodes, still a tree


def test_unknown_candidates_leave_their_subtree_out():
    p = proposer(k=6)
    assert p.propose(state([0, 4]), 6).tokens == []  # nothing seen after 4 yet
    p.candidates[4] = torch.tensor([2, -1, -1, -1])  # (0) known, (0 0) unknown: only one node
    got = p.propose(state([0, 4]), 6)
    assert got.tokens == [2] and got.parents == [-1]


def test_every_verify_row_refills_the_matrix():
    p = proposer()
    # a pass over [last = 3, node 5, node 6] (node 6 rejected): the rows' logits rank tokens 9, 8, 7, ...
    logits = torch.zeros(1, 3, 10)
    for row, best in enumerate((5, 2, 1)):
        logits[0, row] = torch.arange(10, dtype=torch.float32).flip(0) * 0.1
        logits[0, row, best] = 5.0
    s = state([0, 3, 5, 2])  # after the step: 5 accepted, 2 the target's own token
    p.on_verified(s, Proposal([5, 6], parents=[-1, 0]), 1, TargetOutput(_Forward(logits), [0, 1]))
    assert p.candidates[3].tolist() == [5, 0, 1, 2]
    assert p.candidates[5].tolist() == [2, 0, 1, 3]
    assert p.candidates[6].tolist() == [1, 0, 2, 3]  # the rejected node's row is recycled too


def test_prefill_records_the_prompts_last_tokens():
    """The last prompt token from the prefill's logits, the ones before from the LM head over their
    hidden states (the prefill computes the last row's logits only)."""
    p = proposer()
    logits = torch.zeros(1, 1, 10)
    logits[0, 0, 7] = 1.0
    hidden = torch.randn(1, 3, 3)
    p.begin(state([1, 2, 3, 4]), TargetOutput(_Forward(logits, hidden), [0, 1, 2]))
    assert int(p.candidates[3, 0]) == 7  # prompt [1, 2, 3], its last token 3 (output [4] came from it)
    want = torch.topk(hidden[0, :2] @ _Target.lm_head.weight.T, 4).indices
    assert p.candidates[torch.tensor([1, 2])].tolist() == want.tolist()
    assert (p.candidates[4:] == -1).all()


@pytest.mark.slow
def test_recycled_trees_are_accepted_on_the_real_model(smollm_llm):
    """On the default model the recycled tree is accepted often enough to pay: > 1.3 tokens a pass."""
    from specdec.llm import LLM
    spec = LLM("smollm2-135m", dtype="float32", progress=False,
               speculative_config={"method": "recycle", "num_speculative_tokens": 5})
    tok = spec.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a Python function that "
                                               "returns the n-th Fibonacci number, with a docstring."}]))
    ref = smollm_llm.generate_one(ids, SamplingParams(temperature=0, max_tokens=64)).token_ids
    spec.generate_one(ids, SamplingParams(temperature=0, max_tokens=64))  # warms the matrix
    r = spec.generate_one(ids, SamplingParams(temperature=0, max_tokens=64))
    assert r.token_ids == ref
    assert r.metrics.tokens_per_pass > 1.3


@pytest.mark.parametrize("method", ["recycle", "recycle+ngram"])
def test_engine_batch_equals_single_request(tiny_dir, method):
    """The serving engine drafts the tree's first path (a chain) per row, in one batch with the others."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.llm import LLM

    d = tiny_dir("llama")
    plain = LLM(str(d), dtype="float32", max_model_len=160, progress=False, num_threads=1)
    spec = LLM(str(d), dtype="float32", max_model_len=160, progress=False, num_threads=1,
               speculative_config={"method": "recycle"})
    engine = Engine(spec, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                                       request_methods=(method,)))
    prompts = ["The quick brown fox", "one two three four five six. one two three four five six. one two"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [EngineRequest(str(i), spec.tokenizer.encode(t), params) for i, t in enumerate(prompts * 2)]
    for r in reqs:
        r.speculative = {"method": method, "num_speculative_tokens": 3}
        engine.add_request(r)
    got, drafted = drain_engine(engine)
    for r in reqs:
        assert got[r.request_id] == plain.generate_one(r.prompt_ids, r.params).token_ids, r.request_id
    assert drafted > 0


def test_the_tree_shares_follow_the_drafting_order():
    order = tree_order(12)
    shares = [path_share(p) for p in order]
    assert shares == sorted(shares, reverse=True)  # best first: a step drafting k nodes drafts the best k
    assert shares[0] == RANK_SHARE[0] and abs(shares[1] - RANK_SHARE[0] ** 2) < 1e-12
