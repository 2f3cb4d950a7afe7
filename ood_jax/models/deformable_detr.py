"""Deformable DETR (Zhu et al., 2021) and the blocks DINO is built from.

`DeformableDetr` computes what transformers' `DeformableDetrForObjectDetection` computes, with
its `two_stage` and `with_box_refine` options and Flax names mirroring its modules
(tests/models/test_deformable_detr_parity.py). The blocks (`backbone_feature_maps`, `MultiScaleNeck`,
`flatten_levels`, the deformable encoder and decoder layers, `encoder_proposals`) serve
`ood_jax.models.dino` too. The family's surface for `ood_jax.models.registry`: `Model`,
`postprocess`, `make_loss` (`ood_jax.models.focal_set_loss`) and `load_backbone`.
"""

import inspect
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ood_jax.models import backbones, conv, detr
from ood_jax.models.backbones import load_backbone as load_backbone
from ood_jax.models.deformable_attention import MultiScaleDeformableAttention, SpatialShapes
from ood_jax.models.position_embedding import sine_embedding, sine_position_embedding
from ood_jax.models.registry import LossFn

LN_EPS = 1e-5
GN_EPS = 1e-5

# Stands in for the reference's +inf logit of an invalid proposal: sigmoid of it is exactly 1 in
# float32 as sigmoid(inf) is, but nothing downstream sees inf - inf or 0 * inf.
FAR_LOGIT = 1e4

_xavier = nn.initializers.xavier_uniform()


def inverse_sigmoid(x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """log(x / (1 - x)) with both clamped to eps, as the reference implementations do."""
    x = jnp.clip(x, 0.0, 1.0)
    return jnp.log(jnp.maximum(x, eps) / jnp.maximum(1.0 - x, eps))


def valid_ratios(mask: jax.Array) -> jax.Array:
    """[B, h, w] mask -> [B, 2]: (width, height) fraction of the map that is real."""
    # A fully padded (filler) example counts one valid pixel instead of dividing by zero, so it
    # cannot turn a batch's loss into NaN.
    _, height, width = mask.shape
    valid_h = jnp.maximum(mask[:, :, 0].sum(axis=1), 1).astype(jnp.float32)
    valid_w = jnp.maximum(mask[:, 0, :].sum(axis=1), 1).astype(jnp.float32)
    return jnp.stack([valid_w / width, valid_h / height], axis=-1)


def encoder_reference_points(spatial_shapes: SpatialShapes, ratios: jax.Array) -> jax.Array:
    """Pixel centres of every level, in each level's real extent -> [B, S, levels, 2] (x, y)."""
    points = []
    for level, (height, width) in enumerate(spatial_shapes):
        ys, xs = np.meshgrid(
            np.arange(height, dtype=np.float32) + 0.5,
            np.arange(width, dtype=np.float32) + 0.5,
            indexing="ij",
        )
        ref_y = ys.reshape(-1)[None] / (ratios[:, None, level, 1] * height)
        ref_x = xs.reshape(-1)[None] / (ratios[:, None, level, 0] * width)
        points.append(jnp.stack([ref_x, ref_y], axis=-1))
    return jnp.concatenate(points, axis=1)[:, :, None] * ratios[:, None]


def decoder_reference_input(reference: jax.Array, ratios: jax.Array) -> jax.Array:
    """[B, Q, 2 or 4] references -> [B, Q, levels, 2 or 4], scaled into each level's extent."""
    scale = ratios if reference.shape[-1] == 2 else jnp.concatenate([ratios, ratios], -1)
    return reference[:, :, None] * scale[:, None]


class Proposals(NamedTuple):
    memory: jax.Array  # [B, S, D], zero where invalid
    logits: jax.Array  # [B, S, 4] unsigmoided anchors, FAR_LOGIT where invalid
    valid: jax.Array  # [B, S] bool: a real pixel whose anchor lies inside (0.01, 0.99)


def encoder_proposals(
    memory: jax.Array, mask: jax.Array, spatial_shapes: SpatialShapes
) -> Proposals:
    """One anchor per encoder position: its pixel centre in the level's real extent, side
    0.05 * 2 ** level (two-stage Deformable DETR and DINO)."""
    batch = memory.shape[0]
    anchors, start = [], 0
    for level, (height, width) in enumerate(spatial_shapes):
        level_mask = mask[:, start : start + height * width].reshape(batch, height, width)
        start += height * width
        extent = valid_ratios(level_mask) * jnp.asarray([width, height], jnp.float32)
        ys, xs = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
        grid = np.stack([xs, ys], axis=-1).astype(np.float32) + 0.5
        centres = grid[None] / extent[:, None, None, :]
        sizes = jnp.full_like(centres, 0.05 * 2.0**level)
        anchors.append(jnp.concatenate([centres, sizes], -1).reshape(batch, height * width, 4))
    anchors = jnp.concatenate(anchors, axis=1)
    valid = mask & jnp.all((anchors > 0.01) & (anchors < 0.99), axis=-1)
    safe = jnp.where(valid[..., None], anchors, 0.5)
    logits = jnp.where(valid[..., None], jnp.log(safe / (1 - safe)), FAR_LOGIT)
    return Proposals(jnp.where(valid[..., None], memory, 0), logits, valid)


def _layer_norm(dtype: Any, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=LN_EPS, dtype=dtype, name=name)


class _PostNormLayer(nn.Module):
    """Shared fields and sublayer steps of the deformable encoder and decoder layers."""

    num_heads: int = 8
    num_levels: int = 4
    num_points: int = 4
    ffn_dim: int = 1024
    dropout: float = 0.1
    remat: bool = False
    dtype: Any = jnp.float32

    def deformable_attention(self, name: str) -> MultiScaleDeformableAttention:
        return MultiScaleDeformableAttention(
            self.num_heads, self.num_levels, self.num_points, self.remat, self.dtype, name=name
        )

    def add_norm(self, x: jax.Array, y: jax.Array, name: str, train: bool) -> jax.Array:
        y = nn.Dropout(self.dropout)(y, deterministic=not train)
        return _layer_norm(self.dtype, name)(x + y)

    def feed_forward(self, x: jax.Array, train: bool) -> jax.Array:
        y = detr.FeedForward(self.ffn_dim, self.dropout, self.dtype, name="mlp")(x, train)
        return self.add_norm(x, y, "final_layer_norm", train)


class DeformableEncoderLayer(_PostNormLayer):
    """Deformable self-attention over all levels, then the FFN; post-norm."""

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        pos: jax.Array,
        reference_points: jax.Array,
        mask: jax.Array,
        spatial_shapes: SpatialShapes,
        train: bool = False,
    ) -> jax.Array:
        y = self.deformable_attention("self_attn")(
            x + pos, reference_points, x, mask, spatial_shapes
        )
        x = self.add_norm(x, y, "self_attn_layer_norm", train)
        return self.feed_forward(x, train)


class DeformableDecoderLayer(_PostNormLayer):
    """Self-attention among queries (optionally masked), deformable cross-attention into the
    encoder memory around each query's reference, then the FFN; post-norm.

    `query_pos` is added to the queries and keys of the self-attention and to the query of the
    cross-attention, never to values.
    """

    attention_dropout: float = 0.0

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        query_pos: jax.Array,
        reference_points: jax.Array,
        memory: jax.Array,
        memory_mask: jax.Array,
        spatial_shapes: SpatialShapes,
        self_attn_mask: jax.Array | None = None,
        train: bool = False,
    ) -> jax.Array:
        attention = detr.Attention(
            self.num_heads, self.attention_dropout, self.dtype, name="self_attn"
        )
        qk = x + query_pos
        y = attention(qk, qk, x, None, train, attention_mask=self_attn_mask)
        x = self.add_norm(x, y, "self_attn_layer_norm", train)
        y = self.deformable_attention("encoder_attn")(
            x + query_pos, reference_points, memory, memory_mask, spatial_shapes
        )
        x = self.add_norm(x, y, "encoder_attn_layer_norm", train)
        return self.feed_forward(x, train)


# The layer arguments that shape the computation rather than enter it.
_STATIC_LAYER_ARGUMENTS = ("spatial_shapes", "train")


def layer_class(layer: type[_PostNormLayer], remat: bool) -> type[nn.Module]:
    """`layer`, or with `remat` a version that keeps only its inputs for the backward pass and
    recomputes the rest there (`nn.remat`): at 800x1333 one encoder layer's FFN activations
    alone are [B, 22223, 2048]. Its `spatial_shapes` and `train` arguments, passed
    positionally, are static. XLA on GPU and TPU keeps the recomputation apart; its CPU
    pipeline expands the optimization barriers before CSE, which then merges it back into the
    forward pass unless that pass is off, as the trainer's CPU step has it
    (`train.step_compiler_options`)."""
    if not remat:
        return layer
    arguments = list(inspect.signature(layer.__call__).parameters)  # self is argument 0
    return nn.remat(layer, static_argnums=tuple(map(arguments.index, _STATIC_LAYER_ARGUMENTS)))


class _Projection(nn.Module):
    """Conv (1x1, or 3x3 stride 2) + GroupNorm: one level of the multi-scale neck."""

    features: int
    kernel: int = 1
    stride: int = 1
    num_groups: int = 32
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pad = self.kernel // 2
        x = nn.Conv(
            self.features,
            (self.kernel, self.kernel),
            strides=self.stride,
            padding=((pad, pad), (pad, pad)),
            dtype=self.dtype,
            kernel_init=_xavier,
            conv_general_dilated=conv.conv_general_dilated,
            name="conv",
        )(x)
        return nn.GroupNorm(
            num_groups=self.num_groups,
            epsilon=GN_EPS,
            use_fast_variance=False,
            dtype=self.dtype,
            name="norm",
        )(x)


class MultiScaleNeck(nn.Module):
    """Backbone maps -> `num_levels` maps of `hidden_dim` channels, with their padding masks.

    Level i < len(maps) is `input_proj_i` (1x1 conv + GroupNorm) of map i; each further level is
    a 3x3 stride-2 conv + GroupNorm of the last backbone map (first extra level) or of the
    previous projected level.
    """

    hidden_dim: int = 256
    num_levels: int = 4
    num_groups: int = 32
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, maps: Sequence[jax.Array], pixel_mask: jax.Array
    ) -> list[tuple[jax.Array, jax.Array]]:
        if self.hidden_dim % self.num_groups:
            raise ValueError(
                f"hidden_dim {self.hidden_dim} is not divisible by GroupNorm's "
                f"{self.num_groups} groups"
            )
        if len(maps) > self.num_levels:
            raise ValueError(f"{len(maps)} backbone maps for num_feature_levels={self.num_levels}")
        levels = []
        for i in range(self.num_levels):
            if i < len(maps):
                kernel, stride, source = 1, 1, maps[i]
            else:
                kernel, stride = 3, 2
                source = maps[-1] if i == len(maps) else levels[-1]
            proj = _Projection(
                self.hidden_dim, kernel, stride, self.num_groups, self.dtype, name=f"input_proj_{i}"
            )
            levels.append(proj(source))
        return [(x, backbones.resize_mask(pixel_mask, x.shape[1:3])) for x in levels]


class FlatLevels(NamedTuple):
    source: jax.Array  # [B, S, D]
    mask: jax.Array  # [B, S] bool, True for real positions
    pos: jax.Array  # [B, S, D] position + level embedding
    spatial_shapes: tuple[tuple[int, int], ...]
    ratios: jax.Array  # [B, levels, 2] (width, height) valid fractions


def flatten_levels(
    levels: Sequence[tuple[jax.Array, jax.Array]],
    level_embed: jax.Array,
    temperature: float,
    offset: float,
) -> FlatLevels:
    """Concatenates the levels row-major in level order, with their sine + level embeddings."""
    sources, masks, pos, shapes, ratios = [], [], [], [], []
    for level, (x, mask) in enumerate(levels):
        batch, height, width, dim = x.shape
        embedding = sine_position_embedding(mask, dim // 2, temperature, offset=offset)
        embedding = embedding.astype(x.dtype) + level_embed[level].astype(x.dtype)
        sources.append(x.reshape(batch, height * width, dim))
        masks.append(mask.reshape(batch, height * width))
        pos.append(embedding.reshape(batch, height * width, dim))
        shapes.append((height, width))
        ratios.append(valid_ratios(mask))
    return FlatLevels(
        jnp.concatenate(sources, axis=1),
        jnp.concatenate(masks, axis=1),
        jnp.concatenate(pos, axis=1),
        tuple(shapes),
        jnp.stack(ratios, axis=1),
    )


def level_embedding(num_levels: int, dim: int) -> jax.Array:
    """The learned [levels, D] level embedding (an `Embed` table named "level_embed")."""
    return nn.Embed(
        num_levels, dim, embedding_init=nn.initializers.normal(1.0), name="level_embed"
    ).embedding


class SimpleFeaturePyramid(nn.Module):
    """A plain ViT's stride-p map -> maps at strides p/2, p, 2p (ViTDet's simple pyramid:
    a 2x2 stride-2 transposed conv, identity, 2x2 max pool)."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> list[jax.Array]:
        up = nn.ConvTranspose(
            x.shape[-1], (2, 2), strides=(2, 2), dtype=self.dtype, name="upsample"
        )(x)
        down = nn.max_pool(x, (2, 2), strides=(2, 2))
        return [up, x, down]


def backbone_feature_maps(
    backbone: nn.Module,
    images: jax.Array,
    stages: Sequence[str],
    train: bool,
    dtype: Any,
    frozen: bool = False,
) -> list[jax.Array]:
    """The maps the neck projects: ResNet stages by name, or a ViT's simple pyramid.

    A `frozen` backbone runs in inference mode and passes no gradient back (see
    `backbones.BackboneConfig.freeze`); the pyramid over a ViT's map is still trained.
    """
    out = backbone(images, train and not frozen)
    if frozen:
        out = jax.lax.stop_gradient(out)
    if "features" in out:
        return SimpleFeaturePyramid(dtype=dtype, name="vit_pyramid")(out["features"])
    missing = [s for s in stages if s not in out]
    if missing:
        raise ValueError(f"backbone_stages {tuple(stages)}: the backbone has no {missing}")
    return [out[s] for s in stages]


def layer_kwargs(model: nn.Module, points: int) -> dict[str, Any]:
    """Encoder/decoder layer settings from a detector's fields (DeformableDetr, DINO)."""
    return dict(
        num_heads=model.num_heads,
        num_levels=model.num_feature_levels,
        num_points=points,
        ffn_dim=model.ffn_dim,
        dropout=model.dropout,
        remat=model.remat,
        dtype=model.dtype,
    )


def encode_images(
    model: nn.Module,
    images: jax.Array,
    pixel_mask: jax.Array,
    train: bool,
    temperature: float,
    offset: float,
    input_dropout: float = 0.0,
) -> tuple[jax.Array, FlatLevels]:
    """Backbone -> multi-scale neck -> flattened levels -> deformable encoder.

    Called from the compact `__call__` of `model` (a DeformableDetr or DINO, whose field names
    it reads), so the submodules live in its scope: "backbone", "neck", "level_embed",
    "encoder_layers_{i}". `input_dropout` applies to the encoder's input (Deformable DETR's; DINO
    has none). Returns the encoder memory [B, S, D] and the flattened levels.
    """
    spec = model.backbone_config
    maps = backbone_feature_maps(
        spec.build(model.dtype, name="backbone", remat=model.remat),
        images,
        spec.stages,
        train,
        model.dtype,
        spec.freeze,
    )
    levels = MultiScaleNeck(
        model.hidden_dim, model.num_feature_levels, dtype=model.dtype, name="neck"
    )(maps, pixel_mask)
    embedding = level_embedding(model.num_feature_levels, model.hidden_dim)
    flat = flatten_levels(levels, embedding, temperature, offset)
    x = nn.Dropout(input_dropout)(flat.source, deterministic=not train)
    reference = encoder_reference_points(flat.spatial_shapes, flat.ratios)
    for i in range(model.num_encoder_layers):
        layer = layer_class(DeformableEncoderLayer, model.remat)(
            **layer_kwargs(model, model.encoder_points), name=f"encoder_layers_{i}"
        )
        x = layer(x, flat.pos, reference, flat.mask, flat.spatial_shapes, train)
    return x, flat


def shared_heads(
    two_stage: bool,
    with_box_refine: bool,
    shared_class_head: bool | None = None,
    shared_box_head: bool | None = None,
) -> tuple[bool, bool]:
    """(class head, box head): whether one head serves every decoder layer. None ties as
    transformers does: the class head unless two-stage, the box head unless refining boxes."""
    return (
        (not two_stage) if shared_class_head is None else shared_class_head,
        (not with_box_refine) if shared_box_head is None else shared_box_head,
    )


class DeformableDetr(backbones.MultiScaleBackboneFields):
    """Deformable DETR.

    `apply(variables, images [B, H, W, 3], pixel_mask=None, train=False)` returns "logits"
    [B, Q, num_classes] (sigmoid, no "no object" class), "boxes" [B, Q, 4] (cxcywh), "aux" (one
    {"logits", "boxes"} per earlier decoder layer) and, with `two_stage`, "enc" (the encoder's
    proposals over all S positions: [B, S, num_classes], [B, S, 4]); float32.

    Attributes:
      num_classes: object classes (sigmoid logits, no "no object" class).
      num_queries: decoder queries; with `two_stage`, the number of top-scoring encoder
        proposals that become them.
      hidden_dim, num_heads, ffn_dim, dropout, attention_dropout: transformer width, heads, FFN
        width, dropout (residual branches and FFN hidden layer) and self-attention dropout.
      num_encoder_layers, num_decoder_layers: depth.
      num_feature_levels, encoder_points, decoder_points: multi-scale deformable attention.
      two_stage: queries from the encoder's top-k proposals (needs `with_box_refine`).
      with_box_refine: each decoder layer refines the previous layer's boxes.
      shared_class_head, shared_box_head: one head for every decoder layer instead of one per
        layer; None ties them as transformers does (class heads unless `two_stage`, box heads
        unless `with_box_refine`). The two-stage encoder head is always its own.
      backbone, backbone_norm, freeze_backbone, backbone_frozen_stages, dilation,
        backbone_stages: keyword-only, from `backbones.MultiScaleBackboneFields` (one record:
        `self.backbone_config`); `backbone_stages` are the ResNet stages the neck projects
        (C3-C5 by default).
      remat: recompute deformable sampling, every encoder and decoder layer (`layer_class`) and
        a ResNet backbone's trained blocks (`resnet.ResNet.remat`) in the backward pass from
        their inputs.
      dtype: compute dtype; parameters stay float32.
    """

    family: ClassVar[str] = "deformable_detr"

    num_classes: int
    num_queries: int = 300
    hidden_dim: int = 256
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    ffn_dim: int = 1024
    dropout: float = 0.1
    attention_dropout: float = 0.0
    num_feature_levels: int = 4
    encoder_points: int = 4
    decoder_points: int = 4
    two_stage: bool = False
    with_box_refine: bool = False
    shared_class_head: bool | None = None
    shared_box_head: bool | None = None
    remat: bool = False
    dtype: Any = jnp.float32

    def _heads(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """Class and box head of each decoder layer (and, two-stage, the encoder's last)."""
        layers = self.num_decoder_layers
        shared_class, shared_box = shared_heads(
            self.two_stage, self.with_box_refine, self.shared_class_head, self.shared_box_head
        )
        count = layers + int(self.two_stage)
        class_heads = [
            nn.Dense(self.num_classes, dtype=self.dtype, name=f"class_embed_{i}")
            for i in range(1 if shared_class else layers)
        ]
        box_heads = [
            detr.BoxHead(self.hidden_dim, self.dtype, name=f"bbox_embed_{i}")
            for i in range(1 if shared_box else layers)
        ]
        class_heads = [class_heads[0]] * layers if shared_class else class_heads
        box_heads = [box_heads[0]] * layers if shared_box else box_heads
        if self.two_stage:
            class_heads.append(
                nn.Dense(self.num_classes, dtype=self.dtype, name=f"class_embed_{count - 1}")
            )
            box_heads.append(
                detr.BoxHead(self.hidden_dim, self.dtype, name=f"bbox_embed_{count - 1}")
            )
        return class_heads, box_heads

    def _two_stage_queries(
        self, memory: jax.Array, flat: FlatLevels, class_head: nn.Module, box_head: nn.Module
    ) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
        """Queries from the top-k encoder proposals: (query_pos, target, reference boxes, the
        encoder's outputs over every position)."""
        dim = self.hidden_dim
        proposals = encoder_proposals(memory, flat.mask, flat.spatial_shapes)
        features = nn.Dense(dim, dtype=self.dtype, name="enc_output")(proposals.memory)
        features = _layer_norm(self.dtype, "enc_output_norm")(features)
        logits = class_head(features).astype(jnp.float32)
        coords = box_head(features).astype(jnp.float32) + proposals.logits
        # Deformable DETR ranks proposals by the first class's logit (its encoder head is a
        # binary foreground classifier in the original).
        _, top = jax.lax.top_k(logits[..., 0], self.num_queries)
        selected = jnp.take_along_axis(coords, top[..., None], axis=1)
        reference = jax.nn.sigmoid(jax.lax.stop_gradient(selected))
        embedding = sine_embedding(reference * (2 * math.pi), dim // 2).astype(self.dtype)
        embedding = nn.Dense(2 * dim, dtype=self.dtype, name="pos_trans")(embedding)
        embedding = _layer_norm(self.dtype, "pos_trans_norm")(embedding)
        enc = {"logits": logits, "boxes": jax.nn.sigmoid(coords)}
        return embedding[..., :dim], embedding[..., dim:], reference, enc

    def _learned_queries(self, batch: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Learned queries: (query_pos, target, 2-d reference points from query_pos)."""
        dim = self.hidden_dim
        embedding = nn.Embed(
            self.num_queries,
            2 * dim,
            embedding_init=nn.initializers.normal(1.0),
            name="query_position_embeddings",
        )(jnp.arange(self.num_queries))
        embedding = jnp.broadcast_to(embedding.astype(self.dtype), (batch, *embedding.shape))
        query_pos, target = embedding[..., :dim], embedding[..., dim:]
        points = nn.Dense(2, dtype=self.dtype, kernel_init=_xavier, name="reference_points")
        return query_pos, target, jax.nn.sigmoid(points(query_pos).astype(jnp.float32))

    @nn.compact
    def __call__(
        self, images: jax.Array, pixel_mask: jax.Array | None = None, train: bool = False
    ) -> dict[str, Any]:
        if self.two_stage and not self.with_box_refine:
            raise ValueError("two_stage needs with_box_refine, as in Deformable DETR")
        if pixel_mask is None:
            pixel_mask = jnp.ones(images.shape[:3], bool)
        memory, flat = encode_images(
            self, images, pixel_mask, train, 10000.0, offset=0.5, input_dropout=self.dropout
        )
        class_heads, box_heads = self._heads()
        outputs: dict[str, Any] = {}
        if self.two_stage:
            query_pos, hidden, reference, outputs["enc"] = self._two_stage_queries(
                memory, flat, class_heads[-1], box_heads[-1]
            )
        else:
            query_pos, hidden, reference = self._learned_queries(images.shape[0])

        # references[i] is what decoder layer i samples around and predicts its box from.
        references, layer_outputs = [reference], []
        for i in range(self.num_decoder_layers):
            layer = layer_class(DeformableDecoderLayer, self.remat)(
                **layer_kwargs(self, self.decoder_points),
                attention_dropout=self.attention_dropout,
                name=f"decoder_layers_{i}",
            )
            ref_input = decoder_reference_input(references[-1], flat.ratios)
            hidden = layer(
                hidden, query_pos, ref_input, memory, flat.mask, flat.spatial_shapes, None, train
            )
            layer_outputs.append(hidden)
            if self.with_box_refine:
                delta = box_heads[i](hidden).astype(jnp.float32)
                references.append(jax.lax.stop_gradient(_refine(references[-1], delta)))
            else:
                references.append(references[-1])

        logits, boxes = [], []
        for i, h in enumerate(layer_outputs):
            logits.append(class_heads[i](h).astype(jnp.float32))
            boxes.append(_refine(references[i], box_heads[i](h).astype(jnp.float32)))
        aux = [{"logits": lg, "boxes": bx} for lg, bx in zip(logits[:-1], boxes[:-1])]
        return {"logits": logits[-1], "boxes": boxes[-1], "aux": aux, **outputs}


def _refine(reference: jax.Array, delta: jax.Array) -> jax.Array:
    """sigmoid(delta + inverse_sigmoid(reference)); a 2-d reference moves only the centre."""
    if reference.shape[-1] == 4:
        return jax.nn.sigmoid(delta + inverse_sigmoid(reference))
    centre = delta[..., :2] + inverse_sigmoid(reference)
    return jax.nn.sigmoid(jnp.concatenate([centre, delta[..., 2:]], axis=-1))


def postprocess(outputs: dict[str, jax.Array], top_k: int = 100) -> dict[str, jax.Array]:
    """Deformable DETR / DINO post-processing: the top_k (query, class) pairs by sigmoid score.

    Returns "scores" [B, K], "labels" [B, K] int32 and "boxes" [B, K, 4] cxcywh, where
    K = min(top_k, queries x classes): a small model has fewer pairs than the default top_k.
    """
    logits = outputs["logits"].astype(jnp.float32)
    batch, num_queries, num_classes = logits.shape
    top_k = min(top_k, num_queries * num_classes)
    scores, flat = jax.lax.top_k(jax.nn.sigmoid(logits).reshape(batch, -1), top_k)
    query = flat // num_classes
    boxes = jnp.take_along_axis(outputs["boxes"].astype(jnp.float32), query[..., None], axis=1)
    return {"scores": scores, "labels": (flat % num_classes).astype(jnp.int32), "boxes": boxes}


Model = DeformableDetr


def make_loss(config: ml_collections.ConfigDict, model: DeformableDetr) -> LossFn:
    """Deformable DETR's training loss: Hungarian matching on focal costs and the focal set loss
    (`focal_set_loss.focal_set_loss`, with the two-stage encoder's terms), weighted by
    `config.loss`."""
    from ood_jax.models import focal_set_loss, set_loss  # optax: imported for training only

    weights = set_loss.config_weights(config)
    return focal_set_loss.make_loss_fn(model, focal_set_loss.FocalSetLossConfig(**weights))
