"""Learned draft heads as small torch modules, stored in the layouts vLLM and SGLang read.

    EAGLE-1 ("eagle"):  x = fc([embed(x_{t+1}); f_t]) (2H -> H), one decoder layer without input norm,
                        output o_t ~ f_{t+1}; logits = target LM head(o_t). Keys: fc.weight, layers.0.*
    EAGLE-3 ("eagle3"): h = fc([low; mid; high]) (3H -> H) at step 0, the draft's own output o later;
                        a = [input_layernorm(embed); hidden_norm(h)] (2H) -> attention (q/k/v from 2H),
                        residual h; logits over a reduced draft vocabulary = lm_head(norm(o));
                        draft id i is target id i + d2t[i]; t2d[v] marks target ids in the draft vocab.
                        Keys: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
    Medusa ("medusa"):  head i: h + SiLU(W_i h + b_i), then the target LM head: token t+i+2.
                        Keys: blocks.<i>.layers.0.{weight,bias}; token_map (vLLM's reduced vocabulary)
The target's embedding and LM head are shared, not stored (vLLM and SGLang share them too when a
checkpoint omits them); `token_map` restricts the shared LM head to a frequent-token draft vocabulary.
A head directory = config.json (HF fields + "specdec": our fields) + model.safetensors (head_io.py).
The Medusa head's module is in medusa_head.py; the EAGLE head's decoder layer in head_layer.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from specdec.cache.draft_kv import DraftKV
from specdec.config import ConfigError
from specdec.kernels import MAX_ROWS, linear
from specdec.kernels.head import (describe_head_chain, describe_head_layer, describe_linear, head_chains,
                                 head_digest, head_layer, head_tree)
from specdec.model.layers import Rotary, grouped_sdpa, sdpa
from specdec.proposers.head_layer import EagleLayer, RMSNorm, stacked_weight
from specdec.quant.bf16 import Bf16Weight, pack_tiles
from specdec.spec.tree import with_prefix

HEAD_KINDS = ("medusa", "eagle", "eagle3")


@dataclass(frozen=True)
class HeadConfig:
    kind: str
    hidden_size: int
    vocab_size: int
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    draft_vocab_size: int = 0  # 0: the full vocabulary
    aux_layers: tuple[int, ...] = ()  # eagle3: target layers (ours: outputs of these layers)
    medusa_num_heads: int = 0
    medusa_accuracy: tuple[tuple[float, ...], ...] = ()  # [head][rank] held-out top-rank accuracy
    target: str = ""
    training: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"unknown head kind {self.kind!r}; one of {', '.join(HEAD_KINDS)}")

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        """A head directory's `specdec` section (to_dict's); an unknown key is an error."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown head config keys: {', '.join(unknown)}")
        d = dict(d)
        d["aux_layers"] = tuple(d.get("aux_layers", ()))
        d["medusa_accuracy"] = tuple(tuple(r) for r in d.get("medusa_accuracy", ()))
        return cls(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        d["medusa_accuracy"] = [list(r) for r in self.medusa_accuracy]
        return d

    @classmethod
    def for_target(cls, kind: str, mcfg, draft_vocab_size: int = 0, medusa_num_heads: int = 4,
                   aux_layers: tuple[int, ...] = (), target: str = "") -> "HeadConfig":
        return cls(kind, mcfg.hidden_size, mcfg.vocab_size, mcfg.intermediate_size, mcfg.num_attention_heads,
                   mcfg.num_key_value_heads, mcfg.head_dim, mcfg.rms_norm_eps, mcfg.rope_theta, mcfg.rope_scaling,
                   mcfg.max_position_embeddings, draft_vocab_size, tuple(aux_layers),
                   medusa_num_heads if kind == "medusa" else 0, (), target)


def _row_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive row indices grouped so that each group's sizes sum to at most `limit`; a row over the
    limit is a group of its own."""
    groups: list[list[int]] = []
    total = limit + 1
    for i, n in enumerate(sizes):
        if total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def draft_rows(head: torch.nn.Module, target_lm_head) -> torch.Tensor:
    """The target LM head's rows of the head's draft vocabulary [Vd, H], gathered once and kept (a
    gather per drafted token copied ~9 MB on the default model, more than the head's own work); the
    whole matrix when the head drafts the full vocabulary. The target's matrix is a tensor or a packed
    specdec.quant weight (a bf16 or quantized target: its rows widened to the compute dtype). Refreshed
    when the target's matrix or the head's vocabulary changes."""
    stored = target_lm_head if isinstance(target_lm_head, torch.Tensor) else target_lm_head.qweight
    if head.cfg.draft_vocab_size == 0 and stored is target_lm_head:
        return target_lm_head
    key = (stored.data_ptr(), stored._version, head.vocab_version)
    cached = head.__dict__.get("_draft_rows")
    if cached is None or cached[0] != key:
        if isinstance(target_lm_head, torch.Tensor):
            rows = target_lm_head[head.draft_ids]
        elif head.cfg.draft_vocab_size == 0:
            rows = target_lm_head.dequantize(target_lm_head.dtype)
        else:
            rows = target_lm_head.rows(head.draft_ids)
        cached = (key, rows)
        head.__dict__["_draft_rows"] = cached
    return cached[1]


class EagleHead(torch.nn.Module):
    """EAGLE-1 / EAGLE-3 draft head. The target's embedding (and, for EAGLE-1, LM head) are passed in."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        n_feat = 3 if cfg.kind == "eagle3" else 2
        self.fc = torch.nn.Linear(n_feat * H, H, bias=False)
        layer = EagleLayer(cfg)
        if cfg.kind == "eagle3":
            self.midlayer = layer
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = torch.nn.Linear(H, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        else:
            self.layers = torch.nn.ModuleList([layer])
        V = cfg.vocab_size
        Vd = cfg.draft_vocab_size or V
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))  # draft id i -> target id i + d2t[i]
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool) if Vd == V else torch.zeros(V, dtype=torch.bool))
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    @property
    def layer(self) -> EagleLayer:
        return self.midlayer if self.cfg.kind == "eagle3" else self.layers[0]

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] target token id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def vocab_version(self) -> int:
        """Changes whenever the draft vocabulary may have (set_vocab, load_state_dict)."""
        return self.d2t._version

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [Vd] ascending target ids -> d2t offsets and t2d mask."""
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def fuse(self, feats: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Step-0 hidden from target features. eagle3: feats [B, T, 3H] (low, mid, high);
        eagle: feats [B, T, H] (final normed state), fused with the next token's embedding."""
        if self.cfg.kind == "eagle3":
            return linear(feats, stacked_weight(self, ("fc",)))
        return linear(torch.cat([embeds, feats], dim=-1), stacked_weight(self, ("fc",)))

    def step_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden of a later step (the draft's own output) for EAGLE-1 goes through fc again."""
        if self.cfg.kind == "eagle3":
            return hidden
        return linear(torch.cat([embeds, hidden], dim=-1), stacked_weight(self, ("fc",)))

    def _attention_inputs(self, embeds, hidden, positions):
        """The layer, its residual [B, T, H] and its rotated q [B, Hq, T, D], k, v [B, Hkv, T, D]."""
        layer = self.layer
        x, residual = layer.attn_input(embeds, hidden)
        cos, sin = self.rotary(positions, x.dtype)
        return layer, residual, layer.self_attn.qkv(x, cos, sin)

    def forward_layer(self, embeds, hidden, positions, cache: DraftKV | None = None, mask=None):
        """embeds, hidden: [B, T, H]; positions [B, T]; cache: the draft's KV cache (the new keys are
        appended) or None (attend among these T only); mask [T, S + T] bool (None: causal / T == 1).
        Returns the output [B, T, H] (pre-norm; the next step's hidden)."""
        if cache is not None and mask is None:
            out = self._fused_layer(embeds, hidden, positions, [cache], [embeds.shape[1]])
            if out is not None:
                return out
        layer, residual, (q, k, v) = self._attention_inputs(embeds, hidden, positions)
        if cache is not None:
            k, v = cache.append(k, v)
        if mask is None and q.shape[2] > 1:
            S, T = k.shape[2], q.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        return layer.finish(residual, layer.self_attn.attend(q, k, v, mask))

    def forward_tree(self, embeds, hidden, positions, cache: DraftKV, tree: torch.Tensor) -> torch.Tensor:
        """forward_layer over a token tree's rows (EAGLE-2's draft blocks): each sees the cache and its
        ancestors, tree [T, T] bool (spec/tree.py's tree_mask: parents first). On the CPU in one C call
        (the rows read by root path, as a verify pass's), else the torch layer with the mask spelled out.
        Appends the rows' keys. -> [1, T, H]"""
        out = self._fused_layer(embeds, hidden, positions, [cache], [embeds.shape[1]], tree)
        if out is not None:
            return out
        return self.forward_layer(embeds, hidden, positions, cache, with_prefix(tree, cache.length))

    def _fused_layer(self, embeds, hidden, positions, caches: list[DraftKV], sizes: list[int],
                     tree: torch.Tensor | None = None) -> torch.Tensor | None:
        """forward_rows (one cache: forward_layer's causal pass) in one C call (kernels/layer.py's
        head_layer); None where it does not apply (not the CPU in fp32, over MAX_ROWS rows, positions past
        the rotary tables). Its attention is layer.c's, not torch's sdpa: the same up to summation order,
        and a row's result is the one it gets alone (tested)."""
        if embeds.device.type != "cpu":
            return None  # (a GPU's head: not even its description)
        desc = self._layer_description()
        if desc is None:
            return None
        attn_in, residual = self.layer.attn_input(embeds, hidden)
        out = head_layer(desc, residual, attn_in, caches, sizes, positions, self.rotary.cos, self.rotary.sin,
                         self.cfg.num_attention_heads, self.cfg.rms_norm_eps, tree)
        if out is not None:
            for cache, n in zip(caches, sizes):
                cache.length += n
        return out

    def _layer_description(self):
        """The layer's C description (describe_head_layer), kept while its stacked weights are the same
        objects (stacked_weight rebuilds them when a weight moves or changes) on the same kernels."""
        parts = self._layer_weights()
        norm = self.layer.post_attention_layernorm.weight
        kernels = tuple((getattr(p, "round_inputs", False), getattr(p, "tiles", None) is not None) for p in parts)
        key = (*map(id, parts), kernels, norm.data_ptr(), norm._version)
        kept = self.__dict__.get("_c_layer")
        if kept is None or kept[0] != key:  # (kept[1] holds the parts alive: their ids are not reused)
            kept = (key, parts, describe_head_layer(norm, *parts))
            self.__dict__["_c_layer"] = kept
        return kept[2]

    def draft_chains(self, g: torch.Tensor, caches: list[DraftKV], starts: list[int], ks: list[int],
                     embed: torch.nn.Module, draft_ids: torch.Tensor) -> list[list[int]] | None:
        """EAGLE-3 greedy chains in one C call (kernels/head.py's head_chains), the tokens a loop of
        logits / argmax / forward_rows gives: g [B, H] the rows' outputs where their chains start, caches
        (their lengths advanced here by the chain's rows), starts[b] the position of row b's first forward,
        ks[b] tokens, embed the target's embedding, draft_ids the target id of each draft id. None where
        it does not apply (then the caller's loop)."""
        descs = self._c_descriptions(embed, draft_ids) if g.device.type == "cpu" else None
        if descs is None:
            return None
        tokens = head_chains(descs[0], descs[2], g, caches, starts, ks, self.rotary.cos, self.rotary.sin,
                             self.cfg.num_attention_heads, self.cfg.rms_norm_eps)
        if tokens is not None:
            for cache, k in zip(caches, ks):
                cache.length += k - 1
        return tokens

    def draft_tree(self, g: torch.Tensor, cache: DraftKV, start: int, topk: int, depths: int, embed: torch.nn.Module,
                   draft_ids: torch.Tensor) -> tuple[list[int], list[int], list[float]] | None:
        """EAGLE-2's dynamic tree in one C call (kernels/head.py's head_tree): every node's target id, parent
        and cumulative log-probability in eagle_tree.dynamic_tree's order, from g [H] (the output at the
        committed rows of `cache`, whose rows past them the blocks overwrite), start the position of a depth-1
        node's forward. None where it does not apply (then dynamic_tree)."""
        descs = self._c_descriptions(embed, draft_ids) if g.device.type == "cpu" else None
        if descs is None:
            return None
        return head_tree(descs[0], descs[2], g, cache, start, topk, depths, self.rotary.cos, self.rotary.sin,
                         self.cfg.num_attention_heads, self.cfg.rms_norm_eps)

    def digest(self, feats: torch.Tensor, tokens: list[int], caches: list[DraftKV], sizes: list[int],
               positions: torch.Tensor, embed: torch.nn.Module, draft_ids: torch.Tensor) -> torch.Tensor | None:
        """EAGLE-3's forward_rows(embed(tokens), fuse(feats), positions, caches, sizes) in one C call
        (kernels/head.py's head_digest): feats [N, 3H], positions [N]; the caches' lengths advanced by
        their sizes. [N, H], or None where it does not apply (then the caller's torch calls)."""
        descs = self._c_descriptions(embed, draft_ids) if feats.device.type == "cpu" else None
        if descs is None:
            return None
        out = head_digest(descs[0], descs[1], descs[2], feats, tokens, caches, sizes, positions, self.rotary.cos,
                          self.rotary.sin, self.cfg.num_attention_heads, self.cfg.rms_norm_eps)
        if out is not None:
            for cache, n in zip(caches, sizes):
                cache.length += n
        return out

    def _c_descriptions(self, embed: torch.nn.Module, draft_ids: torch.Tensor) -> tuple | None:
        """(head chain, fc, layer) descriptions for head_chain.c and head_tree.c, or None where they do not apply
        (not an EAGLE-3 head; weights or a table layer.c cannot read)."""
        if self.cfg.kind != "eagle3":
            return None
        chain, layer = self._chain_description(embed, draft_ids), self._layer_description()
        return None if chain is None or layer is None else (*chain, layer)

    def _chain_description(self, embed: torch.nn.Module, draft_ids: torch.Tensor):
        """(describe_head_chain's description, fc's), kept while the weights they point at are the same; None
        where the C calls do not apply (an embedding table that is not fp32 or bf16, norms of other eps)."""
        table = getattr(embed, "weight", None)
        table = getattr(table, "qweight", table)  # a packed bf16 table's rows widen exactly (QEmbedding)
        lm_head, fc, layer = stacked_weight(self, ("lm_head",)), stacked_weight(self, ("fc",)), self.midlayer
        norms = (self.norm, layer.input_layernorm, layer.hidden_norm)
        key = (*((id(w), getattr(w, "tiles", None) is not None, getattr(w, "round_inputs", False)) for w in (lm_head, fc)),
               *((n.weight.data_ptr(), n.weight._version) for n in norms),
               None if table is None else (table.data_ptr(), table._version), draft_ids.data_ptr(), draft_ids._version)
        kept = self.__dict__.get("_c_chain")
        if kept is None or kept[0] != key:
            ok = (isinstance(table, torch.Tensor) and len({n.eps for n in norms}) == 1
                  and (isinstance(embed, torch.nn.Embedding) or hasattr(embed.weight, "qweight")))
            chain = describe_head_chain(self.norm.weight, lm_head, draft_ids, table, layer.input_layernorm.weight,
                                        layer.hidden_norm.weight, self.norm.eps) if ok else None
            fc_desc = describe_linear(fc)
            desc = None if chain is None or fc_desc is None else (chain, fc_desc)
            kept = (key, (lm_head, fc, table, draft_ids), desc)  # (holds what desc points at)
            self.__dict__["_c_chain"] = kept
        return kept[2]

    def _layer_weights(self) -> tuple:
        """The layer's four matrices as stacked_weight keeps them: q/k/v, o, gate/up, down."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        return (stacked_weight(attn, ("q_proj", "k_proj", "v_proj")), stacked_weight(attn, ("o_proj",)),
                stacked_weight(mlp, ("gate_proj", "up_proj")), stacked_weight(mlp, ("down_proj",)))

    def draft_weights(self) -> list:
        """The matrices the head drafts with: fc, the layer's four, eagle3's LM head."""
        weights = [stacked_weight(self, ("fc",)), *self._layer_weights()]
        return (weights + [stacked_weight(self, ("lm_head",))]) if self.cfg.kind == "eagle3" else weights

    @torch.inference_mode()
    def use_amx_tiles(self, on: bool = True) -> int:
        """Draft with bf16-rounded matmul inputs on AMX tiles (on, where the CPU has AMX: beside a target decoding
        on them, quant/bf16.py use_amx_tiles) or with exact fp32 inputs; how many matrices now run on tiles.
        A head saved in bf16 keeps its weights exactly; its inputs are rounded, which moves its drafts a little
        and verification none of the output. Measured at 4 sequences: methods.md session 35."""
        weights = [w for w in self.draft_weights() if isinstance(w, Bf16Weight)]
        packed = pack_tiles(weights, weights if on else [])
        for w in weights:  # tiles multiply rounded inputs; off them, the exact ones
            w.round_inputs = w in packed
        return len(packed)

    def forward_static(self, embeds, hidden, positions, cache: DraftKV, slots, mask):
        """forward_layer with no host-side shapes, for a CUDA graph: embeds, hidden [1, T, H]; positions
        [1, T]; the new k/v go to `slots` [T] (index_copy_); the queries attend over the cache's first S
        slots under mask [T, S]. cache.length is the caller's to advance. -> [1, T, H]"""
        layer, residual, (q, k, v) = self._attention_inputs(embeds, hidden, positions)
        cache.k.index_copy_(2, slots, k)
        cache.v.index_copy_(2, slots, v)
        S = mask.shape[-1]
        out = grouped_sdpa(q, cache.k[:, :, :S], cache.v[:, :, :S], mask)  # [1, Hq, T, D]
        return layer.finish(residual, layer.self_attn.project(out))

    def forward_rows(self, embeds, hidden, positions, caches: list[DraftKV], sizes: list[int]):
        """Several requests' new tokens in one pass (the serving engine's rows): embeds, hidden [1, N, H]
        with row i's sizes[i] tokens back to back, positions [1, N]. The linears run over all N at once,
        attention row by row over each row's own cache (causal among its new tokens); with the
        batch-invariant kernels every row's output is what forward_layer gives it alone. On the CPU the
        layer runs in C (_fused_layer) over groups of whole rows of at most MAX_ROWS tokens, and a row of
        more tokens goes alone through the torch layer, as forward_layer runs it: a row's output does
        not depend on the rows beside it. -> [1, N, H]"""
        if len(caches) > 1 and sum(sizes) > MAX_ROWS and embeds.device.type == "cpu":
            outs, start = [], 0
            for group in _row_groups(sizes, MAX_ROWS):
                n = sum(sizes[i] for i in group)
                rows = slice(start, start + n)
                outs.append(self.forward_rows(embeds[:, rows], hidden[:, rows], positions[:, rows],
                                              [caches[i] for i in group], [sizes[i] for i in group]))
                start += n
            return torch.cat(outs, dim=1)
        out = self._fused_layer(embeds, hidden, positions, caches, sizes)
        if out is not None:
            return out
        layer, residual, (q, k, v) = self._attention_inputs(embeds, hidden, positions)  # [1, Hq|Hkv, N, D]
        outs, start = [], 0
        for cache, n in zip(caches, sizes):
            rows = slice(start, start + n)
            kc, vc = cache.append(k[:, :, rows], v[:, :, rows])
            S = kc.shape[2]
            mask = None if n == 1 else torch.ones(n, S, dtype=torch.bool, device=q.device).tril(S - n)
            outs.append(sdpa(q[:, :, rows], kc, vc, mask, enable_gqa=True))
            start += n
        return layer.finish(residual, layer.self_attn.project(torch.cat(outs, dim=2)))

    def logits(self, out: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """[.., H] -> [.., Vd] draft-vocabulary logits (eagle: rows of the target LM head)."""
        if self.cfg.kind == "eagle3":
            return linear(self.norm(out), stacked_weight(self, ("lm_head",)))
        return linear(out, draft_rows(self, target_lm_head))
