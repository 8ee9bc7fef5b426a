"""Weight-only quantization (int8 / int4, group-wise, RTN or AWQ) of Llama-family models, and FP8 (e4m3)
weights with per-token activation scales for GPUs.

    specdec quantize smollm2-135m --scheme int4 --method awq --group-size 128 --out ./smollm2-int4
    specdec generate ./smollm2-int4 --prompt "Hello"                  (a quantized target)
    specdec generate smollm2-135m --speculative-method qdraft ...      (an int4 copy drafts for fp32)

schemes.py: formats, RTN, the readable dequantize; awq.py: activation-aware scales; qlinear.py:
packed-weight modules and the qgemv.c kernel binding; qmodel.py: whole-model conversion; io.py:
save/load of quantized HF-style directories; evaluate.py: perplexity, agreement, speed; fp8.py: FP8
weights through torch._scaled_mm.
"""
from specdec.quant.schemes import Packed, QuantScheme, dequantize, quantize

__all__ = ["Packed", "QuantScheme", "dequantize", "quantize"]
