"""The engine's paged attention kernel: a batched pass over ragged rows (chain, tree, padding) gives
each row the logits of that sequence decoded alone in a static cache, and the pool holds its k/v."""
import pytest
import torch

from specdec.cache.kv_cache import kv_dtype
from specdec.cache.paged_cache import BatchKV, PagedKVPool
from specdec.kernels import attention
from specdec.model.loader import load_model
from specdec.spec.tree import tree_mask, tree_positions

BLOCK = 4


@pytest.fixture(autouse=True)
def _need_kernel():
    if attention._load() is None:
        pytest.skip("attention kernel unavailable")


def _batched(model, pool, tables, past, new_tokens, new_positions, row_masks):
    """One left-padded forward over the rows' new tokens; logits [B, T, V]."""
    B, T = len(past), max(len(t) for t in new_tokens)
    ids, pos = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for b, (toks, p) in enumerate(zip(new_tokens, new_positions)):
        ids[b, T - len(toks):], pos[b, T - len(toks):] = torch.tensor(toks), torch.tensor(p)
    kv = BatchKV(pool, tables, past, [len(t) for t in new_tokens], row_masks)
    return model(ids, pos, kv).logits


def _run(model, prompts, new, trees, num_blocks=64):
    pool = PagedKVPool.for_model(model.config, num_blocks, BLOCK, kv_dtype(model))
    tables, nxt = [], 0
    for p in prompts:  # disjoint blocks, in an order that is not the sequences' own
        n = (len(p) + 8 + BLOCK - 1) // BLOCK
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))
        nxt += n
    for b, p in enumerate(prompts):  # prefill each alone
        _batched(model, pool, [tables[b]], [0], [p], [list(range(len(p)))], None)
    positions, masks = [], []
    for b, p in enumerate(prompts):
        if trees[b]:
            parents = [(i - 1) // 2 - 1 for i in range(1, len(new[b]))]  # a binary tree, row 0 the root
            mask, depth = tree_mask(parents), tree_positions(parents).tolist()
            positions.append([len(p) + d for d in depth])
            masks.append(mask)
        else:
            positions.append(list(range(len(p), len(p) + len(new[b]))))
            masks.append(None)
    logits = _batched(model, pool, tables, [len(p) for p in prompts], new, positions, masks)
    return logits, pool, tables, positions, masks


# prompts of 3-12 tokens: one split of keys (attention.c's KEY_SPLIT, 128); of 300 and 140: three and two,
# beside a short row whose later splits are all padding
# A bfloat16 pool and cache (kv_cache_dtype): the same, bit for bit.
@pytest.mark.parametrize("kv_cache_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(7, 12, 3), (300, 140, 9)])
def test_paged_kernel_rows_equal_single_sequence_static_decoding(tiny_dir, monkeypatch, lengths, kv_cache_dtype):
    model = load_model(tiny_dir("llama"), torch.float32)
    model.kv_cache_dtype = kv_cache_dtype
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    new = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 3, 5)]
    trees = [False, False, True]
    calls, build = [], attention.PagedAttention.build

    def counted(cls, *args):
        calls.append(build(*args))
        return calls[-1]

    monkeypatch.setattr(attention.PagedAttention, "build", classmethod(counted))
    logits, pool, tables, positions, masks = _run(model, prompts, new, trees, num_blocks=160)
    # every pass ran the kernel (a prompt of over PAGED_ROWS tokens in column groups), the batched one too
    assert len(calls) == len(prompts) + 1 and all(c is not None for c in calls)
    T = logits.shape[1]
    for b, p in enumerate(prompts):
        cache = model.new_cache(320)
        model(torch.tensor([p]), torch.arange(len(p))[None], cache)
        want = model(torch.tensor([new[b]]), torch.tensor([positions[b]]), cache, block_mask=masks[b]).logits[0]
        got = logits[b, T - len(new[b]):]
        assert torch.equal(got, want)  # the same kernels, row for row: bitwise
        slots = pool.slots(tables[b], 0, len(p) + len(new[b]))
        # the pool holds the k the static cache holds, at the sequence's own slots
        assert torch.equal(pool.k[:, slots].transpose(1, 2), cache.k[:, 0, :, :len(slots)])


@pytest.mark.parametrize("kv_cache_dtype", [None, torch.bfloat16])
def test_paged_kernel_equals_torch_path(tiny_dir, monkeypatch, kv_cache_dtype):
    model = load_model(tiny_dir("qwen2"), torch.float32)
    model.kv_cache_dtype = kv_cache_dtype
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (9, 2)]
    new = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (4, 1)]
    got, pool_c, *_ = _run(model, prompts, new, [True, False])
    monkeypatch.setattr(attention.PagedAttention, "build", classmethod(lambda cls, *a: None))
    want, pool_t, *_ = _run(model, prompts, new, [True, False])
    for b in range(2):
        n = len(new[b])
        torch.testing.assert_close(got[b, -n:], want[b, -n:], atol=1e-5, rtol=1e-5)
    assert pool_c.k.dtype == pool_t.k.dtype == kv_dtype(model)
    tol = {} if kv_cache_dtype is None else dict(atol=1e-6, rtol=2 ** -7)  # (bf16: a key's rounding may move a step)
    torch.testing.assert_close(pool_c.k, pool_t.k, **({"atol": 1e-6, "rtol": 1e-5} | tol))
    torch.testing.assert_close(pool_c.v, pool_t.v, atol=1e-6, rtol=1e-5)
