"""The multi-scale deformable attention op and layer against two references.

  * transformers' pure-PyTorch `MultiScaleDeformableAttention` (grid_sample, zero padding,
    align_corners=False) and its `DeformableDetrMultiscaleDeformableAttention` layer: values and
    autograd gradients;
  * `multi_scale_deformable_attention_reference` (jax.scipy map_coordinates, one image at a
    time), an implementation that shares no code with the packed-gather op.

Sampling locations range past [0, 1] on every side, so zero padding and the clamped indices of
out-of-bounds neighbours are exercised, and level sizes include 1 x 1 and non-square maps.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.deformable_detr import modeling_deformable_detr as hf  # noqa: E402

from ood_jax.models import deformable_attention as da  # noqa: E402

SHAPES = ((6, 7), (3, 4), (2, 2), (1, 1))
BATCH, HEADS, HEAD_DIM, QUERIES, POINTS = 2, 4, 8, 5, 3


def _op_inputs(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = sum(h * w for h, w in SHAPES)
    value = rng.standard_normal((BATCH, keys, HEADS, HEAD_DIM)).astype(np.float32)
    locations = rng.uniform(-0.25, 1.25, (BATCH, QUERIES, HEADS, len(SHAPES), POINTS, 2))
    weights = rng.uniform(0.0, 1.0, locations.shape[:-1])
    return value, locations.astype(np.float32), weights.astype(np.float32)


def _torch_op(value, locations, weights) -> torch.Tensor:
    shapes = torch.tensor(SHAPES)
    starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    return hf.MultiScaleDeformableAttention()(
        value, shapes, list(SHAPES), starts, locations, weights, 64
    )


def _loss_weights(seed: int = 1) -> np.ndarray:
    """A fixed random cotangent, so the gradients depend on every output element."""
    return np.random.default_rng(seed).standard_normal((BATCH, QUERIES, HEADS * HEAD_DIM))


def _grads(op, value, locations, weights, cotangent):
    def loss(v, loc, w):
        return jnp.sum(op(v, SHAPES, loc, w) * cotangent)

    return jax.grad(loss, argnums=(0, 1, 2))(value, locations, weights)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
def test_op_matches_torch_values_and_gradients(remat: bool) -> None:
    value, locations, weights = _op_inputs()
    cotangent = _loss_weights()
    tensors = [torch.tensor(x, requires_grad=True) for x in (value, locations, weights)]
    ref = _torch_op(*tensors)
    (ref * torch.tensor(cotangent, dtype=torch.float32)).sum().backward()

    def op(v, shapes, loc, w):
        return da.multi_scale_deformable_attention(v, shapes, loc, w, remat=remat)

    out = jax.jit(lambda v, loc, w: op(v, SHAPES, loc, w))(value, locations, weights)
    np.testing.assert_allclose(out, ref.detach().numpy(), atol=1e-5)
    grads = jax.jit(lambda *a: _grads(op, *a, cotangent))(value, locations, weights)
    for name, ours, theirs in zip(("value", "locations", "weights"), grads, tensors):
        scale = np.abs(theirs.grad.numpy()).max()
        np.testing.assert_allclose(ours, theirs.grad.numpy(), atol=1e-5 * scale, err_msg=name)


@pytest.mark.slow
def test_op_matches_map_coordinates_reference() -> None:
    value, locations, weights = _op_inputs(seed=3)
    cotangent = _loss_weights(seed=4)
    ops = (da.multi_scale_deformable_attention, da.multi_scale_deformable_attention_reference)

    @jax.jit
    def values_and_grads(v, loc, w):
        return [(op(v, SHAPES, loc, w), _grads(op, v, loc, w, cotangent)) for op in ops]

    (ours, grads), (ref, ref_grads) = values_and_grads(value, locations, weights)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    for ours_g, ref_g in zip(grads, ref_grads):
        np.testing.assert_allclose(ours_g, ref_g, atol=1e-5 * np.abs(ref_g).max())


def test_op_samples_exact_pixels_and_zero_outside() -> None:
    """At a pixel centre bilinear sampling returns that pixel; fully outside it returns 0."""
    value, _, _ = _op_inputs()
    height, width = SHAPES[0]
    row, col = 4, 2
    centre = np.array([(col + 0.5) / width, (row + 0.5) / height], np.float32)
    locations = np.full((BATCH, 1, HEADS, len(SHAPES), 1, 2), 5.0, np.float32)  # far outside
    locations[:, :, :, 0, 0] = centre
    weights = np.ones(locations.shape[:-1], np.float32)
    op = jax.jit(functools.partial(da.multi_scale_deformable_attention, spatial_shapes=SHAPES))
    out = np.asarray(op(value, sampling_locations=locations, attention_weights=weights))
    expected = value[:, row * width + col].reshape(BATCH, HEADS * HEAD_DIM)
    np.testing.assert_allclose(out[:, 0], expected, atol=1e-6)


def test_op_rejects_inconsistent_shapes() -> None:
    value, locations, weights = _op_inputs()
    with pytest.raises(ValueError, match="spatial_shapes"):
        da.multi_scale_deformable_attention(value, SHAPES[:-1], locations, weights)
    with pytest.raises(ValueError, match="attention_weights"):
        da.multi_scale_deformable_attention(value, SHAPES, locations, weights[..., :1])


def _hf_config(d_model: int, levels: int) -> "hf.DeformableDetrConfig":
    from transformers import DeformableDetrConfig

    return DeformableDetrConfig(
        d_model=d_model, num_feature_levels=levels, encoder_layers=1, use_timm_backbone=False
    )


@pytest.mark.parametrize("coords", [2, 4])
def test_layer_matches_transformers(coords: int) -> None:
    """The layer with converted weights equals transformers' on random weights, reference points
    of 2 (points) and 4 (boxes) coordinates, and a key padding mask."""
    d_model, points = 32, POINTS
    torch.manual_seed(0)
    layer = hf.DeformableDetrMultiscaleDeformableAttention(
        _hf_config(d_model, len(SHAPES)), num_heads=HEADS, n_points=points
    ).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    rng = np.random.default_rng(5)
    keys = sum(h * w for h, w in SHAPES)
    query = rng.standard_normal((BATCH, QUERIES, d_model)).astype(np.float32)
    memory = rng.standard_normal((BATCH, keys, d_model)).astype(np.float32)
    reference = rng.uniform(0.1, 0.9, (BATCH, QUERIES, len(SHAPES), coords)).astype(np.float32)
    mask = rng.uniform(size=(BATCH, keys)) > 0.2

    with torch.no_grad():
        ref, _ = layer(
            hidden_states=torch.tensor(query),
            attention_mask=torch.tensor(mask),
            encoder_hidden_states=torch.tensor(memory),
            reference_points=torch.tensor(reference),
            spatial_shapes=torch.tensor(SHAPES),
            spatial_shapes_list=list(SHAPES),
            level_start_index=None,
        )
    params = {
        name: {
            "kernel": jnp.asarray(getattr(layer, name).weight.detach().numpy().T),
            "bias": jnp.asarray(getattr(layer, name).bias.detach().numpy()),
        }
        for name in ("sampling_offsets", "attention_weights", "value_proj", "output_proj")
    }
    module = da.MultiScaleDeformableAttention(HEADS, len(SHAPES), points)
    out = jax.jit(module.apply, static_argnums=5)(
        {"params": params}, query, reference, memory, mask, SHAPES
    )
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-5)


def test_layer_initialization_matches_transformers() -> None:
    """Deformable DETR's start: zero offset weights, the directional bias grid, uniform
    attention."""
    torch.manual_seed(0)
    # The encoder alone is a PreTrainedModel: constructing it runs transformers' initialization.
    layer = hf.DeformableDetrEncoder(_hf_config(32, len(SHAPES))).layers[0].self_attn
    module = da.MultiScaleDeformableAttention(layer.n_heads, layer.n_levels, layer.n_points)
    keys = sum(h * w for h, w in SHAPES)
    variables = jax.jit(module.init, static_argnums=(4, 5))(
        jax.random.key(0),
        jnp.zeros((1, 2, 32)),
        jnp.full((1, 2, len(SHAPES), 2), 0.5),
        jnp.zeros((1, keys, 32)),
        None,
        SHAPES,
    )["params"]
    np.testing.assert_allclose(
        variables["sampling_offsets"]["bias"],
        layer.sampling_offsets.bias.detach().numpy(),
        atol=1e-6,
    )
    for name in ("sampling_offsets", "attention_weights"):
        assert not np.any(variables[name]["kernel"])
    assert not np.any(variables["attention_weights"]["bias"])


def test_layer_bfloat16_stays_close() -> None:
    rng = np.random.default_rng(6)
    keys = sum(h * w for h, w in SHAPES)
    query = rng.standard_normal((BATCH, QUERIES, 32)).astype(np.float32)
    memory = rng.standard_normal((BATCH, keys, 32)).astype(np.float32)
    reference = rng.uniform(0.1, 0.9, (BATCH, QUERIES, len(SHAPES), 4)).astype(np.float32)
    module = da.MultiScaleDeformableAttention(HEADS, len(SHAPES), POINTS)
    args = (query, reference, memory)
    init = functools.partial(module.init, value_mask=None, spatial_shapes=SHAPES)
    variables = jax.eval_shape(init, jax.random.key(1), *args)
    # Random offsets and attention logits so the sampling is not the initial grid.
    variables = jax.tree.map(lambda x: 0.3 * rng.standard_normal(x.shape), variables)

    def apply(dtype):
        fn = functools.partial(
            module.clone(dtype=dtype).apply, value_mask=None, spatial_shapes=SHAPES
        )
        return jax.jit(fn)(variables, *args)

    full, low = apply(jnp.float32), apply(jnp.bfloat16)
    assert low.dtype == jnp.bfloat16
    assert np.abs(np.asarray(low, np.float32) - np.asarray(full)).max() < 0.05 * np.abs(full).max()


def _padded_op_inputs(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_op_inputs` with every level's right third and bottom row padding (value zeroed, as the
    layer zeroes padded keys) and every second sample far outside its map."""
    value, locations, weights = _op_inputs(seed)
    start = 0
    for height, width in SHAPES:
        level = value[:, start : start + height * width].reshape(BATCH, height, width, -1)
        level[:, :, width - width // 3 :] = 0
        level[:, height - 1 :] = 0 if height > 1 else level[:, height - 1 :]
        start += height * width
    locations[..., ::2, :] = locations[..., ::2, :] * 4.0 - 1.5  # in [-2.5, 3.5]
    return value, locations, weights


@pytest.mark.slow
@pytest.mark.parametrize("query_chunk", [2, 5, 2048])
def test_recomputed_backward_matches_autodiff(query_chunk: int) -> None:
    """`remat=True`'s custom VJP (only the inputs saved, the gather recomputed, `query_chunk`
    queries at a time, padded when they do not divide the queries) gives autodiff's values
    exactly and its gradients to float32 rounding."""
    value, locations, weights = _padded_op_inputs(seed=7)
    cotangent = _loss_weights(seed=8)

    def op(remat: bool):
        return functools.partial(
            da.multi_scale_deformable_attention, remat=remat, query_chunk=query_chunk
        )

    # Each forward in its own program, as a model runs it: XLA may fuse two ops sharing one
    # program differently and round the reference's last bit otherwise.
    ref, ours = (
        jax.jit(op(r), static_argnums=1)(value, SHAPES, locations, weights) for r in (0, 1)
    )
    np.testing.assert_array_equal(ours, ref)
    ref_grads, grads = (
        jax.jit(lambda *a, r=r: _grads(op(r), *a, cotangent))(value, locations, weights)
        for r in (False, True)
    )
    for name, ours_g, ref_g in zip(("value", "locations", "weights"), grads, ref_grads):
        assert ours_g.dtype == ref_g.dtype
        np.testing.assert_allclose(ours_g, ref_g, atol=1e-6 * np.abs(ref_g).max(), err_msg=name)
    # Padded keys get gradient (they are sampled), but no sample reaches past the maps.
    assert np.abs(np.asarray(grads[0])).max() > 0


def test_recomputed_backward_matches_torch_on_padded_inputs() -> None:
    value, locations, weights = _padded_op_inputs(seed=9)
    cotangent = _loss_weights(seed=10)
    tensors = [torch.tensor(x, requires_grad=True) for x in (value, locations, weights)]
    (_torch_op(*tensors) * torch.tensor(cotangent, dtype=torch.float32)).sum().backward()
    op = functools.partial(da.multi_scale_deformable_attention, remat=True, query_chunk=2)
    grads = jax.jit(lambda *a: _grads(op, *a, cotangent))(value, locations, weights)
    for name, ours, theirs in zip(("value", "locations", "weights"), grads, tensors):
        scale = np.abs(theirs.grad.numpy()).max()
        np.testing.assert_allclose(ours, theirs.grad.numpy(), atol=1e-5 * scale, err_msg=name)


@pytest.mark.slow
def test_recomputed_backward_in_bfloat16_follows_autodiff() -> None:
    value, locations, weights = _padded_op_inputs(seed=11)
    cotangent = _loss_weights(seed=12)
    value = jnp.asarray(value, jnp.bfloat16)

    def grads(remat: bool):
        op = functools.partial(da.multi_scale_deformable_attention, remat=remat, query_chunk=2)
        return jax.jit(lambda *a: _grads(op, *a, cotangent))(value, locations, weights)

    for name, ours, ref in zip(("value", "locations", "weights"), grads(True), grads(False)):
        assert ours.dtype == ref.dtype
        ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
        assert np.abs(ours - ref).max() <= 0.02 * np.abs(ref).max(), name


@pytest.mark.slow
def test_recomputed_backward_keeps_no_gathered_rows() -> None:
    """What the custom VJP is for: the compiled backward's temporaries stay far below one
    [B, Q, heads, taps, head_dim] buffer of gathered rows, which autodiff keeps."""
    queries, heads, head_dim, points = 4096, 8, 32, 4
    keys = sum(h * w for h, w in SHAPES)
    spec = jax.ShapeDtypeStruct
    args = (
        spec((1, keys, heads, head_dim), jnp.float32),
        spec((1, queries, heads, len(SHAPES), points, 2), jnp.float32),
        spec((1, queries, heads, len(SHAPES), points), jnp.float32),
    )
    gathered = queries * heads * len(SHAPES) * points * 4 * head_dim * 4  # bytes

    def temp_bytes(remat: bool) -> int:
        op = functools.partial(da.multi_scale_deformable_attention, remat=remat, query_chunk=512)
        grad = jax.grad(lambda *a: jnp.sum(op(a[0], SHAPES, *a[1:])), argnums=(0, 1, 2))
        return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(False) >= gathered
    assert temp_bytes(True) < gathered / 2
