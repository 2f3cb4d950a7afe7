"""timm ViT checkpoints -> `ood_jax.models.vit.ViT` variables.

`vit_from_timm(state_dict)` reads the architecture off the tensor shapes, maps every tensor, and
fails, naming them, on any source key it did not use, any target parameter it did not fill and any
shape that does not match. A checkpoint of another ViT flavour (layer scale, register tokens,
average pooling with `fc_norm`, ...) is therefore refused instead of being loaded half-way. Only
the classification head (`head.*`) is dropped on purpose: a detection backbone has no use for it.
"""

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from ood_jax.models.vit import ViT

# The classifier is the one part of a timm ViT the backbone deliberately leaves out.
IGNORED_PREFIXES = ("head.",)
# Every standard ViT (Ti/S/B/L/H) has 64-dimensional heads; pass `num_heads` for anything else.
HEAD_DIM = 64


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor; `.float()` because numpy has no bfloat16
        return x.detach().cpu().float().numpy()
    return np.asarray(x, np.float32)


def _block_ids(sd: Mapping[str, np.ndarray]) -> list[int]:
    return sorted({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})


def _architecture(sd: Mapping[str, np.ndarray], pos_grid: tuple[int, int] | None) -> dict:
    try:
        width, _, patch, _ = sd["patch_embed.proj.weight"].shape
        num_tokens = sd["pos_embed"].shape[1]
        mlp_dim = sd["blocks.0.mlp.fc1.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"not a timm ViT state dict: missing {e.args[0]!r}") from None
    class_token = "cls_token" in sd
    if pos_grid is None:
        # timm makes the same assumption when it resamples: pretraining grids are square.
        side = math.isqrt(num_tokens - class_token)
        if side * side != num_tokens - class_token:
            raise ValueError(
                f"pos_embed has {num_tokens} tokens: not a square grid"
                f"{' plus a class token' if class_token else ''}; pass pos_grid"
            )
        pos_grid = (side, side)
    return {
        "width": width,
        "depth": len(_block_ids(sd)),
        "mlp_dim": mlp_dim,
        "patch_size": patch,
        "class_token": class_token,
        "pos_grid": tuple(pos_grid),
    }


def _map_tensors(sd: Mapping[str, np.ndarray], num_heads: int) -> dict[str, tuple[str, Any]]:
    """Target param path -> (source key, converted array), for the source keys present."""
    out: dict[str, tuple[str, Any]] = {}

    def put(target: str, key: str, fn: Callable[[np.ndarray], np.ndarray] = lambda a: a) -> None:
        if key in sd:
            out[target] = (key, fn(sd[key]))

    put("embedding/kernel", "patch_embed.proj.weight", lambda a: a.transpose(2, 3, 1, 0))
    put("embedding/bias", "patch_embed.proj.bias")
    put("cls", "cls_token")
    put("pos_embedding", "pos_embed")
    put("norm/scale", "norm.weight")
    put("norm/bias", "norm.bias")
    for i in _block_ids(sd):
        src, dst = f"blocks.{i}.", f"block_{i}/"
        for n in ("norm1", "norm2"):
            put(f"{dst}{n}/scale", f"{src}{n}.weight")
            put(f"{dst}{n}/bias", f"{src}{n}.bias")
        for n in ("fc1", "fc2"):
            put(f"{dst}mlp/{n}/kernel", f"{src}mlp.{n}.weight", lambda a: a.T)
            put(f"{dst}mlp/{n}/bias", f"{src}mlp.{n}.bias")
        # torch stacks q, k, v as row blocks of one [3 * D, D] Linear; flax's attention keeps a
        # [D, heads, head_dim] kernel and [heads, head_dim] bias for each.
        for j, n in enumerate(("query", "key", "value")):
            put(
                f"{dst}attn/{n}/kernel",
                f"{src}attn.qkv.weight",
                lambda a, j=j: a.reshape(3, num_heads, -1, a.shape[-1])[j].transpose(2, 0, 1),
            )
            put(
                f"{dst}attn/{n}/bias",
                f"{src}attn.qkv.bias",
                lambda a, j=j: a.reshape(3, num_heads, -1)[j],
            )
        put(
            f"{dst}attn/out/kernel",
            f"{src}attn.proj.weight",
            lambda a: a.T.reshape(num_heads, -1, a.shape[0]),
        )
        put(f"{dst}attn/out/bias", f"{src}attn.proj.bias")
    return out


def vit_from_timm(
    state_dict: Mapping[str, Any],
    *,
    num_heads: int | None = None,
    pos_grid: tuple[int, int] | None = None,
    **module_kwargs: Any,
) -> tuple[ViT, dict]:
    """Converts a timm `VisionTransformer` state dict to `(ViT module, {"params": ...})`.

    Args:
      state_dict: `model.state_dict()` of a timm ViT (torch tensors or numpy arrays).
      num_heads: defaults to width / 64, true of every standard ViT; the shapes cannot tell.
      pos_grid: the position-embedding grid; read from `pos_embed` when it is square.
      **module_kwargs: other `ViT` fields (resample_method, drop_path_rate, dtype).

    Raises:
      ValueError listing every unused source key, unfilled target parameter and shape mismatch.
    """
    sd = {k: _numpy(v) for k, v in state_dict.items()}
    arch = _architecture(sd, pos_grid)
    heads = num_heads or arch["width"] // HEAD_DIM
    module = ViT(num_heads=heads, **arch, **module_kwargs)

    p, (gh, gw) = arch["patch_size"], arch["pos_grid"]
    channels = sd["patch_embed.proj.weight"].shape[1]
    dummy = jax.ShapeDtypeStruct((1, gh * p, gw * p, channels), jnp.float32)
    shapes = jax.eval_shape(module.init, jax.random.key(0), dummy)["params"]
    targets = flax.traverse_util.flatten_dict(shapes, sep="/")

    mapped = _map_tensors(sd, heads)
    used = {key for key, _ in mapped.values()}
    problems = [
        f"unused source key {k!r}"
        for k in sd
        if k not in used and not k.startswith(IGNORED_PREFIXES)
    ]
    problems += [f"unfilled target param {t!r}" for t in targets if t not in mapped]
    problems += [
        f"source key {key!r} maps to {t!r}, which the module does not have"
        for t, (key, _) in mapped.items()
        if t not in targets
    ]
    problems += [
        f"{t!r} from {key!r}: shape {a.shape} != {targets[t].shape}"
        for t, (key, a) in mapped.items()
        if t in targets and a.shape != targets[t].shape
    ]
    if problems:
        raise ValueError("timm ViT conversion failed:\n  " + "\n  ".join(sorted(problems)))
    params = {t: jnp.asarray(a) for t, (_, a) in mapped.items()}
    return module, {"params": flax.traverse_util.unflatten_dict(params, sep="/")}
