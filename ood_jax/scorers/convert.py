"""CLIP / SigLIP checkpoints -> `clip.CLIP` / `siglip.SigLIP` modules and Flax variables.

`load_hf` reads a transformers `CLIPModel` or `SiglipModel` directory; `module_from_config`
builds the module its config describes; `clip_from_open_clip` reads an open_clip state dict, the
architecture read off the tensor shapes. `TensorMapping` is the torch -> Flax layout machinery
the other scorer converters share. Every tensor is accounted for: an unused source tensor, an
unfilled parameter or a shape mismatch fails, listing them.
"""

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from ood_jax.models import convert as model_convert
from ood_jax.models import vit
from ood_jax.scorers import clip, siglip, towers

CONFIG_FILE = "config.json"
KINDS = {"clip": "clip", "siglip": "siglip"}  # config model_type -> scorer kind

# transformers' `hidden_act` names -> `vit.ACTIVATIONS`.
HIDDEN_ACTS = {
    "quick_gelu": "quick_gelu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}

# transformers' config defaults (configuration_clip.py / configuration_siglip.py), used for the
# fields a saved config leaves out.
CLIP_TEXT_DEFAULTS = {
    "vocab_size": 49408,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "eos_token_id": 49407,
}
CLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
SIGLIP_TEXT_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "projection_size": None,
}
SIGLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}

# Buffers some checkpoints persist that are not weights.
IGNORED_KEY = re.compile(r"(.*\.)?(position_ids|attn_mask)$")


# --------------------------------------------------------------------------- configs


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory; errors name the file."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a CLIP/SigLIP checkpoint directory needs it")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def sub_config(config: Mapping[str, Any], name: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A sub-config with transformers' defaults filled in (CLIP's legacy `*_config_dict` wins):
    hub configs often list only the fields that differ."""
    section = config.get(f"{name}_dict") or config.get(name) or {}
    if not isinstance(section, dict):
        raise ValueError(f"{CONFIG_FILE}: {name} must be an object, got {type(section).__name__}")
    return {**defaults, **section}


def hf_activation(section: Mapping[str, Any], name: str) -> str:
    act = section["hidden_act"]
    if act not in HIDDEN_ACTS:
        raise ValueError(
            f"{CONFIG_FILE}: {name}.hidden_act={act!r} is not supported; "
            f"known: {sorted(HIDDEN_ACTS)}"
        )
    return HIDDEN_ACTS[act]


def hf_heads(section: Mapping[str, Any], name: str) -> int:
    width, heads = section["hidden_size"], section["num_attention_heads"]
    if width % heads:
        raise ValueError(
            f"{CONFIG_FILE}: {name}.hidden_size={width} is not a multiple of "
            f"num_attention_heads={heads}"
        )
    return heads


def hf_grid(section: Mapping[str, Any], name: str) -> tuple[int, int]:
    size, patch = section["image_size"], section["patch_size"]
    size = (size, size) if isinstance(size, int) else tuple(size)
    patch = (patch, patch) if isinstance(patch, int) else tuple(patch)
    if len(size) != 2 or len(patch) != 2 or patch[0] != patch[1]:
        raise ValueError(
            f"{CONFIG_FILE}: {name}.image_size={section['image_size']!r} / patch_size="
            f"{section['patch_size']!r}: expected ints or [h, w] with square patches"
        )
    return size[0] // patch[0], size[1] // patch[0]


def _image_encoder(section: Mapping[str, Any], dtype: Any, **flavour: Any) -> vit.ViT:
    return vit.ViT(
        width=section["hidden_size"],
        depth=section["num_hidden_layers"],
        num_heads=hf_heads(section, "vision_config"),
        mlp_dim=section["intermediate_size"],
        patch_size=section["patch_size"]
        if isinstance(section["patch_size"], int)
        else section["patch_size"][0],
        pos_grid=hf_grid(section, "vision_config"),
        ln_eps=section["layer_norm_eps"],
        activation=hf_activation(section, "vision_config"),
        dtype=dtype,
        **flavour,
    )


def _text_tower(section: Mapping[str, Any], dtype: Any, **flavour: Any) -> towers.TextTower:
    return towers.TextTower(
        vocab_size=section["vocab_size"],
        max_len=section["max_position_embeddings"],
        width=section["hidden_size"],
        depth=section["num_hidden_layers"],
        num_heads=hf_heads(section, "text_config"),
        mlp_dim=section["intermediate_size"],
        ln_eps=section["layer_norm_eps"],
        activation=hf_activation(section, "text_config"),
        dtype=dtype,
        **flavour,
    )


def clip_module(config: Mapping[str, Any], dtype: Any = jnp.float32) -> clip.CLIP:
    """The `CLIP` module of a transformers `CLIPConfig` dict."""
    text = sub_config(config, "text_config", CLIP_TEXT_DEFAULTS)
    vision = sub_config(config, "vision_config", CLIP_VISION_DEFAULTS)
    proj_dim = config.get("projection_dim", 512)
    eos = text["eos_token_id"]
    if not isinstance(eos, int):
        raise ValueError(
            f"{CONFIG_FILE}: text_config.eos_token_id={eos!r}: one integer id expected"
        )
    encoder = _image_encoder(
        vision, dtype, class_token=True, patch_bias=False, ln_pre=True, pool_type="tok"
    )
    return clip.CLIP(
        image=towers.ImageTower(encoder, proj_dim=proj_dim, proj_bias=False),
        text=_text_tower(
            text,
            dtype,
            mask="causal",
            # transformers keeps the argmax of the legacy configs (eos_token_id 2, from before
            # the id was corrected), where the end token is the largest id.
            pool="argmax" if eos == 2 else "eos",
            eos_token_id=eos,
            proj_dim=proj_dim,
            proj_bias=False,
        ),
    )


def siglip_module(config: Mapping[str, Any], dtype: Any = jnp.float32) -> siglip.SigLIP:
    """The `SigLIP` module of a transformers `SiglipConfig` dict."""
    text = sub_config(config, "text_config", SIGLIP_TEXT_DEFAULTS)
    vision = sub_config(config, "vision_config", SIGLIP_VISION_DEFAULTS)
    if not vision["vision_use_head"]:
        raise ValueError(
            f"{CONFIG_FILE}: vision_config.vision_use_head=false: the image tower would have no "
            "pooled output, so there are no image features to score with"
        )
    encoder = _image_encoder(
        vision, dtype, class_token=False, patch_bias=True, ln_pre=False, pool_type="map"
    )
    return siglip.SigLIP(
        image=towers.ImageTower(encoder, proj_dim=None),
        text=_text_tower(
            text,
            dtype,
            mask="bidirectional",
            pool="last",
            proj_dim=text["projection_size"] or text["hidden_size"],
            proj_bias=True,
        ),
    )


def module_from_config(config: Mapping[str, Any], dtype: Any = jnp.float32) -> tuple[str, Any]:
    """(kind, module) for a transformers config dict; kind is "clip" or "siglip"."""
    model_type = config.get("model_type")
    if model_type not in KINDS:
        raise ValueError(
            f"{CONFIG_FILE}: unknown model_type {model_type!r}; supported: {sorted(KINDS)} "
            "(transformers CLIPModel / SiglipModel checkpoints)"
        )
    kind = KINDS[model_type]
    build = clip_module if kind == "clip" else siglip_module
    return kind, build(config, dtype)


# --------------------------------------------------------------------------- weights


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor; `.float()` because numpy has no bfloat16
        return x.detach().cpu().float().numpy()
    return np.asarray(x, np.float32)


def _linear(a: np.ndarray) -> np.ndarray:
    return a.T


def conv_kernel(a: np.ndarray) -> np.ndarray:
    return a.transpose(2, 3, 1, 0)


class TensorMapping:
    """Collects target param path -> (source key, array) for the source keys present."""

    def __init__(self, sd: Mapping[str, np.ndarray]):
        self.sd = sd
        self.out: dict[str, tuple[str, np.ndarray]] = {}

    def put(self, target: str, key: str, fn: Callable[[np.ndarray], np.ndarray] = np.asarray):
        if key in self.sd:
            self.out[target] = (key, fn(self.sd[key]))

    def dense(self, target: str, key: str, fn: Callable = _linear) -> None:
        self.put(f"{target}/kernel", f"{key}.weight", fn)
        self.put(f"{target}/bias", f"{key}.bias")

    def layernorm(self, target: str, key: str) -> None:
        self.put(f"{target}/scale", f"{key}.weight")
        self.put(f"{target}/bias", f"{key}.bias")

    def qkv(self, target: str, keys: tuple[str, str, str], heads: int) -> None:
        """Separate q, k, v Linears (transformers) -> flax attention projections."""
        for name, key in zip(("query", "key", "value"), keys):
            self.put(
                f"{target}/{name}/kernel",
                f"{key}.weight",
                lambda a: a.T.reshape(a.shape[1], heads, -1),
            )
            self.put(f"{target}/{name}/bias", f"{key}.bias", lambda a: a.reshape(heads, -1))

    def packed_qkv(
        self,
        target: str,
        key: str,
        heads: int,
        names: tuple[str, str] = ("in_proj_weight", "in_proj_bias"),
    ) -> None:
        """A [3D, D] packed projection whose rows are (q, k, v) x heads x head_dim (torch's
        MultiheadAttention `in_proj_*`; `names` = (weight, bias) for other layouts) -> the three
        projections."""
        weight, bias = names
        for j, name in enumerate(("query", "key", "value")):
            self.put(
                f"{target}/{name}/kernel",
                f"{key}.{weight}",
                lambda a, j=j: a.reshape(3, -1, a.shape[1])[j].T.reshape(a.shape[1], heads, -1),
            )
            self.put(
                f"{target}/{name}/bias",
                f"{key}.{bias}",
                lambda a, j=j: a.reshape(3, heads, -1)[j],
            )

    def attention_out(self, target: str, key: str, heads: int) -> None:
        self.put(
            f"{target}/out/kernel", f"{key}.weight", lambda a: a.T.reshape(heads, -1, a.shape[0])
        )
        self.put(f"{target}/out/bias", f"{key}.bias")

    def hf_block(self, target: str, key: str, heads: int) -> None:
        """A transformers CLIPEncoderLayer / SiglipEncoderLayer -> `vit.EncoderBlock`."""
        self.layernorm(f"{target}/norm1", f"{key}.layer_norm1")
        self.layernorm(f"{target}/norm2", f"{key}.layer_norm2")
        proj = tuple(f"{key}.self_attn.{n}_proj" for n in "qkv")
        self.qkv(f"{target}/attn", proj, heads)
        self.attention_out(f"{target}/attn", f"{key}.self_attn.out_proj", heads)
        self.dense(f"{target}/mlp/fc1", f"{key}.mlp.fc1")
        self.dense(f"{target}/mlp/fc2", f"{key}.mlp.fc2")

    def open_clip_block(self, target: str, key: str, heads: int) -> None:
        """An open_clip ResidualAttentionBlock -> `vit.EncoderBlock`."""
        self.layernorm(f"{target}/norm1", f"{key}.ln_1")
        self.layernorm(f"{target}/norm2", f"{key}.ln_2")
        self.packed_qkv(f"{target}/attn", f"{key}.attn", heads)
        self.attention_out(f"{target}/attn", f"{key}.attn.out_proj", heads)
        self.dense(f"{target}/mlp/fc1", f"{key}.mlp.c_fc")
        self.dense(f"{target}/mlp/fc2", f"{key}.mlp.c_proj")


def scalar(a: np.ndarray) -> np.ndarray:
    if a.size != 1:
        raise ValueError(f"expected a scalar, got shape {a.shape}")
    return a.reshape(())


def example_inputs(module: clip.CLIP) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    images = jax.ShapeDtypeStruct((1, *module.image_size, 3), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, module.text_length), jnp.int32)
    return images, ids


def assemble(
    module: Any,
    mapped: TensorMapping,
    source: str,
    targets: Mapping[str, jax.ShapeDtypeStruct] | None = None,
) -> dict[str, Any]:
    """{"params": ...} from the mapped tensors, or a ValueError listing every mismatch.

    `targets` are the module's parameters, flattened with "/"; by default those its `__call__`
    creates on `example_inputs` (a model with parameters only another method creates, as
    BLIP-2's matching head, passes its own)."""
    if targets is None:
        shapes = jax.eval_shape(module.init, jax.random.key(0), *example_inputs(module))
        targets = flax.traverse_util.flatten_dict(shapes["params"], sep="/")
    used = {key for key, _ in mapped.out.values()}
    problems = [
        f"unused source key {k!r}" for k in mapped.sd if k not in used and not IGNORED_KEY.match(k)
    ]
    problems += [f"unfilled target param {t!r}" for t in targets if t not in mapped.out]
    problems += [
        f"source key {key!r} maps to {t!r}, which the module does not have"
        for t, (key, _) in mapped.out.items()
        if t not in targets
    ]
    problems += [
        f"{t!r} from {key!r}: shape {a.shape} != {targets[t].shape}"
        for t, (key, a) in mapped.out.items()
        if t in targets and a.shape != targets[t].shape
    ]
    if problems:
        raise ValueError(f"{source} conversion failed:\n  " + "\n  ".join(sorted(problems)))
    params = {t: jnp.asarray(a, jnp.float32) for t, (_, a) in mapped.out.items()}
    return {"params": flax.traverse_util.unflatten_dict(params, sep="/")}


def hf_text(m: TensorMapping, module: clip.CLIP) -> None:
    src, heads = "text_model", module.text.num_heads
    m.put("text/token_embedding/embedding", f"{src}.embeddings.token_embedding.weight")
    m.put("text/pos_embedding", f"{src}.embeddings.position_embedding.weight")
    for i in range(module.text.depth):
        m.hf_block(f"text/block_{i}", f"{src}.encoder.layers.{i}", heads)
    m.layernorm("text/norm", f"{src}.final_layer_norm")


def _hf_vision_blocks(m: TensorMapping, module: clip.CLIP) -> None:
    encoder = module.image.encoder
    src = "vision_model"
    m.put(
        "image/encoder/pos_embedding",
        f"{src}.embeddings.position_embedding.weight",
        lambda a: a[None],
    )
    m.put("image/encoder/embedding/kernel", f"{src}.embeddings.patch_embedding.weight", conv_kernel)
    m.put("image/encoder/embedding/bias", f"{src}.embeddings.patch_embedding.bias")
    for i in range(encoder.depth):
        m.hf_block(f"image/encoder/block_{i}", f"{src}.encoder.layers.{i}", encoder.num_heads)
    m.layernorm("image/encoder/norm", f"{src}.post_layernorm")


def clip_params_from_hf(state_dict: Mapping[str, np.ndarray], module: clip.CLIP) -> dict:
    """Variables for `module` from a transformers `CLIPModel` state dict."""
    m = TensorMapping(state_dict)
    _hf_vision_blocks(m, module)
    m.put("image/encoder/cls", "vision_model.embeddings.class_embedding", lambda a: a[None, None])
    m.layernorm("image/encoder/norm_pre", "vision_model.pre_layrnorm")
    m.put("image/proj/kernel", "visual_projection.weight", _linear)
    hf_text(m, module)
    m.put("text/proj/kernel", "text_projection.weight", _linear)
    m.put("t", "logit_scale", scalar)
    return assemble(module, m, "transformers CLIPModel")


def siglip_params_from_hf(state_dict: Mapping[str, np.ndarray], module: siglip.SigLIP) -> dict:
    """Variables for `module` from a transformers `SiglipModel` state dict."""
    m = TensorMapping(state_dict)
    _hf_vision_blocks(m, module)
    head, heads = "vision_model.head", module.image.encoder.num_heads
    m.put("image/encoder/map_head/probe", f"{head}.probe")
    m.packed_qkv("image/encoder/map_head/attn", f"{head}.attention", heads)
    m.attention_out("image/encoder/map_head/attn", f"{head}.attention.out_proj", heads)
    m.layernorm("image/encoder/map_head/norm", f"{head}.layernorm")
    m.dense("image/encoder/map_head/mlp/fc1", f"{head}.mlp.fc1")
    m.dense("image/encoder/map_head/mlp/fc2", f"{head}.mlp.fc2")
    hf_text(m, module)
    m.dense("text/proj", "text_model.head")
    m.put("t", "logit_scale", scalar)
    m.put("b", "logit_bias", scalar)
    return assemble(module, m, "transformers SiglipModel")


def read_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Tensors of a transformers checkpoint directory, float32 numpy arrays.

    model.safetensors, else the shards a model.safetensors.index.json lists, else
    pytorch_model.bin (read with weights_only=True; never an arbitrary pickle).
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not (path / "model.safetensors").exists() and index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"{index}: no readable weight_map ({e!r})") from e
        state = {}
        for name in files:
            state.update(model_convert.load_state_dict(path / name))
    else:
        state = model_convert.load_state_dict(path)
    return {k: np.asarray(v, np.float32) for k, v in state.items()}


def load_hf(path: str | Path, dtype: Any = jnp.float32) -> tuple[str, Any, dict, dict]:
    """(kind, module, variables, config) of a transformers CLIPModel / SiglipModel directory."""
    config = read_config(path)
    kind, module = module_from_config(config, dtype)
    convert = clip_params_from_hf if kind == "clip" else siglip_params_from_hf
    try:
        variables = convert(read_weights(path), module)
    except ValueError as e:
        raise ValueError(f"{Path(path)}: {e}") from e
    return kind, module, variables, config


# --------------------------------------------------------------------------- open_clip

# open_clip's ViTs use 64-dimensional attention heads in both towers (`head_width`).
OPEN_CLIP_HEAD_DIM = 64


def _depth(sd: Mapping[str, Any], prefix: str) -> int:
    pattern = re.compile(rf"{re.escape(prefix)}\.resblocks\.(\d+)\.")
    ids = {int(m.group(1)) for k in sd if (m := pattern.match(k))}
    if ids != set(range(len(ids))):
        raise ValueError(f"open_clip state dict: {prefix}.resblocks are not numbered 0..N-1")
    return len(ids)


def clip_from_open_clip(
    state_dict: Mapping[str, Any],
    *,
    activation: str = "gelu",
    ln_eps: float = 1e-5,
    dtype: Any = jnp.float32,
) -> tuple[clip.CLIP, dict]:
    """Converts an open_clip ViT `CLIP` state dict to `(CLIP module, {"params": ...})`.

    The shapes give the architecture; attention heads are width / 64, open_clip's default.
    `activation` is "gelu" for open_clip's own trainings (laion2b ViT-L-14 among them) and
    "quick_gelu" for OpenAI's weights and the `-quickgelu` configs; the shapes cannot tell.
    Text features pool at the largest token id (open_clip's "argmax" pooling: the end-of-text
    token has the largest id of its vocabulary).
    """
    sd = {k: _to_numpy(v) for k, v in state_dict.items()}
    try:
        width, _, patch, _ = sd["visual.conv1.weight"].shape
        num_pos = sd["visual.positional_embedding"].shape[0]
        text_len, text_width = sd["positional_embedding"].shape
        vocab = sd["token_embedding.weight"].shape[0]
        proj_dim = sd["visual.proj"].shape[1]
        mlp = sd["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
        text_mlp = sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"not an open_clip ViT CLIP state dict: missing {e.args[0]!r}") from None
    side = int(round((num_pos - 1) ** 0.5))
    if side * side != num_pos - 1:
        raise ValueError(
            f"visual.positional_embedding has {num_pos} rows: not a class token plus a square grid"
        )
    vit.check_activation(activation)
    encoder = vit.ViT(
        width=width,
        depth=_depth(sd, "visual.transformer"),
        num_heads=width // OPEN_CLIP_HEAD_DIM,
        mlp_dim=mlp,
        patch_size=patch,
        pos_grid=(side, side),
        ln_eps=ln_eps,
        activation=activation,
        patch_bias=False,
        ln_pre=True,
        pool_type="tok",
        dtype=dtype,
    )
    module = clip.CLIP(
        image=towers.ImageTower(encoder, proj_dim=proj_dim, proj_bias=False),
        text=towers.TextTower(
            vocab_size=vocab,
            max_len=text_len,
            width=text_width,
            depth=_depth(sd, "transformer"),
            num_heads=text_width // OPEN_CLIP_HEAD_DIM,
            mlp_dim=text_mlp,
            ln_eps=ln_eps,
            activation=activation,
            mask="causal",
            pool="argmax",
            proj_dim=sd["text_projection"].shape[1] if "text_projection" in sd else proj_dim,
            proj_bias=False,
            dtype=dtype,
        ),
    )

    m = TensorMapping(sd)
    m.put("image/encoder/embedding/kernel", "visual.conv1.weight", conv_kernel)
    m.put("image/encoder/cls", "visual.class_embedding", lambda a: a[None, None])
    m.put("image/encoder/pos_embedding", "visual.positional_embedding", lambda a: a[None])
    m.layernorm("image/encoder/norm_pre", "visual.ln_pre")
    for i in range(encoder.depth):
        m.open_clip_block(
            f"image/encoder/block_{i}", f"visual.transformer.resblocks.{i}", encoder.num_heads
        )
    m.layernorm("image/encoder/norm", "visual.ln_post")
    m.put("image/proj/kernel", "visual.proj")  # open_clip multiplies x @ proj: already [in, out]
    m.put("text/token_embedding/embedding", "token_embedding.weight")
    m.put("text/pos_embedding", "positional_embedding")
    for i in range(module.text.depth):
        m.open_clip_block(f"text/block_{i}", f"transformer.resblocks.{i}", module.text.num_heads)
    m.layernorm("text/norm", "ln_final")
    m.put("text/proj/kernel", "text_projection")
    m.put("t", "logit_scale", scalar)
    return module, assemble(module, m, "open_clip CLIP")
