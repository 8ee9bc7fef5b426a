"""The offline path's prefix cache: the previous request's static KV cache, reused by the next request
that shares a prefix with it (a chat's next turn, another question on the same document, the n samples
of one prompt), so only the rest of its prompt is prefilled. One cache is kept: the single-request
decoder runs one request at a time. (The serving engine has its own, by chained block hashes.)

Exact by construction, not by luck: it serves only a model whose prompt pass does not depend on how
the prompt was cut (our kernels at any row count; tests/test_prompt_pass.py), so a kept prefix holds
bitwise the keys and values a cold pass would compute. Which rows qualify (`reuse_level`):
  "all"     fp32 weights: decode and verify passes run the same kernels, so a decoded token's row equals
            its prompt-pass row and a conversation's earlier answer is reused too; so do bf16 weights whose
            prompt passes run the decode passes' kernels (AMX tiles: quant/bf16.py use_amx_tiles);
  "prompt"  bf16 weights on a CPU with bf16 dot products: a prompt's pass rounds its matmuls (oneDNN)
            and decode passes do not, so only rows written by prompt passes are kept. Not on a CPU with
            AMX without the tiles: oneDNN's bf16 GEMM there sums a row one way at 1-32 rows and another at
            more (2 threads), so a prompt cut in two differs (quant/bf16.py onednn_prompt_rows_invariant).
  None      anything else (q/k-norm models, quantized weights, GPUs, no compiled kernels): never reused.
A token tree's accepted path is kept like a chain's: its rows read their root paths' keys by position
(attention.c), so each equals the single-token pass at its position (tests/test_tree_rows.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.cache.kv_cache import KVCache

MIN_REUSE = 16  # a shorter shared prefix (a chat template's opening) is prefilled afresh


def reuse_level(model) -> str | None:
    """Which kept rows equal a cold prompt pass's for this model: "all", "prompt" or None (see above)."""
    from specdec.kernels import _load
    from specdec.model.llama import LlamaModel
    from specdec.quant.bf16 import Bf16Weight, onednn_prompt_rows_invariant
    if (type(model) is not LlamaModel or model.device.type != "cpu" or model.config.qk_norm
            or model.dtype is not torch.float32 or _load() is None):
        return None
    weight = model.layers[0].qkv.weight
    if isinstance(weight, torch.Tensor) and weight.dtype is torch.float32 and model.prefill_matmul_dtype is None:
        return "all"
    if isinstance(weight, Bf16Weight) and weight.round_inputs:
        if model.prefill_matmul_dtype is None:  # prompt passes on the decode passes' kernels (AMX tiles)
            return "all"
        if model.prefill_matmul_dtype is torch.bfloat16:
            return "prompt" if onednn_prompt_rows_invariant() else None
    return None


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (also the universal drafter's and the quantization report's)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Kept:
    tokens: list[int]  # cache rows [0, len(tokens)) hold these tokens' keys/values, as a cold prompt pass would
    cache: KVCache


class KeptPrefix:
    def __init__(self, model):
        self.model = model
        self.level = reuse_level(model)
        self._kept: _Kept | None = None

    def take(self, prompt_ids: list[int], capacity: int) -> tuple[KVCache | None, int]:
        """A cache of at least `capacity` positions holding the longest kept prefix of prompt_ids (at most
        all but its last token, whose logits the prompt pass must compute) and that prefix's length;
        (None, 0) when nothing is reused. The kept cache is handed over: it serves one request at a time."""
        kept, self._kept = self._kept, None
        if kept is None:
            return None, 0
        n = common_prefix(kept.tokens, prompt_ids[:-1])
        if n < MIN_REUSE:
            return None, 0
        cache = kept.cache
        if cache.max_len < capacity:  # the new request needs more room: move the prefix over
            bigger = self.model.new_cache(capacity)
            bigger.k[:, :, :, :n].copy_(cache.k[:, :, :, :n])
            bigger.v[:, :, :, :n].copy_(cache.v[:, :, :, :n])
            bigger.length, cache = n, bigger
        cache.rollback(n)
        return cache, n

    def keep(self, cache: KVCache, token_ids: list[int], prompt_len: int) -> None:
        """After a request finished: keep its cache for the next one (token_ids: its prompt + output)."""
        if self.level is None:
            return
        n = cache.length if self.level == "all" else min(prompt_len, cache.length)
        self._kept = _Kept(list(token_ids[:n]), cache)
