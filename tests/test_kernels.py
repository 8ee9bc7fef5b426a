"""The AVX2 decode kernels equal torch and are batch-invariant (same bits for T=1 and T=k)."""
import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.model.loader import cpu_has_bf16


@pytest.fixture(autouse=True)
def _need_kernel():
    if kernels._load() is None:
        pytest.skip(f"kernel unavailable: {kernels.kernel_status()}")


@pytest.mark.parametrize("T,K,N", [(1, 576, 960), (3, 576, 1537), (8, 1536, 576), (17, 100, 33), (26, 1536, 577)])
def test_linear_matches_torch(T, K, N):
    torch.manual_seed(0)
    x, w, b = torch.randn(T, K), torch.randn(N, K), torch.randn(N)
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("T,K", [(2, 576), (3, 576), (4, 576), (5, 576), (7, 576), (9, 576), (12, 576), (13, 576),
                                 (14, 100), (20, 1536), (32, 576), (31, 104)])
def test_linear_is_batch_invariant(T, K):
    """Every tiling of T rows gives each row the single-row bits: near-equal tiles of at most 7-8 rows
    below gemv.c's WIDE_T (3 to 13 rows by CPU), the blocked 2 x 3 tiles (wide_block, prefetching the
    next block) from there on; K = 100, 104 leave scalar tails."""
    torch.manual_seed(0)
    x, w = torch.randn(T, K), torch.randn(301, K)  # 301: a last single-token tile of one row, a 13-row block
    block = kernels.linear(x, w)
    rows = torch.cat([kernels.linear(x[i:i + 1], w) for i in range(T)])
    assert torch.equal(block, rows)


@pytest.mark.parametrize("T,K,N", [(1, 576, 960), (3, 576, 1537), (8, 1536, 576), (17, 100, 33), (26, 1536, 577)])
def test_bf16_linear_is_the_fp32_one_over_widened_weights(T, K, N):
    """bf16 weights are widened exactly: the result is x @ float(W)^T, only the summation order may differ."""
    torch.manual_seed(0)
    x, w, b = torch.randn(T, K), torch.randn(N, K).bfloat16(), torch.randn(N)
    torch.testing.assert_close(kernels.linear_bf16(x, w, b), F.linear(x, w.float(), b), atol=1e-4, rtol=1e-5)
    # the very sums of the fp32 kernel on the widened matrix (same tiles, same order)
    assert torch.equal(kernels.linear_bf16(x, w, b), kernels.linear(x, w.float(), b))


@pytest.mark.parametrize("T,K", [(2, 576), (3, 576), (7, 576), (12, 576), (13, 576), (21, 576), (22, 576), (31, 104)])
def test_bf16_linear_is_batch_invariant(T, K):
    torch.manual_seed(0)
    x, w = torch.randn(T, K), torch.randn(301, K).bfloat16()
    block = kernels.linear_bf16(x, w)
    rows = torch.cat([kernels.linear_bf16(x[i:i + 1], w) for i in range(T)])
    assert torch.equal(block, rows)


@pytest.mark.parametrize("T,K,N", [(1, 576, 960), (3, 576, 1537), (4, 100, 7), (8, 1536, 576), (17, 100, 33),
                                   (64, 1536, 577)])
def test_bf16_linear_with_rounded_inputs(T, K, N):
    """round_inputs: bf16(x) @ float(W)^T, fp32 sums (bf16dot.c: vdpbf16ps where the CPU has it, else the
    widening kernel over the rounded inputs), batch invariant; it is not the unrounded product."""
    torch.manual_seed(0)
    x, w, b = torch.randn(T, K), torch.randn(N, K).bfloat16(), torch.randn(N)
    got = kernels.linear_bf16(x, w, b, round_inputs=True)
    want = F.linear(x.bfloat16().double(), w.double(), b.double())
    assert (got.double() - want).abs().max().item() < 1e-5 * K ** 0.5 * want.abs().max().item()
    assert (kernels.linear_bf16(x, w, b).double() - want).abs().max().item() > 1e-3
    rows = torch.cat([kernels.linear_bf16(x[i:i + 1], w, b, round_inputs=True) for i in range(T)])
    assert torch.equal(got, rows)
    assert kernels.bf16_dot_native() == cpu_has_bf16()  # -march=native builds the vdpbf16ps path where it runs


def test_amx_tiles_layout():
    """amx_tiles: tile (g, b) row r column c is W[16 g + r, 32 b + c], zero past W's edges, every matrix
    in one buffer in the given order (pure torch: runs on any CPU)."""
    w1, w2 = torch.randn(37, 70).bfloat16(), torch.randn(16, 32).bfloat16()
    t1, t2 = kernels.amx_tiles([w1, w2])
    assert t1.shape == (3, 3, 16, 32) and t2.shape == (1, 1, 16, 32)
    assert t2.data_ptr() == t1.data_ptr() + 2 * t1.numel()  # one buffer, in order
    assert torch.equal(t1[1, 2, 3, :6], w1[19, 64:70]) and torch.equal(t1[2, 0, 4], w1[36, :32])
    assert not t1[2, :, 5:].any() and not t1[:, 2, :, 6:].any()  # rows 37..47 and columns 70..95: zeros
    assert torch.equal(t2[0, 0], w2)


@pytest.mark.parametrize("T,K,N", [(1, 576, 960), (2, 576, 64), (3, 576, 1537), (4, 100, 7), (8, 1536, 576),
                                   (9, 576, 1537), (12, 1536, 577), (16, 64, 64), (17, 100, 33), (37, 576, 96),
                                   (64, 1536, 577)])
def test_bf16_linear_on_amx_tiles(T, K, N):
    """AMX tiles (bf16amx.c): bf16(x) @ float(W)^T with fp32 sums, as vdpbf16ps up to summation order; each
    row bitwise what it is alone, at widths below, at and above a tile's 16 inputs, and padded edges (37 x 576:
    the transposed packing with a partial last chunk; 64 x 1536 x 577: full and partial C tiles)."""
    if not kernels.amx_active():
        pytest.skip("no AMX tiles on this CPU")
    torch.manual_seed(0)
    x, w, b = torch.randn(T, K), torch.randn(N, K).bfloat16(), torch.randn(N)
    tiles, = kernels.amx_tiles([w])
    got = kernels.linear_bf16(x, w, b, True, tiles)
    want = F.linear(x.bfloat16().double(), w.double(), b.double())
    assert (got.double() - want).abs().max().item() < 1e-5 * K ** 0.5 * want.abs().max().item()
    assert not torch.equal(got, kernels.linear_bf16(x, w, b, True)) or K <= 32  # another summation order
    rows = torch.cat([kernels.linear_bf16(x[i:i + 1], w, b, True, tiles) for i in range(T)])
    assert torch.equal(got, rows)
    unbiased = kernels.linear_bf16(x, w, None, True, tiles)  # bit for bit, the signs of zeros too
    rows = torch.cat([kernels.linear_bf16(x[i:i + 1], w, None, True, tiles) for i in range(T)])
    assert torch.equal(unbiased.view(torch.int32), rows.view(torch.int32))


@pytest.mark.parametrize("round_inputs", [False, True])
def test_bf16_linear_takes_wide_passes_in_kernel_sized_parts(round_inputs):
    """More than MAX_ROWS rows: MAX_ROWS per kernel call, so each row is bitwise what it is alone."""
    torch.manual_seed(3)
    x, w, b = torch.randn(2 * kernels.MAX_ROWS + 5, 96), torch.randn(37, 96).bfloat16(), torch.randn(37)
    wide = kernels.linear_bf16(x, w, b, round_inputs)
    assert wide.shape == (2 * kernels.MAX_ROWS + 5, 37)
    for i in (0, kernels.MAX_ROWS - 1, kernels.MAX_ROWS, 2 * kernels.MAX_ROWS + 4):
        assert torch.equal(wide[i], kernels.linear_bf16(x[i:i + 1], w, b, round_inputs)[0])


def test_bf16_linear_declines_what_it_cannot_run():
    w = torch.randn(8, 32).bfloat16()
    assert kernels.linear_bf16(torch.randn(2, 32).double(), w) is None
    assert kernels.linear_bf16(torch.randn(2, 32), w.float()) is None


def test_rmsnorm_and_silu_mul_match_torch():
    x, w = torch.randn(4, 576), torch.rand(576)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 2 * 100)
    torch.testing.assert_close(kernels.silu_mul(gu), F.silu(gu[:, :100]) * gu[:, 100:], atol=1e-5, rtol=1e-5)


def test_rmsnorm_and_silu_mul_rows_do_not_depend_on_the_split():
    """From 32 rows (a prompt's pass) the rows go over the threads; each row's bits are those it gets alone."""
    x, w, gu = torch.randn(100, 576), torch.rand(576), torch.randn(100, 2 * 1536)
    alone_norm = torch.cat([kernels.rms_norm(x[i:i + 1], w, 1e-5) for i in range(100)])
    alone_silu = torch.cat([kernels.silu_mul(gu[i:i + 1]) for i in range(100)])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(kernels.rms_norm(x, w, 1e-5), alone_norm)
        assert torch.equal(kernels.silu_mul(gu), alone_silu)
    finally:
        torch.set_num_threads(before)


def _layer_and_inputs(T, past, seed=0, dims=(9, 3, 64), max_len=128, kv_dtype=torch.float32):
    """A tiny attention layer (default 9 query heads, 3 kv heads, D 64), a filled cache (of kv_dtype), T new
    tokens."""
    from specdec.cache.kv_cache import KVCache
    from specdec.model.layers import Rotary
    torch.manual_seed(seed)
    Hq, Hkv, D = dims
    rotary = Rotary(D, 10000.0, None, max(512, max_len))
    cache = KVCache(2, 1, Hkv, D, max_len, kv_dtype)
    cache.k.normal_(), cache.v.normal_()
    cache.length = past
    qkv = torch.randn(1, T, (Hq + 2 * Hkv) * D)
    return rotary, cache, qkv, (Hq, Hkv, D)


def _torch_attention(rotary, cache, qkv, dims, positions, block_mask):
    from specdec.model.layers import apply_rotary
    Hq, Hkv, D = dims
    T = qkv.shape[1]
    q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = (t.view(1, T, -1, D).transpose(1, 2) for t in (q, k, v))
    cos, sin = rotary(positions, torch.float32)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    mask = cache.attention_mask(block_mask, T)
    k_all, v_all = cache.write(1, k, v)
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, T, -1)


def _tree(T: int, past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token tree's mask and positions: node i's parent is (i - 1) // 2, positions are depths."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, T)]
    block_mask = torch.eye(T, dtype=torch.bool)
    depth = [0] * T
    for i in range(1, T):
        block_mask[i] |= block_mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return block_mask, torch.tensor([[past + d for d in depth]])


# past 37: one split of keys (attention_split.h's KEY_SPLIT, 128); 300: three, folded; 2300: eighteen.
# A bfloat16 cache: the kernel rounds what it writes as torch does and reads it back widened.
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [37, 300, 2300])
@pytest.mark.parametrize("T,tree", [(1, False), (5, False), (7, True)])
def test_fused_attention_matches_torch(T, tree, past, kv_dtype):
    from specdec.kernels.attention import FusedAttention
    positions = torch.arange(past, past + T)[None]
    block_mask = None
    if tree:
        block_mask, positions = _tree(T, past)
    rotary, cache, qkv, dims = _layer_and_inputs(T, past, max_len=past + 64, kv_dtype=kv_dtype)
    fused = FusedAttention.build(rotary, positions, block_mask, cache, qkv, dims[0])
    assert fused is not None and fused.kv_bf16 == (kv_dtype is torch.bfloat16)
    got = fused(qkv, 1, *dims)
    k_written, v_written = cache.k[1, 0, :, past:past + T].clone(), cache.v[1, 0, :, past:past + T].clone()
    want = _torch_attention(rotary, cache, qkv, dims, positions, block_mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # rotary's last bit may differ from torch's, and move a key's bf16 rounding by one step (2^-8 relative)
    tol = dict(atol=1e-6, rtol=1e-5) if kv_dtype is torch.float32 else dict(atol=1e-6, rtol=2 ** -7)
    torch.testing.assert_close(k_written, cache.k[1, 0, :, past:past + T], **tol)
    assert torch.equal(v_written, cache.v[1, 0, :, past:past + T])


@pytest.mark.parametrize("past", [37, 300])
def test_a_nan_key_gives_nan_attention_as_torch(past):
    """A visible NaN score was dropped (max_ps and a compare skip NaNs, and the exponential clamped it to a
    weight of ~0): a diverging model's NaN keys went unnoticed where torch's softmax gives NaN."""
    from specdec.kernels.attention import FusedAttention
    T = 3
    positions = torch.arange(past, past + T)[None]
    rotary, cache, qkv, dims = _layer_and_inputs(T, past, max_len=past + 64)
    cache.k[1, 0, 0, 5] = float("nan")  # layer 1, kv head 0, position 5: every query of its heads sees it
    fused = FusedAttention.build(rotary, positions, None, cache, qkv, dims[0])
    got = fused(qkv, 1, *dims)
    want = _torch_attention(rotary, cache, qkv, dims, positions, None)
    assert want.isnan().any() and not want.isnan().all()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-4)


def test_fused_attention_rounds_a_bf16_caches_values_as_torch():
    """What the kernel writes into a bfloat16 cache is torch's rounding of the fp32 value, bit for bit: ties
    to even, values past bf16's largest to inf, NaN kept a NaN, subnormals and signed zeros as they are."""
    from specdec.kernels.attention import FusedAttention
    T, past = 4, 10
    rotary, cache, qkv, (Hq, Hkv, D) = _layer_and_inputs(T, past, max_len=64, kv_dtype=torch.bfloat16)
    one = torch.tensor(1.0).view(torch.int32)
    special = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.3895e38, -3.4e38, float("nan"),
                            float("inf"), -0.0, 1e-40, -1e-40, 2 ** -133, float((one + 0x7fff).view(torch.float32)),
                            float((one + 0x8001).view(torch.float32))])
    v = qkv[0, :, (Hq + Hkv) * D:]  # the new tokens' values: [T, Hkv D], a view into qkv
    v[0, :len(special)] = special
    positions = torch.arange(past, past + T)[None]
    FusedAttention.build(rotary, positions, None, cache, qkv, Hq)(qkv, 1, Hq, Hkv, D)
    written = cache.v[1, 0, :, past:past + T].transpose(0, 1).reshape(T, Hkv * D)  # [T, Hkv D]
    want = v.to(torch.bfloat16)
    assert torch.equal(written.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    assert torch.equal(written.isnan(), want.isnan()) and bool(want.isnan().any())


# head layouts beyond SmolLM2's (9 query heads over 3 kv heads): multi-head, Qwen2.5-0.5B's 7-head
# groups (work units of 3 and 4 queries), multi-query with D 128, D 40 (8-lane scores where the CPU has
# AVX-512: D not a multiple of 16) and D 20 (the scalar path: D not a multiple of 8)
HEAD_LAYOUTS = [(9, 3, 64), (4, 4, 32), (14, 2, 64), (8, 1, 128), (4, 2, 40), (4, 2, 20)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [45, 300])
@pytest.mark.parametrize("dims", HEAD_LAYOUTS)
@pytest.mark.parametrize("T", [1, 6])
def test_fused_attention_matches_torch_for_head_layouts(dims, T, past, kv_dtype):
    """(D 40 and D 20 read a bf16 cache through the 8-lane and the scalar loads.)"""
    from specdec.kernels.attention import FusedAttention
    positions = torch.arange(past, past + T)[None]
    rotary, cache, qkv, dims = _layer_and_inputs(T, past, dims=dims, max_len=512, kv_dtype=kv_dtype)
    got = FusedAttention.build(rotary, positions, None, cache, qkv, dims[0])(qkv, 1, *dims)
    want = _torch_attention(rotary, cache, qkv, dims, positions, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# past 30: one split of keys; 250 + 9 new tokens: the rows cross the split boundary at 256 (two splits, then
# three); 2040 + 12: sixteen splits, then seventeen; 0 + 48 and 70 + 64: prompt-shaped passes (causal, full
# work units of 8 queries)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past,T", [(30, 6), (250, 9), (2040, 12), (0, 48), (70, 64)])
@pytest.mark.parametrize("dims", HEAD_LAYOUTS)
def test_fused_attention_is_batch_invariant(dims, past, T, kv_dtype):
    """Row t of a pass over T tokens equals, bit for bit, a single-token pass at that position (a bfloat16
    cache too: the pass reads its own new keys back rounded, as the later single-token passes do)."""
    from specdec.kernels.attention import FusedAttention
    rotary, cache, qkv, dims = _layer_and_inputs(T, past, dims=dims, max_len=past + 64, kv_dtype=kv_dtype)
    positions = torch.arange(past, past + T)[None]
    block = FusedAttention.build(rotary, positions, None, cache, qkv, dims[0])(qkv, 1, *dims)
    rows = []
    for t in range(T):
        cache.length = past + t
        one = FusedAttention.build(rotary, positions[:, t:t + 1], None, cache, qkv[:, t:t + 1], dims[0])
        rows.append(one(qkv[:, t:t + 1], 1, *dims))
    assert torch.equal(block, torch.cat(rows, dim=1))


def test_fused_attention_leaves_to_torch_what_would_keep_too_many_partials(monkeypatch):
    """The kernel keeps a partial softmax per query and split of 128 keys; past MAX_PARTIALS_BYTES the pass
    runs the torch path instead of growing the kept buffer."""
    from specdec.kernels import attention
    past, T = 300, 4
    rotary, cache, qkv, dims = _layer_and_inputs(T, past, max_len=512)
    x = torch.zeros(1, T, dims[0] * dims[2])  # the hidden state the model passes: Hq x D wide
    positions = torch.arange(past, past + T)[None]
    assert attention.FusedAttention.build(rotary, positions, None, cache, x, dims[0]) is not None
    need = T * dims[0] * 3 * (dims[2] + 2) * 4  # 304 keys: three splits
    monkeypatch.setattr(attention, "MAX_PARTIALS_BYTES", need - 1)
    assert attention.FusedAttention.build(rotary, positions, None, cache, x, dims[0]) is None
    assert attention.partials_fit(T, dims[0], dims[2], 128)  # one split keeps no partials
    # the model's head count, not hidden / head_dim: 9 heads of 64 over a 192-wide hidden state (as Gemma 3
    # 270M: 4 heads of 256 over 640) keep 3x the partials the hidden width suggests
    narrow = torch.zeros(1, T, 3 * dims[2])
    assert attention.FusedAttention.build(rotary, positions, None, cache, narrow, dims[0]) is None


def test_prune_builds_keeps_the_newest_and_other_kernels(tmp_path):
    import os
    names = [f"libspecdec_layer-{i:016x}.so" for i in range(6)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    other = tmp_path / "libspecdec_other-0000000000000000.so"
    other.write_bytes(b"")
    newest = tmp_path / names[1]  # just written: the one in use, whatever the clock says of the others
    os.utime(newest, (5000, 5000))
    deleted = kernels.prune_builds(newest, keep=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([names[1], names[5], names[4], other.name])
    assert sorted(p.name for p in deleted) == sorted([names[0], names[2], names[3]])


@pytest.mark.parametrize("V", [7, 31, 32, 100, 49152])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_top_indices_match_torch(V, k):
    """topk.c: each row's k largest, largest first; k = 1 is torch.argmax; blocks of 32 and tails."""
    from specdec.sampler import argmax, top_tokens
    if V < k:
        pytest.skip("fewer values than k")
    torch.manual_seed(V + k)
    x = torch.randn(5, V)
    got = kernels.top_indices(x, k)
    assert got is not None and got.dtype is torch.int64
    assert torch.equal(got, torch.topk(x, k, dim=-1).indices)
    assert torch.equal(argmax(x), x.argmax(-1)) and torch.equal(top_tokens(x, k), got)
    three = torch.randn(2, 3, V)
    assert torch.equal(argmax(three), three.argmax(-1))


def test_top_indices_ties_and_edge_rows_follow_torch():
    from specdec.sampler import argmax
    x = torch.zeros(3, 100)
    x[0, 40] = x[0, 70] = 2.0  # a tie: the lower index, as torch.argmax
    x[1, 99] = 1.0  # the maximum in the tail after the blocks of 32
    x[2] = torch.arange(100.0).flip(0)  # the maximum first
    assert kernels.top_indices(x, 1)[:, 0].tolist() == [40, 99, 0] == x.argmax(-1).tolist()
    assert kernels.top_indices(x, 2)[0].tolist() == [40, 70]
    # rows the kernel does not answer go to torch: a NaN, too few values above -inf, another dtype
    nan = torch.randn(2, 64)
    nan[1, 33] = float("nan")
    masked = torch.full((1, 64), float("-inf"))
    masked[0, 5] = 0.0
    assert kernels.top_indices(nan, 1) is None and torch.equal(argmax(nan), nan.argmax(-1))
    assert kernels.top_indices(masked, 2) is None and kernels.top_indices(masked, 1).tolist() == [[5]]
    assert kernels.top_indices(x.bfloat16(), 1) is None and torch.equal(argmax(x.bfloat16()), x.bfloat16().argmax(-1))
    strided = torch.randn(4, 200)[:, ::2]  # not contiguous
    assert torch.equal(argmax(strided), strided.argmax(-1))


def test_the_kernels_refuse_what_they_would_read_past(tmp_path):
    """linear_bf16, the int8/int4 kernel and rms_norm handed their pointers to C without checking widths:
    an input narrower than the weight read past its rows, a short norm weight past its end, and a strided
    bias's temporary copy was freed before the kernel read it. Each now falls back to torch, which raises
    or computes right."""
    from specdec.quant.bf16 import Bf16Weight
    from specdec.quant.qlinear import QuantizedWeight
    from specdec.quant.schemes import QuantScheme, quantize

    torch.manual_seed(0)
    w = torch.randn(8, 64)
    for weight in (Bf16Weight(w), QuantizedWeight(quantize(w, QuantScheme(8, 32, True))),
                   QuantizedWeight(quantize(w, QuantScheme(4, 32, False)))):
        with pytest.raises(RuntimeError):
            weight.linear(torch.randn(1, 32))
        with pytest.raises(RuntimeError):
            weight.linear(torch.randn(1, 64), torch.randn(4))
        assert weight.linear(torch.randn(0, 64)).shape == (0, 8)
    bias = torch.randn(16)[::2]  # strided
    x = torch.randn(3, 64)
    got = kernels.linear_bf16(x, w.bfloat16(), bias)
    if got is not None:
        torch.testing.assert_close(got, F.linear(x, w.bfloat16().float(), bias), rtol=1e-5, atol=1e-5)
    assert kernels.linear_bf16(torch.randn(1, 32), w.bfloat16()) is None
    with pytest.raises(RuntimeError):
        kernels.rms_norm(torch.randn(2, 64), torch.ones(8), 1e-6)
    strided = torch.randn(128)[::2]
    x = torch.randn(2, 64)
    torch.testing.assert_close(kernels.rms_norm(x, strided, 1e-6), F.rms_norm(x, (64,), strided, 1e-6))
