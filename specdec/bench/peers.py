"""Peers, run in the same process on the same prompts and token budgets as our systems.

    transformers:greedy          model.generate(do_sample=False)
    transformers:prompt_lookup   generate(prompt_lookup_num_tokens=10)   (its n-gram drafter, max n 2)
    transformers:assisted        generate(assistant_model=<draft dir>)   (needs a draft model)
    llama.cpp:plain-<prec>       llama-cpp-python, greedy, on the GGUF at <prec>
    llama.cpp:prompt_lookup-<prec>  the same with LlamaPromptLookupDecoding (num_pred_tokens 10, n 2)

transformers loads our converted HF directory at the benchmark's dtype. llama.cpp runs the model's
own GGUF (its native quantization, e.g. Q4_1) and, for equal precision, a copy of the same weights
dequantized to the benchmark's dtype (F32/F16/BF16), written once into the cache. Every peer counts
the target's forward passes (a forward hook / a wrapper around Llama.eval) to report tokens per pass.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from specdec.bench.systems import Generated, System
from specdec.config import ConfigError

GGUF_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated tokens arrive (generate() first
    hands it the prompt, then each step's new tokens)."""

    def __init__(self):
        self.puts, self.t, self.count = 0, None, 1

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.t, self.count = time.perf_counter(), max(int(value.numel()), 1)

    def end(self) -> None:
        pass


class TransformersSystem(System):
    family = "transformers"

    def __init__(self, model_dir: Path, dtype: torch.dtype, variant: str, assistant_dir: Path | None = None,
                 eos_ids=()):
        self.model_dir, self.dtype, self.variant, self.assistant_dir = model_dir, dtype, variant, assistant_dir
        self.method = variant
        self.name = f"transformers:{variant}"
        self.precision = str(dtype).replace("torch.", "")
        self.eos_ids = list(eos_ids)
        self.kwargs: dict = {}
        if variant == "prompt_lookup":
            self.kwargs = {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}
        self.config = dict(self.kwargs, **({"assistant_model": str(assistant_dir)} if assistant_dir else {}))
        self.model = self.assistant = None
        self.calls = 0

    def _load(self, directory: Path):
        import transformers as tf
        tf.utils.logging.disable_progress_bar()
        tf.utils.logging.set_verbosity_error()
        model = tf.AutoModelForCausalLM.from_pretrained(str(directory), dtype=self.dtype).eval()
        model.generation_config.eos_token_id = self.eos_ids or model.generation_config.eos_token_id
        model.generation_config.pad_token_id = (self.eos_ids or [0])[0]
        for name in ("temperature", "top_p", "top_k"):
            setattr(model.generation_config, name, None)
        return model

    def setup(self) -> None:
        if self.variant == "assisted" and self.assistant_dir is None:
            raise ConfigError("assisted generation needs a draft model (none available)")
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ConfigError("transformers is not installed") from None
        self.model = self._load(self.model_dir)
        self.model.register_forward_pre_hook(self._count)
        if self.assistant_dir is not None:
            self.assistant = self._load(self.assistant_dir)
            self.kwargs = {"assistant_model": self.assistant}

    def _count(self, module, args) -> None:
        self.calls += 1

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generated:
        x = torch.tensor([prompt_ids])
        self.calls = 0
        clock = _FirstTokenClock()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                      do_sample=False, streamer=clock, **self.kwargs)
            seconds = time.perf_counter() - t0
        first = None if clock.t is None else clock.t - t0
        return Generated(out[0, len(prompt_ids):].tolist(), seconds, first, max(self.calls - 1, 0),
                         first_tokens=clock.count)

    def close(self) -> None:
        self.model = self.assistant = None


def llama_cpp_available() -> str | None:
    """None if llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e.name or e}); `make bench-deps` builds it"
    except OSError as e:  # the shared library failed to load
        return f"llama-cpp-python failed to load: {e}"
    return None


class LlamaCppSystem(System):
    family = "llama.cpp"

    def __init__(self, src: Path, precision: str, variant: str, threads: int, n_ctx: int, eos_ids=(),
                 convert: bool = False):
        """precision: "Q4_1"-style for the file as it is; "float32"/"float16"/"bfloat16" with convert=True
        for a dequantized copy of it (made at setup)."""
        self.src, self.precision, self.variant, self.convert = src, precision, variant, convert
        self.method = variant
        label = GGUF_TYPES[precision] if convert else precision
        self.name = f"llama.cpp:{variant}-{label.lower()}"
        self.threads, self.n_ctx, self.eos_ids = threads, n_ctx, set(eos_ids)
        self.config = {"gguf": f"{src.name}" + (f" dequantized to {label}" if convert else ""), "n_threads": threads}
        if variant == "prompt_lookup":
            self.config.update(num_pred_tokens=10, max_ngram_size=2)
        self.llm = None
        self.calls = 0

    def setup(self) -> None:
        why = llama_cpp_available()
        if why:
            raise ConfigError(why)
        from llama_cpp import Llama
        draft = None
        if self.variant == "prompt_lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=10)
        path = gguf_at_precision(self.src, self.precision) if self.convert else self.src
        # logits_all with a draft model: llama-cpp-python keeps logits of every row then anyway, but sizes
        # its buffer from the argument (n_batch rows), which overflows past 512 tokens
        self.llm = Llama(model_path=str(path), n_ctx=self.n_ctx, n_threads=self.threads,
                         n_threads_batch=self.threads, n_batch=512, seed=0, verbose=False, draft_model=draft,
                         logits_all=draft is not None)
        self.eos_ids.add(self.llm.token_eos())
        inner = self.llm.eval

        def counting_eval(tokens):
            self.calls += 1
            return inner(tokens)

        self.llm.eval = counting_eval  # the generate loop calls self.eval once per target pass

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generated:
        out: list[int] = []
        self.calls = 0
        first = None
        t0 = time.perf_counter()
        self.llm.reset()  # no KV reuse from the previous prompt: every system prefills in full
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            if first is None:
                first = time.perf_counter() - t0
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= max_tokens:
                break
        seconds = time.perf_counter() - t0
        return Generated(out, seconds, first, max(self.calls - 1, 0))

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
        self.llm = None


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory came from (written by the loader), if any."""
    src = model_dir / "source.json"
    if src.exists():
        path = Path(json.loads(src.read_text()).get("gguf", ""))
        return path if path.is_file() else None
    return None


def gguf_at_precision(src: Path, precision: str) -> Path:
    """A copy of `src` with every tensor dequantized to F32/F16/BF16 (the same weights our loader
    reads, at the benchmark's dtype), cached next to the converted models."""
    from specdec.model.loader import cache_root

    gtype = GGUF_TYPES[precision]
    st = src.stat()
    out = cache_root() / "bench" / "gguf" / f"{src.stem}-{st.st_size}-{gtype}.gguf"
    if out.exists():
        return out
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    qtype = getattr(gguf.GGMLQuantizationType, gtype)
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "BF16": gguf.LlamaFileType.MOSTLY_BF16}[gtype]
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = int(file_type) if name == "general.file_type" else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, f.types[0], sub_type=sub)
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype("float32", copy=False)
        if w.ndim == 1 or gtype == "F32":  # norms stay F32 (as llama.cpp's converters keep them)
            writer.add_tensor(t.name, w)
        elif gtype == "F16":
            writer.add_tensor(t.name, w.astype("float16"))
        else:
            writer.add_tensor(t.name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


PEER_FAMILIES = (TransformersSystem.family, LlamaCppSystem.family)  # what --peers names (or their systems)


def make_peers(model_dir: Path, dtype: torch.dtype, threads: int, n_ctx: int, eos_ids, draft_dir: Path | None,
               which: tuple[str, ...] | None = None) -> tuple[list[System], list[tuple[str, str]]]:
    """The peer systems to try, and (name, reason) for those that cannot run here."""
    precision = str(dtype).replace("torch.", "")
    systems: list[System] = [TransformersSystem(model_dir, dtype, v, draft_dir if v == "assisted" else None, eos_ids)
                             for v in ("greedy", "prompt_lookup", "assisted")]
    skipped: list[tuple[str, str]] = []
    if draft_dir is None:
        systems = [s for s in systems if s.method != "assisted"]
        skipped.append(("transformers:assisted", "no draft model (a layer-truncated copy) available"))
    src = gguf_source(model_dir)
    why = llama_cpp_available()
    if why or src is None:
        skipped.append(("llama.cpp", why or "the model did not come from a GGUF file"))
    else:
        native = src.stem.rsplit(".", 1)[-1] if "." in src.stem else "gguf"
        variants = [(native, False)] + ([(precision, True)] if precision in GGUF_TYPES else [])
        for prec, convert in variants:
            for variant in ("plain", "prompt_lookup"):
                systems.append(LlamaCppSystem(src, prec, variant, threads, n_ctx, eos_ids, convert))
    if which is not None:
        def wanted(name: str, family: str) -> bool:
            return name in which or family in which or name.split("-")[0] in which
        systems = [s for s in systems if wanted(s.name, s.family)]
        skipped = [(n, r) for n, r in skipped if wanted(n, n.split(":")[0])]
    return systems, skipped
