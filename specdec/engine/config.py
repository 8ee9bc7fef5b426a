"""The serving engine's settings (EngineConfig): batch and KV sizes, prefix caching, and the speculative
methods a request may pick."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import ConfigError, check_method_name, check_minimums, split_method


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_memory_gb, capped at what max_num_seqs can use
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    profile_cost: bool = True  # measure c(N) at start (else learnt online only)
    # the speculative methods a request may pick besides the default and "off" ('qdraft+ngram' names a
    # pairing), built with the engine: a request never builds one (a layer search, a draft model's load
    # would stall every running stream) nor grows memory, and their KV bytes are in the blocks' size
    request_methods: tuple[str, ...] = ("ngram", "suffix")

    def __post_init__(self):
        check_minimums(self, {"max_num_seqs": 1, "max_num_batched_tokens": 1, "block_size": 1, "num_kv_blocks": 1})
        methods = self.request_methods
        if not isinstance(methods, (tuple, list)) or not all(isinstance(m, str) for m in methods):
            raise ConfigError(f"request_methods must be a tuple of method names, got {methods!r}")
        for method in methods:
            check_method_name(method)
        # one spelling per method, the proposer's name ('qdraft+ngram'; 'ngram+' is 'ngram'), each once
        names = ("+".join(filter(None, split_method(m))) for m in methods)
        object.__setattr__(self, "request_methods", tuple(dict.fromkeys(names)))
        if not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
