"""transformers DETR checkpoints -> Flax `detr.DETR`, and the PyTorch converters' public names.

* `detr_from_hf(path)`: a transformers `DetrForObjectDetection` directory (config.json plus
  model.safetensors, or pytorch_model.bin read with `torch.load(weights_only=True)`), with a
  timm backbone (`use_timm_backbone=True`, as facebook/detr-resnet-50) or a transformers
  `ResNetConfig` backbone. Returns `(module, variables)`.
* `resnet_from_torch(state_dict, module)`, `load_state_dict(path)`, `convert(...)` and the
  ResNet rule tables are those of `ood_jax.models.convert_torch` (rule tables, strict key
  accounting; described there), importable from here too.
"""

import json
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from ood_jax.models import detr
from ood_jax.models.convert_torch import (
    HF_RESNET_RULES,
    TORCHVISION_RESNET_RULES,
    Rule,
    Target,
    abstract_variables,
    convert,
    hf_backbone,
    load_state_dict,
    prefixed,
    require,
    resnet_from_torch,
    timm_backbone,
)

__all__ = [
    "DETR_RULES",
    "HF_RESNET_RULES",
    "TORCHVISION_RESNET_RULES",
    "Rule",
    "Target",
    "convert",
    "canonical_detr_key",
    "detr_from_hf",
    "detr_module_from_config",
    "load_state_dict",
    "resnet_from_torch",
]

# transformers' DetrForObjectDetection, after `canonical_detr_key`; Flax names mirror it. Read
# forwards by `detr_from_hf`, backwards by `transformers_export.write`.
DETR_RULES: list[Rule] = [
    (r"model\.input_projection", "input_projection", "conv"),
    (r"model\.query_position_embeddings", "query_position_embeddings", "embedding"),
    (
        r"model\.(encoder|decoder)\.layers\.(\d+)\.(self_attn|encoder_attn)\.([qkvo]_proj)",
        r"\1/layers_\2/\3/\4",
        "linear",
    ),
    (r"model\.(encoder|decoder)\.layers\.(\d+)\.mlp\.(fc[12])", r"\1/layers_\2/mlp/\3", "linear"),
    (
        r"model\.(encoder|decoder)\.layers\.(\d+)\.(\w+_layer_norm)",
        r"\1/layers_\2/\3",
        "layernorm",
    ),
    (r"model\.decoder\.layernorm", "decoder/layernorm", "layernorm"),
    (r"class_labels_classifier", "class_labels_classifier", "linear"),
    (r"bbox_predictor\.layers\.(\d)", r"bbox_predictor/layers_\1", "linear"),
]

# Saved checkpoints (hub and transformers 5.x save_pretrained alike) use the legacy names on the
# left; transformers 5.x modules use the ones on the right. Both load.
_DETR_RENAMES = [
    (r"^model\.backbone\.conv_encoder\.", "model.backbone."),
    (r"\.out_proj\.", ".o_proj."),
    (r"\.layers\.(\d+)\.fc([12])\.", r".layers.\1.mlp.fc\2."),
]


def canonical_detr_key(key: str) -> str:
    for pattern, repl in _DETR_RENAMES:
        key = re.sub(pattern, repl, key)
    return key


def detr_module_from_config(config: Any, dtype: Any = jnp.float32) -> tuple[detr.DETR, list[Rule]]:
    """The `DETR` a transformers `DetrConfig` describes, and the rules for its checkpoint."""
    pos_type, act = config.position_embedding_type, config.activation_function
    require(pos_type == "sine", "position_embedding_type", pos_type, "sine")
    require(act == "relu", "activation_function", act, "relu")
    heads = (config.encoder_attention_heads, config.decoder_attention_heads)
    require(heads[0] == heads[1], "encoder/decoder_attention_heads", heads, "must be equal")
    ffn = (config.encoder_ffn_dim, config.decoder_ffn_dim)
    require(ffn[0] == ffn[1], "encoder/decoder_ffn_dim", ffn, "must be equal")

    backbone_cfg = config.backbone_config
    prefix = r"model\.backbone\.model\."
    if backbone_cfg.model_type == "timm_backbone":
        backbone, dilation = timm_backbone(backbone_cfg)
        rules = prefixed(TORCHVISION_RESNET_RULES, prefix, "backbone/")
    elif backbone_cfg.model_type == "resnet":
        # transformers ignores `dilation` for this backbone, and so does the module.
        backbone, dilation = hf_backbone(backbone_cfg, dtype), False
        rules = prefixed(HF_RESNET_RULES, prefix, "backbone/")
    else:
        raise ValueError(
            f"config.json: backbone_config.model_type={backbone_cfg.model_type!r} is not "
            "supported (timm_backbone or resnet)"
        )
    module = detr.DETR(
        num_classes=config.num_labels,
        num_queries=config.num_queries,
        hidden_dim=config.d_model,
        num_heads=heads[0],
        num_encoder_layers=config.encoder_layers,
        num_decoder_layers=config.decoder_layers,
        ffn_dim=ffn[0],
        dropout=config.dropout,
        backbone=backbone,
        backbone_norm="frozen",
        dilation=dilation,
        norm_between_decoder_layers=config.auxiliary_loss,
        dtype=dtype,
    )
    return module, rules + DETR_RULES


def detr_from_hf(
    path: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[detr.DETR, dict[str, Any]]:
    """A transformers DETR checkpoint directory -> (`DETR` module, variables).

    The backbone's BatchNorms load as frozen ones (transformers freezes them, eps 1e-5).
    `dtype` is the compute dtype; parameters load as float32.
    """
    from transformers import DetrConfig

    path = Path(path)
    with open(path / "config.json") as f:
        architectures = json.load(f).get("architectures") or []
    require(
        architectures in ([], ["DetrForObjectDetection"]),
        "architectures",
        architectures,
        "DetrForObjectDetection",
    )
    module, rules = detr_module_from_config(DetrConfig.from_pretrained(path), dtype)
    state = {canonical_detr_key(k): v for k, v in load_state_dict(path).items()}
    return module, convert(state, rules, abstract_variables(module))
