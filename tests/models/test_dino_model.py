"""DINO: denoising isolation, mixed query selection, look forward twice, post-processing, and
the official checkpoint layout.

The DINO blocks shared with Deformable DETR are pinned to transformers by
tests/models/test_deformable_detr_parity.py; here:
  * the attention mask of `denoising.make_cdn_queries` really isolates the matching queries
    (their outputs are the same with or without denoising queries, and differ without the mask)
    and the denoising groups from each other;
  * the encoder's top-K proposals by best class logit (padding never selected) become the
    queries' anchors, with their outputs reported under "enc";
  * gradients: a layer's predicted box trains the previous layer's box head (look forward
    twice), while the selected anchors are detached;
  * `postprocess` against a numpy top-k;
  * the IDEA-Research DINO-4scale R50 state dict layout (constructed here, full size, with the
    official key names and shapes) converts, and its decoder and encoder layers, rebuilt in
    PyTorch after the official code (nn.MultiheadAttention with a True-means-blocked mask,
    transformers' deformable attention module, the official norm1/norm2/norm3 order), give
    the outputs of the converted Flax layers.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.deformable_detr import modeling_deformable_detr as hf  # noqa: E402

from ood_jax.models import (  # noqa: E402
    backbones,
    convert_deformable,
    deformable_detr,
    denoising,
    dino,
    resnet,
    vit,
)
from ood_jax.testing.random_variables import random_variables  # noqa: E402

NUM_CLASSES, NUM_QUERIES, MAX_TARGETS, NUM_DN = 5, 12, 3, 12
TINY_RESNET = resnet.ResNet(
    stage_sizes=(1, 1, 1, 1), block="basic", planes=(8, 16, 32, 64), stem_width=8, norm="frozen"
)
TINY = dict(
    num_classes=NUM_CLASSES,
    num_queries=NUM_QUERIES,
    hidden_dim=32,
    num_heads=4,
    num_encoder_layers=1,
    num_decoder_layers=2,
    ffn_dim=64,
    decoder_points=3,
    shared_decoder_heads=False,
    backbone=TINY_RESNET,
)


@pytest.fixture(scope="module")
def tiny():
    module = dino.DINO(**TINY)
    rng = np.random.default_rng(1)
    images = jnp.asarray(rng.standard_normal((2, 64, 64, 3)), jnp.float32)
    pixel_mask = np.ones((2, 64, 64), bool)
    pixel_mask[1, 40:, :] = False
    pixel_mask[1, :, 36:] = False
    variables = random_variables(module, images)
    targets = {
        "labels": jnp.asarray([[1, 4, 0], [2, 2, 3]], jnp.int32),
        "boxes": jnp.asarray(rng.uniform(0.2, 0.6, (2, MAX_TARGETS, 4)), jnp.float32),
        "mask": jnp.asarray([[True, True, False], [True, True, True]]),
    }
    denoise = denoising.make_cdn_queries(
        jax.random.key(2),
        targets["labels"],
        targets["boxes"],
        targets["mask"],
        num_classes=NUM_CLASSES,
        num_queries=NUM_QUERIES,
        num_dn_queries=NUM_DN,
    )
    apply = jax.jit(module.apply)
    # Without denoising, also capture every submodule's output (the encoder's full logits).
    capture = jax.jit(functools.partial(module.apply, capture_intermediates=True))
    return module, variables, images, jnp.asarray(pixel_mask), denoise, apply, capture


def _max_diff(a, b) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@pytest.mark.slow
def test_denoising_queries_are_invisible_to_matching_queries(tiny) -> None:
    module, variables, images, mask, denoise, apply, capture = tiny
    plain, _ = capture(variables, images, mask)
    noised = apply(variables, images, mask, denoise=denoise)

    layers, num_dn = module.num_decoder_layers, denoise["labels"].shape[1]
    assert num_dn == 2 * MAX_TARGETS * denoising.num_groups(MAX_TARGETS, NUM_DN)
    assert noised["dn"]["logits"].shape == (layers, 2, num_dn, NUM_CLASSES)
    assert noised["dn"]["boxes"].shape == (layers, 2, num_dn, 4)
    assert noised["logits"].shape == (2, NUM_QUERIES, NUM_CLASSES)
    assert len(noised["aux"]) == layers - 1 and "dn" not in plain
    matching = ("logits", "boxes", "aux", "enc")
    diff = _max_diff([plain[k] for k in matching], [noised[k] for k in matching])
    assert diff < 1e-5, diff

    # The same queries without the mask do see the denoising queries.
    unmasked = dict(denoise, attention_mask=jnp.ones_like(denoise["attention_mask"]))
    leaked = apply(variables, images, mask, denoise=unmasked)
    assert _max_diff(plain["logits"], leaked["logits"]) > 1e-3


@pytest.mark.slow
def test_denoising_groups_are_isolated(tiny) -> None:
    _, variables, images, mask, denoise, apply, _ = tiny
    group = 2 * MAX_TARGETS
    moved = dict(denoise)
    moved["boxes"] = denoise["boxes"].at[:, group:].set(0.5 * denoise["boxes"][:, group:] + 0.2)
    moved["labels"] = denoise["labels"].at[:, group:].set((denoise["labels"][:, group:] + 1) % 5)
    a = apply(variables, images, mask, denoise=denoise)["dn"]
    b = apply(variables, images, mask, denoise=moved)["dn"]
    assert _max_diff(a["logits"][:, :, :group], b["logits"][:, :, :group]) < 1e-5
    assert _max_diff(a["boxes"][:, :, :group], b["boxes"][:, :, :group]) < 1e-5
    assert _max_diff(a["logits"][:, :, group:], b["logits"][:, :, group:]) > 1e-3


@pytest.mark.slow
def test_padding_changes_only_the_padded_image(tiny) -> None:
    _, variables, images, mask, _, _, capture = tiny
    padded, _ = capture(variables, images, mask)
    full, _ = capture(variables, images, jnp.ones_like(mask))
    assert _max_diff(padded["logits"][0], full["logits"][0]) < 1e-5
    assert _max_diff(padded["logits"][1], full["logits"][1]) > 1e-3


def test_queries_are_the_top_k_real_encoder_proposals(tiny) -> None:
    module, variables, images, mask, _, _, capture = tiny
    out, state = capture(variables, images, mask)
    all_logits = np.asarray(state["intermediates"]["enc_class_embed"]["__call__"][0])
    # The encoder positions that are real pixels, level by level as the encoder flattens them.
    sizes = [(8, 8), (4, 4), (2, 2), (1, 1)]
    real = np.concatenate(
        [np.asarray(backbones.resize_mask(mask, s)).reshape(2, -1) for s in sizes], 1
    )
    assert all_logits.shape == (2, real.shape[1], NUM_CLASSES) and not real[1].all()
    for b in range(2):
        score = np.where(real[b], all_logits[b].max(-1), -np.inf)
        expected = np.argsort(-score, kind="stable")[:NUM_QUERIES]
        np.testing.assert_allclose(out["enc"]["logits"][b], all_logits[b][expected], atol=1e-6)
        assert real[b][expected].all()
    boxes = np.asarray(out["enc"]["boxes"])
    assert boxes.shape == (2, NUM_QUERIES, 4) and ((boxes > 0) & (boxes < 1)).all()


@pytest.mark.slow
def test_look_forward_twice_and_detached_anchors(tiny) -> None:
    module, variables, images, mask, _, _, _ = tiny
    heads = ("bbox_embed_0", "bbox_embed_1", "enc_bbox_embed")
    rest = {k: v for k, v in variables["params"].items() if k not in heads}

    def losses(box_params):
        params = {**rest, **box_params}
        out = module.apply({**variables, "params": params}, images, mask)
        return jnp.stack(
            [out["boxes"].sum(), out["aux"][0]["boxes"].sum(), out["enc"]["boxes"].sum()]
        )

    # Differentiating only the box heads lets XLA drop the backbone's backward pass.
    jacobian = jax.jit(jax.jacrev(losses))({k: variables["params"][k] for k in heads})

    def norm(tree, row: int) -> float:
        return float(sum(np.abs(np.asarray(x[row])).sum() for x in jax.tree.leaves(tree)))

    final, first, enc = 0, 1, 2
    # The last layer's box is its delta on the first layer's refined box, gradient kept.
    assert norm(jacobian["bbox_embed_0"], final) > 1e-3
    assert norm(jacobian["bbox_embed_1"], final) > 1e-3
    # The first layer's box does not depend on the second layer's head.
    assert norm(jacobian["bbox_embed_1"], first) == 0.0
    # Selected anchors are detached: the encoder's box head is trained by "enc" alone.
    assert norm(jacobian["enc_bbox_embed"], final) == 0.0
    assert norm(jacobian["enc_bbox_embed"], first) == 0.0
    assert norm(jacobian["enc_bbox_embed"], enc) > 1e-3


def test_postprocess_is_top_k_over_queries_and_classes() -> None:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 120, 5)).astype(np.float32)
    boxes = rng.uniform(0.0, 1.0, (2, 120, 4)).astype(np.float32)
    out = jax.jit(dino.postprocess)({"logits": logits, "boxes": boxes})
    assert out["scores"].shape == out["labels"].shape == (2, dino.DINO_TOP_K)
    for b in range(2):
        flat = 1 / (1 + np.exp(-logits[b].reshape(-1)))
        order = np.argsort(-flat, kind="stable")[: dino.DINO_TOP_K]
        np.testing.assert_allclose(out["scores"][b], flat[order], rtol=1e-6)
        np.testing.assert_array_equal(out["labels"][b], order % 5)
        np.testing.assert_array_equal(out["boxes"][b], boxes[b][order // 5])
    # Fewer (query, class) pairs than top_k: every pair, best first.
    small = dino.postprocess({"logits": logits[:, :10], "boxes": boxes[:, :10]})
    assert small["scores"].shape == (2, 50)
    assert np.all(np.diff(np.asarray(small["scores"]), axis=1) <= 0)


def test_vit_backbone_and_input_checks() -> None:
    backbone = vit.ViT(width=32, depth=1, num_heads=2, mlp_dim=64, pos_grid=(4, 4))
    module = dino.DINO(**dict(TINY, backbone=backbone))
    images = jnp.zeros((1, 64, 64, 3))
    variables = random_variables(module, images)
    # Shapes only: tracing shows the ViT's stride-16 map feeds the pyramid and the 4 levels.
    out = jax.eval_shape(module.apply, variables, images)
    assert out["boxes"].shape == (1, NUM_QUERIES, 4)
    assert out["enc"]["logits"].shape == (1, NUM_QUERIES, NUM_CLASSES)
    assert variables["params"]["vit_pyramid"]["upsample"]["kernel"].shape == (2, 2, 32, 32)
    assert variables["params"]["neck"]["input_proj_3"]["conv"]["kernel"].shape == (3, 3, 32, 32)

    with pytest.raises(ValueError, match="num_queries"):
        jax.eval_shape(dino.DINO(**dict(TINY, num_queries=100)).init, jax.random.key(0), images)


# --------------------------------------------------------------------------------------------
# The official checkpoint layout
# --------------------------------------------------------------------------------------------


def _official_state(
    *,
    num_classes=91,
    queries=900,
    dim=256,
    ffn=2048,
    encoder_layers=6,
    decoder_layers=6,
    levels=4,
    heads=8,
    points=4,
    seed=0,
) -> dict[str, np.ndarray]:
    """A DINO-4scale ResNet-50 state dict with the official names and shapes (random values;
    the shared decoder heads appear under all four of their names, as torch saves them)."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    body = torchvision.models.resnet50().state_dict()
    state = {
        f"backbone.0.body.{k}": v.numpy()
        for k, v in body.items()
        if not k.startswith("fc.") and not k.endswith("num_batches_tracked")
    }
    # The first extra level is a stride-2 convolution of the last backbone map (C5).
    for level, channels in enumerate([512, 1024, 2048, 2048][:levels]):
        kernel = 1 if level < 3 else 3
        state[f"input_proj.{level}.0.weight"] = r(dim, channels, kernel, kernel)
        state[f"input_proj.{level}.0.bias"] = r(dim)
        state[f"input_proj.{level}.1.weight"] = r(dim)
        state[f"input_proj.{level}.1.bias"] = r(dim)

    def linear(prefix, out_dim, in_dim):
        state[f"{prefix}.weight"] = r(out_dim, in_dim)
        state[f"{prefix}.bias"] = r(out_dim)

    def norm(prefix):
        state[f"{prefix}.weight"] = 1 + r(dim)
        state[f"{prefix}.bias"] = r(dim)

    def deformable(prefix):
        linear(f"{prefix}.sampling_offsets", heads * levels * points * 2, dim)
        linear(f"{prefix}.attention_weights", heads * levels * points, dim)
        linear(f"{prefix}.value_proj", dim, dim)
        linear(f"{prefix}.output_proj", dim, dim)

    state["transformer.level_embed"] = r(levels, dim)
    for i in range(encoder_layers):
        p = f"transformer.encoder.layers.{i}"
        deformable(f"{p}.self_attn")
        norm(f"{p}.norm1")
        linear(f"{p}.linear1", ffn, dim)
        linear(f"{p}.linear2", dim, ffn)
        norm(f"{p}.norm2")
    for i in range(decoder_layers):
        p = f"transformer.decoder.layers.{i}"
        deformable(f"{p}.cross_attn")
        norm(f"{p}.norm1")
        state[f"{p}.self_attn.in_proj_weight"] = r(3 * dim, dim)
        state[f"{p}.self_attn.in_proj_bias"] = r(3 * dim)
        linear(f"{p}.self_attn.out_proj", dim, dim)
        norm(f"{p}.norm2")
        linear(f"{p}.linear1", ffn, dim)
        linear(f"{p}.linear2", dim, ffn)
        norm(f"{p}.norm3")
    norm("transformer.decoder.norm")
    linear("transformer.decoder.ref_point_head.layers.0", dim, 2 * dim)
    linear("transformer.decoder.ref_point_head.layers.1", dim, dim)
    state["transformer.tgt_embed.weight"] = r(queries, dim)
    linear("transformer.enc_output", dim, dim)
    norm("transformer.enc_output_norm")
    linear("transformer.enc_out_class_embed", num_classes, dim)
    for j, (out_dim, in_dim) in enumerate([(dim, dim), (dim, dim), (4, dim)]):
        linear(f"transformer.enc_out_bbox_embed.layers.{j}", out_dim, in_dim)
    state["label_enc.weight"] = r(num_classes + 1, dim)
    # One class head and one box head, shared by every decoder layer and stored under each name.
    head = {"weight": r(num_classes, dim), "bias": r(num_classes)}
    box = {j: (r(o, i), r(o)) for j, (o, i) in enumerate([(dim, dim), (dim, dim), (4, dim)])}
    for prefix in ("", "transformer.decoder."):
        for i in range(decoder_layers):
            for leaf, value in head.items():
                state[f"{prefix}class_embed.{i}.{leaf}"] = value
            for j, (weight, bias) in box.items():
                state[f"{prefix}bbox_embed.{i}.layers.{j}.weight"] = weight
                state[f"{prefix}bbox_embed.{i}.layers.{j}.bias"] = bias
    return state


@pytest.mark.slow
def test_official_dino_4scale_checkpoint_layout_converts() -> None:
    state = _official_state()
    module, variables = convert_deformable.dino_from_official(state)
    assert (module.num_classes, module.num_queries, module.hidden_dim) == (91, 900, 256)
    assert (module.num_encoder_layers, module.num_decoder_layers, module.ffn_dim) == (6, 6, 2048)
    assert module.backbone == "resnet50" and module.shared_decoder_heads
    assert module.backbone_stages == ("stage2", "stage3", "stage4")
    params = variables["params"]
    assert params["label_enc"]["embedding"].shape == (92, 256)
    assert "class_embed_1" not in params and "bbox_embed_1" not in params

    def same(ours, key, transpose=False):
        value = state[key].T if transpose else state[key]
        np.testing.assert_array_equal(np.asarray(ours), value, err_msg=key)

    layer = params["decoder_layers_3"]
    packed = state["transformer.decoder.layers.3.self_attn.in_proj_weight"]
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        np.testing.assert_array_equal(layer["self_attn"][name]["kernel"], packed[i * 256 :][:256].T)
    same(layer["self_attn_layer_norm"]["scale"], "transformer.decoder.layers.3.norm2.weight")
    same(layer["encoder_attn_layer_norm"]["scale"], "transformer.decoder.layers.3.norm1.weight")
    same(layer["final_layer_norm"]["bias"], "transformer.decoder.layers.3.norm3.bias")
    same(
        params["encoder_layers_5"]["final_layer_norm"]["scale"],
        "transformer.encoder.layers.5.norm2.weight",
    )
    same(params["level_embed"]["embedding"], "transformer.level_embed")
    same(params["enc_class_embed"]["kernel"], "transformer.enc_out_class_embed.weight", True)
    same(params["class_embed_0"]["bias"], "class_embed.0.bias")
    np.testing.assert_array_equal(
        variables["batch_stats"]["backbone"]["stage3_block5"]["norm2"]["var"],
        state["backbone.0.body.layer3.5.bn2.running_var"],
    )

    # Strict: a tied copy that differs, an unknown tensor and a missing one are errors.
    untied = dict(
        state, **{"transformer.decoder.class_embed.2.bias": state["class_embed.2.bias"] + 1}
    )
    with pytest.raises(ValueError, match=r"class_embed\.2\.bias"):
        convert_deformable.dino_from_official(untied)
    extra = dict(state, **{"transformer.decoder.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(KeyError, match=r"transformer\.decoder\.extra\.weight"):
        convert_deformable.dino_from_official(extra)
    missing = {
        k: v for k, v in state.items() if k != "transformer.decoder.ref_point_head.layers.1.bias"
    }
    with pytest.raises(KeyError, match="ref_point_head/layers_1/bias"):
        convert_deformable.dino_from_official(missing)


class _OfficialDecoderLayer(torch.nn.Module):
    """DINO's DeformableTransformerDecoderLayer (decoder_sa_type "sa", module_seq sa, ca, ffn),
    batch-first, with transformers' deformable attention standing in for MSDeformAttn (the same
    four linear layers under the same names)."""

    def __init__(self, config, dim, heads, points, ffn):
        super().__init__()
        self.cross_attn = hf.DeformableDetrMultiscaleDeformableAttention(config, heads, points)
        self.norm1 = torch.nn.LayerNorm(dim)
        self.self_attn = torch.nn.MultiheadAttention(dim, heads)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.linear1 = torch.nn.Linear(dim, ffn)
        self.linear2 = torch.nn.Linear(ffn, dim)
        self.norm3 = torch.nn.LayerNorm(dim)

    def forward(self, tgt, query_pos, reference, memory, memory_mask, shapes, blocked):
        q = k = (tgt + query_pos).transpose(0, 1)
        tgt2 = self.self_attn(q, k, tgt.transpose(0, 1), attn_mask=blocked)[0].transpose(0, 1)
        tgt = self.norm2(tgt + tgt2)
        tgt2, _ = self.cross_attn(
            hidden_states=tgt + query_pos,
            attention_mask=memory_mask,
            encoder_hidden_states=memory,
            reference_points=reference,
            spatial_shapes=torch.tensor(shapes),
            spatial_shapes_list=list(shapes),
        )
        tgt = self.norm1(tgt + tgt2)
        return self.norm3(tgt + self.linear2(torch.relu(self.linear1(tgt))))


class _OfficialEncoderLayer(torch.nn.Module):
    """DINO's DeformableTransformerEncoderLayer."""

    def __init__(self, config, dim, heads, points, ffn):
        super().__init__()
        self.self_attn = hf.DeformableDetrMultiscaleDeformableAttention(config, heads, points)
        self.norm1 = torch.nn.LayerNorm(dim)
        self.linear1 = torch.nn.Linear(dim, ffn)
        self.linear2 = torch.nn.Linear(ffn, dim)
        self.norm2 = torch.nn.LayerNorm(dim)

    def forward(self, src, pos, reference, mask, shapes):
        src2, _ = self.self_attn(
            hidden_states=src + pos,
            attention_mask=mask,
            encoder_hidden_states=src,
            reference_points=reference,
            spatial_shapes=torch.tensor(shapes),
            spatial_shapes_list=list(shapes),
        )
        src = self.norm1(src + src2)
        return self.norm2(src + self.linear2(torch.relu(self.linear1(src))))


@pytest.mark.slow
def test_official_layers_match_their_pytorch_definition() -> None:
    dim, heads, points, ffn, levels, queries = 32, 4, 2, 64, 4, 7
    shapes = ((5, 6), (3, 3), (2, 2), (1, 1))
    config = transformers.DeformableDetrConfig(
        d_model=dim, num_feature_levels=levels, use_timm_backbone=False
    )
    torch.manual_seed(0)
    layers = {
        "transformer.decoder.layers.0": _OfficialDecoderLayer(config, dim, heads, points, ffn),
        "transformer.encoder.layers.0": _OfficialEncoderLayer(config, dim, heads, points, ffn),
    }
    state = _official_state(
        num_classes=3,
        queries=queries,
        dim=dim,
        ffn=ffn,
        encoder_layers=1,
        decoder_layers=1,
        heads=heads,
        points=points,
    )
    for prefix, layer in layers.items():
        layer.eval()
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(torch.randn(p.shape) * (0.1 if p.ndim == 1 else p.shape[-1] ** -0.5))
                if name.startswith("norm"):
                    p.add_(1.0 if name.endswith("weight") else 0.0)
        state.update({f"{prefix}.{k}": v.numpy() for k, v in layer.state_dict().items()})
    module, variables = convert_deformable.dino_from_official(
        state, num_heads=heads, encoder_points=points, decoder_points=points
    )
    params = variables["params"]

    rng = np.random.default_rng(4)
    keys = sum(h * w for h, w in shapes)

    def arr(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    tgt, query_pos, memory, pos = (
        arr(2, queries, dim),
        arr(2, queries, dim),
        arr(2, keys, dim),
        arr(2, keys, dim),
    )
    reference = rng.uniform(0.2, 0.8, (2, queries, levels, 4)).astype(np.float32)
    memory_mask = rng.uniform(size=(2, keys)) > 0.2
    allowed = rng.uniform(size=(queries, queries)) > 0.4
    np.fill_diagonal(allowed, True)
    enc_reference = rng.uniform(0.0, 1.0, (2, keys, levels, 2)).astype(np.float32)

    t = torch.tensor
    with torch.no_grad():
        ref_dec = layers["transformer.decoder.layers.0"](
            t(tgt), t(query_pos), t(reference), t(memory), t(memory_mask), shapes, t(~allowed)
        )
        ref_enc = layers["transformer.encoder.layers.0"](
            t(memory), t(pos), t(enc_reference), t(memory_mask), shapes
        )
    layer_kwargs = dict(
        num_heads=heads, num_levels=levels, ffn_dim=ffn, dropout=0.0, num_points=points
    )
    decoder = deformable_detr.DeformableDecoderLayer(**layer_kwargs)
    encoder = deformable_detr.DeformableEncoderLayer(**layer_kwargs)
    ours_dec = jax.jit(decoder.apply, static_argnums=6)(
        {"params": params["decoder_layers_0"]},
        tgt,
        query_pos,
        reference,
        memory,
        memory_mask,
        shapes,
        allowed,
    )
    ours_enc = jax.jit(encoder.apply, static_argnums=5)(
        {"params": params["encoder_layers_0"]}, memory, pos, enc_reference, memory_mask, shapes
    )
    np.testing.assert_allclose(ours_dec, ref_dec.numpy(), atol=1e-4)
    np.testing.assert_allclose(ours_enc, ref_enc.numpy(), atol=1e-4)
