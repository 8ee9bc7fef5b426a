"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) in one file.

forward(input_ids [B, T], positions [B, T], cache, block_mask [T, T] | None) scores a block of
T new tokens after the cached prefix in one pass: T = 1 for plain decoding, k + 1 for a drafted
chain, the node count for a token tree (block_mask = the tree's ancestor mask). It can run a
subset of layers (self-speculation) and return the hidden states of chosen layers (EAGLE-3).
q/k/v and gate/up projections are fused into one matmul each to cut per-op overhead.
A serving batch (BatchKV) is left-padded to [B, T]; where layer.c runs it, only its real tokens go
through the linears and the LM head (`packed`), so ragged drafts do not pay for their padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.cache.kv_cache import KVCache, kv_dtype
from specdec.model.config import ModelConfig
from specdec.kernels import TILE_CALL_ROWS, linear, silu_mul
from specdec.kernels.attention import FusedAttention, fused_attention
from specdec.kernels.layer import decoder_layer, decoder_layers, packs, unpack
from specdec.model.layers import RMSNorm, Rotary, apply_rotary, grouped_sdpa, rounded_linear, sdpa
from specdec.model.row_attention import RowAttention
from specdec.quant.bf16 import on_tiles


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T_logits, V] (T_logits = num_logits or T)
    hidden: torch.Tensor  # [B, T, H] final normed hidden state
    layer_hidden: dict[int, torch.Tensor] | None = None  # layer index -> [B, T, H] (output of that layer)
    packed: bool = False  # a padded paged batch whose linears ran on the real tokens alone (layer.c)
    row_argmax: list[int] | None = None  # each logits row's argmax, already on the host (a CUDA graph's pass)


def prompt_pass(model, ids: torch.Tensor, start: int, cache, output_layers: Sequence[int] = (),
                rows_per_pass: int | None = None) -> ForwardOutput:
    """A prompt's tokens ids [1, N] at positions start.. through model(..., prefill=True), the last one's
    logits, in passes of rows_per_pass tokens (None: one pass) whose hidden states are put back together.
    A prompt's pass does not depend on its cuts (tests/test_prompt_pass.py), so every row is the one-pass
    row; what changes is which kernels fit: on AMX tiles layer.c takes passes of up to TILE_CALL_ROWS whole
    (specdec/kernels/layer.py), 6-10% less time than one per-op pass over 450-870 tokens (session 41)."""
    N = ids.shape[1]
    step = rows_per_pass or N
    outs = [model(ids[:, s:s + step], torch.arange(start + s, start + min(N, s + step), device=ids.device)[None],
                  cache, num_logits=1, output_layers=output_layers, prefill=True) for s in range(0, N, step)]
    if len(outs) == 1:
        return outs[0]
    kept = None if outs[0].layer_hidden is None else {
        layer: torch.cat([o.layer_hidden[layer] for o in outs], dim=1) for layer in outs[0].layer_hidden}
    return ForwardOutput(outs[-1].logits, torch.cat([o.hidden for o in outs], dim=1), kept)


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv = torch.nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = torch.nn.Linear(q, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.split = (q, kv, kv)

    def forward(self, x, cos, sin, cache: KVCache, layer_idx: int, mask, fused: FusedAttention | None = None,
                matmul_dtype: torch.dtype | None = None):
        # x: [B, T, H]; matmul_dtype: the dtype of the four matmuls' inputs and outputs (None: x's)
        if fused is not None and matmul_dtype is None:  # the whole layer in one C call where it applies
            out = decoder_layer(self, x, fused, layer_idx)
            if out is not None:
                return out
        if fused is not None:  # one C call: rotary, cache write, attention
            return self.block(x, lambda qkv: fused(qkv, layer_idx, self.n_heads, self.n_kv, self.head_dim),
                              matmul_dtype)
        return self.block(x, lambda qkv: self.attention(qkv, cos, sin, cache, layer_idx, mask), matmul_dtype)

    def forward_static(self, x, cos, sin, cache: KVCache, layer_idx: int, slots, mask):
        """forward() through attention_static: no host-side shapes (LlamaModel.forward_static)."""
        return self.block(x, lambda qkv: self.attention_static(qkv, cos, sin, cache, layer_idx, slots, mask))

    def block(self, x, attend, matmul_dtype: torch.dtype | None = None):
        """The layer around its attention: attend(qkv [B, T, (Hq + 2 Hkv) D]) -> [B, T, Hq D]."""
        dt = matmul_dtype
        qkv = rounded_linear(self.input_norm(x), self.qkv.weight, self.qkv.bias, dt)  # [B, T, (Hq + 2 Hkv) D]
        x = x + rounded_linear(attend(qkv), self.o_proj.weight, None, dt)
        gate_up = rounded_linear(self.post_norm(x), self.gate_up.weight, None, dt)  # [B, T, 2 I]
        return x + rounded_linear(silu_mul(gate_up), self.down.weight, None, dt)

    def heads(self, qkv, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, (Hq + 2 Hkv) D] -> q [B, Hq, T, D], k, v [B, Hkv, T, D]; q/k-normed (Qwen3), rotated."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attention(self, qkv, cos, sin, cache: KVCache, layer_idx: int, mask) -> torch.Tensor:
        # cache.write stores this block's k/v and returns the visible keys/values
        B, T, _ = qkv.shape
        q, k, v = self.heads(qkv, cos, sin)
        k_all, v_all = cache.write(layer_idx, k, v)  # [B, Hkv, past+T, D]
        if isinstance(mask, RowAttention):  # row by row, each as a single-token pass (row_attention.py)
            attn = mask.attend(q, k_all, v_all)
        else:  # mask None: one token (sees everything), or a prompt into an empty cache (causal, T == S)
            attn = sdpa(q, k_all, v_all, mask, is_causal=mask is None and T > 1, enable_gqa=True)
        return attn.transpose(1, 2).reshape(B, T, -1)

    def attention_static(self, qkv, cos, sin, cache: KVCache, layer_idx: int, slots, mask) -> torch.Tensor:
        """attention() with no host-side shapes (a CUDA graph's): k/v go to `slots` [T] by index_copy_ and
        every query attends over the cache's first S slots under `mask` [T, S], S = mask's width."""
        B, T, _ = qkv.shape
        S = mask.shape[-1]
        q, k, v = self.heads(qkv, cos, sin)
        cache.k[layer_idx].index_copy_(2, slots, k.to(cache.k.dtype))
        cache.v[layer_idx].index_copy_(2, slots, v.to(cache.v.dtype))
        k_all, v_all = cache.k[layer_idx, :, :, :S].to(q.dtype), cache.v[layer_idx, :, :, :S].to(q.dtype)
        attn = grouped_sdpa(q, k_all, v_all, mask)  # [B, H, T, D]
        return attn.transpose(1, 2).reshape(B, T, -1)


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        super().__init__()
        self.config = cfg
        self.max_len = max_len or cfg.max_position_embeddings
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, self.max_len)
        # the matmuls' dtype in a prompt's pass (forward(prefill=True)); None: as every other pass.
        # The loader sets bfloat16 for bf16 weights on a CPU with native bf16 dot products (quant/bf16.py)
        self.prefill_matmul_dtype: torch.dtype | None = None
        # what caches store keys/values in (LLM(kv_cache_dtype=...)); None: the model's dtype
        self.kv_cache_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, max_len: int | None = None, batch_size: int = 1) -> KVCache:
        return KVCache.for_model(self.config, min(max_len or self.max_len, self.max_len), kv_dtype(self),
                                 batch_size, self.device)

    def prompt_rows_per_pass(self) -> int | None:
        """How many of a prompt's tokens a pass should take (prompt_pass): TILE_CALL_ROWS where the matmuls
        are on AMX tiles (layer.c then runs each pass whole), else None (the whole prompt in one)."""
        return TILE_CALL_ROWS if on_tiles(self) and not self.config.qk_norm else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                block_mask: torch.Tensor | None = None, num_logits: int | None = None,
                layers: Sequence[int] | None = None, output_layers: Sequence[int] = (),
                input_embeds: torch.Tensor | None = None, prefill: bool = False) -> ForwardOutput:
        """input_ids, positions: [B, T]; num_logits: compute logits for the last n positions only;
        layers: run only these layer indices (self-speculation; they share this cache);
        prefill: a prompt's tokens (compute-bound), whose layer matmuls run in prefill_matmul_dtype."""
        x = self.embed(input_ids) if input_embeds is None else input_embeds  # [B, T, H]
        T = x.shape[1]
        matmul_dtype = self.prefill_matmul_dtype if prefill else None
        fused = None if self.config.qk_norm else fused_attention(self.rotary, positions, block_mask, cache, x,
                                                                  self.config.num_attention_heads)
        if fused is None:
            cos, sin = self.rotary(positions, x.dtype)
            # a prompt into an empty cache is plain causal: None lets SDPA skip the masked half
            prompt = type(cache) is KVCache and cache.length == 0 and block_mask is None
            mask = None if prompt else cache.attention_mask(block_mask, T)  # paged caches make their own
            rows = RowAttention.build(mask, positions, cache, prefill)  # decode / verify: row by row
            mask = mask if rows is None else rows
        else:
            cos = sin = mask = None
        layer_ids = list(range(len(self.layers)) if layers is None else layers)
        # every layer in one C call where layer.c applies to all of them (keeping the requested hidden
        # states in the same call), else one by one
        stacked = None
        if fused is not None and matmul_dtype is None:
            stacked = decoder_layers(self.layers, layer_ids, x, fused, output_layers, pack=True)
        if stacked is not None:
            x, kept = stacked
        else:
            kept = {}
            for i in layer_ids:
                x = self.layers[i](x, cos, sin, cache, i, mask, fused, matmul_dtype)
                if i in output_layers:
                    kept[i] = x
        kept = kept if output_layers else None
        cache.advance(T)
        h = self.norm(x)
        packed = stacked is not None and packs(fused)
        if num_logits is None and packed:  # the padding's logits are not computed (zeros)
            B, _, H = h.shape
            rows = linear(h.reshape(B * T, H)[fused.real_index], self.lm_head.weight)  # [N, V]
            return ForwardOutput(unpack(rows, fused.real_index, B, T), h, kept, packed)
        h_logits = h if num_logits is None else h[:, -num_logits:]
        return ForwardOutput(self.logits_of(h_logits), h, kept, packed)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [..., H] -> logits [..., V] (the LM head)."""
        return linear(h, self.lm_head.weight)

    def forward_static(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       start: torch.Tensor, block_mask: torch.Tensor, cache: KVCache, num_keys: int,
                       output_layers: Sequence[int] = (), key_valid: torch.Tensor | None = None,
                       last_logits: bool = False) -> ForwardOutput:
        """forward() as pure tensor work, for capture in a CUDA graph (model/cuda_graph.py): no host-side
        value decides a shape. input_ids, positions [B, T]; slots [T] the cache slots written (start + i);
        start [] the first of them; block_mask [T, T] bool, the new tokens' mask among themselves. Each
        token sees the slots before start, and block_mask's among [start, start + T); attention spans the
        cache's first num_keys slots. key_valid [B, >= num_keys] bool: a left-padded batch's keys per row
        (each token still sees itself). last_logits: the last position's logits only. cache.length is NOT
        advanced (the caller's job after a replay)."""
        x = self.embed(input_ids)  # [B, T, H]
        T = x.shape[1]
        cos, sin = self.rotary(positions, x.dtype)
        keys = torch.arange(num_keys, device=x.device)
        rel = keys - start  # [S]: key slot relative to the block
        in_block = (rel >= 0) & (rel < T)
        mask = (rel < 0)[None, :] | (in_block[None, :] & block_mask[:, rel.clamp(0, T - 1)])  # [T, S]
        if key_valid is not None:
            mask = (mask[None] & key_valid[:, None, :num_keys]) | (slots[:, None] == keys[None, :])[None]  # [B, T, S]
        kept = {}
        for i, layer in enumerate(self.layers):
            x = layer.forward_static(x, cos, sin, cache, i, slots, mask)
            if i in output_layers:
                kept[i] = x
        h = self.norm(x)
        return ForwardOutput(linear(h[:, -1:] if last_logits else h, self.lm_head.weight), h,
                             kept if output_layers else None)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)
