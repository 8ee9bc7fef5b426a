"""Lookup first, model second: a free lookup drafter (n-gram or suffix) tried at every step, the
method's model drafter (qdraft, draft_model, EAGLE, Medusa, layer skip) when the lookup finds no
long enough match, as Arctic Inference pairs suffix decoding with its draft models.

    LLM("smollm2-135m", speculative_config={"method": "qdraft", "lookup": "ngram", "lookup_min_match": 3})

Why: a model drafter pays for every token it drafts (qdraft: ~0.4 of a target step each on a 2-core
CPU), a lookup pays nothing, and where the output copies its context (quotes, code, lists, repeated
phrasing) a match of several tokens predicts many tokens well. A step takes the lookup's chain when
its match covers at least `lookup_min_match` context tokens, else the model drafter's proposal.
Either way the target verifies it as usual, so the output is exactly the target's. On steps where
adaptive k turns the model drafter off (it costs more than it saves there), the lookup still drafts
(`propose_free`): as many tokens as a verify pass absorbs for <= 1.15x a plain step, so pairing a
drafter with a lookup does not lose the lookup where the drafter is off. (That is the single-request
decoder; in the serving engine a batch-wide K of 0 keeps both off, as every verify column there is
paid for by the whole batch.)

Each part keeps its own per-request state: it sees a view of the request (the same prompt and
output lists, its own `draft` dict), and hears every verification, so the model drafter's caches
stay in step after the lookup's steps (qdraft and EAGLE catch up lazily on the tokens they missed).
"""
from __future__ import annotations

from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput


def _view(state: RequestState, key: str) -> RequestState:
    """The request as one part sees it: shared token lists and target cache, the part's own draft dict."""
    parts = state.draft.setdefault("parts", {})
    if key not in parts:
        parts[key] = RequestState(state.prompt_ids, state.params, state.generator, state.output_ids,
                                  state.request_id, {})
    view = parts[key]
    view.output_ids = state.output_ids  # the engine may rebind it (preemption by recompute)
    if "target_cache" in state.draft:
        view.draft["target_cache"] = state.draft["target_cache"]
    return view


class HybridProposer(Proposer):
    """model: the method's drafter; lookup: an n-gram or suffix proposer (both built on ctx; the
    config refuses a lookup method as the model drafter)."""

    def __init__(self, ctx, model: Proposer, lookup: Proposer):
        super().__init__(ctx)
        self.model, self.lookup = model, lookup
        self.name = f"{model.name}+{lookup.name}"
        self.deterministic = model.deterministic
        self.feature_layers = model.feature_layers
        self.min_match = ctx.config.lookup_min_match
        self.lookup_steps = 0  # steps whose proposal came from the lookup (for reports)

    @property
    def draft_cost_per_token(self) -> float:
        return self.model.draft_cost_per_token

    @property
    def acceptance_prior(self) -> float:
        return self.model.acceptance_prior

    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        self.model.begin(_view(state, "model"), prefill)
        self.lookup.begin(_view(state, "lookup"), prefill)

    def _from_lookup(self, state: RequestState, k: int) -> Proposal | None:
        tokens, _ = self.lookup.lookup(_view(state, "lookup"), k, self.min_match)
        if not tokens:
            return None
        self.lookup_steps += 1
        return Proposal(tokens, lookup=True)

    def propose(self, state: RequestState, k: int) -> Proposal:
        found = self._from_lookup(state, k)
        return found if found is not None else self.model.propose(_view(state, "model"), k)

    def propose_free(self, state: RequestState, k: int) -> Proposal:
        return self._from_lookup(state, k) or EMPTY

    def propose_batch(self, states: list[RequestState], ks: list[int]) -> list[Proposal]:
        proposals = [self._from_lookup(s, k) for s, k in zip(states, ks)]
        rest = [i for i, p in enumerate(proposals) if p is None]
        if rest:
            drafted = self.model.propose_batch([_view(states[i], "model") for i in rest], [ks[i] for i in rest])
            for i, p in zip(rest, drafted):
                proposals[i] = p
        return proposals

    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        self.model.on_verified(_view(state, "model"), proposal, num_accepted, target)
        self.lookup.on_verified(_view(state, "lookup"), proposal, num_accepted, target)

    def end(self, state: RequestState) -> None:
        self.model.end(_view(state, "model"))
        self.lookup.end(_view(state, "lookup"))
        state.draft.clear()
