"""KV cache rollback and keep-positions, checked against recomputation from scratch."""
import torch

from specdec.model.loader import load_model


def _logits(model, cache, ids, start):
    return model(torch.tensor([ids]), torch.arange(start, start + len(ids))[None], cache).logits[0]


def test_rollback_equals_recompute(tiny_dir):
    model = load_model(tiny_dir("llama"))
    prefix, wrong, right = [5, 6, 7, 8], [100, 200, 300], [9, 10]
    cache = model.new_cache(32)
    _logits(model, cache, prefix, 0)
    _logits(model, cache, wrong, 4)
    cache.rollback(4)
    got = _logits(model, cache, right, 4)
    fresh = model.new_cache(32)
    want = _logits(model, fresh, prefix + right, 0)[4:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_keep_positions_equals_recompute(tiny_dir):
    """Score a block, keep slots 1 and 3 of it (a tree path), continue: same as never seeing the rest."""
    model = load_model(tiny_dir("qwen2"))
    prefix, block = [5, 6, 7], [11, 12, 13, 14]
    cache = model.new_cache(32)
    _logits(model, cache, prefix, 0)
    # tree: 11 and 13 are a path only if they were computed with the right positions/mask;
    # use a mask where 13 sees 11 only (parents: 12 <- root, 13 <- 11, 14 <- 12)
    mask = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([[3, 3, 4, 4]])
    model(torch.tensor([block]), pos, cache, block_mask=mask)
    cache.keep([3, 5], start=3)  # slots of 11 and 13
    assert cache.length == 5
    got = _logits(model, cache, [42], 5)
    want = _logits(model, model.new_cache(32), prefix + [11, 13, 42], 0)[-1:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_cache_is_preallocated(tiny_dir):
    model = load_model(tiny_dir("llama"))
    cache = model.new_cache(16)
    ptr = cache.k.data_ptr()
    for i in range(10):
        _logits(model, cache, [3 + i], i)
    assert cache.k.data_ptr() == ptr and cache.length == 10
