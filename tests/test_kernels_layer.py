"""The one-call decoder layer (layer.c), one layer a call or the whole stack in one, gives bitwise the
per-op path's output and KV cache."""
import pytest
import torch

import specdec.model.llama as llama
from specdec.kernels import MAX_ROWS
from specdec.kernels import layer as fused_layer
from specdec.model.loader import load_model
from specdec.kernels import amx_active
from specdec.quant.bf16 import Bf16Scheme, set_bf16_inputs, use_amx_tiles
from specdec.quant.qmodel import quantize_model
from specdec.quant.schemes import QuantScheme
from specdec.spec.tree import tree_mask, tree_positions


@pytest.fixture(autouse=True)
def _need_kernel():
    if fused_layer._load() is None:
        pytest.skip("layer kernel unavailable")


MODES = ["layer", "stack"]  # layer.c one layer a call, or the model's whole stack in one call


def _count_fused_layers(monkeypatch, mode: str) -> list[bool]:
    """Route every layer through the per-op path ("per-op"), layer.c one layer a call ("layer") or the
    whole stack in one call ("stack"); the list records, per layer of a decode-shaped pass, whether
    layer.c ran it."""
    calls = []

    def one(*args):
        out = fused_layer.decoder_layer(*args) if mode == "layer" else None
        calls.append(out is not None)
        return out

    def stack(layers, layer_ids, x, fused, keep=(), pack=False):
        out = fused_layer.decoder_layers(layers, layer_ids, x, fused, keep, pack) if mode == "stack" else None
        calls.extend([True] * len(layer_ids) if out is not None else [])
        return out

    monkeypatch.setattr(llama, "decoder_layer", one)
    monkeypatch.setattr(llama, "decoder_layers", stack)
    return calls


def _run(model, ids, monkeypatch, mode: str, wide_prompt: bool = False):
    """Prefill P = MAX_ROWS + 4 tokens (the per-op path; with wide_prompt, linears on AMX tiles, layer.c),
    3 single-token steps, a causal block of 4 and a tree of 7: all logits and the cache."""
    calls = _count_fused_layers(monkeypatch, mode)
    P = MAX_ROWS + 4
    cache = model.new_cache(P + 20)
    outs = [model(ids[:, :P], torch.arange(P)[None], cache).logits]
    if wide_prompt and mode != "per-op":  # P > MAX_ROWS rows: layer.c takes them where every linear is on tiles
        assert calls and all(calls)
    else:  # else it declines them: the per-op path (attention in C, in parts)
        assert not any(calls)
    calls.clear()
    for i in range(P, P + 3):
        outs.append(model(ids[:, i:i + 1], torch.tensor([[i]]), cache).logits)
    outs.append(model(ids[:, P + 3:P + 7], torch.arange(P + 3, P + 7)[None], cache).logits)
    parents = [(i - 1) // 2 - 1 for i in range(1, 7)]  # a binary tree of 7 rows (row 0 the root)
    mask, depth = tree_mask(parents), tree_positions(parents).tolist()
    outs.append(model(ids[:, P + 7:P + 14], torch.tensor([[P + 7 + d for d in depth]]), cache, block_mask=mask).logits)
    return outs, cache, calls


BF16_DOT = "bf16 weights, bf16 inputs"  # Bf16Scheme with set_bf16_inputs (bf16dot.c)
BF16_AMX = "bf16 weights, bf16 inputs, AMX tiles"  # and use_amx_tiles (bf16amx.c; skipped without AMX)


def _quantized(model, scheme):
    if scheme is None:
        return model
    if scheme in (BF16_DOT, BF16_AMX):
        model = quantize_model(model, Bf16Scheme())
        weights = set_bf16_inputs(model, True)
        assert weights > 0
        if scheme == BF16_AMX:
            if not amx_active():
                pytest.skip("no AMX tiles on this CPU")
            assert use_amx_tiles(model) == weights
        return model
    return quantize_model(model, scheme)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("scheme", [None, QuantScheme(8, 32, True), QuantScheme(4, 32, False), Bf16Scheme(), BF16_DOT,
                                    BF16_AMX], ids=["fp32", "int8", "int4", "bf16", "bf16-dot", "bf16-amx"])
def test_fused_layer_is_bitwise_the_per_op_path(tiny_dir, monkeypatch, arch, scheme, mode):
    model = _quantized(load_model(tiny_dir(arch), torch.float32), scheme)
    ids = torch.randint(0, 1000, (1, MAX_ROWS + 18), generator=torch.Generator().manual_seed(0))
    want, want_cache, _ = _run(model, ids, monkeypatch, "per-op")
    got, got_cache, calls = _run(model, ids, monkeypatch, mode, wide_prompt=scheme == BF16_AMX)
    n_layers = len(model.layers)
    assert len(calls) == 5 * n_layers and all(calls)  # the 5 passes after the prefill, every layer fused
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    n = want_cache.length
    assert got_cache.length == n
    assert torch.equal(got_cache.k[..., :n, :], want_cache.k[..., :n, :])
    assert torch.equal(got_cache.v[..., :n, :], want_cache.v[..., :n, :])


def test_fused_layer_redescribes_moved_weights(tiny_dir):
    """Replacing a weight tensor (a new address) is picked up, not read through a stale pointer."""
    model = load_model(tiny_dir("llama"), torch.float32)
    layer = model.layers[0]
    first = fused_layer._layer_weights(layer)
    assert first is not None and fused_layer._layer_weights(layer) is first
    with torch.no_grad():
        layer.o_proj.weight.data = layer.o_proj.weight.data.clone()
    second = fused_layer._layer_weights(layer)
    assert second is not first and second.o_proj.weight == layer.o_proj.weight.data_ptr()
    import copy
    layer.down = copy.deepcopy(layer.down)  # a new module (and weight) under the same name
    third = fused_layer._layer_weights(layer)
    assert third is not second and third.down.weight == layer.down.weight.data_ptr()
    assert fused_layer._layer_weights(layer) is third  # nothing moved: the description is kept


def test_fused_layer_redescribes_when_a_bf16_weight_changes_kernel(tiny_dir):
    """A bf16 weight's input rounding (a plain attribute, not a tensor) picks the kernel: flipping it
    describes the layer again."""
    from specdec.kernels.layer import LIN_BF16, LIN_BF16_DOT
    model = load_model(tiny_dir("llama"), torch.bfloat16)
    layer = model.layers[0]
    w = layer.gate_up.weight
    w.round_inputs = False
    first = fused_layer._layer_weights(layer)
    assert first is not None and first.gate_up.kind == LIN_BF16
    w.round_inputs = True
    second = fused_layer._layer_weights(layer)
    assert second is not first and second.gate_up.kind == LIN_BF16_DOT


def _run_paged(model, monkeypatch, mode: str):
    """Three sequences prefilled alone, then one left-padded batch of 1, 3 and 5
    new tokens (a chain, a chain, a tree of 5) over the paged pool: the batch's logits and the pool."""
    from specdec.cache.paged_cache import BatchKV, PagedKVPool
    calls = _count_fused_layers(monkeypatch, mode)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (40, 12, 35)]
    new = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 3, 5)]
    pool = PagedKVPool.for_model(model.config, 32, 8, torch.float32)
    tables = [[3, 1, 0, 2, 4, 5, 6], [9, 8], [10, 12, 11, 13, 14, 15]]  # not in the sequences' order
    for p, table in zip(prompts, tables):
        model(torch.tensor([p]), torch.arange(len(p))[None], BatchKV(pool, [table], [0], [len(p)]))
    parents = [-1, -1, 0, 1]  # drafted nodes 1-4 under the root row: a tree of 5 rows
    positions = [[40], [12, 13, 14], [35 + d for d in tree_positions(parents).tolist()]]
    ids, pos = torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long)
    for b, (toks, p) in enumerate(zip(new, positions)):
        ids[b, 5 - len(toks):], pos[b, 5 - len(toks):] = torch.tensor(toks), torch.tensor(p)
    del calls[:]
    kv = BatchKV(pool, tables, [len(p) for p in prompts], [len(t) for t in new], [None, None, tree_mask(parents)])
    logits = model(ids, pos, kv).logits  # [3, 5, V]
    real = [logits[b, 5 - len(t):] for b, t in enumerate(new)]  # the padding's logits are not computed when packed
    return torch.cat(real), logits, pool, calls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheme", [None, QuantScheme(4, 32, False), Bf16Scheme(), BF16_DOT, BF16_AMX],
                         ids=["fp32", "int4", "bf16", "bf16-dot", "bf16-amx"])
def test_fused_layer_on_the_paged_batch_is_bitwise_the_per_op_path(tiny_dir, monkeypatch, scheme, mode):
    model = _quantized(load_model(tiny_dir("qwen2"), torch.float32), scheme)
    want, _, want_pool, _ = _run_paged(model, monkeypatch, "per-op")
    got, grid, got_pool, calls = _run_paged(model, monkeypatch, mode)
    assert len(calls) == len(model.layers) and all(calls)  # the batch of 3 x 5 rows ran fused
    assert torch.equal(got, want)
    assert torch.equal(got_pool.k, want_pool.k) and torch.equal(got_pool.v, want_pool.v)
    if mode == "stack":  # packed: the linears ran on the 9 real tokens; the 6 padding rows' logits are zeros
        assert not grid[0, :4].any() and not grid[1, :2].any() and grid[2].abs().sum(-1).gt(0).all()


def test_stacked_segments_keep_the_requested_hidden_states(tiny_dir, monkeypatch):
    """With output_layers (EAGLE-3's features) the stack still runs in one call, copying the hidden
    states after those layers: they and the logits are bitwise the per-op path's."""
    model = load_model(tiny_dir("llama"), torch.float32)
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(3))
    results = {}
    for mode in ("per-op", "stack"):
        calls = _count_fused_layers(monkeypatch, mode)
        cache = model.new_cache(32)
        model(ids[:, :20], torch.arange(20)[None], cache)
        del calls[:]
        out = model(ids[:, 20:24], torch.arange(20, 24)[None], cache, output_layers=(0, 2))
        results[mode] = (out, calls)
    (want, _), (got, calls) = results["per-op"], results["stack"]
    assert calls == [True] * len(model.layers)  # every layer of the 4-token pass ran in layer.c
    assert sorted(got.layer_hidden) == [0, 2]
    for i in (0, 2):
        assert torch.equal(got.layer_hidden[i], want.layer_hidden[i])
    assert torch.equal(got.logits, want.logits)


def test_a_layers_description_follows_its_zero_points(tiny_dir):
    """The C description of a layer holds its packed weights' zero-point pointers; replacing them alone (a
    buffer swap) kept the old pointer, which _watched did not watch."""
    from specdec.kernels.layer import _layer_weights
    from specdec.model.loader import load_model
    from specdec.quant.qmodel import quantize_model
    from specdec.quant.schemes import QuantScheme

    model = quantize_model(load_model(tiny_dir("llama"), torch.float32), QuantScheme(4, 32, False))
    layer = model.layers[0]
    first = _layer_weights(layer)
    assert first is not None and _layer_weights(layer) is first  # kept while nothing changes
    w = layer.qkv.weight
    w.zeros = w.zeros.clone()
    assert _layer_weights(layer) is not first
