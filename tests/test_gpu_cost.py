"""The GPU cost probe's CPU test mode (--tiny): report structure, positive timings, budget skipping."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.bench.gpu_cost import main


def test_tiny_report(tmp_path):
    threads = torch.get_num_threads()
    data = main(["--out", str(tmp_path), "--tiny", "--budget-s", "30"])
    assert torch.get_num_threads() == threads  # the tiny mode's single thread is given back
    saved = json.loads((tmp_path / "gpu_cost.json").read_text())
    assert saved == json.loads(json.dumps(data))  # the last save holds everything measured
    assert {"meta", "verify_cost", "gemm", "skipped", "errors"} <= set(saved)
    assert {"torch", "device", "device_name", "date", "elapsed_s", "budget_s"} <= set(saved["meta"])
    assert saved["skipped"] == [] and saved["errors"] == []

    tiny = saved["verify_cost"]["tiny"]
    assert tiny["prefix"] == 32 and tiny["prefill_ms"] > 0 and tiny["params_m"] > 0
    assert [r["T"] for r in tiny["eager"]] == [1, 2, 4] and tiny["cuda_graph"] == []  # no graphs on a CPU
    for r in tiny["eager"]:
        assert 0 < r["ms_min"] <= r["ms_median"] <= r["ms_max"] and r["ratio"] > 0
    assert tiny["eager"][0]["ratio"] == 1.0

    bf16 = [g for g in saved["gemm"] if g["kind"] == "bf16"]
    assert len(bf16) == 3 * 4  # three weight shapes, M = 1, 4, 8, 16
    for g in bf16:
        assert g["us_median"] > 0 and g["gb_s"] > 0 and g["rel_err"] == 0.0 and "error" not in g
    others = [g for g in saved["gemm"] if g["kind"] != "bf16"]
    assert others and all(g["error"] == "needs CUDA" for g in others)

    md = (tmp_path / "gpu_cost.md").read_text()
    for heading in ("# GPU cost probe", "## 1. Verify cost", "### tiny", "## 2. GEMMs", "## Skipped", "## Errors"):
        assert heading in md
    assert "| eager | 1 |" in md and "| 256 | 512 | 16 | bf16 |" in md


def test_budget_spent_skips_everything(tmp_path):
    data = main(["--out", str(tmp_path), "--tiny", "--budget-s", "0"])
    assert data["skipped"] == ["tiny", "gemm"] and data["verify_cost"] == {} and data["gemm"] == []
    assert "tiny, gemm" in (tmp_path / "gpu_cost.md").read_text()


def test_gpu_speed_on_the_cpu(tiny_dir, tmp_path):
    """gpu_speed runs on any device: plain and n-gram over the same prompts, the profile of plain decoding,
    and on the CPU (batch-invariant kernels) every speculative output equal to plain decoding's."""
    from specdec.bench.gpu_speed import main as speed

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["the the the the the", "one two one two one two"]))
    out = tmp_path / "out"
    assert speed(["--model", str(tiny_dir("llama")), "--device", "cpu", "--dtype", "float32", "--prompts",
                  str(prompts), "--max-tokens", "12", "--profile", "6", "--eager-prompts", "1", "--out", str(out)]) == 0
    report = json.loads((out / "gpu_speed.json").read_text())
    # no head given: no eagle3 rows; on the CPU both modes run eagerly, the "(eager)" rows on one prompt
    assert set(report["results"]) == {"plain", "ngram k4", "ngram (adaptive)", "plain (eager)", "ngram k4 (eager)"}
    for name, r in report["results"].items():
        assert r["equal_to_plain"] == ("1/1" if "eager" in name else "2/2")
        assert r["decode_tokens"] > 0 and r["decode_tokens_per_s"] > 0 and r["cuda_graphs"] is None
    assert "| ngram k4 |" in (out / "gpu_speed.md").read_text()
    with pytest.raises(SystemExit, match="unknown methods"):
        speed(["--model", str(tiny_dir("llama")), "--device", "cpu", "--methods", "plain,warp", "--out", str(out)])
    assert "plain decoding, eager: 6 tokens" in (out / "gpu_profile.txt").read_text()


def test_gpu_host_probe_on_the_cpu(tmp_path):
    """The host-cost probe runs anywhere; without CUDA it has only the launch row, a positive time."""
    from specdec.bench.gpu_host import main as host

    report = host(["--out", str(tmp_path), "--device", "cpu", "--repeats", "10"])
    (name, row), = report["rows"].items()
    assert name.startswith("launch") and 0 < row["us_min"] <= row["us_median"] <= row["us_max"]
    assert "| launch" in (tmp_path / "gpu_host.md").read_text()
