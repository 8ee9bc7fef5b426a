"""The rejection sampler as a distribution: emitted tokens follow p whatever q is.

Toy p, q over a vocabulary of 10; N samples; the total-variation distance between the empirical
distribution and p must be under a bound derived from N (4 standard deviations per cell). A
deliberately wrong sampler (resampling from p instead of the residual after a rejection) is
rejected by the same test: the negative control shows the test has teeth.
"""
import math

import torch

from specdec.sampler import sample
from specdec.spec.rejection import Verdict, verify_greedy, verify_sampling

V, N = 10, 100_000


def tv_bound(p: torch.Tensor, n: int) -> float:
    return 0.5 * sum(4 * math.sqrt(float(pi) * (1 - float(pi)) / n) for pi in p) + 1e-3


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def toy(seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    return p, q


def wrong_verify(draft, p, q, gen):
    """A classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    for i, x in enumerate(draft):
        if float(torch.rand((), generator=gen)) < min(1.0, float(p[i, x] / q[i, x])):
            continue
        return Verdict(i, list(draft[:i]) + [sample(p[i], gen)])
    return Verdict(len(draft), list(draft) + [sample(p[len(draft)], gen)])


def run(verify, p, q, one_hot=False, seed=0, n=N):
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        draft = [sample(q[0], gen), sample(q[1], gen)]
        v = verify(draft, p, None if one_hot else q, gen)
        first[v.tokens[0]] += 1
        if len(v.tokens) > 1:
            second[v.tokens[1]] += 1
    return first, second


def test_speculative_sampling_matches_target():
    p, q = toy(0)
    first, second = run(verify_sampling, p, q)
    assert tv(first, p[0]) < tv_bound(p[0], N)
    assert tv(second, p[1]) < tv_bound(p[1], int(second.sum()))


def test_deterministic_proposals_match_target():
    """n-gram style drafts: q is one-hot on the drafted token."""
    p, q = toy(1)
    first, second = run(verify_sampling, p, q, one_hot=True)
    assert tv(first, p[0]) < tv_bound(p[0], N)
    assert tv(second, p[1]) < tv_bound(p[1], int(second.sum()))


def test_negative_control_wrong_sampler_is_rejected():
    p, q = toy(0)
    first, _ = run(wrong_verify, p, q, n=N // 5)
    assert tv(first, p[0]) > tv_bound(p[0], N // 5), "the distribution test cannot tell a wrong sampler apart"


def test_identical_p_and_q_accepts_everything():
    p, _ = toy(2)
    gen = torch.Generator().manual_seed(0)
    accepted = sum(verify_sampling([sample(p[0], gen), sample(p[1], gen)], p, p[:2], gen).num_accepted
                   for _ in range(2000))
    assert accepted == 4000


def test_greedy_verification():
    assert verify_greedy([5, 6, 7], [5, 6, 9, 1]) == Verdict(2, [5, 6, 9])
    assert verify_greedy([5, 6], [5, 6, 3]) == Verdict(2, [5, 6, 3])  # bonus token
    assert verify_greedy([4], [5, 0]) == Verdict(0, [5])


class ForbidGrammar:
    """A grammar that forbids a fixed set of tokens everywhere (cut: how many drafts it allows)."""

    def __init__(self, forbidden: set[int]):
        self.forbidden = forbidden

    def cut(self, tokens: list[int]) -> tuple[int, bool]:
        allowed = next((i for i, t in enumerate(tokens) if t in self.forbidden), len(tokens))
        return allowed, allowed < len(tokens)


def run_grammar_cut(fit, p, q, forbidden, seed=0, n=N // 4):
    """Draft 2 tokens from q, fit them to a grammar as the serving engine does, verify against p (whose
    forbidden tokens have probability 0, as the engine's grammar mask makes them): the emitted tokens."""
    from types import SimpleNamespace

    from specdec.engine.speculation import verify_rows
    from specdec.sampling_params import SamplingParams
    from specdec.spec.proposer import Proposal

    seq = SimpleNamespace(grammar=ForbidGrammar(forbidden), params=SamplingParams(temperature=1.0), draft_yield=0.0)
    logits = p.log()  # [3, V], -inf where p is 0
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        fitted = fit(seq, Proposal([sample(q[0], gen), sample(q[1], gen)], q), 2)
        v = verify_rows(fitted, logits[:len(fitted) + 1], seq.params, gen)
        first[v.tokens[0]] += 1
        if len(v.tokens) > 1:
            second[v.tokens[1]] += 1
    return first, second


def test_after_an_eos_that_ends_the_grammar_the_next_token_is_the_targets_draw():
    """With ignore_eos, a draft that ends the grammar (EOS in a final state) and goes on is cut after the
    EOS for its place, not for a token's value: the token after it is the target's own draw. It was drawn
    from the residual of the cut token's q, as for a forbidden token (4000 of 4000 draws one token where p
    is 50/50). Negative control: that residual is rejected."""
    from dataclasses import replace
    from types import SimpleNamespace

    from specdec.engine.grammar import GrammarState
    from specdec.engine.speculation import Speculation, verify_rows
    from specdec.sampling_params import SamplingParams
    from specdec.spec.proposer import Proposal

    class EndGrammar:  # one final state: tokens 0 and 1 stay in it, EOS (2) ends it, 3 is forbidden
        eos_id = 2

        def next(self, state, token):
            return state if token == self.eos_id else (0 if token in (0, 1) else None)

    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=10)
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.9, 0.1, 0.0, 0.0]])  # EOS, then mostly token 0
    p_after = torch.tensor([0.5, 0.5, 0.0, 0.0])
    logits = torch.stack([torch.tensor([0.0, 0.0, 1.0, 0.0]), p_after, p_after]).log()
    n = 4000

    def after_eos(fit):
        gen, counts = torch.Generator().manual_seed(0), torch.zeros(4)
        seq = SimpleNamespace(grammar=GrammarState(EndGrammar(), 0), params=params, draft_yield=0.0)
        for _ in range(n):
            fitted = fit(seq, Proposal([2, sample(q[1], gen)], q), 2)
            counts[verify_rows(fitted, logits[:len(fitted) + 1], params, gen).tokens[1]] += 1
        return counts

    assert tv(after_eos(Speculation._fit), p_after) < tv_bound(p_after, n)

    def residual_as_it_was(seq, proposal, k):
        fitted = Speculation._fit(seq, proposal, k)
        return replace(fitted, cut_probs=proposal.probs[len(fitted)]) if len(fitted) < k else fitted

    assert tv(after_eos(residual_as_it_was), p_after) > tv_bound(p_after, n)


def test_a_grammar_cut_draws_the_residual():
    """A drafted token the grammar forbids is cut from the chain for its value: the token in its place
    must be the one its certain rejection would draw (Proposal.cut_probs), not a fresh draw from p.
    Negative control: the cut as it was (the chain shortened, q of the cut token dropped) is rejected."""
    from dataclasses import replace

    from specdec.engine.speculation import Speculation

    p, q = toy(3)
    forbidden = {int(t) for t in q[0].topk(3).indices}  # the drafter likes what the grammar forbids
    p = p.clone()
    p[:, sorted(forbidden)] = 0.0
    p /= p.sum(-1, keepdim=True)
    first, second = run_grammar_cut(Speculation._fit, p, q, forbidden)
    n = int(first.sum())
    assert tv(first, p[0]) < tv_bound(p[0], n)
    assert tv(second, p[1]) < tv_bound(p[1], int(second.sum()))

    def cut_as_it_was(seq, proposal, k):
        return replace(Speculation._fit(seq, proposal, k), cut_probs=None)

    first, _ = run_grammar_cut(cut_as_it_was, p, q, forbidden)
    assert tv(first, p[0]) > tv_bound(p[0], n)
