"""transformers `GroupViTModel` checkpoints -> `groupvit.GroupViT` modules and Flax variables.

`groupvit_from_hf` reads a GroupViTModel directory, as `convert.load_hf` does; the projection
heads' BatchNorm statistics go to "batch_stats", as `resnet.FrozenBatchNorm` keeps them, and the
text tower is converted by `convert`'s CLIP text mapping. As in `convert`, every tensor is
accounted for.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ood_jax.models import convert_torch
from ood_jax.scorers import convert, groupvit, hf_directory

KIND = "groupvit"
MODEL_TYPE = "groupvit"

# transformers' config defaults (configuration_groupvit.py).
TEXT_DEFAULTS = {
    **convert.CLIP_TEXT_DEFAULTS,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
}
VISION_DEFAULTS = {
    "hidden_size": 384,
    "intermediate_size": 1536,
    "depths": [6, 3, 3],
    "num_group_tokens": [64, 8, 0],
    "num_output_groups": [64, 8, 8],
    "num_attention_heads": 6,
    "image_size": 224,
    "patch_size": 16,
    "num_channels": 3,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "assign_eps": 1.0,
    "assign_mlp_ratio": [0.5, 4],
}
MODEL_DEFAULTS = {"projection_dim": 256, "projection_intermediate_dim": 4096}

# Projection head -> its transformers nn.Sequential(Linear, BatchNorm1d, ReLU, Linear).
HEADS = {"image/head": "visual_projection", "text_head": "text_projection"}


# --------------------------------------------------------------------------- configs


def _stages(vision: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    """(depths, num_group_tokens, num_output_groups), checked to describe a model that runs."""
    fields = ("depths", "num_group_tokens", "num_output_groups")
    depths, tokens, groups = (tuple(int(v) for v in vision[f]) for f in fields)
    if not len(depths) == len(tokens) == len(groups):
        raise ValueError(
            f"{convert.CONFIG_FILE}: vision_config.depths / num_group_tokens / "
            f"num_output_groups have lengths {len(depths)} / {len(tokens)} / {len(groups)}"
        )
    for i in range(1, len(depths)):
        # transformers sizes stage i's group projector for num_output_groups[i - 1] tokens and
        # feeds it the num_group_tokens[i - 1] group tokens of stage i - 1.
        if tokens[i] and tokens[i - 1] != groups[i - 1]:
            raise ValueError(
                f"{convert.CONFIG_FILE}: vision_config.num_group_tokens[{i - 1}]="
                f"{tokens[i - 1]} must equal num_output_groups[{i - 1}]={groups[i - 1]}, as "
                f"stage {i} mixes the previous stage's group tokens"
            )
    return depths, tokens, groups


def _assign_dims(vision: Mapping[str, Any]) -> tuple[int, int]:
    ratio = vision["assign_mlp_ratio"]
    ratio = (ratio, ratio) if isinstance(ratio, (int, float)) else tuple(ratio)
    if len(ratio) != 2:
        raise ValueError(
            f"{convert.CONFIG_FILE}: vision_config.assign_mlp_ratio={ratio!r}: one or two numbers"
        )
    return tuple(int(r * vision["hidden_size"]) for r in ratio)


def _vision_encoder(vision: Mapping[str, Any], dtype: Any) -> groupvit.VisionEncoder:
    depths, tokens, groups = _stages(vision)
    tokens_mlp_dim, channels_mlp_dim = _assign_dims(vision)
    patch = vision["patch_size"]
    return groupvit.VisionEncoder(
        width=vision["hidden_size"],
        num_heads=convert.hf_heads(vision, "vision_config"),
        mlp_dim=vision["intermediate_size"],
        patch_size=patch if isinstance(patch, int) else patch[0],
        pos_grid=convert.hf_grid(vision, "vision_config"),
        depths=depths,
        num_group_tokens=tokens,
        num_groups=groups,
        tokens_mlp_dim=tokens_mlp_dim,
        channels_mlp_dim=channels_mlp_dim,
        assign_eps=float(vision["assign_eps"]),
        ln_eps=vision["layer_norm_eps"],
        activation=convert.hf_activation(vision, "vision_config"),
        dtype=dtype,
    )


def groupvit_module(config: Mapping[str, Any], dtype: Any = jnp.float32) -> groupvit.GroupViT:
    """The `GroupViT` module of a transformers `GroupViTConfig` dict."""
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"{convert.CONFIG_FILE}: model_type {config.get('model_type')!r}; expected "
            f"{MODEL_TYPE!r} (a transformers GroupViTModel checkpoint)"
        )
    config = {**MODEL_DEFAULTS, **config}
    text = convert.sub_config(config, "text_config", TEXT_DEFAULTS)
    vision = convert.sub_config(config, "vision_config", VISION_DEFAULTS)
    head = {
        "hidden_dim": config["projection_intermediate_dim"],
        "out_dim": config["projection_dim"],
        "dtype": dtype,
    }
    # CLIP's text tower as `convert` builds it (eos / legacy-argmax pooling), minus its
    # projection: GroupViT projects with an MLP.
    text_tower = convert.clip_module({"text_config": text}, dtype).text.clone(proj_dim=None)
    return groupvit.GroupViT(
        image=groupvit.ImageTower(_vision_encoder(vision, dtype), groupvit.ProjectionHead(**head)),
        text=text_tower,
        text_head=groupvit.ProjectionHead(**head),
    )


# --------------------------------------------------------------------------- weights


def _block_attention(m: convert.TensorMapping, target: str, key: str, heads: int) -> None:
    proj = tuple(f"{key}.{n}_proj" for n in "qkv")
    m.qkv(target, proj, heads)
    m.attention_out(target, f"{key}.out_proj", heads)


def _grouping_block(m: convert.TensorMapping, target: str, key: str, heads: int) -> None:
    for norm in ("norm_tokens", "norm_x", "norm_post_tokens", "norm_new_x"):
        m.layernorm(f"{target}/{norm}", f"{key}.{norm}")
    for mlp in ("mlp_inter", "mlp_channels", "pre_assign_attn/mlp"):
        for fc in ("fc1", "fc2"):
            m.dense(f"{target}/{mlp}/{fc}", f"{key}.{mlp.replace('/', '.')}.{fc}")
    cross = f"{key}.pre_assign_attn"
    _block_attention(m, f"{target}/pre_assign_attn/attn", f"{cross}.attn", heads)
    m.layernorm(f"{target}/pre_assign_attn/norm2", f"{cross}.norm2")
    m.layernorm(f"{target}/pre_assign_attn/norm_post", f"{cross}.norm_post")
    for name in ("q_proj", "k_proj", "v_proj", "proj"):
        m.dense(f"{target}/assign/{name}", f"{key}.assign.{name}")


def _vision(m: convert.TensorMapping, encoder: groupvit.VisionEncoder) -> None:
    target, src = "image/encoder", "vision_model"
    embed = f"{src}.embeddings"
    patch = f"{embed}.patch_embeddings.projection"
    m.put(f"{target}/embedding/kernel", f"{patch}.weight", convert.conv_kernel)
    m.put(f"{target}/embedding/bias", f"{patch}.bias")
    m.layernorm(f"{target}/norm_embed", f"{embed}.layernorm")
    m.put(f"{target}/pos_embedding", f"{embed}.position_embeddings")
    for i, depth in enumerate(encoder.depths):
        stage, key = f"{target}/stage_{i}", f"{src}.encoder.stages.{i}"
        m.put(f"{stage}/group_token", f"{key}.group_token")
        m.layernorm(f"{stage}/group_projector_norm", f"{key}.group_projector.0")
        m.dense(f"{stage}/group_projector/fc1", f"{key}.group_projector.1.fc1")
        m.dense(f"{stage}/group_projector/fc2", f"{key}.group_projector.1.fc2")
        for j in range(depth):
            m.hf_block(f"{stage}/block_{j}", f"{key}.layers.{j}", encoder.num_heads)
        _grouping_block(m, f"{stage}/downsample", f"{key}.downsample", encoder.num_heads)
    m.layernorm(f"{target}/norm", f"{src}.layernorm")


def _batch_stats(sd: Mapping[str, np.ndarray], module: groupvit.GroupViT) -> dict[str, Any]:
    """{"batch_stats": ...} from the heads' BatchNorm1d tensors, checked against the module."""
    abstract = jax.eval_shape(module.init, jax.random.key(0), *convert.example_inputs(module))
    rules = [(rf"{key}\.1", f"{target}/bn", "batchnorm") for target, key in HEADS.items()]
    stats = {k: v for k, v in sd.items() if _is_batch_norm(k)}
    try:
        return convert_torch.convert(stats, rules, {"batch_stats": abstract["batch_stats"]})
    except KeyError as e:  # one exception type for every conversion failure, as `convert`
        raise ValueError(f"transformers GroupViTModel conversion failed: {e.args[0]}") from None


def _is_batch_norm(key: str) -> bool:
    return key.rpartition(".")[0] in {f"{head}.1" for head in HEADS.values()}


def groupvit_params_from_hf(
    state_dict: Mapping[str, np.ndarray], module: groupvit.GroupViT
) -> dict[str, Any]:
    """Variables for `module` from a transformers `GroupViTModel` state dict."""
    m = convert.TensorMapping({k: v for k, v in state_dict.items() if not _is_batch_norm(k)})
    _vision(m, module.image.encoder)
    convert.hf_text(m, module)
    for target, key in HEADS.items():
        m.dense(f"{target}/fc1", f"{key}.0")
        m.dense(f"{target}/fc2", f"{key}.3")
    m.put("t", "logit_scale", convert.scalar)
    variables = convert.assemble(module, m, "transformers GroupViTModel")
    return {**variables, **_batch_stats(state_dict, module)}


def groupvit_from_hf(path: str | Path, dtype: Any = jnp.float32) -> tuple[str, Any, dict, dict]:
    """(kind, module, variables, config) of a transformers GroupViTModel directory."""
    return hf_directory.load(KIND, path, dtype, groupvit_module, groupvit_params_from_hf)
