"""LLM: the offline API, named as vLLM's (`LLM(model, speculative_config=...)`, `generate`, `chat`).

    llm = LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    print(out.outputs[0].text, out.metrics)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from specdec.cache.kv_cache import kv_cache_dtype_named, kv_dtype
from specdec.config import ConfigError, SpeculativeConfig, with_hardware_defaults
from specdec.model.cuda_graph import GraphedModel, check_pass_width
from specdec.model.loader import DEFAULT_MODEL, load_model, resolve_device, resolve_dtype, resolve_model
from specdec.model.tokenizer import Tokenizer
from specdec.quant.bf16 import use_amx_tiles
from specdec.sampling_params import SamplingParams
from specdec.spec.decoder import GenerationResult, SpeculativeDecoder
from specdec.spec.metrics import SpecMetrics
from specdec.spec.proposer import ProposerContext, make_proposer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict] | None = None
    stop_reason: str | int | None = None
    metrics: dict = field(default_factory=dict)  # this sample's (RequestOutput.metrics: all n together)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens reused from the previous request's cache (its first sample's)
    prompt_logprobs: list[dict | None] | None = None  # SamplingParams.prompt_logprobs: per prompt token, None first


def load_target(model: str, dtype, max_model_len: int | None, progress: bool = True, device: str = "auto"):
    source = resolve_model(model, progress=progress)
    device = resolve_device(device)
    target = load_model(source.directory, resolve_dtype(dtype, device), max_model_len, device)
    return source, target, Tokenizer(source.directory)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, speculative_config: dict | SpeculativeConfig | None = None,
                 dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                 num_threads: int | None = None, progress: bool = True, device: str = "auto",
                 enforce_eager: bool = False, pass_width: int = 1, enable_prefix_caching: bool = True,
                 amx: bool = False, kv_cache_dtype: str = "auto"):
        if num_threads is not None and num_threads < 0:
            raise ConfigError(f"num_threads must be >= 1 (0 or None: every core), got {num_threads}")
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        check_pass_width(pass_width)  # a no-op on the CPU, whose kernels are batch-invariant at any width
        self.kv_cache_dtype = kv_cache_dtype_named(kv_cache_dtype)  # None ("auto"): the model's dtype
        self.source, self.model, self.tokenizer = load_target(model, dtype, max_model_len, progress, device)
        # bf16 on an AMX CPU: decode/verify matmuls on AMX tiles, for this model and its drafters (use_amx_tiles)
        self.amx = amx and use_amx_tiles(self.model) > 0
        self.model.kv_cache_dtype = self.kv_cache_dtype  # every cache of the target (and of its drafters)
        if self.model.device.type == "cuda" and not enforce_eager and hasattr(self.model, "forward_static"):
            self.model = GraphedModel(self.model, pass_width=pass_width)  # decode/verify passes replay CUDA graphs
        self.dtype = self.model.dtype  # the activations' (bf16 on a CPU stores weights in bf16, computes in fp32)
        self.load_dtype = resolve_dtype(dtype, str(self.model.device))  # what the weights were asked in
        # an eagle3 config that names no draft shape gets the one this hardware favours (config.py)
        self.speculative_config = SpeculativeConfig.from_dict(with_hardware_defaults(speculative_config, self.amx))
        self.proposer = None
        if self.speculative_config is not None:
            ctx = ProposerContext(self.model, self.tokenizer, self.speculative_config, self.source.directory,
                                  self.dtype, self.model.max_len, self._load_aux)
            self.proposer = make_proposer(ctx)
        # enable_prefix_caching: a request sharing a prompt prefix with the previous one prefills only the rest,
        # where that is exact (specdec/cache/kept_prefix.py)
        self.decoder = SpeculativeDecoder(self.model, self.tokenizer, self.proposer, self.speculative_config,
                                          prefix_caching=enable_prefix_caching)
        self._counter = 0

    def _load_aux(self, name: str):
        """Load another model (a drafter) at the target's dtype and context length."""
        source = resolve_model(name)
        model = load_model(source.directory, self.load_dtype, self.model.max_len, str(self.model.device))
        use_amx_tiles(model, self.amx)
        model.kv_cache_dtype = self.kv_cache_dtype
        return model, Tokenizer(source.directory), source

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids): a string, {"prompt": str}, {"prompt_token_ids": [...]} or a
        list of token ids; anything else is a ValueError saying what a prompt is."""
        given = prompt
        if isinstance(prompt, dict) and set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            prompt = prompt["prompt"]
        elif isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"] if isinstance(prompt["prompt_token_ids"], (list, tuple)) else None
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids, {{'prompt': str}} or "
                         f"{{'prompt_token_ids': [...]}}; got {repr(given)[:80]}")

    def generate_one(self, prompt_ids: list[int], params: SamplingParams, on_delta=None) -> GenerationResult:
        return self.decoder.generate(prompt_ids, params, on_delta)

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """prompts: a prompt or a list of them; a prompt is a string, a list of token ids, {"prompt": str} or
        {"prompt_token_ids": [...]} (as vLLM's). sampling_params: one SamplingParams for all, or a list of
        them, one a prompt (as vLLM's); None: the defaults."""
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise ValueError(f"prompts: a prompt or a list of prompts, got {repr(prompts)[:80]}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._generate([self._encode(prompt) for prompt in prompts], sampling_params)

    def _generate(self, encoded: list[tuple[str | None, list[int]]], sampling_params) -> list[RequestOutput]:
        """encoded: each prompt as (text or None, token ids)."""
        per_prompt = _per_prompt_params(sampling_params, len(encoded))
        for (_, ids), params in zip(encoded, per_prompt):  # every request checked before any work
            self.decoder.check_request(ids, params)
        results = []
        for (text, ids), params in zip(encoded, per_prompt):
            outs, runs = [], []
            for i in range(params.n):
                p = params if params.n == 1 or params.seed is None else _with_seed(params, params.seed + i)
                r = self.decoder.generate(ids, p)
                runs.append(r)
                outs.append(CompletionOutput(i, r.text, r.token_ids, r.finish_reason, r.logprobs, r.stop_reason,
                                             r.metrics_dict()))
            self._counter += 1
            results.append(RequestOutput(str(self._counter), text, ids, outs, _combined_metrics(runs),
                                         runs[0].num_cached_tokens, runs[0].prompt_logprobs))
        return results

    def chat(self, messages, sampling_params=None) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of conversations."""
        def conversation(c) -> bool:
            return isinstance(c, (list, tuple)) and bool(c) and all(isinstance(m, dict) for m in c)

        if conversation(messages):
            convs = [messages]
        elif isinstance(messages, (list, tuple)) and messages and all(map(conversation, messages)):
            convs = messages
        else:
            raise ValueError("messages: a conversation (a list of {'role': ..., 'content': ...} dicts) or a list "
                             f"of conversations; got {repr(messages)[:80]}")
        return self._generate([self.tokenizer.chat_prompt(c) for c in convs], sampling_params)

    def info(self) -> dict:
        from specdec.kernels import kernel_status
        from specdec.quant.qmodel import describe
        cfg = self.model.config
        inputs = "bfloat16" if _rounds_inputs(self.model) else str(self.dtype).replace("torch.", "")
        prompt = self.model.prefill_matmul_dtype  # None: a prompt's matmuls are the decode passes'
        return {"model": self.source.origin, "loaded_from": str(self.source.directory), "source_kind": self.source.kind,
                "architecture": cfg.model_type, "parameters": cfg.num_parameters, "layers": cfg.num_hidden_layers,
                "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                "vocab_size": cfg.vocab_size, "dtype": str(self.load_dtype).replace("torch.", ""),
                "weights": describe(self.model), "activations": str(self.dtype).replace("torch.", ""),
                "prefill_matmuls": inputs if prompt is None else str(prompt).replace("torch.", ""),
                "matmul_inputs": inputs,
                "amx_tiles": self.amx,
                "kv_cache_dtype": str(kv_dtype(self.model)).replace("torch.", ""),
                "device": str(self.model.device),
                "max_model_len": self.model.max_len, "threads": torch.get_num_threads(), "kernels": kernel_status(),
                "speculative_config": None if self.speculative_config is None else self.speculative_config.method,
                # which kept rows a next request may reuse: "all", "prompt" (prompt-pass rows) or None (never)
                "prefix_caching": None if self.decoder.prefix is None else self.decoder.prefix.level}


def _per_prompt_params(sampling_params, num_prompts: int) -> list[SamplingParams]:
    """generate()'s sampling_params as one SamplingParams a prompt."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    if (isinstance(sampling_params, (list, tuple)) and len(sampling_params) == num_prompts
            and all(isinstance(p, SamplingParams) for p in sampling_params)):
        return list(sampling_params)
    raise ValueError(f"sampling_params: a SamplingParams or a list of {num_prompts} (one a prompt); "
                     f"got {repr(sampling_params)[:80]}")


def _rounds_inputs(model) -> bool:
    """Whether the model's bf16 weights round their matmul inputs to bf16 (specdec/quant/bf16.py)."""
    return any(getattr(m, "round_inputs", False) for m in getattr(model, "model", model).modules())


def _combined_metrics(runs: list) -> dict:
    """The metrics of a request's n samples together (each sample's are on its CompletionOutput)."""
    if len(runs) == 1:
        return runs[0].metrics_dict()
    spec = SpecMetrics()
    for r in runs:
        spec.merge(r.metrics)
    prefill, decode = sum(r.prefill_time for r in runs), sum(r.decode_time for r in runs)
    decoded = sum(max(len(r.token_ids) - 1, 0) for r in runs)
    return {"prefill_time_s": round(prefill, 4), "decode_time_s": round(decode, 4),
            "decode_tokens_per_s": round(decoded / decode, 2) if decode > 0 else 0.0,
            "target_forward_passes": spec.target_passes + len(runs), "speculative": spec.to_dict()}


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, seed=seed, n=1)  # (one sample: its seed's range is checked as one)
