"""The bench's exactness check: with greedy decoding every specdec system must emit exactly plain
decoding's tokens on each prompt (speculation is lossless), so a speedup is never bought with other
output. Compared by a digest of each run's token ids (RunRecord.output_digest); peers (llama.cpp,
transformers) run other kernels and are not compared."""
from __future__ import annotations

from specdec.bench.systems import BASELINE


def greedy_mismatches(records: list[dict]) -> tuple[int, list[str]]:
    """(runs compared, "system on prompt i (category), repeat r" for each that differs from plain decoding's
    output on the same prompt and repeat). Records without a digest (older reports) are not compared."""
    plain = {(r["repeat"], r["prompt"]): r.get("output_digest") for r in records if r["system"] == BASELINE}
    compared, bad = 0, []
    for r in records:
        want = plain.get((r["repeat"], r["prompt"]))
        if r["system"] == BASELINE or not r["system"].startswith("specdec:") or not want or not r.get("output_digest"):
            continue
        compared += 1
        if r["output_digest"] != want:
            bad.append(f"{r['system']} on prompt {r['prompt']} ({r['category']}), repeat {r['repeat']}")
    return compared, bad


def outputs_line(records: list[dict], temperature: float) -> str:
    """One line for the report: the check's result, or why there is none."""
    if temperature:
        return "Outputs: sampled, so not compared token for token (the rejection sampler's tests check them)."
    compared, bad = greedy_mismatches(records)
    if not compared:
        return "Outputs: not compared (no digests in these records)."
    if not bad:
        return f"Outputs: every specdec system's greedy output equals plain decoding's ({compared} runs compared)."
    return (f"**Outputs: {len(bad)} of {compared} runs differ from plain decoding's greedy output**: "
            + "; ".join(bad[:8]) + ("; ..." if len(bad) > 8 else "") + ".")
