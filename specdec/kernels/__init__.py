"""CPU kernels for decode-shaped matmuls, built on first use with the system C compiler.

`linear(x, weight, bias)` equals torch.nn.functional.linear; for fp32 on CPU with few rows
(decode, verify of a draft) it calls gemv.c, which streams the weights at memory bandwidth where
MKL's small-M path does not (measured: 2x on an AMD EPYC). All kernel files are compiled together
with -march=native into one shared library in $SPECDEC_CACHE/kernels (keyed by sources, compiler flags
and CPU), so a machine never runs code built for another, and they split their work through one
dispatch (pool.c: OpenMP regions on the main thread, its own worker pool on any other). Without a
compiler, or with SPECDEC_KERNELS=0, torch is used.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

# Up to this many rows the C kernels run (batch-invariant); above, torch. gemv.c's blocked path beats
# torch's fp32 matmul up to 64 rows on this project's CPUs (the 135M model's linears, weights from
# DRAM, 2 threads, AMD EPYC: 32 rows 61 vs 74 ms, 64 rows 107 vs 115, 96 rows 155 vs 152).
MAX_ROWS = 64
_SRC = Path(__file__).with_name("gemv.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-lm"]
_lib = None
_load_error: str | None = None


def _cpu_key() -> str:
    try:
        flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build_library(source: Path, extra: tuple[Path, ...] = ()) -> Path:
    """Compile C files of this package (once per sources, flags and CPU) into the cache; its path.
    `extra` are further files linked into the same library (their functions are called by `source`)."""
    from specdec.model.loader import cache_root

    sources = (source, *extra)
    headers = sorted({h for p in sources for h in p.parent.glob("*.h")})  # what the sources #include
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*sources, *headers)))
    digest.update(" ".join(_FLAGS).encode() + _cpu_key().encode())
    out = cache_root() / "kernels" / f"libspecdec_{source.stem}-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, *map(str, sources), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prune_builds(out, KEEP_BUILDS)
    return out


# libraries of one kernel kept in the cache: every source change (or another CPU sharing the cache
# directory) adds one; the newest few stay so that machines or checkouts taking turns do not rebuild
KEEP_BUILDS = 4


def prune_builds(newest: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` most recently written builds of newest's kernel (newest among those
    kept); the paths deleted. A process that has a deleted library loaded keeps its mapping."""
    stem = newest.name.rsplit("-", 1)[0]
    written = {}
    for p in newest.parent.glob(f"{stem}-*.so"):
        try:
            written[p] = p.stat().st_mtime
        except OSError:  # another process pruned it first
            continue
    older = sorted((p for p in written if p != newest), key=written.get, reverse=True)
    stale = older[max(keep - 1, 0):]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


# every kernel file goes into ONE library, so that all of them share pool.c's worker threads (two
# pools would spin against each other between a layer stack's call and the LM head's)
_SOURCES = tuple(_SRC.with_name(f) for f in ("layer.c", "head_chain.c", "head_tree.c", "gemv.c", "rows.c", "bf16dot.c",
                                              "bf16amx.c", "qgemv.c", "attention.c", "topk.c", "pool.c"))


def _build() -> Path:
    return build_library(_SOURCES[0], _SOURCES[1:])


def load_kernels() -> tuple[ctypes.CDLL | None, str | None]:
    """The compiled kernels (gemv.c, rows.c, bf16dot.c, qgemv.c, attention.c, layer.c, head_chain.c, head_tree.c,
    topk.c, pool.c in one library): (library, None), or (None, why not). Loading it again returns the same library."""
    if os.environ.get("SPECDEC_KERNELS", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return None, "disabled"
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, (str(e).splitlines()[0] if str(e) else type(e).__name__)
    # the kernel's permission for AMX tiles where the CPU has them (bf16amx.c; a model uses them only when
    # asked: quant/bf16.py use_amx_tiles); SPECDEC_AMX=0 never asks
    if os.environ.get("SPECDEC_AMX", "1") != "0":
        lib.specdec_amx_enable()
    return lib, None


def _load():
    global _lib, _load_error
    if _lib is None and _load_error is None:
        lib, _load_error = load_kernels()
        if lib is not None:
            lib.specdec_linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
            lib.specdec_linear_f32.restype = None
            lib.specdec_linear_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
            lib.specdec_linear_bf16.restype = None
            lib.specdec_linear_bf16_dot.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
            lib.specdec_linear_bf16_dot.restype = ctypes.c_int
            lib.specdec_linear_bf16_tiles.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
            lib.specdec_linear_bf16_tiles.restype = ctypes.c_int
            lib.specdec_rmsnorm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
            lib.specdec_rmsnorm_f32.restype = None
            lib.specdec_silu_mul_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
            lib.specdec_silu_mul_f32.restype = None
            lib.specdec_topk_f32.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
            lib.specdec_topk_f32.restype = ctypes.c_int
            _lib = lib
    return _lib


def kernel_status() -> str:
    lib = _load()
    if lib is None:
        return f"torch ({_load_error})"
    lanes = {16: 'AVX-512', 8: 'AVX2'}.get(lib.specdec_gemv_lanes(), 'scalar')
    dot = "bf16 dot products" if lib.specdec_bf16_dot_native() else "bf16 inputs widened"
    if lib.specdec_amx_active():
        dot += ", AMX tiles on request"
    return f"gemv.c ({lanes}, {dot}, OpenMP on the main thread, own pool elsewhere; fp32 and bf16 weights)"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):  # a packed weight (specdec.quant: QuantizedWeight, Fp8Weight) runs itself
        return weight.linear(x, bias)
    rows = x.numel() // x.shape[-1]
    # what the kernel reads as given (a contiguous [N, K] fp32 CPU matrix, a length-N fp32 bias); anything
    # else is torch's, which raises where the shapes do not fit instead of reading past them
    if (x.dtype is not torch.float32 or weight.dtype is not torch.float32 or x.device.type != "cpu"
            or not _cpu_matrix(weight, x.shape[-1], bias)
            or (bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()))
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    lib = _load()
    if lib is None:
        return F.linear(x, weight, bias)
    x = x.contiguous()
    N, K = weight.shape
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    b = bias.data_ptr() if bias is not None else None
    # more than MAX_ROWS rows (a long prompt, a wide serving batch): MAX_ROWS at a time, so every row gets
    # the kernel's sums at any width. MKL's rows change with the row count (at 1-11 rows here), so a prompt
    # prefilled in pieces, or decoded, would not equal one pass; the kernel costs ~10-35% more than MKL per
    # wide matmul (704 rows of the 135M model's shapes)
    for start in range(0, rows, MAX_ROWS):
        lib.specdec_linear_f32(x.data_ptr() + 4 * start * K, weight.data_ptr(), b, y.data_ptr() + 4 * start * N,
                               min(MAX_ROWS, rows - start), K, N)
    return y


# Without round_inputs (a CPU without bf16 dot products) a long prompt's pass goes to torch: its fp32 GEMM
# outruns the widening kernel once the rows are many, which pays for widening the matrix per call. Up to
# here (a wide decode or verify batch, a recomputed chunk) the kernel, in parts, is the faster one.
WIDE_BF16_ROWS = 4 * MAX_ROWS
# rows per call to the AMX tiles (a prompt's pass): the weights are read once per call, and 256 rows of
# packed inputs (<= 0.8 MB at K = 1536) stay in a core's L2. Against 64 a call (2-vCPU Xeon, bf16, medians
# of 15 / 5 prompt passes): 150 tokens 60.2 -> 57.5 ms, 870 tokens 433 -> 420 ms
TILE_CALL_ROWS = 256


def _cpu_matrix(weight: torch.Tensor, K: int, bias: torch.Tensor | None) -> bool:
    """Whether weight is a contiguous [N, K] CPU matrix and bias None or a length-N CPU vector: what a kernel
    reads from their pointers (a [N, 32] weight beside x [..., 64] read past x's rows' ends, a CUDA one segfaulted)."""
    return (weight.dim() == 2 and weight.shape[1] == K and weight.device.type == "cpu" and weight.is_contiguous()
            and (bias is None or (bias.device.type == "cpu" and bias.shape == weight.shape[:1])))


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                round_inputs: bool = False, tiles: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] fp32 @ weight [N, K] bfloat16 ^T (+ bias) with fp32 sums through the C kernels: the
    weight is widened exactly, so this is F.linear(x, weight.float(), bias) up to summation order; with
    round_inputs, F.linear(x.bfloat16().float(), weight.float(), bias) (bf16dot.c: bf16 dot products where
    the CPU has them; tiles: the weight as amx_tiles packed it, multiplied on AMX). More than MAX_ROWS rows
    go MAX_ROWS per kernel call. None where the kernel does not apply (not CPU fp32, autograd, no compiled
    library; over WIDE_BF16_ROWS rows without round_inputs)."""
    rows = x.numel() // x.shape[-1]
    if (x.dtype is not torch.float32 or x.device.type != "cpu" or weight.dtype is not torch.bfloat16
            or not _cpu_matrix(weight, x.shape[-1], bias)
            or (rows > WIDE_BF16_ROWS and not round_inputs) or (bias is not None and bias.dtype is not torch.float32)
            or (torch.is_grad_enabled() and x.requires_grad) or _load() is None):
        return None  # (the caller's torch path, which raises where the shapes do not fit instead of reading past them)
    x = x.contiguous()
    N, K = weight.shape
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    run = _lib.specdec_linear_bf16_dot if round_inputs else _lib.specdec_linear_bf16
    if round_inputs and tiles is not None:
        run, weight = _lib.specdec_linear_bf16_tiles, tiles
    bias = None if bias is None else bias.contiguous()  # (held: a copy's pointer alone was freed before the call)
    b = None if bias is None else bias.data_ptr()
    # more than MAX_ROWS rows (a wide serving batch, a recomputed chunk): MAX_ROWS at a time, so every row
    # gets the kernel's sums (batch invariance at any width); torch would widen the whole matrix per call
    # (the 135M model at 80 rows: 319 ms in bf16 against ~100 through the kernel). The tiles take any
    # number of rows with the same sums: TILE_CALL_ROWS a call reads the weights once per 256 prompt rows
    step = TILE_CALL_ROWS if run is _lib.specdec_linear_bf16_tiles else MAX_ROWS
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if run(x.data_ptr() + 4 * start * K, weight.data_ptr(), b, y.data_ptr() + 4 * start * N, n, K, N):
            raise MemoryError("bf16dot.c could not allocate its rounded inputs")  # (the widening kernel returns None)
    return y


def amx_active() -> bool:
    """Whether bf16-input matmuls can run on AMX tiles here (bf16amx.c: an Intel CPU with AMX, the kernel's
    permission, SPECDEC_AMX not 0)."""
    lib = _load()
    return lib is not None and bool(lib.specdec_amx_active())


def amx_tiles(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """bf16 [N, K] matrices as bf16amx.c reads them: each [N / 16, K / 32, 16, 32] (a 16 x 32 tile is one
    1 KB block, a group of 16 rows one sequential stream), zero-padded to whole tiles, all in one buffer
    in the given order (a forward pass's, so that one matrix's stream runs on into the next, as the
    model's own weights lie; measured no slower than separate buffers, not clearly faster)."""
    shapes = [((N + 15) // 16, (K + 31) // 32, 16, 32) for N, K in (w.shape for w in weights)]
    flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.bfloat16)
    out, offset = [], 0
    for w, shape in zip(weights, shapes):
        N, K = w.shape
        tiles = flat[offset:offset + math.prod(shape)].view(shape)
        tiles.copy_(F.pad(w, (0, -K % 32, 0, -N % 16)).view(shape[0], 16, shape[1], 32).permute(0, 2, 1, 3))
        out.append(tiles)
        offset += tiles.numel()
    return out


def bf16_dot_native() -> bool:
    """Whether bf16-input matmuls (linear_bf16(round_inputs=True)) run on the CPU's bf16 dot products."""
    lib = _load()
    return lib is not None and bool(lib.specdec_bf16_dot_native())


def _row_local_f32(x: torch.Tensor) -> bool:
    """Whether a row-local op (RMSNorm, SwiGLU) runs our kernel: fp32 on the CPU, no autograd, the library.
    At any row count, so a row's value never depends on how many rows came with it (a prompt's pass,
    chunked or not, and the decode passes agree)."""
    return (x.dtype is torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad) and _load() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (not (_row_local_f32(x) and weight.dtype is torch.float32) or (torch.is_grad_enabled() and weight.requires_grad)
            or weight.shape != x.shape[-1:] or weight.device.type != "cpu" or not weight.is_contiguous()):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x = x.contiguous()
    y = torch.empty_like(x)
    _lib.specdec_rmsnorm_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate then up) -> silu(gate) * up, [..., I]."""
    if not _row_local_f32(gate_up) or gate_up.shape[-1] % 2:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    y = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    _lib.specdec_silu_mul_f32(gate_up.data_ptr(), y.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter)
    return y


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """[..., V] fp32 CPU -> [..., k] int64, the indices of each row's k largest values (k <= 8), largest
    first, ties lower index first (topk.c); None where the kernel does not answer (another dtype or
    device, no library, a row with a NaN or fewer than k values above -inf)."""
    if x.dtype is not torch.float32 or x.device.type != "cpu" or not 1 <= k <= 8 or x.shape[-1] < k:
        return None
    lib = _load()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], k, dtype=torch.int64)
    if not lib.specdec_topk_f32(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], k, out.data_ptr()):
        return None
    return out
