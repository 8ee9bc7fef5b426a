"""EAGLE drafting: feature-level autoregression with a one-layer head (EAGLE-1 "eagle", EAGLE-3
"eagle3"), as a chain (eagle_topk = 1) or an EAGLE-2 dynamic tree (eagle_topk > 1).

Draft state per request (state.draft): its KV cache over the committed positions 0..c-1, where row
p was computed from the target's feature f_p and the embedding of token x_{p+1}; `g`, the draft's
output at position c-1 (it predicts the token after the last emitted one).
    on_verified: roll the draft cache back to c, run the rows the target just accepted (their
                 features and next tokens) through the head, causally: cache c -> c + accepted + 1.
    propose:     depth 1 = top-k of logits(g). Each further depth forwards the frontier nodes (input:
                 the parent's output + the node's embedding, position c + depth - 1, attending to
                 the committed prefix and its ancestors) and scores their top-k children by the
                 cumulative log-probability. EAGLE-2: only the best eagle_topk nodes of a depth are
                 expanded; after num_steps depths all nodes are reranked and the best
                 num_draft_tokens - 1 are verified (parents score >= children: the cut is a tree;
                 eagle_tree.py).
E.g. eagle_topk 2, num_steps 3, num_draft_tokens 5: depth 1 {a, b}; forward a, b -> 4 children, keep
the best 2 {ab, aa}; forward them -> 4 grandchildren; rerank all 10 nodes, verify the best 4.
Greedy and tree proposals are deterministic (verified as one-hot drafts); a sampled chain returns q.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from specdec.cache.draft_kv import DraftKV
from specdec.model.cuda_graph import TOKEN_BUCKETS, GraphedModel
from specdec.proposers import eagle_rows
from specdec.proposers.chain import unsure
from specdec.proposers.eagle_graph import GraphedHead
from specdec.proposers.eagle_tree import dynamic_tree, rerank
from specdec.proposers.head_io import check_head_fits, default_head, load_head
from specdec.quant.bf16 import on_tiles
from specdec.sampler import argmax, sample, warp
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput, register_proposer
from specdec.spec.tree import with_prefix



class _EagleBase(Proposer):
    kind = "eagle"
    # a head's acceptance swings with the content: starting each request from the last one's estimates
    # cost ~5-10% of eagle3's gain on mixed categories (interleaved A/B, session 24)
    carries_estimates = False
    # a head's first draft is accepted about half the time on unfamiliar prompts, and it drafts short
    # chains: weighted per step (0.3), three misses at k = 1 took its estimate from 0.5 to 0.17 and
    # switched it off, and one-token probes kept it off. Per tested position (interleaved A/B, 12 MT-bench
    # prompts, decode): eagle3 fp32 1.24x -> 1.30x (a fixed chain of 3: 1.30x), bf16 1.06x -> 1.16x;
    # eagle3+ngram 1.36x -> 1.42x, 1.18x -> 1.23x. qdraft+ngram moved -4%..+4% between runs: not taken
    acceptance_position_weight = 0.1
    # an EAGLE-2 tree's prior share of rank r: FIRST_RANK_SHARE * RANK_DECAY^r (the shipped eagle3 head,
    # 3 candidates a node, measured 0.44, 0.32, 0.22, 0.15, 0.14, 0.11, 0.08, 0.08, ...: spec/tree_shares.py)
    FIRST_RANK_SHARE, RANK_DECAY = 0.45, 0.75

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.config
        path = Path(cfg.model) if cfg.model else default_head(self.kind, ctx.target.config)
        self.device = ctx.target.device  # the head, its cache and every index live with the target
        self.head = load_head(path, ctx.dtype, ctx.target.config).to(self.device)  # upstream layouts too
        check_head_fits(self.head, ctx.target.config, path, self.kind)
        if on_tiles(ctx.target):  # a bf16 target on AMX tiles: the head's matmuls too (heads.use_amx_tiles)
            self.head.use_amx_tiles(True)
        self.feature_layers = tuple(self.head.cfg.aux_layers)
        self.embed = ctx.target.embed  # ids -> [..., H]: a table, or rows of a packed one (a bf16 target)
        self.lm_head = ctx.target.lm_head.weight  # a tensor or a packed weight (heads.draft_rows reads both)
        self.draft_ids = self.head.draft_ids  # [Vd] target id per draft id
        self.num_steps, self.topk = cfg.num_steps, cfg.eagle_topk
        self.threshold = cfg.draft_confidence_threshold  # a chain stops after a token drafted below it
        self.budget = cfg.num_draft_tokens - 1  # drafted nodes (SGLang counts the root token too)
        # a tree's nodes come likeliest first (eagle_tree.rerank), k of them drafted in min(k, num_steps) head passes
        self.dynamic_tree_depth = self.num_steps if self.topk > 1 else 0
        self._catchup = (0.0, 0)  # seconds and rows of digests since take_catchup last reported them
        self._kept: tuple[list[int], torch.Tensor] | None = None  # the last request's tokens, rows' features
        # a CUDA-graphed target (the single-request decoder on a GPU): the head's passes are graphed too
        self.graphed = None
        if isinstance(ctx.target, GraphedModel):
            self.graphed = GraphedHead(self.head, ctx.max_len + self._speculative_rows(), ctx.dtype, self.device)

    def tree_shares(self) -> list[float] | None:
        """A tree's prior share per rank (None: this head drafts chains, eagle_topk 1)."""
        if self.topk == 1:
            return None
        return [self.FIRST_RANK_SHARE * self.RANK_DECAY ** r for r in range(self.budget)]

    def _speculative_rows(self) -> int:
        """Draft cache rows one proposal may add: a chain's, or the tree's frontier forwards (<= topk a depth)."""
        return max(self.budget, self.num_steps * self.topk) + 2

    def _layer(self, emb, hidden, positions, cache, tree: torch.Tensor | None = None) -> torch.Tensor:
        """One request's head pass (forward_layer; tree [T, T]: a tree's block, forward_tree), through the
        head's graphs where it has them (their mask spelled out)."""
        if self.graphed is not None:
            mask = None if tree is None else with_prefix(tree, cache.length)
            return self.graphed.forward(emb, hidden, positions, cache, mask)
        if tree is None:
            return self.head.forward_layer(emb, hidden, positions, cache)
        return self.head.forward_tree(emb, hidden, positions, cache, tree.to(emb.device))

    # -- target features -> committed draft rows -------------------------------------------------
    def _features(self, fwd, rows: list[int]) -> torch.Tensor:
        """[n, H] (eagle) or [n, 3H] (eagle3) target features of the given input rows."""
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):  # consecutive (but a tree's paths): no
            rows = slice(rows[0], rows[0] + len(rows))  # gather (22 -> 6.5 us a row, queued on every engine step)
        if self.kind == "eagle3":  # cat copies: nothing queued aliases the forward's buffers
            return torch.cat([fwd.layer_hidden[l][0, rows] for l in self.feature_layers], dim=-1)
        return fwd.hidden[0, rows].clone()

    def _commit(self, work: list[tuple[RequestState, torch.Tensor, list[int]]]) -> None:
        """Run each row's (state, features [n, .], next tokens [n]) through the head, all rows in one pass:
        row i's cache grows by its n_i rows and its g becomes the output at its last one."""
        caches: list[DraftKV] = []
        positions = []
        for state, _, next_tokens in work:
            st = state.draft
            st["cache"].length = st["len"]  # forget the speculative rows of the last proposal
            caches.append(st["cache"])
            positions.append(st["offset"] + torch.arange(st["len"], st["len"] + len(next_tokens), device=self.device))
        sizes = [len(t) for _, _, t in work]
        tokens = [t for _, _, toks in work for t in toks]
        feats = torch.cat([f for _, f, _ in work])  # [N, H or 3H]
        out = None
        if self.graphed is None:  # EAGLE-3 on the CPU: the lines below in one C call, where it applies
            out = self.head.digest(feats, tokens, caches, sizes, torch.cat(positions), self.embed, self.draft_ids)
            out = None if out is None else out[None]
        if out is None:
            emb = self.embed(torch.tensor(tokens, device=self.device))[None]  # [1, N, H]
            feats = feats[None].to(emb.dtype)  # [1, N, H or 3H]
            if self.graphed is not None and len(work) == 1:
                out = self._layer(emb, self.head.fuse(feats, emb), positions[0][None], caches[0])
            else:
                out = self.head.forward_rows(emb, self.head.fuse(feats, emb), torch.cat(positions)[None], caches, sizes)
        end = 0
        for (state, _, _), cache, n in zip(work, caches, sizes):
            end += n
            state.draft["len"], state.draft["g"] = cache.length, out[:, end - 1:end]

    @torch.inference_mode()
    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        n = len(state.prompt_ids)
        st = state.draft
        # committed rows (at most the request's prompt + output) and one proposal's speculative rows:
        # a chain's, or the tree's frontier forwards (<= topk per depth); sized by the request, not the context
        committed = min(n + state.params.max_tokens, self.ctx.max_len)
        st["cache"] = (self.graphed.new_cache() if self.graphed is not None else
                       DraftKV(self.head.cfg, committed + self._speculative_rows(), self.ctx.dtype, self.device))
        feats = self._features(prefill.forward, prefill.accepted_rows)  # [m, .]: the prompt's last m positions
        feats = self._with_kept_prefix(state, feats)
        m = feats.shape[0]  # m < n where a prefix cache held the first n - m (not computed, not kept here)
        # every row's features from position 0 (at most KEPT_ROWS), kept at the end for the next request
        st["context"], st["context_rows"] = ([feats] if m == n else None), m
        st["len"] = 0
        st["offset"] = n - m  # position of the cache's row 0 (rows before the first draft's window are skipped)
        st["pending"] = [(feats, state.token_ids[n - m + 1:n + 1])]
        st["queued"] = m  # rows in pending
        eagle_rows.trim_pending(st)  # the first digest: only the prompt's newest PROMPT_WINDOW rows

    @torch.inference_mode()
    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        """Queue the accepted rows' features; the head digests them when it next drafts, so the steps
        that adaptive k makes plain cost the head nothing. A pass without them (the serving engine's
        drafters resting, Speculation.resting) drops the queue: the head restarts from the next rows
        it is given, at their true positions, and drafts nothing until then."""
        st = state.draft
        if "cache" not in st:
            return
        if self.feature_layers and target.forward.layer_hidden is None:
            st["pending"].clear()
            st["queued"], st["resting"], st["context"] = 0, True, None
            return
        rows = target.accepted_rows
        nxt = state.output_ids[-len(rows):]  # accepted drafts + the recovered/bonus token, all emitted this step
        if len(nxt) < len(rows):
            return  # the request stopped inside the block: it ends here
        if st.pop("resting", False):  # row 0 of this pass sits at position len(tokens) - len(nxt) - 1
            st["offset"], st["len"] = state.num_tokens - len(nxt) - 1, 0
        feats = self._features(target.forward, rows)
        st["pending"].append((feats, nxt))
        st["queued"] += len(nxt)
        eagle_rows.trim_pending(st)
        if st["context"] is not None and st["context_rows"] < eagle_rows.KEPT_ROWS:
            st["context"].append(feats)
            st["context_rows"] += len(nxt)

    def _with_kept_prefix(self, state: RequestState, feats: torch.Tensor) -> torch.Tensor:
        """feats [m, .] of the prompt's last m rows, preceded by the kept features of the n - m cached
        ones where the last request that ended had the same tokens there (features depend on the tokens
        before them alone); as they are otherwise."""
        cached = len(state.prompt_ids) - feats.shape[0]
        if cached == 0 or self._kept is None:
            return feats
        tokens, kept = self._kept
        if kept.shape[0] < cached or tokens[:cached] != state.token_ids[:cached]:
            return feats
        return torch.cat([kept[:cached], feats])

    def _flush(self, states: list[RequestState]) -> None:
        """Digest the rows the target accepted since each request last drafted (one head pass for all)."""
        work = [(state, *rows) for state in states if (rows := eagle_rows.take_pending(state.draft)) is not None]
        if work:
            self._timed_commit(work)

    def _timed_commit(self, work: list[tuple[RequestState, torch.Tensor, list[int]]]) -> None:
        """_commit, its time and rows added to the catch-up take_catchup reports."""
        t0 = time.perf_counter()
        self._commit(work)  # (on a GPU, the time to queue it: the verify pass's synchronize waits for it)
        seconds, rows = self._catchup
        self._catchup = (seconds + time.perf_counter() - t0, rows + sum(len(toks) for _, _, toks in work))

    def take_catchup(self) -> tuple[float, int]:
        catchup, self._catchup = self._catchup, (0.0, 0)
        return catchup

    def _graphed_proposal(self, state: RequestState, k: int, tree: bool) -> Proposal | None:
        """This step's proposal through the head's graphs: the digest and the whole chain (k of num_steps
        tokens kept) or tree (cut to k nodes) in one replay (GraphedHead.digest_and_draft); None where it
        does not apply (then the eager way)."""
        st = state.draft
        rows = eagle_rows.take_pending(state.draft)
        if rows is not None and len(rows[1]) > TOKEN_BUCKETS[-1]:  # a prompt's first digest: its own pass
            self._timed_commit([(state, *rows)])
            rows = None
        st["cache"].length = st["len"]
        feats, tokens = rows if rows is not None else (None, [])
        g = st.get("g")  # (none before a prompt's first digest: unused when rows are digested, as here)
        if g is None:
            g = torch.zeros(1, 1, self.head.cfg.hidden_size, dtype=self.ctx.dtype, device=self.device)
        got = self.graphed.digest_and_draft("tree" if tree else "chain", feats, tokens, st["offset"], g,
                                            self.num_steps, self.topk if tree else 1, self.embed, self.draft_ids,
                                            self.lm_head)
        if got is None:
            if rows is not None:
                self._timed_commit([(state, *rows)])  # (counted as the catch-up adaptive k prices)
            return None
        drafted, st["g"] = got
        st["len"] = st["cache"].length
        if not tree:
            return Proposal(drafted[:k], None)
        tok, par, val = drafted
        return rerank([int(t) for t in tok], [int(p) for p in par], val, k)

    # -- drafting -------------------------------------------------------------------------------
    def _logprobs(self, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head.logits(out, self.lm_head).float(), dim=-1)  # [N, Vd]

    def _forward_nodes(self, state, tokens: list[int], parent_out: torch.Tensor, depths: list[int],
                       tree: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: target ids of the nodes; parent_out [m, H]; tree [m, m] bool: the nodes are a tree's
        block (each sees the cache and its ancestors), None: a chain's next node. Returns outputs [m, H]."""
        emb = self.embed(torch.tensor(tokens, device=self.device))[None]  # [1, m, H]
        hidden = self.head.step_input(emb, parent_out[None])
        pos = (state.draft["offset"] + state.draft["len"] + torch.tensor(depths, device=self.device) - 1)[None]
        return self._layer(emb, hidden, pos, state.draft["cache"], tree)[0]

    @torch.inference_mode()
    def propose(self, state: RequestState, k: int) -> Proposal:
        """One request (the offline decoder): a chain, or with eagle_topk > 1 an EAGLE-2 tree."""
        return self._draft([state], [k], trees=True)[0]

    @torch.inference_mode()
    def propose_batch(self, states: list[RequestState], ks: list[int], trees: bool = False) -> list[Proposal]:
        """The serving engine's rows. A batch that verifies trees (one row: speculation.TREE_MAX_ROWS) gets a
        tree config's trees; a wider one verifies chains, so a tree config drafts its chain there: the rows'
        chains go together, a head pass per depth."""
        return self._draft(states, ks, trees=trees)

    def _draft(self, states: list[RequestState], ks: list[int], trees: bool) -> list[Proposal]:
        """The rows' queued rows digested in one head pass, and greedy chains drafted together, one pass
        per depth; trees (where `trees`) and sampled chains row by row. With the batch-invariant kernels
        each row's proposal is what it would be alone (tested).
        The head leaves draft_cost_per_token at 0 (adaptive k takes its drafts as free): priced at its
        measured ~0.9 ms a token (fp32), eagle3+ngram drafted less and gained less, interleaved A/B in
        the engine: c = 1 1.30x vs 1.36x, c = 4 1.10x vs 1.12x, 16 rows in bf16 1.28x vs 1.34x (session
        24); adaptive k's acceptance model, one rate for every position, underrates a head's chains."""
        ready = [i for i, s in enumerate(states) if "cache" in s.draft and ks[i] > 0 and not s.draft.get("resting")]
        may_tree = trees and self.topk > 1
        if self.graphed is not None and ready == [0]:  # the single-request decoder on a GPU
            tree = may_tree and min(ks[0], self.budget) > 1
            if tree or (states[0].params.greedy and not self.threshold):  # the graphed chain has no cut
                k = min(ks[0], self.budget if tree else self.num_steps)
                proposal = self._graphed_proposal(states[0], k, tree)
                if proposal is not None:
                    return [proposal]
        self._flush([states[i] for i in ready])
        proposals, chains = [EMPTY] * len(states), []
        for i in ready:
            state, k = states[i], ks[i]
            state.draft["cache"].length = state.draft["len"]
            if may_tree and min(k, self.budget) > 1:
                proposals[i] = self._tree(state, min(k, self.budget))
            elif state.params.greedy:
                chains.append(i)
            else:
                proposals[i] = self._sampled_chain(state, min(k, self.num_steps))
        if chains:
            drafted = self._greedy_chains([states[i] for i in chains], [min(ks[i], self.num_steps) for i in chains])
            for i, p in zip(chains, drafted):
                proposals[i] = p
        return proposals

    def _greedy_chains(self, states: list[RequestState], ks: list[int]) -> list[Proposal]:
        """Row i drafts ks[i] tokens; each depth forwards the rows still drafting in one pass. With a
        draft_confidence_threshold a row stops after a token whose draft probability is below it."""
        g = torch.cat([s.draft["g"][0] for s in states])  # [B, H]
        if not self.threshold and self.graphed is None:  # the whole loop below in one C call, where it applies
            drafted = self.head.draft_chains(g, [s.draft["cache"] for s in states],
                                             [s.draft["offset"] + s.draft["len"] for s in states], ks, self.embed,
                                             self.draft_ids)
            if drafted is not None:
                return [Proposal(t, None) for t in drafted]
        tokens: list[list[int]] = [[] for _ in states]
        live = list(range(len(states)))
        for d in range(1, max(ks) + 1):
            logits = self.head.logits(g, self.lm_head).float()  # [len(live), Vd]
            best = argmax(logits)  # [len(live)] draft ids
            for j, tok in enumerate(self.draft_ids[best].tolist()):  # one copy to the host a depth
                tokens[live[j]].append(tok)
            stop = unsure(logits, self.threshold)
            keep = [j for j, i in enumerate(live) if d < ks[i] and not stop[j]]
            if not keep:
                break
            live = [live[j] for j in keep]
            emb = self.embed(torch.tensor([tokens[i][-1] for i in live], device=self.device))[None]  # [1, m, H]
            pos = torch.tensor([states[i].draft["offset"] + states[i].draft["len"] + d - 1 for i in live],
                               device=self.device)[None]
            if self.graphed is not None and len(live) == 1:
                g = self._layer(emb, self.head.step_input(emb, g[keep][None]), pos, states[live[0]].draft["cache"])[0]
            else:
                g = self.head.forward_rows(emb, self.head.step_input(emb, g[keep][None]), pos,
                                           [states[i].draft["cache"] for i in live], [1] * len(live))[0]
        return [Proposal(t, None) for t in tokens]

    def _sampled_chain(self, state: RequestState, k: int) -> Proposal:
        params, g = state.params, state.draft["g"][0]  # [1, H]
        tokens, probs = [], []
        for d in range(1, k + 1):
            logits = self.head.logits(g, self.lm_head).float()[0]  # [Vd]
            if params.greedy:
                tok = int(self.draft_ids[int(argmax(logits))])
            else:  # q over the full vocabulary, warped exactly as the target's p
                full = torch.full((self.ctx.target.config.vocab_size,), float("-inf"), device=self.device)
                full[self.draft_ids] = logits
                q = warp(full[None], params)[0]
                tok = sample(q, state.generator)
                probs.append(q)
            tokens.append(tok)
            if unsure(logits, self.threshold)[0]:
                break  # as _greedy_chains: the unsure token is proposed, the chain stops after it
            if d < k:
                g = self._forward_nodes(state, [tok], g, [d])
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def _tree(self, state: RequestState, budget: int) -> Proposal:
        def forward(tokens, parent_outs, depths, tree):  # one block of the tree (eagle_tree.dynamic_tree)
            return self._forward_nodes(state, tokens, parent_outs, depths, tree)

        g = state.draft["g"][0]  # [1, H]
        if self.graphed is None:  # the whole tree in one C call, where it applies
            nodes = self.head.draft_tree(g[0], state.draft["cache"], state.draft["offset"] + state.draft["len"],
                                         self.topk, min(self.num_steps, budget), self.embed, self.draft_ids)
            if nodes is not None:
                return rerank(*nodes, budget)
        return dynamic_tree(self._logprobs(g)[0], g[0], state.draft["len"], state.draft["cache"], budget,
                            self.topk, self.num_steps, self.draft_ids, forward, self._logprobs)

    def end(self, state: RequestState) -> None:
        context = state.draft.get("context")
        if context:  # rows 0..R-1 in order: R = len(state.prompt_ids) + the accepted rows since
            feats = torch.cat(context)[:eagle_rows.KEPT_ROWS]
            self._kept = (list(state.token_ids[:feats.shape[0]]), feats)
        state.draft.clear()


@register_proposer("eagle")
class EagleProposer(_EagleBase):
    kind = "eagle"


@register_proposer("eagle3")
class Eagle3Proposer(_EagleBase):
    kind = "eagle3"
