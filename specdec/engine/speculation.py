"""Batched speculation: one shared draft length per decode batch, chosen from a measured cost model.

Every running request in the decode batch drafts up to K tokens with its own proposer (from the
registry; per-request method or none): a chain, or in a batch of one row (TREE_MAX_ROWS) a tree drafter's
tree of up to K nodes; and ONE target forward verifies all rows: rows are left-padded
to T = 1 + (longest draft), and where the model runs the batch packed (layer.c: the linears on the
real tokens alone) the pass costs about c(N), the time of a forward over N = B + (drafted tokens)
token rows; else c(B * T), padding included. On a CPU c(N) is flat while the matmuls are
memory-bound (small N) and grows linearly once they are compute-bound, so speculation is nearly free at small batches and expensive at large
ones. The rule (documented in docs/benchmarks/serving.md):

    E_b(k)   = (1 - a_b^(k+1)) / (1 - a_b)           tokens row b emits per pass when it drafts
    a_b      = acceptance estimate of what row b would draft: its free lookup's chain (n-gram, suffix,
               a pairing's lookup; asked before K is chosen), by that chain's match length, else its
               model drafter's (AdaptiveK, per request)
    y_b      = 1 for a row with a lookup chain, 0 for a lookup-only row without one (no draft, no
               cost), else EMA of "the model drafter had a draft when asked"
    P0       = prod_b (1 - y_b)                        no row drafts: the pass stays a plain one, c(B)
    rate(K)  = (B + sum_b y_b (E_b(min(K, cap_b)) - 1))            (cap_b: a chain's length at most)
               / ((1 - P0) (c(R(K)) + sum_b min(K, cap_b) draft_cost_b + B o_spec) + P0 (c(B) + B o_plain))
    R(K)     = B + sum_b y_b min(K, cap_b) packed (BatchCost.rows), else B (1 + the longest draft)
    K        = over 1..k_max, a longer K taken only where it beats the best rate so far (from rate(0)) by 2%
               (a noise-level gain does not lengthen the pass)

c(N) is profiled at start (N = 1, 2, 4, ..., 64); each decode pass rescales the curve (BatchCost).
o_spec, o_plain: measured seconds per row of a decode step outside the target forward (verification,
bookkeeping, lookup drafting; a model drafter's time is draft_cost_b, measured by the proposer without
its one-off catch-up on a prompt, which made o_spec ~1 s and kept qdraft off for good), for steps
that drafted and steps that did not: a drafter that is
accepted but whose steps cost more than they save backs off (the n-gram drafter at concurrency 1
was 9% slower than plain before this term).
A request with a fixed num_speculative_tokens drafts exactly that many; its draft is in every rate(K)'s
sums (the pass it widens is the one the other rows' K adds to). After PROBE_INTERVAL decode
batches in a row with K = 0 the whole batch drafts one token once, so the acceptance estimates stay
current (probing row by row would pad nearly every pass of a large batch); each probe after which
K stays 0 doubles the wait, up to MAX_PROBE_INTERVAL (at 16 rows a qdraft probe costs 16 int4 drafts
and a 32-row verify: every 32 batches it cost ~6% of TPOT). A batch whose drafts would not pay even if
every one were accepted (the drafts' and the wide pass's cost alone rule it out) waits the longest
interval at once: a probe re-measures acceptance, which cannot change that verdict (bf16 at 16 rows:
TPOT on/off 0.95x with probes every 32-64 batches).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace

import torch

from specdec.cache.kv_cache import kv_dtype
from specdec.cache.paged_cache import BatchKV, PagedKVPool, SeqKV
from specdec.config import ConfigError, SpeculativeConfig, split_method, with_hardware_defaults
from specdec.kernels import MAX_ROWS
from specdec.kernels.attention import PAGED_ROWS
from specdec.spec.adaptive import ProbeBackoff, StepOverhead, robust_ema
from specdec.spec.proposer import EMPTY, Proposal, ProposerContext, available_methods, make_proposer
from specdec.spec.rejection import Verdict, verify_greedy, verify_sampling
from specdec.sampler import argmax, warp

log = logging.getLogger("specdec.engine")
EMA = 0.3
PROBE_INTERVAL = 32  # plain batches before the first probe
MAX_PROBE_INTERVAL = 512
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# after this many decode steps in a row without drafts the model drafters' features rest: decode passes
# stop keeping the target's hidden states for EAGLE-3 (and its rows queue none), until WAKE_BEFORE steps
# before the next probe. At 16 rows in bf16, where adaptive K stays 0, keeping them cost ~1 ms of a
# 37 ms step (the pass's copies of 3 layers, each row's slices and queue)
REST_AFTER = 8
WAKE_BEFORE = 4
# a decode batch of at most this many rows verifies its tree drafters' trees (EAGLE-2, Medusa, recycling);
# a wider one cuts each tree to its first path. One row: a tree's extra verify rows cost little beside
# one row's pass, while 4 rows of 9-node trees would make a 40-row pass (a 16-row one costs 1.2x a 4-row one
# in bf16 on tiles) for ~30% more tokens a row, and tree drafting is row by row (~1 ms a tree)
TREE_MAX_ROWS = 1
# passes wider than MAX_ROWS real tokens leave layer.c for the per-op path, which costs more per row than the
# curve's slope up to 64 says (fp32, 135M model: c(80) 233 ms against 172 extrapolated from c(64) = 137);
# a batch of 8+ rows can draft its way there, so its engine measures them too
WIDE_SIZES = (96, 128)


def profile_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The pass sizes to profile for an engine of max_num_seqs rows."""
    return PROFILE_SIZES + (WIDE_SIZES if max_num_seqs >= 8 else ())


class BatchCost:
    """Seconds of a target forward over N token rows (B rows x T columns, padded).

    The curve's shape comes from the profile; every decode pass rescales it (an EMA of measured /
    predicted), which follows the growth of the contexts and the machine's load without letting one
    noisy pass at one N distort the ratios c(B (K+1)) / c(B) that K is chosen from."""

    def __init__(self):
        self.seconds: dict[int, float] = {}  # N -> profiled seconds
        self.scale = 1.0
        # whether a left-padded pass runs its linears on the real tokens alone (llama.py's `packed`):
        # then rows drafting different lengths cost their tokens, not B x T (found by profile())
        self.packs = False

    def profile(self, model, sizes=PROFILE_SIZES, prefix_len: int = 32, repeats: int = 3,
                block_size: int = 16) -> None:
        """c(N) for N rows of one new token each, through the engine's own path (a scratch paged pool
        and BatchKV, whose kernels differ from the single-sequence static cache's)."""
        per_seq = -(-(prefix_len + 1) // block_size)
        pool = PagedKVPool.for_model(model.config, per_seq * max(sizes), block_size, kv_dtype(model), model.device)
        for n in sizes:
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
            times = []
            for _ in range(repeats):  # a zero prefix: the matmuls dominate, as in decode
                t0 = time.perf_counter()
                kv = BatchKV(pool, tables, [prefix_len] * n, [1] * n)
                model(torch.zeros(n, 1, dtype=torch.long), torch.full((n, 1), prefix_len), kv)
                times.append(time.perf_counter() - t0)
            self.seconds[n] = min(times)
        kv = BatchKV(pool, [list(range(per_seq)), list(range(per_seq, 2 * per_seq))], [prefix_len] * 2, [2, 1])
        ids, pos = torch.zeros(2, 2, dtype=torch.long), torch.full((2, 2), prefix_len)
        self.packs = bool(getattr(model(ids, pos, kv), "packed", False))  # a ragged pass of 2 + 1 tokens

    def rows(self, B: int, K: int, real: float) -> float:
        """Rows a verify pass computes: B x (K + 1) padded, or `real` (the expected real tokens) where
        passes run packed and fit layer.c's rows (MAX_ROWS) and the attention kernel's grid (PAGED_ROWS)."""
        padded = B * (K + 1)
        return real if self.packs and real <= MAX_ROWS and padded <= PAGED_ROWS else padded

    def observe(self, n: int, seconds: float) -> None:
        if not self.seconds:  # never profiled: the first pass anchors the curve
            self.seconds[n] = seconds
            return
        self.scale = robust_ema(self.scale, seconds / self._curve(n))  # one stalled pass moves it <= 1.6x

    def estimate(self, n: int) -> float:
        return self._curve(n) * self.scale

    def _curve(self, n: float) -> float:
        if n in self.seconds:
            return self.seconds[n]
        if not self.seconds:
            return float(n)
        known = sorted(self.seconds)
        lo = max((x for x in known if x < n), default=None)
        hi = min((x for x in known if x > n), default=None)
        if lo is None:
            return self.seconds[hi]
        if hi is None:  # past the largest measured size: linear in N (compute-bound)
            return self.seconds[lo] * n / lo
        w = (n - lo) / (hi - lo)
        return (1 - w) * self.seconds[lo] + w * self.seconds[hi]


def expected_tokens(a: float, k: int) -> float:
    a = min(a, 0.99)
    return (1 - a ** (k + 1)) / (1 - a)


def first_path(proposal: Proposal) -> Proposal:
    """A token tree cut to its first root-to-leaf path, verified as a deterministic chain (a batch of
    more than TREE_MAX_ROWS rows, or a row with a grammar).

    Treating drafts as deterministic (q one-hot) is exact for any drafted tokens, sampled or not."""
    tokens, node = [], -1
    for i, parent in enumerate(proposal.parents):
        if parent == node:
            tokens.append(proposal.tokens[i])
            node = i
    return Proposal(tokens)


def verify_rows(proposal: Proposal, logits: torch.Tensor, params, generator) -> Verdict:
    """logits [k+1, V] of a pass over [last, x_1..x_k]: the accepted drafts plus one token."""
    if params.greedy:
        return verify_greedy(proposal.tokens, argmax(logits).tolist())
    return verify_sampling(proposal.tokens, warp(logits, params), proposal.probs, generator, proposal.cut_probs)


class Speculation:
    """The proposers (the server's default and per-request ones), the cost model, the choice of K."""

    def __init__(self, llm, default_config: SpeculativeConfig | None):
        self.llm = llm
        self.default_config = default_config
        self.proposers = {}
        if llm.proposer is not None:
            self.proposers[llm.proposer.name] = llm.proposer
        self.cost = BatchCost()
        self.overhead = StepOverhead()  # per row of a decode step, outside the target forward
        self.pool = None  # the engine's PagedKVPool
        self.probes = ProbeBackoff(PROBE_INTERVAL, MAX_PROBE_INTERVAL)
        self.propose_seconds = 0.0  # time in proposers since the engine last reset it (once per step)
        self.drafter_failures = 0  # rows whose drafter raised (each decodes on without drafts)
        self._lock = threading.Lock()

    def proposer(self, method: str):
        """The proposer for a method ('qdraft+ngram': a pairing), built on first use (thread-safe). The engine
        builds the methods requests may pick when it starts (EngineConfig.request_methods)."""
        with self._lock:
            if method in self.proposers:
                return self.proposers[method]
            name, lookup = split_method(method)
            if name not in available_methods():
                raise ConfigError(f"speculative method {name!r} is not available; available: "
                                  f"{', '.join(available_methods())}")
            base = self.default_config
            cfg = SpeculativeConfig.from_dict(with_hardware_defaults(
                {"method": name, "model": base.model if base and base.method == name else None, "lookup": lookup},
                self.llm.amx))
            llm = self.llm
            ctx = ProposerContext(llm.model, llm.tokenizer, cfg, llm.source.directory, llm.dtype, llm.model.max_len,
                                  llm._load_aux)
            self.proposers[method] = make_proposer(ctx)
            return self.proposers[method]

    def cap(self, seq, max_model_len: int) -> int:
        """The most tokens this row may draft now (k_max, tokens left, context room)."""
        if seq.spec.proposer is None or not seq.begun:
            return 0
        remaining = seq.params.max_tokens - len(seq.output_ids)
        room = max_model_len - seq.num_tokens - 1  # a step emits up to k + 1 tokens
        return max(0, min(seq.spec.k_max, remaining - 1, room))

    def resting(self) -> bool:
        """Whether this step's decode pass may leave out the model drafters' features (after choose_k:
        no row drafts on it, and none will on the next, a probe included)."""
        return self.probes.resting(REST_AFTER, WAKE_BEFORE)

    def observe_overhead(self, rows: int, drafted: bool, seconds: float) -> None:
        """A pure decode step's time outside its target forward and its proposers, for `rows` rows.
        Drafting is costed apart (draft_cost_per_token, which each proposer measures without the
        catch-up of a prompt or of the tokens of plain steps, a one-off per request)."""
        self.overhead.observe(drafted, seconds / max(rows, 1))

    def lookups(self, seqs, caps: list[int]) -> list[Proposal]:
        """Each adaptive row's free lookup chain (n-gram, suffix, a pairing's lookup; EMPTY where there is
        none), asked before K is chosen: a lookup costs nothing, and its chain's match length says how
        likely it is to be accepted (AdaptiveK keeps one estimate per match length)."""
        found = []
        for seq, cap in zip(seqs, caps):
            chain = EMPTY
            if cap > 0 and not seq.spec.fixed_k:
                try:
                    chain = seq.spec.proposer.propose_lookup(seq.state, cap)
                except Exception as e:  # noqa: BLE001 (a drafter's failure is its row's, not the step's)
                    self.drop_drafter(seq, e)
            found.append(chain)
        return found

    def drop_drafter(self, seq, error: Exception) -> None:
        """A row whose drafter raised decodes on without one: its output is plain decoding's either way, and
        the step's other rows go on (the exception failed the whole step, and the async engine then aborted
        every request in flight). The drafter's state for the row is released as at its end."""
        proposer = seq.spec.proposer
        log.warning("drafter %s failed for request %s (%s: %s); it decodes on without drafts", proposer.name,
                    seq.request_id, type(error).__name__, error)
        seq.spec = replace(seq.spec, proposer=None, failed_method=proposer.name,
                           drafter_error=f"{type(error).__name__}: {error}")
        self.drafter_failures += 1
        if seq.begun:
            try:
                proposer.end(seq.state)
            except Exception as e:  # noqa: BLE001 (its state may be what failed: nothing more to release)
                log.warning("drafter %s could not release request %s: %s", proposer.name, seq.request_id, e)

    @staticmethod
    def _drafter(seq, cap: int, chain: Proposal | None) -> tuple[float, float, int, float] | None:
        """(yield, acceptance, longest draft, seconds per drafted token) of what a row would draft:
        its lookup chain if it has one, else its model drafter; None: it cannot draft."""
        if chain:
            return 1.0, seq.adaptive.lookup_acceptance(chain.match_len), min(cap, len(chain)), 0.0
        if chain is not None and not seq.spec.proposer.has_model_drafter:
            return None  # a lookup alone that found nothing this step
        return seq.draft_yield, seq.adaptive.acceptance, cap, seq.spec.proposer.draft_cost_per_token

    def choose_k(self, seqs, caps: list[int], found: list[Proposal] | None = None) -> int:
        """found: the rows' lookup chains (Speculation.lookups); None: every row's drafter is priced by
        its yield and its model estimate. Rows with a fixed num_speculative_tokens draft their own length
        at every K: they are priced in every pass (the pass they widen is the one K's rows join)."""
        adaptive, fixed = [], []
        for i, (s, c) in enumerate(zip(seqs, caps)):
            if c > 0 and s.spec.proposer is not None:
                if s.spec.fixed_k:
                    fixed.append(self._drafter(s, c, None))  # (propose asks its own proposer: no lookup chain)
                else:
                    adaptive.append(self._drafter(s, c, found[i] if found is not None else None))
        adaptive, fixed = [d for d in adaptive if d is not None], [d for d in fixed if d is not None]
        if not adaptive:
            return 0
        B = len(seqs)
        plain = self.cost.estimate(B) + B * self.overhead.plain

        def rates(K: int) -> tuple[float, float]:
            """(tokens a second, tokens a second if every draft were kept) of a pass where K's rows draft
            min(K, cap) and the fixed rows their own length."""
            drafts = [(y, a, min(K, c), d) for y, a, c, d in adaptive if min(K, c) > 0] + fixed
            p_none = math.prod(1.0 - y for y, _, _, _ in drafts)  # no row drafts: a plain pass
            gain = B + sum(y * (expected_tokens(a, n) - 1) for y, a, n, _ in drafts)
            draft = sum(n * d for _, _, n, d in drafts)
            real = B + sum(y * n for y, _, n, _ in drafts)  # expected real tokens of the pass
            verify = self.cost.estimate(self.cost.rows(B, max((n for _, _, n, _ in drafts), default=0), real))
            cost = (1 - p_none) * (verify + draft + B * self.overhead.spec) + p_none * plain
            return gain / cost, real / cost

        best, base_if_all_accepted = rates(0)
        best_k, best_if_all_accepted = 0, 0.0  # the best rate of K >= 1 if every draft were accepted
        for K in range(1, max(c for _, _, c, _ in adaptive) + 1):
            rate, if_all_accepted = rates(K)
            if rate > best * 1.02:  # a noise-level gain does not lengthen the pass
                best_k, best = K, rate
            best_if_all_accepted = max(best_if_all_accepted, if_all_accepted)
        # hopeless: the drafts' cost alone rules speculation out, so a probe (acceptance) would change nothing
        hopeless = best_if_all_accepted <= 1.02 * base_if_all_accepted
        if self.probes.should_probe(best_k > 0, hopeless=hopeless):
            return 1  # probe, the whole batch at once: re-measure acceptance
        return best_k

    def propose(self, seqs, k: int, caps: list[int], found: list[Proposal] | None = None) -> list[Proposal]:
        """Up to k drafted tokens for each row (caps: each row's limit; the blocks for them are already
        allocated): its lookup chain when `found` holds one, else its model drafter's; the rows that
        share a proposer draft together (Proposer.propose_batch / propose_model_batch)."""
        ks = [0 if c <= 0 or s.spec.proposer is None else c if s.spec.fixed_k else min(k, c)
              for s, c in zip(seqs, caps)]
        proposals = [EMPTY] * len(seqs)
        # (id(proposer), whole) -> row indices; whole: the proposer's own choice (a pairing's lookup
        # first), else its model drafter alone (the lookup was asked already and had nothing)
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (seq, n) in enumerate(zip(seqs, ks)):
            chain = found[i] if found is not None and not seq.spec.fixed_k else None
            if n <= 0:
                continue
            if chain:
                proposals[i] = self._fit(seq, chain, n)
                continue
            if chain is not None and not seq.spec.proposer.has_model_drafter:
                continue  # a lookup alone that found nothing this step
            groups.setdefault((id(seq.spec.proposer), chain is None), []).append(i)
            if self.pool is not None:  # self-speculation drafts into / reads the sequence's own blocks
                seq.state.draft["target_cache"] = SeqKV(self.pool, seq.block_table, seq.num_computed)
        trees = len(seqs) <= TREE_MAX_ROWS
        for (_, whole), rows in groups.items():
            proposer = seqs[rows[0]].spec.proposer
            t0 = time.perf_counter()
            states, row_ks = [seqs[i].state for i in rows], [ks[i] for i in rows]
            try:
                drafted = (proposer.propose_batch if whole else proposer.propose_model_batch)(states, row_ks, trees)
            except Exception as e:  # noqa: BLE001 (its rows decode on without it; the others draft)
                for i in rows:
                    self.drop_drafter(seqs[i], e)
                continue
            # a model drafter's time is costed apart (draft_cost_per_token; its one-off prompt catch-up, before
            # it has a measured cost, nowhere): not step overhead. A lookup's stays there (it costs ~0)
            if proposer.has_model_drafter:
                self.propose_seconds += time.perf_counter() - t0
            for i, p in zip(rows, drafted):
                proposals[i] = self._fit(seqs[i], p, ks[i], trees)
        return proposals

    @staticmethod
    def _fit(seq, proposal: Proposal, k: int, trees: bool = False) -> Proposal:
        """A row's proposal as the verify pass takes it: at most k nodes of a tree where `trees` and the row
        has no grammar, else a chain of at most k tokens the grammar allows (a tree's first path)."""
        if proposal.is_tree and (not trees or seq.grammar is not None):
            proposal = first_path(proposal)
        tokens = proposal.tokens[:k]
        allowed, forbidden = seq.grammar.cut(tokens) if seq.grammar is not None else (len(tokens), False)
        seq.draft_yield = (1 - EMA) * seq.draft_yield + EMA * bool(allowed)
        if forbidden and proposal.probs is not None and not seq.params.greedy:
            # a drafted token cut for its value: the next token comes from the residual its rejection gives
            # (one cut for its place, after an EOS that ends the grammar, is a shorter draft: p's own draw)
            return replace(proposal.first(allowed), cut_probs=proposal.probs[allowed])
        return proposal.first(allowed) if allowed else EMPTY
