"""`forward`: exact parity with mlx-lm, tree verification with explicit positions and masks."""

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_specdec import masks
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.model.forward import forward, rope_at

from conftest import make_tiny_llama, tree_path

PREFIX = [5, 17, 42, 3, 88, 11, 60]


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _assert_parity_with_mlx_lm(model, prompt, steps):
    """Prefill `prompt`, then feed `steps` one at a time; logits must match mlx-lm bit for bit."""
    ours = ContiguousKVCache.for_model(model)
    theirs = make_prompt_cache(model)

    got = forward(model, mx.array(prompt)[None], ours).logits
    want = model(mx.array(prompt)[None], cache=theirs)
    assert got.shape == want.shape == (1, len(prompt), model.args.vocab_size)
    assert mx.array_equal(got, want).item()

    for token in steps:
        got = forward(model, mx.array([[token]]), ours).logits
        want = model(mx.array([[token]]), cache=theirs)
        assert mx.array_equal(got, want).item()
    assert ours.offset == theirs[0].offset == len(prompt) + len(steps)


@pytest.mark.parametrize("tie", [True, False])
def test_forward_matches_mlx_lm_bit_for_bit(tie):
    model = make_tiny_llama(tie=tie)
    _assert_parity_with_mlx_lm(model, PREFIX, [7, 19, 2, 55, 31])


def test_forward_chunked_prefill_matches_mlx_lm():
    """A second multi-token chunk on a non-empty cache uses the bottom-right-aligned causal mask."""
    model = make_tiny_llama(tie=False)
    ours = ContiguousKVCache.for_model(model)
    theirs = make_prompt_cache(model)
    for chunk in ([1, 2, 3, 4], [5, 6, 7], [8]):
        got = forward(model, mx.array(chunk)[None], ours).logits
        want = model(mx.array(chunk)[None], cache=theirs)
        assert mx.array_equal(got, want).item()


def test_forward_without_cache_matches_model():
    model = make_tiny_llama(tie=False)
    tokens = mx.array(PREFIX)[None]
    assert mx.array_equal(forward(model, tokens).logits, model(tokens)).item()


def test_logits_for_selects_positions():
    model = make_tiny_llama(tie=False)
    tokens = mx.array(PREFIX)[None]
    full = forward(model, tokens)
    last = forward(model, tokens, logits_for="last")
    picked = forward(model, tokens, logits_for=mx.array([0, 3]))
    none = forward(model, tokens, logits_for="none")
    assert none.logits is None
    assert none.hidden.shape == (1, len(PREFIX), model.args.hidden_size)
    assert last.logits.shape == (1, 1, model.args.vocab_size)
    assert np.allclose(_np(last.logits[0, 0]), _np(full.logits[0, -1]), atol=1e-6)
    assert np.allclose(_np(picked.logits[0]), _np(full.logits[0, [0, 3]]), atol=1e-6)


def test_rope_at_matches_scalar_offset_exactly():
    model = make_tiny_llama()
    rope = model.model.layers[0].self_attn.rope
    mx.random.seed(1)
    x = mx.random.normal((1, 4, 6, 16))  # (B, H, L, Dh)
    for offset in (0, 1, 13, 250):
        positions = mx.arange(offset, offset + 6)[None]
        assert mx.array_equal(rope_at(rope, x, positions), rope(x, offset=offset)).item()


def test_rope_at_per_token_positions():
    """A token's rotation depends only on its own position, wherever it sits in the sequence."""
    model = make_tiny_llama()
    rope = model.model.layers[0].self_attn.rope
    mx.random.seed(2)
    x = mx.random.normal((1, 2, 3, 16))
    positions = mx.array([[9, 4, 9]])
    rotated = rope_at(rope, x, positions)
    for l, p in enumerate([9, 4, 9]):
        alone = rope(x[:, :, l : l + 1, :], offset=p)
        assert mx.array_equal(rotated[:, :, l : l + 1, :], alone).item()


# A tree hanging off the prefix, in topological order:
#
#   0:a ─ 1:b ─ 2:c ─ 3:d        branch A: a b c d
#       │     └ 4:e              branch B: a b e
#       └ 5:f ─ 6:g              branch C: a f g
#   7:h                          branch D: h (a second root)
TREE_TOKENS = [30, 31, 32, 33, 34, 35, 36, 37]
TREE_PARENTS = [-1, 0, 1, 2, 1, 0, 5, -1]



def _prefilled(model, prefix):
    cache = ContiguousKVCache.for_model(model)
    forward(model, mx.array(prefix)[None], cache, logits_for="none")
    mx.eval(cache.state)
    return cache


def _verify_tree(model, cache, prefix_len):
    positions = masks.tree_positions(TREE_PARENTS, prefix_len)
    mask = masks.prefix_tree_mask(TREE_PARENTS, prefix_len)[None, None]  # (1, 1, N, prefix + N)
    return forward(model, mx.array(TREE_TOKENS)[None], cache, positions=positions, mask=mask).logits


@pytest.mark.parametrize("tie", [True, False])
def test_tree_verification_matches_each_branch_alone(tie):
    model = make_tiny_llama(tie=tie)
    cache = _prefilled(model, PREFIX)
    tree_logits = _verify_tree(model, cache, len(PREFIX))
    assert cache.offset == len(PREFIX) + len(TREE_TOKENS)

    for i in range(len(TREE_TOKENS)):
        path = tree_path(TREE_PARENTS, i)
        sequence = PREFIX + [TREE_TOKENS[j] for j in path]
        alone = forward(model, mx.array(sequence)[None]).logits[0, -1]
        np.testing.assert_allclose(_np(tree_logits[0, i]), _np(alone), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("accepted", [[0, 1, 2, 3], [0, 1, 4], [0, 5, 6], [0, 5], [7], []])
def test_keep_appended_commits_one_branch(accepted):
    model = make_tiny_llama(tie=False)
    cache = _prefilled(model, PREFIX)
    _verify_tree(model, cache, len(PREFIX))
    cache.keep_appended(len(PREFIX), accepted)
    assert cache.offset == len(PREFIX) + len(accepted)

    next_token = 9
    after = forward(model, mx.array([[next_token]]), cache).logits[0, -1]

    sequence = PREFIX + [TREE_TOKENS[j] for j in accepted] + [next_token]
    plain = ContiguousKVCache.for_model(model)
    for token in sequence[:-1]:
        forward(model, mx.array([[token]]), plain, logits_for="none")
    want = forward(model, mx.array([[next_token]]), plain).logits[0, -1]
    np.testing.assert_allclose(_np(after), _np(want), atol=1e-4, rtol=1e-4)
    # and the whole committed cache equals the plain sequence's cache
    for got_kv, want_kv in zip(cache.state, plain.state):
        np.testing.assert_allclose(_np(got_kv), _np(want_kv), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kept_rows", [[[0, 1, 2, 3], [0, 1]], [[0], [0]], [[0, 1, 4], [0, 5, 6]], [[0, 1, 2], [0, 5]]])
def test_keep_appended_rows_commits_each_row_s_branch_and_moves_nothing_already_in_place(kept_rows):
    """Two rows verify the same tree and keep different branches. Where every row's branch is
    already at the front (a chain, a plain step) only the offset moves: nothing in the buffers is
    written (a shorter row's holes keep its rejected drafts); otherwise the branches are gathered
    down. Either way each row's kept tokens hold the plain sequence's keys and values."""
    model = make_tiny_llama(tie=False)
    cache = ContiguousKVCache.for_model(model)
    forward(model, mx.array([PREFIX, PREFIX]), cache, logits_for="none")
    positions = mx.broadcast_to(masks.tree_positions(TREE_PARENTS, len(PREFIX)), (2, len(TREE_TOKENS)))
    mask = masks.prefix_tree_mask(TREE_PARENTS, len(PREFIX))[None, None]
    forward(model, mx.array([TREE_TOKENS, TREE_TOKENS]), cache, positions=positions, mask=mask)
    mx.eval(cache.state)
    before = [_np(layer.keys) for layer in cache.layers]
    width = max(len(k) for k in kept_rows)
    assert cache.keep_appended_rows(len(PREFIX), kept_rows) == len(PREFIX) + width
    in_place = all(list(k) == list(range(len(k))) for k in kept_rows)
    if in_place:
        for layer, buffer in zip(cache.layers, before):
            np.testing.assert_array_equal(_np(layer.keys), buffer)
    for row, kept in enumerate(kept_rows):
        plain = ContiguousKVCache.for_model(model)
        forward(model, mx.array(PREFIX + [TREE_TOKENS[j] for j in kept])[None], plain, logits_for="none")
        for got, want in zip(cache.state, plain.state):
            np.testing.assert_allclose(_np(got[row:row + 1, :, : len(PREFIX) + len(kept)]), _np(want), atol=1e-4, rtol=1e-4)


def test_quantized_model_forward_matches_mlx_lm():
    model = make_tiny_llama(tie=False)
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(model.lm_head, nn.QuantizedLinear)
    _assert_parity_with_mlx_lm(model, PREFIX, [7, 19, 2])


def test_quantized_tied_model_forward_matches_mlx_lm():
    model = make_tiny_llama(tie=True)
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    _assert_parity_with_mlx_lm(model, PREFIX, [7, 19, 2])


def test_quantized_tree_verification():
    model = make_tiny_llama(tie=False)
    nn.quantize(model, group_size=32, bits=4)
    cache = _prefilled(model, PREFIX)
    tree_logits = _verify_tree(model, cache, len(PREFIX))
    for i in (3, 4, 6, 7):
        sequence = PREFIX + [TREE_TOKENS[j] for j in tree_path(TREE_PARENTS, i)]
        alone = forward(model, mx.array(sequence)[None]).logits[0, -1]
        np.testing.assert_allclose(_np(tree_logits[0, i]), _np(alone), atol=1e-4, rtol=1e-4)


def test_forward_float16_matches_mlx_lm():
    model = make_tiny_llama(tie=False, dtype=mx.float16)
    _assert_parity_with_mlx_lm(model, PREFIX, [7, 19])


def test_tree_mask_is_what_makes_branches_independent():
    """Control: the same tree tokens under a plain causal mask give different logits for branch C,
    so the equality above really depends on the tree positions and mask."""
    model = make_tiny_llama(tie=False)
    tree = _verify_tree(model, _prefilled(model, PREFIX), len(PREFIX))
    causal = forward(model, mx.array(TREE_TOKENS)[None], _prefilled(model, PREFIX)).logits
    assert np.allclose(_np(tree[0, :4]), _np(causal[0, :4]), atol=1e-4)  # branch A is a prefix chain
    assert not np.allclose(_np(tree[0, 5]), _np(causal[0, 5]), atol=1e-2)


@pytest.mark.parametrize("traditional", [True, False])
def test_compiled_rope_equals_the_module_bit_for_bit(traditional):
    """apply_rope (compiled on the CPU) against the rope module itself: scalar and per-row offsets,
    one token, several tokens, the per-token rows rope_at makes."""
    from mlx_specdec.model.forward import apply_rope

    rope = nn.RoPE(64, traditional=traditional, base=100000.0)
    cases = [((1, 9, 1, 64), 150), ((1, 3, 5, 64), 3000), ((2, 9, 4, 64), 0),
             ((7, 9, 1, 64), mx.arange(100, 107, dtype=mx.int32))]
    for shape, offset in cases:
        x = mx.random.normal(shape) * 3
        assert mx.array_equal(apply_rope(rope, x, offset), rope(x, offset=offset)).item(), (shape, offset)


def test_the_compiled_block_gives_the_plain_blocks_bits(monkeypatch):
    """The CPU's compiled blocks (model/forward.py: every block after the first joined with the
    one before it, `_compiled_layers`; and each block on its own, `_compiled_block`) against the
    blocks built op by op: a prefill, one token, a chain, and a tree at per-token positions."""
    forward_module = importlib.import_module("mlx_specdec.model.forward")  # the module, not the function

    if not forward_module.on_cpu():
        pytest.skip("the compiled block is the CPU's")
    model = make_tiny_llama(tie=False)

    def run():
        cache = _prefilled(model, PREFIX)
        one = forward(model, mx.array([[9]]), cache).logits
        chain = forward(model, mx.array([[4, 8, 15]]), cache).logits
        tree = _verify_tree(model, cache, cache.offset)
        return [np.array(a) for a in (one, chain, tree)]

    joined_calls, compiled_layers = [], forward_module._compiled_layers
    monkeypatch.setattr(forward_module, "_compiled_layers", lambda *args: joined_calls.append(1) or compiled_layers(*args))
    joined = run()
    assert len(joined_calls) == 4  # the prefill, one token, the chain and the tree all ran joined
    with monkeypatch.context() as patch:
        patch.setattr(forward_module, "_joined", lambda *args: False)
        block_by_block = run()
    with monkeypatch.context() as patch:
        patch.setattr(forward_module, "COMPILED_BLOCKS", False)
        plain = run()
    for a, b, c in zip(joined, block_by_block, plain):
        assert np.array_equal(a, c) and np.array_equal(b, c)


def test_the_compiled_block_reads_the_layers_parameters_as_they_are_now():
    """New weights (a loaded adapter, a re-laid-out matrix) and replaced modules reach the next forward."""
    forward_module = importlib.import_module("mlx_specdec.model.forward")  # the module, not the function

    model = make_tiny_llama(tie=False)
    before = np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits)
    mlp = model.model.layers[0].mlp
    mlp.down_proj.weight = mlp.down_proj.weight * 2.0  # the same module, a new array
    doubled = np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits)
    assert not np.allclose(before, doubled)
    attn = model.model.layers[1].self_attn
    # a new module with one more parameter (as an adapter brings): other graph inputs, a new trace
    attn.o_proj = nn.Linear(attn.o_proj.weight.shape[1], attn.o_proj.weight.shape[0], bias=True)
    replaced = np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits)
    assert not np.allclose(doubled, replaced)
    with pytest.MonkeyPatch.context() as patch:  # the plain path agrees on the new model
        patch.setattr(forward_module, "COMPILED_BLOCKS", False)
        assert np.array_equal(replaced, np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits))


def test_a_block_with_python_state_in_a_projection_is_not_compiled():
    """A projection that reads Python state set between forwards (APAR's gated LoRA reads its
    gate so) would be frozen at a compiled graph's trace: such a block runs op by op."""

    class Switched(nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear, self.on = linear, False

        def __call__(self, x):
            y = self.linear(x)
            return y * 2.0 if self.on else y

    model = make_tiny_llama(tie=False)
    plain = np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits)
    layer = model.model.layers[0]
    layer.mlp.down_proj = Switched(layer.mlp.down_proj)
    assert np.array_equal(plain, np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits))
    layer.mlp.down_proj.on = True  # Python state only: no array changed
    assert not np.allclose(plain, np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits))


def test_a_shallow_copy_of_a_model_compiles_its_own_blocks():
    """APAR's model is a shallow copy of the base model (apar/adapter.py `_share_copy`) that then
    gets its own modules; the base model's compiled halves, copied with the layer's attributes,
    still read the base layer: the copy must build its own (it did not, and APAR's answer after two
    `ar` chats differed from the op-by-op one)."""
    from mlx_specdec.apar.adapter import _share_copy

    model = make_tiny_llama(tie=False)
    forward(model, mx.array([[9]]), _prefilled(model, PREFIX))  # the base layers compile their halves
    copy = _share_copy(model)
    mlp = copy.model.layers[0].mlp
    mlp.down_proj = nn.Linear(mlp.down_proj.weight.shape[1], mlp.down_proj.weight.shape[0], bias=False)
    base = np.array(forward(model, mx.array([[9]]), _prefilled(model, PREFIX)).logits)
    copied = np.array(forward(copy, mx.array([[9]]), _prefilled(copy, PREFIX)).logits)
    assert not np.allclose(base, copied)
    forward_module = importlib.import_module("mlx_specdec.model.forward")
    with pytest.MonkeyPatch.context() as patch:  # what the copy gives op by op
        patch.setattr(forward_module, "COMPILED_BLOCKS", False)
        assert np.array_equal(copied, np.array(forward(copy, mx.array([[9]]), _prefilled(copy, PREFIX)).logits))


@pytest.mark.parametrize("traditional", [True, False])
def test_rope_tables_rotate_with_the_modules_bits(traditional):
    """model/rope_table.py: cos and sin read off the module rotating a unit vector, applied by
    `rotate`, give the module's bits at every offset and length (both pair layouts)."""
    from mlx_specdec.model import rope_table

    for base in (10000.0, 100000.0):
        rope = nn.RoPE(64, traditional=traditional, base=base)
        for heads, length, offset in [(9, 1, 0), (3, 1, 150), (9, 5, 37), (3, 13, 999), (9, 2, 6001), (3, 4, 32000)]:
            x = mx.random.normal((1, heads, length, 64), key=mx.random.key(offset + length)) * 3
            cos, sin = rope_table.tables(rope, lambda unit, start: rope(unit, offset=start), offset, length)
            assert mx.array_equal(rope_table.rotate(x, cos, sin, traditional), rope(x, offset=offset)).item()


def test_rope_tables_only_for_one_plain_rope_over_whole_heads():
    from mlx_specdec.model import rope_table

    model = make_tiny_llama(tie=False)
    layers = model.model.layers
    assert rope_table.shared_rope(layers) is layers[0].self_attn.rope
    layers[1].self_attn.rope = nn.RoPE(layers[1].self_attn.rope.dims, base=1234.0)  # another base
    assert rope_table.shared_rope(layers) is None


@pytest.mark.parametrize("traditional", [True, False])
def test_rope_tables_at_per_token_positions_rotate_with_the_modules_bits(traditional):
    """model/rope_table.py `tables_at`: one table row per token at its own position (a verified
    tree's) gives the bits of the module rotating each token at its position (`rope_at`)."""
    from mlx_specdec.model import rope_table

    rope = nn.RoPE(64, traditional=traditional, base=10000.0)
    for heads, positions in [(9, [[0]]), (3, [[150, 151, 151, 152, 151]]), (9, [[37, 38, 39], [12, 13, 13]]),
                             (3, [[31999, 32000, 32000, 32001]]), (3, [[[8, 9, 9, 10]]])]:
        positions = mx.array(positions)  # (B, L), or (B, 1, L) as some callers pass it
        B, L = positions.shape[0], positions.shape[-1]
        x = mx.random.normal((B, heads, L, 64), key=mx.random.key(L)) * 3
        cos, sin = rope_table.tables_at(rope, lambda unit, starts: rope(unit, offset=starts), positions)
        assert cos.shape == sin.shape == (B, 1, L, 32)
        assert mx.array_equal(rope_table.rotate(x, cos, sin, traditional), rope_at(rope, x, positions)).item()
