"""specdec: lossless speculative decoding for Llama-family models.

    from specdec import LLM, SamplingParams
    llm = LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))[0]
"""
from specdec.sampling_params import SamplingParams
from specdec.config import SpeculativeConfig

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name):  # lazy: importing specdec must not load torch-heavy modules
    if name == "LLM":
        from specdec.llm import LLM
        return LLM
    raise AttributeError(name)
