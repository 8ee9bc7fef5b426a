"""Lookup first, model second: a free lookup drafter (n-gram or suffix) tried at every step, the
method's model drafter (qdraft, draft_model, EAGLE, Medusa, layer skip) when the lookup finds no
long enough match, as Arctic Inference pairs suffix decoding with its draft models.

    LLM("smollm2-135m", speculative_config={"method": "qdraft", "lookup": "ngram", "lookup_min_match": 3})

Why: a model drafter pays for every token it drafts (qdraft: ~0.4 of a target step each on a 2-core
CPU), a lookup pays nothing, and where the output copies its context (quotes, code, lists, repeated
phrasing) a match of several tokens predicts many tokens well. The lookup is asked first, and only
matches of at least `lookup_min_match` context tokens count; with a fixed k a step takes its chain
whenever it has one, else the model drafter's proposal.
Either way the target verifies it as usual, so the output is exactly the target's. In the
single-request decoder, adaptive k weighs the two at every step (`propose_lookup` first, it is free;
`propose_model` if its expected speedup is 1.15x higher): the lookup's chain is priced by its own acceptance
at that match length and costs nothing to draft, the model drafter's by its acceptance and measured
cost, so the lookup still drafts where the model drafter does not pay. (In the serving engine a
batch-wide K of 0 keeps both off, as every verify column there is paid for by the whole batch.)

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
        self.lookup_steps = 0  # verified steps that drafted the lookup's chain (for reports and tests)
        self.model, self.lookup = model, lookup
        self.name = f"{model.name}+{lookup.name}"
        self.feature_layers = model.feature_layers
        self.min_match = ctx.config.lookup_min_match

    @property
    def draft_cost_per_token(self) -> float:
        return self.model.draft_cost_per_token

    @property
    def carries_estimates(self) -> bool:
        return self.model.carries_estimates

    @property
    def acceptance_prior(self) -> float:
        return self.model.acceptance_prior

    @property
    def acceptance_position_weight(self) -> float | None:
        return self.model.acceptance_position_weight

    def tree_shares(self) -> list[float] | None:
        return self.model.tree_shares()

    @property
    def dynamic_tree_depth(self) -> int:
        return self.model.dynamic_tree_depth

    def take_catchup(self) -> tuple[float, int]:
        return self.model.take_catchup()

    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        self.model.begin(_view(state, "model"), prefill)
        self.lookup.begin(_view(state, "lookup"), prefill)

    def propose_lookup(self, state: RequestState, k: int) -> Proposal:
        tokens, n = self.lookup.lookup(_view(state, "lookup"), k, self.min_match)
        return Proposal(tokens, match_len=n) if tokens else EMPTY

    def propose_model(self, state: RequestState, k: int) -> Proposal:
        return self.model.propose(_view(state, "model"), k)

    def propose(self, state: RequestState, k: int) -> Proposal:
        """The lookup's chain when it matches, else the model drafter's (fixed k, and the engine's rows)."""
        found = self.propose_lookup(state, k)
        return found if found else self.propose_model(state, k)

    def propose_batch(self, states: list[RequestState], ks: list[int], trees: bool = False) -> list[Proposal]:
        proposals = [self.propose_lookup(s, k) for s, k in zip(states, ks)]
        rest = [i for i, p in enumerate(proposals) if not p]
        if rest:
            drafted = self.propose_model_batch([states[i] for i in rest], [ks[i] for i in rest], trees)
            for i, p in zip(rest, drafted):
                proposals[i] = p
        return proposals

    def propose_model_batch(self, states: list[RequestState], ks: list[int], trees: bool = False) -> list[Proposal]:
        return self.model.propose_batch([_view(s, "model") for s in states], ks, trees)

    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        if proposal.lookup:
            self.lookup_steps += 1
        self.model.on_verified(_view(state, "model"), proposal, num_accepted, target)
        self.lookup.on_verified(_view(state, "lookup"), proposal, num_accepted, target)

    def on_preempted(self, state: RequestState) -> None:
        self.model.on_preempted(_view(state, "model"))
        self.lookup.on_preempted(_view(state, "lookup"))

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_bytes_per_block(block_size)

    def end(self, state: RequestState) -> None:
        self.model.end(_view(state, "model"))
        self.lookup.end(_view(state, "lookup"))
        state.draft.clear()
