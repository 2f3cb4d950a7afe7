"""transformers `Blip2ForImageTextRetrieval` checkpoints -> `blip2.BLIP2` modules and variables.

`blip2_from_hf` reads a retrieval directory (the `blip2-itm-vit-g` family), as `convert.load_hf`
does; `blip2_from_lavis` reads a LAVIS BLIP-2 state dict, renamed to transformers' names, with
the learned ITC temperature `temp` that transformers' checkpoints drop. As in `convert`, every
tensor is accounted for. Only retrieval checkpoints have the ITC / ITM heads; a
Blip2ForConditionalGeneration or Blip2Model directory is refused by its `architectures`.
"""

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from ood_jax.models import convert_torch, vit
from ood_jax.scorers import blip2, convert, hf_directory

KIND = "blip2"
MODEL_TYPE = "blip-2"
ARCHITECTURE = "Blip2ForImageTextRetrieval"

# transformers' config defaults (configuration_blip_2.py).
VISION_DEFAULTS = {
    "hidden_size": 1408,
    "intermediate_size": 6144,
    "num_hidden_layers": 39,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 14,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-6,
    "qkv_bias": True,
}
QFORMER_DEFAULTS = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "layer_norm_eps": 1e-12,
    "cross_attention_frequency": 2,
    "use_qformer_text_input": False,
}
MODEL_DEFAULTS = {"num_query_tokens": 32, "image_text_hidden_size": 256}


# --------------------------------------------------------------------------- configs


def _require(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"{convert.CONFIG_FILE}: {field}={value!r}: {why}")


def _check_retrieval(config: Mapping[str, Any]) -> None:
    _require(
        config.get("model_type") == MODEL_TYPE,
        "model_type",
        config.get("model_type"),
        f"expected {MODEL_TYPE!r} (a transformers {ARCHITECTURE} checkpoint)",
    )
    # Hand-written configs may leave it out; a language model's tensors then fail the conversion.
    architectures = config.get("architectures") or [ARCHITECTURE]
    _require(
        ARCHITECTURE in architectures,
        "architectures",
        architectures,
        f"only {ARCHITECTURE} (the blip2-itm-vit-g family) has the ITC / ITM heads",
    )


def _vision_encoder(vision: Mapping[str, Any], dtype: Any) -> vit.ViT:
    # vit.ViT's q, k and v projections have biases, filled from transformers' packed
    # (q_bias, 0, v_bias) tensor, which a model without qkv_bias does not have.
    _require(
        vision["qkv_bias"],
        "vision_config.qkv_bias",
        vision["qkv_bias"],
        "BLIP-2's image encoders have q / v biases; only those are supported",
    )
    patch = vision["patch_size"]
    return vit.ViT(
        width=vision["hidden_size"],
        depth=vision["num_hidden_layers"],
        num_heads=convert.hf_heads(vision, "vision_config"),
        mlp_dim=vision["intermediate_size"],
        patch_size=patch if isinstance(patch, int) else patch[0],
        pos_grid=convert.hf_grid(vision, "vision_config"),
        ln_eps=vision["layer_norm_eps"],
        activation=convert.hf_activation(vision, "vision_config"),
        class_token=True,
        patch_bias=True,
        pool_type="tok",
        dtype=dtype,
    )


def _qformer(qformer: Mapping[str, Any]) -> blip2.QFormer:
    _require(
        qformer["use_qformer_text_input"],
        "qformer_config.use_qformer_text_input",
        qformer["use_qformer_text_input"],
        "the Q-Former needs its text feed-forward layers to embed text",
    )
    frequency = qformer["cross_attention_frequency"]
    _require(
        isinstance(frequency, int) and frequency > 0,
        "qformer_config.cross_attention_frequency",
        frequency,
        "a positive integer",
    )
    return blip2.QFormer(
        vocab_size=qformer["vocab_size"],
        max_len=qformer["max_position_embeddings"],
        width=qformer["hidden_size"],
        depth=qformer["num_hidden_layers"],
        num_heads=convert.hf_heads(qformer, "qformer_config"),
        mlp_dim=qformer["intermediate_size"],
        cross_attention_frequency=frequency,
        ln_eps=qformer["layer_norm_eps"],
        activation=convert.hf_activation(qformer, "qformer_config"),
        # float32 whatever `dtype`, as transformers keeps the Q-Former (`_keep_in_fp32_modules`).
        dtype=jnp.float32,
    )


def blip2_module(config: Mapping[str, Any], dtype: Any = jnp.float32) -> blip2.BLIP2:
    """The `BLIP2` module of a transformers `Blip2Config` dict; `dtype` is the image encoder's."""
    _check_retrieval(config)
    config = {**MODEL_DEFAULTS, **config}
    # `image_token_index` is ignored: transformers' processor can prepend num_query_tokens image
    # tokens, which the retrieval model strips before embedding; our tokenizer never adds them.
    vision = convert.sub_config(config, "vision_config", VISION_DEFAULTS)
    qformer = _qformer(convert.sub_config(config, "qformer_config", QFORMER_DEFAULTS))
    return blip2.BLIP2(
        vision=_vision_encoder(vision, dtype),
        qformer=qformer,
        num_query_tokens=config["num_query_tokens"],
        proj_dim=config["image_text_hidden_size"],
        text_length=min(blip2.TEXT_LENGTH, qformer.max_len),
    )


# --------------------------------------------------------------------------- weights


def _vision(m: convert.TensorMapping, encoder: vit.ViT) -> None:
    target, src = "vision", "vision_model"
    embed = f"{src}.embeddings"
    m.put(f"{target}/embedding/kernel", f"{embed}.patch_embedding.weight", convert.conv_kernel)
    m.put(f"{target}/embedding/bias", f"{embed}.patch_embedding.bias")
    m.put(f"{target}/cls", f"{embed}.class_embedding")
    m.put(f"{target}/pos_embedding", f"{embed}.position_embedding")
    heads = encoder.num_heads
    for i in range(encoder.depth):
        block, key = f"{target}/block_{i}", f"{src}.encoder.layers.{i}"
        m.layernorm(f"{block}/norm1", f"{key}.layer_norm1")
        m.layernorm(f"{block}/norm2", f"{key}.layer_norm2")
        # The key's third of the packed bias is zero in BLIP-2 but a free tensor in transformers:
        # it is copied as it is.
        m.packed_qkv(f"{block}/attn", f"{key}.self_attn.qkv", heads, ("weight", "bias"))
        m.attention_out(f"{block}/attn", f"{key}.self_attn.projection", heads)
        m.dense(f"{block}/mlp/fc1", f"{key}.mlp.fc1")
        m.dense(f"{block}/mlp/fc2", f"{key}.mlp.fc2")
    m.layernorm(f"{target}/norm", f"{src}.post_layernorm")


def _post_norm_attention(m: convert.TensorMapping, target: str, key: str, heads: int) -> None:
    """A transformers Blip2QFormerAttention (attention + output dense + LayerNorm)."""
    m.qkv(target, tuple(f"{key}.attention.{n}" for n in ("query", "key", "value")), heads)
    m.attention_out(target, f"{key}.output.dense", heads)
    m.layernorm(f"{target}_norm", f"{key}.output.LayerNorm")


def _feed_forward(m: convert.TensorMapping, target: str, key: str, suffix: str) -> None:
    m.dense(f"{target}/fc1", f"{key}.intermediate{suffix}.dense")
    m.dense(f"{target}/fc2", f"{key}.output{suffix}.dense")
    m.layernorm(f"{target}_norm", f"{key}.output{suffix}.LayerNorm")


def _qformer_params(m: convert.TensorMapping, qformer: blip2.QFormer) -> None:
    m.put("qformer/word_embeddings/embedding", "embeddings.word_embeddings.weight")
    m.put("qformer/position_embeddings/embedding", "embeddings.position_embeddings.weight")
    m.layernorm("qformer/embed_norm", "qformer.layernorm")
    for i in range(qformer.depth):
        layer, key = f"qformer/layer_{i}", f"qformer.encoder.layer.{i}"
        _post_norm_attention(m, f"{layer}/attention", f"{key}.attention", qformer.num_heads)
        _post_norm_attention(
            m, f"{layer}/cross_attention", f"{key}.crossattention", qformer.num_heads
        )
        _feed_forward(m, f"{layer}/query_ffn", key, "_query")
        _feed_forward(m, f"{layer}/text_ffn", key, "")


def _param_shapes(module: blip2.BLIP2) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter, flattened: ITC's `__call__` creates all but the ITM head's."""
    key = jax.random.key(0)
    images = jax.ShapeDtypeStruct((1, *module.image_size, 3), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    gh, gw = module.vision.pos_grid
    states = jax.ShapeDtypeStruct((1, 1 + gh * gw, module.vision.width), jnp.float32)
    itc = jax.eval_shape(module.init, key, images, ids)
    itm = jax.eval_shape(lambda s, i: module.init(key, s, i, method=module.itm_logits), states, ids)
    return {
        **flax.traverse_util.flatten_dict(itc["params"], sep="/"),
        **flax.traverse_util.flatten_dict(itm["params"], sep="/"),
    }


def blip2_params_from_hf(
    state_dict: Mapping[str, np.ndarray], module: blip2.BLIP2
) -> dict[str, Any]:
    """Variables for `module` from a transformers `Blip2ForImageTextRetrieval` state dict."""
    m = convert.TensorMapping(state_dict)
    _vision(m, module.vision)
    _qformer_params(m, module.qformer)
    m.put("query_tokens", "query_tokens")
    for name in ("vision_projection", "text_projection", "itm_head"):
        m.dense(name, name)
    return convert.assemble(module, m, f"transformers {ARCHITECTURE}", _param_shapes(module))


def blip2_from_hf(path: str | Path, dtype: Any = jnp.float32) -> tuple[str, Any, dict, dict]:
    """(kind, module, variables, config) of a transformers Blip2ForImageTextRetrieval
    directory."""
    return hf_directory.load(KIND, path, dtype, blip2_module, blip2_params_from_hf)


# --------------------------------------------------------------------------- LAVIS

# LAVIS name -> transformers name, applied in order (transformers'
# convert_blip_2_original_to_pytorch.py); names no rule matches are kept, so that the
# conversion lists them as unused.
LAVIS_RENAMES = (
    (r"^visual_encoder\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^visual_encoder\.pos_embed$", "vision_model.embeddings.position_embedding"),
    (r"^visual_encoder\.patch_embed\.proj\.", "vision_model.embeddings.patch_embedding."),
    (
        r"^visual_encoder\.blocks\.(\d+)\.norm([12])\.",
        r"vision_model.encoder.layers.\1.layer_norm\2.",
    ),
    (
        r"^visual_encoder\.blocks\.(\d+)\.attn\.proj\.",
        r"vision_model.encoder.layers.\1.self_attn.projection.",
    ),
    (r"^visual_encoder\.blocks\.(\d+)\.attn\.", r"vision_model.encoder.layers.\1.self_attn."),
    (r"^visual_encoder\.blocks\.(\d+)\.mlp\.", r"vision_model.encoder.layers.\1.mlp."),
    (r"^ln_vision\.", "vision_model.post_layernorm."),
    (r"^Qformer\.bert\.embeddings\.LayerNorm\.", "qformer.layernorm."),
    (r"^Qformer\.bert\.embeddings\.", "embeddings."),
    (r"^Qformer\.bert\.encoder\.(.*)\.self\.", r"qformer.encoder.\1.attention."),
    (r"^Qformer\.bert\.encoder\.", "qformer.encoder."),
    (r"^vision_proj\.", "vision_projection."),
    (r"^text_proj\.", "text_projection."),
)
# BLIP-2's first-stage captioning head (BERT's LM head), which the retrieval model does not have.
LAVIS_DROPPED = re.compile(r"^Qformer\.cls\.")
LAVIS_QV_BIAS = re.compile(r"^(visual_encoder\.blocks\.\d+\.attn)\.q_bias$")


def _lavis_name(key: str) -> str:
    for pattern, replacement in LAVIS_RENAMES:
        key = re.sub(pattern, replacement, key)
    return key


def hf_state_dict_from_lavis(
    state_dict: Mapping[str, Any],
) -> tuple[dict[str, np.ndarray], float]:
    """A LAVIS BLIP-2 state dict -> (transformers Blip2ForImageTextRetrieval state dict, temp).

    EVA's separate `q_bias` / `v_bias` become transformers' packed `qkv.bias` (q, 0, v); the
    captioning head `Qformer.cls.*` is dropped. `temp` is the learned ITC temperature: BLIP-2
    trained ITC on softmax(`logits_per_image` / temp).
    """
    sd = {k: convert_torch.to_numpy(v) for k, v in state_dict.items()}
    if "temp" not in sd:
        raise ValueError("LAVIS BLIP-2 state dict: no 'temp' (the ITC temperature)")
    temp = float(convert.scalar(sd.pop("temp")))
    for key in [k for k in sd if LAVIS_QV_BIAS.match(k)]:
        attn = LAVIS_QV_BIAS.match(key).group(1)
        q, v = sd.pop(key), sd.pop(f"{attn}.v_bias")
        sd[f"{attn}.qkv.bias"] = np.concatenate([q, np.zeros_like(q), v])
    renamed = {_lavis_name(k): a for k, a in sd.items() if not LAVIS_DROPPED.match(k)}
    return renamed, temp


def blip2_from_lavis(
    checkpoint: str | Path | Mapping[str, Any], config: Mapping[str, Any], dtype: Any = jnp.float32
) -> tuple[blip2.BLIP2, dict, float]:
    """(module, variables, temp) of a LAVIS BLIP-2 checkpoint (a state dict, or a .pth file whose
    "model" entry is one). LAVIS stores no config: `config` is the transformers Blip2Config dict
    of the same architecture (e.g. Salesforce/blip2-itm-vit-g's config.json)."""
    if not isinstance(checkpoint, Mapping):
        checkpoint = convert_torch.load_state_dict(checkpoint)
    module = blip2_module(config, dtype)
    state_dict, temp = hf_state_dict_from_lavis(checkpoint)
    return module, blip2_params_from_hf(state_dict, module), temp
