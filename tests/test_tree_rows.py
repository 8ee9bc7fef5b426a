"""A token tree's verify rows equal plain decoding of each node's root path, bitwise.

A tree node's ancestors are not contiguous in the pass's key columns (siblings sit between them), and
near a multiple of the attention kernel's key split (128) an ancestor's column can fall in the next
split. The kernel attends each row's keys in the order and splits of their positions, as a single-token
pass does; before that it used the columns, and a real-model EAGLE-2 tree picked another token than
plain greedy decoding at a near tie (run S30, bf16: logits 20.597 vs 20.591 after a 1-ulp attention
difference several passes earlier)."""
import pytest
import torch

from specdec.cache.paged_cache import BatchKV, PagedKVPool
from specdec.kernels import attention
from specdec.model.loader import load_model
from specdec.spec.tree import root_path_columns, tree_mask, tree_positions

# drafted nodes under the root row 0: siblings at every depth, the deepest path not the leftmost
PARENTS = [-1, -1, -1, 1, 1, 2, 4, 5, 6]


@pytest.fixture(autouse=True)
def _need_kernel():
    if attention._load() is None:
        pytest.skip("attention kernel unavailable")


def _plain_rows(model, prompt, tokens, parents, max_len):
    """Each node's logits from single-token passes over its root path (plain decoding's passes)."""
    rows = []
    paths = [[0]]
    for j, par in enumerate(parents):
        paths.append(paths[par + 1] + [j + 1])
    for path in paths:
        cache = model.new_cache(max_len)
        model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
        for node in path:
            pos = cache.length
            logits = model(torch.tensor([[tokens[node]]]), torch.tensor([[pos]]), cache).logits[0, -1]
        rows.append(logits)
    return torch.stack(rows)


# past 40: one key split; 124: the tree's columns cross the split at 128, its depths (<= 4) do not all
@pytest.mark.parametrize("past", [40, 124])
def test_static_tree_rows_equal_plain_decoding(tiny_dir, past):
    model = load_model(tiny_dir("llama"), torch.float32)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (past,), generator=g).tolist()
    tokens = torch.randint(0, 1000, (1 + len(PARENTS),), generator=g).tolist()
    cache = model.new_cache(past + 32)
    model(torch.tensor([prompt]), torch.arange(past)[None], cache)
    got = model(torch.tensor([tokens]), (past + tree_positions(PARENTS))[None], cache,
                block_mask=tree_mask(PARENTS)).logits[0]
    want = _plain_rows(model, prompt, tokens, PARENTS, past + 32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("past", [40, 124])
def test_paged_tree_rows_equal_plain_decoding(tiny_dir, past):
    """Beside a chain row in one batched pass over the paged pool."""
    model = load_model(tiny_dir("llama"), torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (past, 9)]
    tokens = torch.randint(0, 1000, (1 + len(PARENTS),), generator=g).tolist()
    chain = torch.randint(0, 1000, (3,), generator=g).tolist()
    pool = PagedKVPool.for_model(model.config, 64, 4, torch.float32)
    tables = [list(range(40)), list(range(40, 64))]
    for b, p in enumerate(prompts):
        kv = BatchKV(pool, [tables[b]], [0], [len(p)])
        model(torch.tensor([p]), torch.arange(len(p))[None], kv)
    T = len(tokens)
    ids, pos = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    ids[0], pos[0] = torch.tensor(tokens), past + tree_positions(PARENTS)
    ids[1, T - 3:], pos[1, T - 3:] = torch.tensor(chain), torch.arange(9, 12)
    kv = BatchKV(pool, tables, [past, 9], [T, 3], [tree_mask(PARENTS), None])
    got = model(ids, pos, kv).logits[0]
    assert torch.equal(got, _plain_rows(model, prompts[0], tokens, PARENTS, past + 32))


def test_root_path_columns():
    mask = tree_mask(PARENTS)
    vis, path = root_path_columns(mask)
    depth = tree_positions(PARENTS)
    assert torch.equal(vis, torch.arange(len(depth))[None] <= depth[:, None])
    assert path[8, :4].tolist() == [0, 3, 6, 8]  # row 8: root -> row 3 -> row 6 -> row 8, at depths 0-3
    assert path[9].tolist() == [0, 2, 5, 7, 9, 5, 6, 7, 8, 9]  # past its depth (4): the columns themselves
    assert path[1, :2].tolist() == [0, 1]
    assert root_path_columns(tree_mask([-1, 0, 1])) is None  # a chain: nothing to remap


def test_random_trees_rows_equal_plain_decoding(tiny_dir):
    """Seeded random trees of 2-64 rows after prefixes around the key splits: each row bitwise the
    single-token pass after its parent's (the old kernel failed 22 of 30 such trees)."""
    import copy
    import random

    model = load_model(tiny_dir("llama"), torch.float32)
    rng = random.Random(0)
    for _ in range(6):
        T, past = rng.choice([3, 8, 24, 64]), rng.choice([7, 126, 127, 250])
        parents = [rng.randint(-1, j - 1) for j in range(T - 1)]
        prompt = [rng.randrange(1000) for _ in range(past)]
        tokens = [rng.randrange(1000) for _ in range(T)]
        cache = model.new_cache(past + T)
        model(torch.tensor([prompt]), torch.arange(past)[None], cache)
        got = model(torch.tensor([tokens]), (past + tree_positions(parents))[None], cache,
                    block_mask=tree_mask(parents)).logits[0]
        base = model.new_cache(past + T)
        model(torch.tensor([prompt]), torch.arange(past)[None], base)
        after = {}  # row -> the cache after plain decoding reached it
        for i, tok in enumerate(tokens):
            c = copy.deepcopy(base if i == 0 else after[parents[i - 1] + 1])
            row = model(torch.tensor([[tok]]), torch.tensor([[c.length]]), c).logits[0, -1]
            assert torch.equal(got[i], row), (T, past, i)
            after[i] = c
