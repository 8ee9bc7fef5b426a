"""The proposer interface: every drafter (draft model, n-gram, suffix, layer skip, lookahead, ...)
proposes up to k tokens after a request's last token, and hears back what the target accepted.

Proposers register themselves by method name; `make_proposer` looks the name up, so adding a
method is one new file with `@register_proposer("name")`, not a new branch in the engine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from specdec.config import ConfigError, SpeculativeConfig
from specdec.sampling_params import SamplingParams
from specdec.spec.adaptive import robust_ema


@dataclass
class RequestState:
    """One request as the proposer and verifier see it.

    token_ids = prompt + output; the last token has been emitted but is not yet in the target's
    KV cache (the next target pass starts with it)."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    request_id: str = ""
    draft: dict[str, Any] = field(default_factory=dict)  # the proposer's per-request state

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class Proposal:
    """A chain (parents None) or a token tree of drafted nodes.

    Tree example: parents = [-1, -1, 0, 0, 2] is two children of the last token (nodes 0, 1), two
    children of node 0 (nodes 2, 3) and one child of node 2 (node 4); -1 means "the last token".
    Nodes are in topological order (a parent before its children)."""

    tokens: list[int]  # [k] drafted tokens (tree: one per node)
    probs: torch.Tensor | None = None  # [k, V] warped draft distribution each token was drawn from; None: one-hot q
    parents: list[int] | None = None  # [k] parent node index per node, -1 = root; None: a chain
    # > 0: drafted by a free context lookup (n-gram, suffix) after a match of this many tokens; adaptive
    # k keeps such chains' acceptance apart from a model drafter's, by match length
    match_len: int = 0
    # [V] the draft distribution of the token drafted after the chain and then cut from it because the
    # target cannot accept it (a grammar forbids it): the token after the chain is drawn as rejecting it
    # would draw it, from norm(max(0, p - cut_probs)). Cutting a drafted token for its value and drawing
    # from p instead would skew the output (None: nothing was cut, or q is one-hot)
    cut_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> "Proposal":
        """The first n nodes: a chain's first tokens, or a tree's (a parent comes before its children)."""
        if n >= len(self.tokens):
            return self
        return Proposal(self.tokens[:n], None if self.probs is None else self.probs[:n],
                        None if self.parents is None else self.parents[:n], self.match_len)

    @property
    def lookup(self) -> bool:
        return self.match_len > 0

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def depth(self) -> int:
        """The positions past the last token the draft reaches: a chain's length, a tree's deepest path."""
        return len(self.tokens) if self.parents is None else max(node_depths(self.parents), default=0)


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth past the last token (1: a child of it), parents before their children (else a ValueError)."""
    depths: list[int] = []
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"node {j} has parent {parent}: parents must come before their children")
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


@dataclass
class TargetOutput:
    """What the target computed in a pass, for proposers that read its features (EAGLE, Medusa).

    forward.hidden[0, r] / forward.layer_hidden[l][0, r] belong to input row r of the pass; in a verify
    pass row 0 is the last token and row i >= 1 is drafted node i-1. accepted_rows lists, in order, the
    rows whose tokens are now part of the sequence (chain: [0, 1, ..., num_accepted])."""

    forward: Any  # specdec.model.llama.ForwardOutput
    accepted_rows: list[int]


EMPTY = Proposal([])


@dataclass
class ProposerContext:
    """What a proposer may use: the target model and tokenizer, the config, how to load models."""

    target: Any  # LlamaModel
    tokenizer: Any  # specdec.model.tokenizer.Tokenizer
    config: SpeculativeConfig
    target_dir: Path | None = None
    dtype: torch.dtype = torch.float32
    max_len: int = 4096
    load_model: Callable[[str], tuple[Any, Any]] | None = None  # name -> (model, tokenizer)


class Proposer(ABC):
    name: ClassVar[str] = ""
    feature_layers: ClassVar[tuple[int, ...]] = ()  # target layers whose hidden states this proposer reads
    draft_cost_per_token: float = 0.0  # seconds per drafted token, measured; 0 for lookup drafters
    has_model_drafter: ClassVar[bool] = True  # False: a lookup alone (n-gram, suffix), free to ask
    # whether a request's adaptive k may start from the previous request's estimates (a draft model with a
    # measured cost: its acceptance holds across requests); False: a head, whose acceptance swings with the content
    carries_estimates: ClassVar[bool] = True
    acceptance_prior: float = 0.6  # per-token acceptance adaptive k assumes before a request's first step
    # adaptive k's estimate of its acceptance weighs each tested position this much (None: each step EMA,
    # however many positions it tested; spec/adaptive.py's Acceptance)
    acceptance_position_weight: float | None = None
    # > 0: tree_shares are a dynamic tree's priors per rank (its node i is its i-th likeliest), which adaptive
    # k learns from the request's verified trees, and a tree of k nodes takes min(k, this) drafting passes;
    # 0: a static tree's shares, k nodes priced as k drafted tokens (spec/tree_shares.py)
    dynamic_tree_depth: int = 0

    def __init__(self, ctx: ProposerContext):
        self.ctx = ctx

    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        """A request starts: its prompt is in state.prompt_ids, the first sampled token in output_ids,
        and `prefill` holds the target's prefill pass over the prompt (rows = prompt positions)."""

    @abstractmethod
    def propose(self, state: RequestState, k: int) -> Proposal:
        """Up to k tokens continuing state.token_ids. May return fewer (or none)."""

    def propose_lookup(self, state: RequestState, k: int) -> Proposal:
        """Up to k tokens from a free context lookup, with its match_len (n-gram, suffix, or the lookup
        paired with a model drafter), asked first on every adaptive step: adaptive k then weighs the
        chain against the model drafter's option (propose_model). EMPTY when there is none."""
        return EMPTY

    def propose_model(self, state: RequestState, k: int) -> Proposal:
        """Up to k tokens from the model drafter alone (a pairing's without its lookup)."""
        return self.propose(state, k)

    def take_catchup(self) -> tuple[float, int]:
        """(seconds, rows) the last proposal spent catching up on rows the target accepted before it
        (a head digesting its queued features), reset to (0, 0): adaptive k prices that as the step's
        overhead, not per drafted token (spec/decoder.py). (0.0, 0) for a proposer that catches up
        elsewhere (a draft model's, in on_verified) or not at all."""
        return 0.0, 0

    def tree_shares(self) -> list[float] | None:
        """A tree drafter's prior chance that each node it drafts lies on the accepted path, in drafting
        order (a step drafting k nodes drafts the first k); adaptive k prices a tree of k nodes by them
        (spec/tree_shares.py). None: this proposer drafts chains."""
        return None

    def observe_draft_cost(self, per_token: float) -> None:
        """Fold one measured cost per drafted token (seconds) into draft_cost_per_token (an EMA whose new
        observations are capped, as adaptive k's own estimates are: one stalled step moves it <= 1.6x)."""
        self.draft_cost_per_token = robust_ema(self.draft_cost_per_token, per_token)

    def propose_batch(self, states: list[RequestState], ks: list[int], trees: bool = False) -> list[Proposal]:
        """Proposals for several requests of one decode batch (up to ks[b] tokens for states[b]).
        Row by row here; a model drafter overrides it to run one forward per draft step for all rows.
        trees: the engine verifies trees for these rows (a drafter may then draft its trees where it
        would draft chains for the batch; it may always return a tree, which the engine cuts otherwise)."""
        return [self.propose(s, k) for s, k in zip(states, ks)]

    def propose_model_batch(self, states: list[RequestState], ks: list[int], trees: bool = False) -> list[Proposal]:
        """propose_batch from the model drafter alone (a pairing's without its lookup)."""
        return self.propose_batch(states, ks, trees)

    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        """Called after every target pass (also plain ones, with an empty proposal). The target
        accepted num_accepted drafted tokens (tree: along one path); state.output_ids already holds
        them plus the recovered/bonus token. Roll back any draft-side cache here."""

    def on_preempted(self, state: RequestState) -> None:
        """The serving engine freed the request's KV blocks (preemption by recompute): forget anything
        the drafter kept in them (its keys/values in the engine's blocks)."""

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes the drafter keeps in each of the serving engine's KV blocks (0: none, or a cache of its own)."""
        return 0

    def end(self, state: RequestState) -> None:
        """The request finished; free its per-request state."""
        state.draft.clear()


_REGISTRY: dict[str, type[Proposer]] = {}


def register_proposer(name: str):
    def deco(cls: type[Proposer]) -> type[Proposer]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def available_methods() -> list[str]:
    import specdec.proposers  # noqa: F401  (registers the built-in proposers)
    return sorted(_REGISTRY)


def make_proposer(ctx: ProposerContext) -> Proposer:
    methods = available_methods()
    if ctx.config.method not in _REGISTRY:
        raise ConfigError(f"speculative method {ctx.config.method!r} is not available; "
                          f"available: {', '.join(methods)}")
    proposer = _REGISTRY[ctx.config.method](ctx)
    if ctx.target.device.type != "cpu":
        warn_not_batch_invariant(ctx.target.device)
    if ctx.config.lookup is None:
        return proposer
    from specdec.proposers.hybrid import HybridProposer
    return HybridProposer(ctx, proposer, _REGISTRY[ctx.config.lookup](ctx))


def warn_not_batch_invariant(device) -> None:
    """Greedy speculation equals plain decoding token for token where a verify pass over k tokens sums
    each row as a one-token pass does: our CPU kernels do (tested), GPU libraries do not promise it. On
    an H200 in bf16, 12 of 16 MT-bench answers left plain decoding's path within 128 tokens with ngram
    (docs/benchmarks/gpu-s24.md): near-ties flip. Said (once, by the default warnings filter), not silent."""
    import warnings

    warnings.warn(f"speculative decoding on {device}: the verify pass is not batch-invariant there, so greedy "
                  "output can differ from plain decoding at near-ties (each token is still the target's argmax "
                  "over its own logits); on the CPU it is bitwise equal", RuntimeWarning, stacklevel=3)

