"""Systems under test: one way to generate each (our plain decoding, each speculative method, the peers).

A system generates greedily from prompt token ids up to max_tokens (stopping at EOS) and returns the
new token ids with the wall time around the call; `new_repeat()` gives it a fresh drafter so nothing
learnt from a previous repeat's outputs (suffix caches, n-gram pools) leaks into the next.
"""
from __future__ import annotations

import time
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdec.config import SpeculativeConfig, split_method, with_hardware_defaults
from specdec.quant.bf16 import on_tiles
from specdec.sampling_params import SamplingParams

BASELINE = "specdec:plain"


@dataclass
class Generated:
    """One generation: new token ids and wall seconds (prefill included)."""

    token_ids: list[int]
    seconds: float
    prefill_seconds: float | None = None  # time to the first emitted token(s), measured inside this call
    target_passes: int | None = None  # target forwards after the prefill
    spec: dict | None = None  # specdec metrics: drafts, drafted/accepted tokens, per position, draft time
    first_tokens: int = 1  # tokens emitted at prefill_seconds (assisted generation may emit several at once)


class System:
    """A way to generate. Subclasses set the descriptive fields and implement generate()."""

    name = ""  # unique, e.g. "specdec:ngram", "transformers:greedy", "llama.cpp:plain-f32"
    family = ""  # "specdec" | "transformers" | "llama.cpp"
    method = ""  # "plain", "ngram", "prompt_lookup", ...
    precision = ""  # "float32", "bfloat16", "Q4_1", ...
    config: dict = {}
    note = ""

    def setup(self) -> None:
        """Load what the system needs (timed separately, outside the measurements)."""

    def new_repeat(self) -> None:
        """Forget anything learnt from earlier requests (a fresh drafter)."""

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generated:
        raise NotImplementedError

    def close(self) -> None:
        """Free the system's memory."""

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "method": self.method, "precision": self.precision,
                "config": self.config, "note": self.note}


class SpecdecSystem(System):
    """Our decoder on a shared target model; method None is plain decoding."""

    family = "specdec"

    def __init__(self, target, tokenizer, target_dir: Path, method: str | None = None, spec: dict | None = None,
                 load_aux: Callable | None = None, label: str | None = None, temperature: float = 0.0,
                 repetition_penalty: float = 1.0):
        self.target, self.tokenizer, self.target_dir = target, tokenizer, target_dir
        self.temperature = temperature  # > 0: sampled, with a seed per prompt (the same for every system)
        self.repetition_penalty = repetition_penalty
        self.method = method or "plain"  # "qdraft+ngram": a model drafter with a lookup (config key `lookup`)
        self.name = f"specdec:{label or self.method}"
        from specdec.quant.qmodel import describe
        body = describe(target)  # "float32", or how the weights are stored: "bf16", "int8-g128 (lm_head ...)"
        self.precision = body if body == str(target.dtype).replace("torch.", "") else f"{body} weights, fp32 sums"
        base, lookup = split_method(self.method)
        self.config = dict(spec or {}, method=base, **({"lookup": lookup} if lookup else {})) if method else {}
        if self.config:  # the draft shape LLM would give this config on this target (config.with_hardware_defaults)
            self.config = with_hardware_defaults(self.config, on_tiles(target))
        self.load_aux = load_aux
        self.decoder = None
        self.cost = None

    def _spec_config(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.config) if self.config else None

    def setup(self) -> None:
        self.new_repeat()

    def new_repeat(self) -> None:
        from specdec.spec.adaptive import CostModel
        from specdec.spec.decoder import SpeculativeDecoder
        from specdec.spec.proposer import ProposerContext, make_proposer

        cfg = self._spec_config()
        proposer = None
        if cfg is not None:
            ctx = ProposerContext(self.target, self.tokenizer, cfg, self.target_dir, self.target.dtype,
                                  self.target.max_len, self.load_aux)
            proposer = make_proposer(ctx)
        if self.cost is None:  # the target's cost profile is kept across repeats (it is the machine's)
            self.cost = CostModel((cfg.k_max if cfg else 0) + 1)
        self.decoder = SpeculativeDecoder(self.target, self.tokenizer, proposer, cfg, cost_model=self.cost)

    def generate(self, prompt_ids: list[int], max_tokens: int, greedy: bool = False) -> Generated:
        """One generation at this system's temperature and repetition penalty (greedy: at 0 and without
        a penalty, e.g. for a prompt's own turns)."""
        t = 0.0 if greedy else self.temperature
        seed = zlib.crc32(array("q", prompt_ids).tobytes()) if t > 0 else None
        params = SamplingParams(temperature=t, max_tokens=max_tokens, seed=seed,
                                repetition_penalty=1.0 if greedy else self.repetition_penalty)
        t0 = time.perf_counter()
        r = self.decoder.generate(prompt_ids, params)
        seconds = time.perf_counter() - t0
        m = r.metrics
        spec = {"num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
                "num_accepted_tokens": m.num_accepted_tokens, "drafted_per_pos": list(m.drafted_per_pos),
                "accepted_per_pos": list(m.accepted_per_pos), "draft_seconds": m.draft_time,
                "by_match_length": {str(n): list(row) for n, row in m.by_match_length.items()}}
        return Generated(list(r.token_ids), seconds, r.prefill_time, m.target_passes, spec)

    def close(self) -> None:
        self.decoder = None
