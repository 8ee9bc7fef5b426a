"""Configuration: the speculative-decoding config, and what every config shares (ConfigError, JSON files,
minimums). The model's architecture is specdec/model/config.py's ModelConfig.

A frozen dataclass validated at construction; unknown keys in a user-supplied speculative config are an
error (as in vLLM), so a typo never silently turns speculation off.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A configuration the user gave cannot be used (one clear line, no traceback in the CLI)."""


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object (a config.json, a tokenizer_config.json), or a ConfigError
    naming it."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return value


def check_minimums(config, minimums: dict[str, float]) -> None:
    """A ConfigError naming the first of config's fields below its minimum (a None value is unset: allowed)."""
    for name, least in minimums.items():
        value = getattr(config, name)
        if value is not None and not value >= least:  # (NaN fails too)
            raise ConfigError(f"{name} must be >= {least}, got {value}")


SPEC_METHODS = ("draft_model", "ngram", "suffix", "layerskip", "lookahead", "medusa", "eagle", "eagle3", "qdraft", "recycle")
LEARNED_TREE_METHODS = ("medusa", "eagle", "eagle3")  # learned heads; `model` = the head dir (default: shipped)
LOOKUP_METHODS = ("ngram", "suffix")  # free drafters a model drafter can be paired with (`lookup`)
# speculative_config keys that only some methods read (a predicate on the config): given to another
# method, such a key is an error, as an unknown one is, since it would change nothing
_METHOD_KEYS = {
    "skip_layers": lambda c: c.method == "layerskip",
    "lookahead_window": lambda c: c.method == "lookahead",
    "lookahead_ngram": lambda c: c.method == "lookahead",
    "lookahead_guess_set": lambda c: c.method == "lookahead",
    "suffix_decoding_max_tree_depth": lambda c: "suffix" in (c.method, c.lookup),
    "suffix_decoding_max_cached_requests": lambda c: "suffix" in (c.method, c.lookup),
    "suffix_decoding_max_spec_factor": lambda c: "suffix" in (c.method, c.lookup),
    "suffix_decoding_min_token_prob": lambda c: "suffix" in (c.method, c.lookup),
    "num_steps": lambda c: c.method in ("eagle", "eagle3"),
    "eagle_topk": lambda c: c.method in ("eagle", "eagle3"),
    "num_draft_tokens": lambda c: c.method in LEARNED_TREE_METHODS,
    "extra": lambda c: c.method in ("draft_model", "qdraft"),
    "prompt_lookup_min": lambda c: "ngram" in (c.method, c.lookup),
    "prompt_lookup_max": lambda c: "ngram" in (c.method, c.lookup),
    "lookup_min_match": lambda c: c.lookup is not None,
    "max_speculative_tokens": lambda c: c.num_speculative_tokens is None and c.method not in LEARNED_TREE_METHODS,
    # the model drafters whose chains stop at a token drafted below it (not an EAGLE tree's, nor a draft
    # of another tokenizer)
    "draft_confidence_threshold": lambda c: (c.method in ("draft_model", "qdraft", "layerskip")
                                             or c.method in ("eagle", "eagle3") and c.eagle_topk == 1)
                                            and not c.extra.get("universal_tokenizer"),
}


def split_method(name: str) -> tuple[str, str | None]:
    """'qdraft+ngram' -> ('qdraft', 'ngram'): a model drafter with a lookup (the bench's and the
    server's per-request name for {"method": "qdraft", "lookup": "ngram"}); 'ngram' -> ('ngram', None)."""
    method, _, lookup = name.partition("+")
    return method, lookup or None


def check_method_name(name: str) -> None:
    """A ConfigError unless `name` is a speculative method or a model drafter + lookup ('qdraft+ngram'), as the
    bench and eval-draft take method names."""
    method, lookup = split_method(name)
    if method not in SPEC_METHODS:
        raise ConfigError(f"unknown speculative method {method!r} in {name!r}; choose one of {', '.join(SPEC_METHODS)}")
    if lookup is not None and (lookup not in LOOKUP_METHODS or method in LOOKUP_METHODS + ("lookahead",)):
        raise ConfigError(f"{name!r}: a model drafter pairs with a lookup ({', '.join(LOOKUP_METHODS)}), "
                          f"as in qdraft+ngram")


# --kv-cache-dtype's choices (LLM(kv_cache_dtype=...)): "auto" is the model's own dtype; specdec.cache.kv_cache
# turns a name into the caches' torch dtype
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


# The EAGLE-3 draft shape where the target's passes run on AMX tiles and a config names no shape (nor a
# fixed k): an EAGLE-2 tree, the 3 best nodes of a depth expanded, 3 deep, 9 tokens verified. On the tiles a
# 10-row verify costs ~1.1 single-token passes. Same process, 32 bench prompts, bf16, session 40: eagle3 1.39x
# -> 1.43x, eagle3+ngram 1.47x -> 1.63x over plain decoding. Elsewhere a chain, as SGLang's default: in fp32 a
# 10-row pass costs ~1.4x (eagle3 1.27x either way; with the lookup 1.39x -> 1.44x), and on a GPU trees lost.
AMX_EAGLE3_TREE = {"eagle_topk": 3, "num_steps": 3, "num_draft_tokens": 9}
HEAD_SHAPE_KEYS = tuple(AMX_EAGLE3_TREE)  # a learned head's step; without them num_speculative_tokens shapes it


def with_hardware_defaults(config, amx: bool):
    """config (as given: a dict, a SpeculativeConfig or None) with the draft shape the hardware favours where
    it leaves that open: AMX_EAGLE3_TREE for an eagle3 dict without num_steps, eagle_topk, num_draft_tokens
    or num_speculative_tokens when `amx` (the target's passes on AMX tiles); else config itself."""
    if (not amx or not isinstance(config, dict) or config.get("method") != "eagle3"
            or any(k in config for k in (*HEAD_SHAPE_KEYS, "num_speculative_tokens"))):
        return config
    return {**config, **AMX_EAGLE3_TREE}


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with. Keys follow vLLM's `--speculative-config`.

    num_speculative_tokens: k, drafted tokens per target pass. None means adaptive (per request,
    from observed acceptance and the measured cost model); a number fixes k. Given alone to a learned head
    (from_dict, which every entry point reads configs through), it also shapes the head's step, as vLLM's:
    an EAGLE chain of k (num_steps), a Medusa tree of k nodes (num_draft_tokens - 1).
    """

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True
    max_speculative_tokens: int = 8
    draft_confidence_threshold: float = 0.0
    # layerskip
    skip_layers: tuple[int, ...] | None = None
    # lookahead (Fu et al. 2024): window W, n-gram size N, guess-set size G
    lookahead_window: int = 5
    lookahead_ngram: int = 3
    lookahead_guess_set: int = 5
    # suffix decoding (names as vLLM's suffix_decoding_*)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # learned heads (names as SGLang's --speculative-num-steps / -eagle-topk / -num-draft-tokens):
    # tree depth, children per expanded node, tokens verified per step counting the root (topk 1: a chain)
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int | None = None
    # a lookup drafter ("ngram" | "suffix") tried first at every step; the method's model drafter
    # drafts when the lookup matches fewer than lookup_min_match context tokens (proposers/hybrid.py)
    lookup: str | None = None
    lookup_min_match: int = 2
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; choose one of {', '.join(SPEC_METHODS)}")
        k = self.num_speculative_tokens
        if k is not None and not (1 <= k <= 64):
            raise ConfigError(f"num_speculative_tokens must be in [1, 64], got {k}")
        if not (1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64):
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("method 'draft_model' needs 'model' (the draft model's path or alias)")
        if not (0.0 <= self.draft_confidence_threshold < 1.0):
            raise ConfigError("draft_confidence_threshold must be in [0, 1)")
        if not (1 <= self.max_speculative_tokens <= 64):
            raise ConfigError(f"max_speculative_tokens must be in [1, 64], got {self.max_speculative_tokens}")
        self._check_method_keys()
        self._check_suffix()
        if self.method in LEARNED_TREE_METHODS:
            self._check_tree()
        if self.lookup is not None and self.lookup not in LOOKUP_METHODS:
            raise ConfigError(f"lookup must be one of {', '.join(LOOKUP_METHODS)}, got {self.lookup!r}")
        if self.lookup is not None and self.method in LOOKUP_METHODS + ("lookahead",):
            raise ConfigError(f"'lookup' pairs a lookup with a model drafter; method {self.method!r} is a lookup itself")
        if not (1 <= self.lookup_min_match <= 64):
            raise ConfigError(f"lookup_min_match must be in [1, 64], got {self.lookup_min_match}")

    def _check_method_keys(self) -> None:
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(self) if f.name in _METHOD_KEYS}
        ignored = [name for name, reads in _METHOD_KEYS.items()
                   if getattr(self, name) != defaults[name] and not reads(self)]
        if ignored:
            raise ConfigError(f"method {self.method!r}{f' with lookup {self.lookup!r}' if self.lookup else ''} does "
                              f"not read {', '.join(ignored)}")

    def _check_suffix(self) -> None:
        if not (1 <= self.suffix_decoding_max_tree_depth <= 1024 and self.suffix_decoding_max_cached_requests >= 0):
            raise ConfigError("need 1 <= suffix_decoding_max_tree_depth <= 1024 and "
                              "suffix_decoding_max_cached_requests >= 0")
        factor, min_prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not (0.0 < factor <= 64.0 and 0.0 <= min_prob <= 1.0):
            raise ConfigError("need 0 < suffix_decoding_max_spec_factor <= 64 and "
                              "0 <= suffix_decoding_min_token_prob <= 1")

    def _check_tree(self) -> None:
        if not (1 <= self.num_steps <= 16 and 1 <= self.eagle_topk <= 16):
            raise ConfigError("need 1 <= num_steps <= 16 and 1 <= eagle_topk <= 16")
        n = self.num_draft_tokens
        if n is None:  # SGLang's rule for chains; a small tree otherwise
            n = self.num_steps + 1 if self.eagle_topk == 1 else min(2 * self.num_steps + 2, 64)
            object.__setattr__(self, "num_draft_tokens", n)
        if not (2 <= n <= 65):
            raise ConfigError(f"num_draft_tokens must be in [2, 65], got {n}")
        if self.num_speculative_tokens is not None:
            self.check_step_k(self.num_speculative_tokens)

    def check_step_k(self, k: int) -> None:
        """A ConfigError for a fixed k (the config's, or a request's) above what this learned head drafts a
        step (it was cut silently), unless a lookup is paired (its chains draft up to k)."""
        if self.lookup is None and self.step_limit is not None and k > self.step_limit:
            n = self.num_draft_tokens
            shape = (f"num_draft_tokens {n}" if self.method == "medusa" else
                     f"num_steps {self.num_steps}, eagle_topk {self.eagle_topk}, num_draft_tokens {n}")
            raise ConfigError(f"{self.method} drafts at most {self.step_limit} tokens a step with {shape}; "
                              f"num_speculative_tokens {k} asks for more")

    @property
    def fixed_k(self) -> bool:
        return self.num_speculative_tokens is not None

    @property
    def step_limit(self) -> int | None:
        """The most tokens a learned head drafts a step (None: no such limit): a chain's num_steps (within
        its num_draft_tokens), a tree's num_draft_tokens - 1 nodes besides the root."""
        if self.method not in LEARNED_TREE_METHODS:
            return None
        nodes = self.num_draft_tokens - 1
        return min(self.num_steps, nodes) if self.method != "medusa" and self.eagle_topk == 1 else nodes

    @property
    def k_max(self) -> int:
        """The most tokens a step drafts: k when fixed; else a learned tree's budget (num_draft_tokens
        counts the root), else max_speculative_tokens. Adaptive k chooses in 0..k_max."""
        if self.num_speculative_tokens:
            return self.num_speculative_tokens
        if self.method in LEARNED_TREE_METHODS:
            return self.step_limit
        return self.max_speculative_tokens

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown speculative_config key(s): {', '.join(unknown)}")
        d = dict(d)
        if "method" not in d:
            raise ConfigError("speculative_config needs 'method'")
        for f in dataclasses.fields(cls):
            if f.name in d:
                check_type("speculative_config", f.name, f.type, d[f.name])
        if d.get("skip_layers") is not None:
            d["skip_layers"] = tuple(d["skip_layers"])
        k = d.get("num_speculative_tokens")
        if isinstance(k, int) and not any(key in d for key in HEAD_SHAPE_KEYS):
            if d["method"] in ("eagle", "eagle3") and not 1 <= k <= 16:
                raise ConfigError(f"num_speculative_tokens must be in [1, 16] for {d['method']} (its chain's "
                                  f"length, num_steps), got {k}")
            if d["method"] in ("eagle", "eagle3"):
                d["num_steps"] = k  # vLLM's meaning for EAGLE: a chain of k (the head's passes a step)
            elif d["method"] == "medusa":
                d["num_draft_tokens"] = k + 1  # a static tree of k nodes besides the root
        return cls(**d)


# a field's annotation -> the values it takes (bool is not a number here, though Python's int holds it)
_VALUE_TYPES = {"str": (str, "a string", "strings"), "int": (int, "an integer", "integers"),
                "float": ((int, float), "a number", "numbers"), "bool": (bool, "true or false", "booleans"),
                "dict": (dict, "an object", "objects")}


def _fits(value, base: str) -> bool:
    return isinstance(value, _VALUE_TYPES[base][0]) and (base == "bool" or not isinstance(value, bool))


def check_type(owner: str, name: str, annotation: str, value) -> None:
    """A ConfigError unless `value` fits a dataclass field's annotation ('int', 'int | None', 'tuple[int, ...]',
    ...): a config's {"num_speculative_tokens": "3"} is one clear line, not a TypeError in a comparison or a
    wrong value taken silently. Annotations of nested tuples are left to their owner."""
    base, _, rest = annotation.partition(" | ")
    if value is None and rest == "None":
        return
    if base.startswith("tuple[tuple"):
        return
    if base.startswith("tuple["):
        item = base[len("tuple["):].split(",")[0]
        ok = isinstance(value, (list, tuple)) and all(_fits(v, item) for v in value)
        what = f"a list of {_VALUE_TYPES[item][2]}"
    else:
        ok, what = _fits(value, base), _VALUE_TYPES[base][1]
    if not ok:
        raise ConfigError(f"{owner} {name!r} must be {what}{' or null' if rest == 'None' else ''}, got {value!r}")
