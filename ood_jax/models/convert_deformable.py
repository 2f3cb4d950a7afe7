"""PyTorch checkpoints -> Flax variables for `DeformableDetr` and `DINO`.

  * `deformable_detr_from_hf(path)`: a transformers `DeformableDetrForObjectDetection` directory
    (config.json plus model.safetensors, or pytorch_model.bin read with weights_only=True), any
    of its `two_stage` / `with_box_refine` settings, with a timm ResNet backbone
    (`use_timm_backbone=True`, as SenseTime/deformable-detr) or a transformers `ResNetConfig`
    one. Returns `(module, variables)`.
  * `dino_from_official(state_dict)` / `load_official_dino(path)`: IDEA-Research's DINO
    checkpoints (`checkpoint0011_4scale.pth` and the other DINO-4scale ResNet-50/101 releases,
    `{"model": state_dict, ...}` as its `main.py` saves them). Returns `(module, variables)`.

Both use the rule tables and the strict key accounting of `ood_jax.models.convert_torch` (every source
tensor used or explicitly dropped, every target filled, shapes checked), after a canonicalizing
pass that
  * renames transformers' saved (legacy) names to the live module names, as for DETR;
  * splits `nn.MultiheadAttention`'s packed `in_proj_weight` / `in_proj_bias` (DINO's decoder
    self-attention) into q/k/v projections and renames `out_proj` to `o_proj`;
  * gives bare parameters (`level_embed`) a `.weight` leaf so they load as embedding tables;
  * folds tied copies of one tensor into one: transformers stores a two-stage model's heads
    under `model.decoder.*` and, in a live state dict, again at the top; DINO stores its shared
    decoder heads six times under `bbox_embed.*`, `class_embed.*` and
    `transformer.decoder.{bbox,class}_embed.*`. Copies must be equal (ValueError naming both
    keys otherwise).

Head sharing follows the checkpoint: heads whose per-layer tensors are all equal (or that exist
only once) load as one shared head, distinct ones as one head per layer. For transformers models
this is how it ties them (class heads unless two-stage, box heads unless box refinement).

DINO's layout (models/dino in IDEA-Research/DINO, config DINO_4scale.py) is mapped by name:

  official key                                            -> Flax path
  backbone.0.body.{conv1,bn1,layerN.M.*}                  -> backbone/... (torchvision ResNet)
  input_proj.{l}.0 / .1                                   -> neck/input_proj_{l}/conv / norm
  transformer.level_embed                                 -> level_embed/embedding
  transformer.encoder.layers.{i}.self_attn.*              -> encoder_layers_{i}/self_attn/*
  transformer.encoder.layers.{i}.norm1 / linear1 / linear2 / norm2
      -> encoder_layers_{i}/self_attn_layer_norm / mlp/fc1 / mlp/fc2 / final_layer_norm
  transformer.decoder.layers.{i}.X, with decoder_layers_{i}/... for:
      self_attn.in_proj_*, out_proj    -> self_attn/{q,k,v}_proj, self_attn/o_proj
      norm2 (after self-attention)     -> self_attn_layer_norm
      cross_attn.*                     -> encoder_attn/*
      norm1 (after cross-attention)    -> encoder_attn_layer_norm
      linear1 / linear2 / norm3        -> mlp/fc1 / mlp/fc2 / final_layer_norm
  transformer.decoder.norm                                -> decoder_norm
  transformer.decoder.ref_point_head.layers.{j}           -> ref_point_head/layers_{j}
  [transformer.decoder.]class_embed.{i} / bbox_embed.{i}  -> class_embed_{i} / bbox_embed_{i}
  transformer.tgt_embed                                   -> tgt_embed (content queries)
  transformer.enc_output / enc_output_norm                -> enc_output / enc_output_norm
  transformer.enc_out_class_embed / enc_out_bbox_embed    -> enc_class_embed / enc_bbox_embed
  label_enc                                               -> label_enc (denoising labels)

DINO configs that share the encoder's proposal heads with the decoder's
(`two_stage_{class,bbox}_embed_share`) load them as two equal copies, which fine-tuning unties.

The shapes give the architecture (classes, queries, width, depths, FFN width, levels, ResNet-50
or -101); heads and points per level cannot be told apart from shapes and are arguments
(DINO-4scale: 8 and 4).
"""

import argparse
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ood_jax.models import convert_torch, deformable_detr, dino, resnet
from ood_jax.models.convert_torch import Rule

# transformers' DeformableDetrForObjectDetection after `_canonical_keys`.
DEFORMABLE_DETR_RULES: list[Rule] = [
    (r"model\.input_proj\.(\d+)\.0", r"neck/input_proj_\1/conv", "conv"),
    (r"model\.input_proj\.(\d+)\.1", r"neck/input_proj_\1/norm", "layernorm"),
    (r"model\.level_embed", "level_embed", "embedding"),
    (r"model\.query_position_embeddings", "query_position_embeddings", "embedding"),
    (r"model\.reference_points", "reference_points", "linear"),
    (r"model\.(enc_output|pos_trans)", r"\1", "linear"),
    (r"model\.(enc_output_norm|pos_trans_norm)", r"\1", "layernorm"),
    (
        r"model\.encoder\.layers\.(\d+)\.self_attn\.(\w+)",
        r"encoder_layers_\1/self_attn/\2",
        "linear",
    ),
    (
        r"model\.decoder\.layers\.(\d+)\.(self_attn|encoder_attn)\.(\w+)",
        r"decoder_layers_\1/\2/\3",
        "linear",
    ),
    (r"model\.(encoder|decoder)\.layers\.(\d+)\.mlp\.(fc[12])", r"\1_layers_\2/mlp/\3", "linear"),
    (
        r"model\.(encoder|decoder)\.layers\.(\d+)\.(\w+_layer_norm)",
        r"\1_layers_\2/\3",
        "layernorm",
    ),
    (r"class_embed\.(\d+)", r"class_embed_\1", "linear"),
    (r"bbox_embed\.(\d+)\.layers\.(\d)", r"bbox_embed_\1/layers_\2", "linear"),
]

_ENCODER_LAYER = r"transformer\.encoder\.layers\.(\d+)"
_DECODER_LAYER = r"transformer\.decoder\.layers\.(\d+)"

# IDEA-Research DINO after `_canonical_keys` (see the module docstring's table).
DINO_RULES: list[Rule] = [
    (r"input_proj\.(\d+)\.0", r"neck/input_proj_\1/conv", "conv"),
    (r"input_proj\.(\d+)\.1", r"neck/input_proj_\1/norm", "layernorm"),
    (r"transformer\.level_embed", "level_embed", "embedding"),
    (r"transformer\.tgt_embed", "tgt_embed", "embedding"),
    (r"label_enc", "label_enc", "embedding"),
    (_ENCODER_LAYER + r"\.self_attn\.(\w+)", r"encoder_layers_\1/self_attn/\2", "linear"),
    (_ENCODER_LAYER + r"\.norm1", r"encoder_layers_\1/self_attn_layer_norm", "layernorm"),
    (_ENCODER_LAYER + r"\.linear([12])", r"encoder_layers_\1/mlp/fc\2", "linear"),
    (_ENCODER_LAYER + r"\.norm2", r"encoder_layers_\1/final_layer_norm", "layernorm"),
    (_DECODER_LAYER + r"\.self_attn\.(\w+)", r"decoder_layers_\1/self_attn/\2", "linear"),
    (_DECODER_LAYER + r"\.norm2", r"decoder_layers_\1/self_attn_layer_norm", "layernorm"),
    (_DECODER_LAYER + r"\.cross_attn\.(\w+)", r"decoder_layers_\1/encoder_attn/\2", "linear"),
    (_DECODER_LAYER + r"\.norm1", r"decoder_layers_\1/encoder_attn_layer_norm", "layernorm"),
    (_DECODER_LAYER + r"\.linear([12])", r"decoder_layers_\1/mlp/fc\2", "linear"),
    (_DECODER_LAYER + r"\.norm3", r"decoder_layers_\1/final_layer_norm", "layernorm"),
    (r"transformer\.decoder\.norm", "decoder_norm", "layernorm"),
    (
        r"transformer\.decoder\.ref_point_head\.layers\.(\d)",
        r"ref_point_head/layers_\1",
        "linear",
    ),
    (r"transformer\.(enc_output)", r"\1", "linear"),
    (r"transformer\.(enc_output_norm)", r"\1", "layernorm"),
    (r"transformer\.enc_out_class_embed", "enc_class_embed", "linear"),
    (r"transformer\.enc_out_bbox_embed\.layers\.(\d)", r"enc_bbox_embed/layers_\1", "linear"),
    (r"class_embed\.(\d+)", r"class_embed_\1", "linear"),
    (r"bbox_embed\.(\d+)\.layers\.(\d)", r"bbox_embed_\1/layers_\2", "linear"),
]

_HF_RENAMES = [
    (r"^model\.backbone\.conv_encoder\.", "model.backbone."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.layers\.(\d+)\.fc([12])\.", r".layers.\1.mlp.fc\2."),
    (r"^model\.level_embed$", "model.level_embed.weight"),
]

_DINO_RENAMES = [
    (r"^module\.", ""),  # saved from a DistributedDataParallel wrapper
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"^transformer\.level_embed$", "transformer.level_embed.weight"),
]


def _renamed(key: str, renames: list[tuple[str, str]]) -> str:
    for pattern, repl in renames:
        key = re.sub(pattern, repl, key)
    return key


def canonical_hf_key(key: str) -> str:
    """A transformers Deformable DETR key (saved or live name) as `DEFORMABLE_DETR_RULES` and
    the backbone rules read it."""
    return _renamed(key, _HF_RENAMES)


def _canonical_keys(
    state: Mapping[str, Any], renames: list[tuple[str, str]]
) -> dict[str, np.ndarray]:
    out = {}
    for key, value in state.items():
        key = _renamed(key, renames)
        value = convert_torch.to_numpy(value)
        packed = re.fullmatch(r"(.*\.self_attn)\.in_proj_(weight|bias)", key)
        if packed:
            # nn.MultiheadAttention stacks the q, k and v projections along the output axis.
            for name, part in zip("qkv", np.split(value, 3, axis=0)):
                out[f"{packed[1]}.{name}_proj.{packed[2]}"] = part
        else:
            out[key] = value
    return out


def _fold_tied(
    state: dict[str, np.ndarray], head: str, aliases: list[str], num_layers: int
) -> tuple[dict[str, np.ndarray], bool]:
    """Folds the copies of `{alias}{head}.{i}.*` into `{head}.{i}.*` (i < num_layers) and,
    when every layer's tensors equal layer 0's, into `{head}.0.*` alone.

    Returns the new state and whether the head is shared across layers. Indices >= num_layers
    (a two-stage encoder head) are folded across aliases but never shared.
    """
    pattern = re.compile(rf"^({'|'.join(re.escape(a) for a in aliases)}){head}\.(\d+)\.(.+)$")
    copies: dict[tuple[int, str], list[tuple[str, np.ndarray]]] = {}
    rest = {}
    for key, value in state.items():
        match = pattern.match(key)
        if match:
            copies.setdefault((int(match[2]), match[3]), []).append((key, value))
        else:
            rest[key] = value
    folded = {}
    for (index, leaf), found in copies.items():
        first_key, first = found[0]
        for key, value in found[1:]:
            if value.shape != first.shape or not np.array_equal(value, first):
                raise ValueError(f"{key} and {first_key} should be one tied tensor but differ")
        folded[(index, leaf)] = (first_key, first)
    layer_leaves = {leaf for index, leaf in folded if index == 0}
    shared = bool(layer_leaves) and all(
        np.array_equal(value, folded[(0, leaf)][1])
        for (index, leaf), (_, value) in folded.items()
        if 0 < index < num_layers and (0, leaf) in folded
    )
    for (index, leaf), (_, value) in folded.items():
        if shared and 0 < index < num_layers:
            continue
        rest[f"{head}.{index}.{leaf}"] = value
    return rest, shared


def _abstract(module: Any, min_positions: int) -> dict[str, Any]:
    """Variable shapes of `module`, traced on an image large enough for its top-k selection."""
    # Four levels at strides 8..64 hold about size**2 / 48 positions.
    size = 64
    while (size // 8) ** 2 < min_positions:
        size *= 2
    images = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    return jax.eval_shape(module.init, jax.random.key(0), images)


# --------------------------------------------------------------------------------------------
# transformers Deformable DETR
# --------------------------------------------------------------------------------------------


def _backbone(
    config: Any, dtype: Any
) -> tuple[str | resnet.ResNet, bool, tuple[str, ...], list[Rule]]:
    """(backbone, dilation, stages the neck reads, backbone rules) of a DeformableDetrConfig."""
    cfg = config.backbone_config
    prefix = r"model\.backbone\.model\."
    if cfg.model_type == "timm_backbone":
        name, dilation = convert_torch.timm_backbone(cfg)
        stages = tuple(f"stage{i}" for i in (cfg.out_indices or [4]))
        rules = convert_torch.prefixed(convert_torch.TORCHVISION_RESNET_RULES, prefix, "backbone/")
        return name, dilation, stages, rules
    if cfg.model_type == "resnet":
        stages = tuple(cfg.out_features)
        rules = convert_torch.prefixed(convert_torch.HF_RESNET_RULES, prefix, "backbone/")
        return convert_torch.hf_backbone(cfg, dtype), False, stages, rules
    raise ValueError(
        f"config.json: backbone_config.model_type={cfg.model_type!r} is not supported "
        "(timm_backbone or resnet)"
    )


def deformable_detr_from_config(
    config: Any, state: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> tuple[deformable_detr.DeformableDetr, list[Rule], dict[str, np.ndarray]]:
    """The module a `DeformableDetrConfig` and its (canonical) state describe, its rules, and
    the state with tied heads folded."""
    require = convert_torch.require
    require(
        config.position_embedding_type == "sine",
        "position_embedding_type",
        config.position_embedding_type,
        "sine",
    )
    require(
        config.activation_function == "relu",
        "activation_function",
        config.activation_function,
        "relu",
    )
    heads = (config.encoder_attention_heads, config.decoder_attention_heads)
    require(heads[0] == heads[1], "encoder/decoder_attention_heads", heads, "must be equal")
    ffn = (config.encoder_ffn_dim, config.decoder_ffn_dim)
    require(ffn[0] == ffn[1], "encoder/decoder_ffn_dim", ffn, "must be equal")

    layers = config.decoder_layers
    aliases = ["model.decoder.", ""]
    state, shared_class = _fold_tied(state, "class_embed", aliases, layers)
    state, shared_box = _fold_tied(state, "bbox_embed", aliases, layers)
    backbone, dilation, stages, backbone_rules = _backbone(config, dtype)
    module = deformable_detr.DeformableDetr(
        num_classes=config.num_labels,
        num_queries=config.two_stage_num_proposals if config.two_stage else config.num_queries,
        hidden_dim=config.d_model,
        num_heads=heads[0],
        num_encoder_layers=config.encoder_layers,
        num_decoder_layers=layers,
        ffn_dim=ffn[0],
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        num_feature_levels=config.num_feature_levels,
        encoder_points=config.encoder_n_points,
        decoder_points=config.decoder_n_points,
        two_stage=config.two_stage,
        with_box_refine=config.with_box_refine,
        shared_class_head=shared_class,
        shared_box_head=shared_box,
        backbone=backbone,
        backbone_norm="frozen",
        dilation=dilation,
        backbone_stages=stages,
        dtype=dtype,
    )
    return module, backbone_rules + DEFORMABLE_DETR_RULES, state


def deformable_detr_rules(config: Any) -> list[Rule]:
    """The rules reading the (canonical) checkpoint of a `DeformableDetrConfig`'s model."""
    return _backbone(config, jnp.float32)[3] + DEFORMABLE_DETR_RULES


def deformable_detr_from_hf(
    path: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[deformable_detr.DeformableDetr, dict[str, Any]]:
    """A transformers Deformable DETR checkpoint directory -> (`DeformableDetr`, variables).

    Backbone BatchNorms load frozen (transformers freezes them, eps 1e-5). `dtype` is the
    compute dtype; parameters load as float32.
    """
    from transformers import DeformableDetrConfig

    path = Path(path)
    with open(path / "config.json") as f:
        architectures = json.load(f).get("architectures") or []
    convert_torch.require(
        architectures in ([], ["DeformableDetrForObjectDetection"]),
        "architectures",
        architectures,
        "DeformableDetrForObjectDetection",
    )
    config = DeformableDetrConfig.from_pretrained(path)
    state = _canonical_keys(convert_torch.load_state_dict(path), _HF_RENAMES)
    module, rules, state = deformable_detr_from_config(config, state, dtype)
    abstract = _abstract(module, module.num_queries if module.two_stage else 0)
    return module, convert_torch.convert(state, rules, abstract)


# --------------------------------------------------------------------------------------------
# IDEA-Research DINO
# --------------------------------------------------------------------------------------------


def _count(state: Mapping[str, Any], pattern: str) -> int:
    found = {int(m[1]) for k in state if (m := re.match(pattern, k))}
    if found != set(range(len(found))):
        raise KeyError(f"non-contiguous indices {sorted(found)} for {pattern!r}")
    return len(found)


def _shape(state: Mapping[str, np.ndarray], key: str) -> tuple[int, ...]:
    if key not in state:
        raise KeyError(f"DINO checkpoint has no {key}; is it a DINO (4/5-scale, ResNet) one?")
    return state[key].shape


def dino_rules() -> list[Rule]:
    """The rules reading an IDEA-Research DINO state dict (ResNet backbone) after
    `_canonical_keys`."""
    backbone = convert_torch.prefixed(
        convert_torch.TORCHVISION_RESNET_RULES, r"backbone\.0\.body\.", "backbone/"
    )
    return backbone + DINO_RULES


def dino_from_official(
    state_dict: Mapping[str, Any],
    *,
    num_heads: int = 8,
    encoder_points: int = 4,
    decoder_points: int = 4,
    dtype: Any = jnp.float32,
) -> tuple[dino.DINO, dict[str, Any]]:
    """An IDEA-Research DINO state dict (ResNet backbone) -> (`DINO` module, variables)."""
    state = _canonical_keys(state_dict, _DINO_RENAMES)
    decoder_layers = _count(state, _DECODER_LAYER + r"\.")
    state, shared_class = _fold_tied(
        state, "class_embed", ["transformer.decoder.", ""], decoder_layers
    )
    state, shared_box = _fold_tied(
        state, "bbox_embed", ["transformer.decoder.", ""], decoder_layers
    )
    if shared_class != shared_box:
        raise ValueError(
            "DINO checkpoint shares its decoder class heads but not its box heads (or the "
            "reverse); DINO shares both or neither"
        )
    levels, hidden_dim = _shape(state, "transformer.level_embed.weight")
    num_queries = _shape(state, "transformer.tgt_embed.weight")[0]
    num_classes = _shape(state, "class_embed.0.weight")[0]
    ffn_dim = _shape(state, "transformer.encoder.layers.0.linear1.weight")[0]
    backbone_levels = _count(state, r"input_proj\.(\d+)\.0\.weight")
    backbone_levels = sum(
        _shape(state, f"input_proj.{i}.0.weight")[2:] == (1, 1) for i in range(backbone_levels)
    )
    blocks = _count(state, r"backbone\.0\.body\.layer3\.(\d+)\.conv1\.weight")
    arch = {6: "resnet50", 23: "resnet101"}.get(blocks)
    if arch is None:
        raise ValueError(f"backbone.0.body.layer3 has {blocks} blocks: neither ResNet-50 nor -101")
    module = dino.DINO(
        num_classes=num_classes,
        num_queries=num_queries,
        hidden_dim=hidden_dim,
        num_heads=num_heads,
        num_encoder_layers=_count(state, _ENCODER_LAYER + r"\."),
        num_decoder_layers=decoder_layers,
        ffn_dim=ffn_dim,
        num_feature_levels=levels,
        encoder_points=encoder_points,
        decoder_points=decoder_points,
        num_label_embeddings=_shape(state, "label_enc.weight")[0],
        shared_decoder_heads=shared_class,
        backbone=arch,
        backbone_norm="frozen",
        backbone_stages=tuple(f"stage{i}" for i in range(5 - backbone_levels, 5)),
        dtype=dtype,
    )
    return module, convert_torch.convert(state, dino_rules(), _abstract(module, num_queries))


def load_official_dino(path: str | os.PathLike, **kwargs: Any) -> tuple[dino.DINO, dict[str, Any]]:
    """`dino_from_official` on a released DINO .pth file ({"model": state_dict, ...}).

    The file is read with `torch.load(weights_only=True)`; the training arguments some releases
    store next to the weights (an argparse.Namespace) are allowed, nothing else is unpickled.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(
            f"{path}: cannot be read with weights_only=True ({e}); re-save its 'model' entry "
            "alone with torch.save(torch.load(path)['model'], new_path) where you trust the file"
        ) from e
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict or {{'model': state dict}}")
    return dino_from_official(state, **kwargs)
