"""Machine measurements the benchmark and `advise` stand on.

    cost curve      c(k) / c(1): one target forward over k new tokens after a cached prefix, k = 1..32
    bandwidth       GB/s of a streaming read (sum over a buffer much larger than the last-level cache)
    bound           tokens/s <= bandwidth / weight bytes read per decoded token
    memory          RSS now, and the peak RSS inside a window (VmHWM, reset through /proc/self/clear_refs)
    environment     CPU model (lscpu), threads, torch / transformers / llama-cpp-python versions, load
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass

import torch


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass
class CostCurve:
    """seconds[k] for k = 1..max_k (median of repeats; also the minimum, less sensitive to load)."""

    ks: list[int]
    seconds: list[float]  # [len(ks)] median
    seconds_min: list[float]  # [len(ks)]
    prefix_len: int

    def relative(self, k: int) -> float:
        """c(k) / c(1), interpolated between measured k (linear), extrapolated linearly past the last."""
        base = self.seconds[0]
        if k <= self.ks[0]:
            return 1.0
        for i in range(1, len(self.ks)):
            if k <= self.ks[i]:
                k0, k1, s0, s1 = self.ks[i - 1], self.ks[i], self.seconds[i - 1], self.seconds[i]
                return (s0 + (s1 - s0) * (k - k0) / (k1 - k0)) / base
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.ks[-1] - self.ks[-2]) if len(self.ks) > 1 else 0.0
        return (self.seconds[-1] + slope * (k - self.ks[-1])) / base

    def to_dict(self) -> dict:
        return {"ks": self.ks, "seconds": [round(s, 6) for s in self.seconds],
                "seconds_min": [round(s, 6) for s in self.seconds_min],
                "relative": [round(s / self.seconds[0], 4) for s in self.seconds], "prefix_len": self.prefix_len}


@torch.inference_mode()
def measure_cost_curve(model, ks=tuple(range(1, 33)), prefix_len: int = 128, repeats: int = 5,
                       layers=None) -> CostCurve:
    """Time one forward of k new tokens after a cached prefix of prefix_len tokens (all k interleaved
    per repeat, so slow drift of the machine's load hits every k alike). layers: a subset (drafters)."""
    ks = sorted(set(int(k) for k in ks))
    cache = model.new_cache(prefix_len + max(ks) + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (1, prefix_len), generator=gen)
    model(prefix, torch.arange(prefix_len)[None], cache, num_logits=1, layers=layers)
    blocks = {k: torch.randint(0, vocab, (1, k), generator=gen) for k in ks}
    times: dict[int, list[float]] = {k: [] for k in ks}
    for k in ks:  # warm-up: first calls at a new shape allocate
        cache.rollback(prefix_len)
        model(blocks[k], torch.arange(prefix_len, prefix_len + k)[None], cache, layers=layers)
    for _ in range(repeats):
        for k in ks:
            cache.rollback(prefix_len)
            t0 = time.perf_counter()
            model(blocks[k], torch.arange(prefix_len, prefix_len + k)[None], cache, layers=layers)
            times[k].append(time.perf_counter() - t0)
    cache.rollback(prefix_len)
    return CostCurve(ks, [_median(times[k]) for k in ks], [min(times[k]) for k in ks], prefix_len)


def measure_bandwidth(megabytes: int = 512, repeats: int = 9) -> float:
    """GB/s of a streaming read: sum() over a float32 buffer far larger than the caches (median of
    repeats). The best of 5 read 54-55 GB/s on a shared Zen 4 VM where medians were 28-32 GB/s minutes
    apart (runs S14, S14b): one burst set the bound, and the fraction of it swung 0.29-0.72."""
    n = megabytes * (1 << 20) // 4
    # random values, like the weights: a buffer of identical pages is one a hypervisor may merge or
    # compress (not shown to matter: 33.5 GB/s for ones vs 34.8 for random values, read back to back)
    buf = torch.rand(n, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    buf.sum()  # fault the pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    del buf
    return n * 4 / sorted(times)[len(times) // 2] / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every matrix and norm once, the embedding only as one
    row (unless it is tied to the LM head, which reads all of it). Packed matrices (bf16, int8/int4, fp8)
    are buffers of their weight modules."""
    seen, total = set(), 0
    emb = model.embed.weight
    packed = [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in ("qweight", "scales", "zeros")]
    for p in list(model.parameters()) + packed:
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p is emb and emb is not model.lm_head.weight:
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------- memory
def _status_kb(key: str) -> int | None:
    try:
        text = open("/proc/self/status").read()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


def rss_mb() -> float | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else kb / 1024


class PeakRSS:
    """Peak resident memory of this process inside a `with` block (whole process, in MB)."""

    def __init__(self):
        self.peak_mb: float | None = None
        self.start_mb: float | None = None

    @property
    def extra_mb(self) -> float | None:
        """How far the peak rose above the RSS at entry (the generation's working memory)."""
        return None if self.peak_mb is None or self.start_mb is None else max(self.peak_mb - self.start_mb, 0.0)

    def __enter__(self) -> "PeakRSS":
        self.start_mb = rss_mb()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            self._resettable = True
        except OSError:
            self._resettable = False
        return self

    def __exit__(self, *exc) -> None:
        kb = _status_kb("VmHWM") if self._resettable else None
        self.peak_mb = kb / 1024 if kb is not None else rss_mb()


# ---------------------------------------------------------------- environment
def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if m:
            return m.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return []
    m = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(m.group(1).split()) if m else set()
    return sorted(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "f16c") if f in flags)


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def environment() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": _version("transformers"), "llama_cpp_python": _version("llama-cpp-python"),
            "python": platform.python_version(), "load_average": [round(x, 2) for x in os.getloadavg()]}
