"""PyTorch state dicts <-> Flax variables: the rule machinery every converter uses, and ResNets.

`convert` fills a variable tree from a state dict by a table of rules, with strict key
accounting: nothing is skipped silently; `to_state_dict` reads the same rules backwards. `resnet_from_torch` reads torchvision and timm ResNets
(ImageNet weights, the paper's starting point); `load_state_dict` reads safetensors or torch
checkpoints without unpickling; `timm_backbone`, `hf_backbone`, `require` and `prefixed` are what
the transformers detector converters share about a config's ResNet backbone.
"""

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from ood_jax.models import resnet

Target = str | Callable[[re.Match], str]
Rule = tuple[str, Target | None, str]

_LEAVES: dict[str, dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]] | None]] = {
    "conv": {"weight": ("kernel", lambda w: w.transpose(2, 3, 1, 0)), "bias": ("bias", np.asarray)},
    "linear": {"weight": ("kernel", lambda w: w.T), "bias": ("bias", np.asarray)},
    "batchnorm": {
        "weight": ("scale", np.asarray),
        "bias": ("bias", np.asarray),
        "running_mean": ("mean", np.asarray),
        "running_var": ("var", np.asarray),
        "num_batches_tracked": None,
    },
    "layernorm": {"weight": ("scale", np.asarray), "bias": ("bias", np.asarray)},
    "embedding": {"weight": ("embedding", np.asarray)},
}

# torchvision and timm share one ResNet layout.
TORCHVISION_RESNET_RULES: list[Rule] = [
    (r"conv1", "stem_conv", "conv"),
    (r"bn1", "stem_norm", "batchnorm"),
    (r"layer(\d)\.(\d+)\.conv(\d)", r"stage\1_block\2/conv\3", "conv"),
    (r"layer(\d)\.(\d+)\.bn(\d)", r"stage\1_block\2/norm\3", "batchnorm"),
    (r"layer(\d)\.(\d+)\.downsample\.0", r"stage\1_block\2/proj_conv", "conv"),
    (r"layer(\d)\.(\d+)\.downsample\.1", r"stage\1_block\2/proj_norm", "batchnorm"),
    (r"fc", None, "drop"),
]


def _hf_stage_block(m: re.Match, leaf: str) -> str:
    # transformers counts stages and the layers inside a block from 0.
    return f"stage{int(m[1]) + 1}_block{m[2]}/{leaf}"


# transformers' ResNetModel / ResNetBackbone layout.
HF_RESNET_RULES: list[Rule] = [
    (r"embedder\.embedder\.convolution", "stem_conv", "conv"),
    (r"embedder\.embedder\.normalization", "stem_norm", "batchnorm"),
    (
        r"encoder\.stages\.(\d)\.layers\.(\d+)\.layer\.(\d)\.convolution",
        lambda m: _hf_stage_block(m, f"conv{int(m[3]) + 1}"),
        "conv",
    ),
    (
        r"encoder\.stages\.(\d)\.layers\.(\d+)\.layer\.(\d)\.normalization",
        lambda m: _hf_stage_block(m, f"norm{int(m[3]) + 1}"),
        "batchnorm",
    ),
    (
        r"encoder\.stages\.(\d)\.layers\.(\d+)\.shortcut\.convolution",
        lambda m: _hf_stage_block(m, "proj_conv"),
        "conv",
    ),
    (
        r"encoder\.stages\.(\d)\.layers\.(\d+)\.shortcut\.normalization",
        lambda m: _hf_stage_block(m, "proj_norm"),
        "batchnorm",
    ),
]


def prefixed(rules: Sequence[Rule], source: str, target: str) -> list[Rule]:
    """Rules for a sub-model whose keys start with `source` and land under `target`."""

    def shift(dst: Target | None) -> Target | None:
        if dst is None:
            return None
        if callable(dst):
            return lambda m: target + dst(m)
        return target + dst

    return [(source + pattern, shift(dst), kind) for pattern, dst, kind in rules]


def to_numpy(value: Any) -> np.ndarray:
    """A torch tensor (bfloat16 widened to float32) or array-like as a numpy array."""
    if hasattr(value, "detach"):  # a torch tensor; numpy has no bfloat16, so widen first
        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def abstract_variables(module: Any, image_size: int = 64) -> dict[str, Any]:
    """Variable shapes of `module` (traced, nothing computed)."""
    # Parameter shapes do not depend on the image size; 64 px survives the stride of 32.
    images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
    return jax.eval_shape(module.init, jax.random.key(0), images)


def _first_match(rules: Sequence[Rule], module_path: str) -> tuple[Rule, re.Match] | None:
    for rule in rules:
        match = re.fullmatch(rule[0], module_path)
        if match:
            return rule, match
    return None


# What a rule table makes of a key besides a variable: nothing (a "drop" rule), or a counter.
_DROPPED, _COUNTER = "dropped", "counter"


def _reading(rules: Sequence[Rule], key: str) -> tuple[str, str] | str | None:
    """How `rules` read the PyTorch tensor `key`: (kind, the Flax variable's path), _DROPPED,
    _COUNTER (num_batches_tracked, a step count and no weight), or None when no rule reads it."""
    module_path, _, leaf = key.rpartition(".")
    found = _first_match(rules, module_path)
    if found is None:
        return None
    (_, dst, kind), match = found
    if kind == "drop":
        return _DROPPED
    if leaf not in _LEAVES[kind]:
        return None
    leaf_rule = _LEAVES[kind][leaf]
    if leaf_rule is None:
        return _COUNTER
    base = dst(match) if callable(dst) else match.expand(dst)
    return kind, f"{base}/{leaf_rule[0]}"


def convert(
    state_dict: Mapping[str, Any], rules: Sequence[Rule], abstract: Mapping[str, Any]
) -> dict[str, Any]:
    """Fills the variable tree `abstract` (shapes only) from `state_dict` by `rules`.

    A rule (pattern, target, kind) maps a source module path (a key without its last
    component, matched by `re.fullmatch`) to a target module path (a template or a function of
    the match). The kind decides how leaves are renamed and laid out: "conv" (weight -> kernel,
    OIHW -> HWIO; bias), "linear" (weight -> kernel, transposed; bias), "batchnorm" (weight,
    bias, running_mean, running_var -> scale, bias, mean, var; the step counter
    num_batches_tracked is dropped), "layernorm" (weight, bias -> scale, bias), "embedding"
    (weight -> embedding) and "drop" (every leaf dropped, e.g. the ImageNet classifier `fc`).
    The target's collection ("params" or "batch_stats") comes from `abstract`, so frozen and
    trainable BatchNorm load from one table.

    Raises:
      KeyError: a source tensor matches no rule or no target, or a target is left unfilled.
      ValueError: a shape disagrees, or two sources fill one target.
    """
    targets = {}  # "a/b/leaf" -> (collection, ShapeDtypeStruct)
    for path, leaf in traverse_util.flatten_dict(abstract).items():
        targets["/".join(path[1:])] = (path[0], leaf)

    filled: dict[str, str] = {}  # target -> source key
    out: dict[tuple[str, ...], np.ndarray] = {}
    unused, errors = [], []
    for key in sorted(state_dict):
        reading = _reading(rules, key)
        if reading is None:
            unused.append(key)
            continue
        if reading in (_DROPPED, _COUNTER):
            continue
        kind, target = reading
        if target not in targets:
            unused.append(f"{key} (-> {target}, which the module does not have)")
            continue
        if target in filled:
            errors.append(f"{target} filled by both {filled[target]} and {key}")
            continue
        collection, spec = targets[target]
        value = _LEAVES[kind][key.rpartition(".")[2]][1](to_numpy(state_dict[key]))
        if value.shape != spec.shape:
            errors.append(f"{key} -> {target}: shape {value.shape}, expected {spec.shape}")
            continue
        filled[target] = key
        out[(collection, *target.split("/"))] = value.astype(spec.dtype)

    missing = sorted(set(targets) - set(filled))
    if errors:
        raise ValueError("checkpoint does not fit the module:\n  " + "\n  ".join(errors))
    if unused or missing:
        raise KeyError(
            f"checkpoint and module disagree: {len(unused)} source tensors unused "
            f"{unused}; {len(missing)} target variables unfilled {missing}"
        )
    return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(out))


# How `convert` lays a leaf out, undone: HWIO -> OIHW, and a linear kernel transposed back.
_TORCH_LAYOUT: dict[tuple[str, str], Callable[[np.ndarray], np.ndarray]] = {
    ("conv", "weight"): lambda k: k.transpose(3, 2, 0, 1),
    ("linear", "weight"): lambda k: k.T,
}


def to_state_dict(
    variables: Mapping[str, Any], rules: Sequence[Rule], template: Mapping[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """`convert` backwards: the state dict with `template`'s keys and shapes (a PyTorch
    module's own), each tensor taken from `variables` by the rule that would have read it.

    Raises:
      KeyError: a template key has no rule or no variable, or a variable is left unused.
      ValueError: a shape disagrees with the template's.
    """
    sources = {
        "/".join(path[1:]): np.asarray(leaf)
        for path, leaf in traverse_util.flatten_dict(variables).items()
    }
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    unfilled, errors = [], []
    for key, shape in template.items():
        reading = _reading(rules, key)
        if reading == _COUNTER:
            out[key] = np.zeros(shape, np.int64)
            continue
        if reading in (None, _DROPPED):
            unfilled.append(key)
            continue
        kind, source = reading
        leaf = key.rpartition(".")[2]
        if source not in sources:
            unfilled.append(f"{key} (<- {source}, which the variables do not have)")
            continue
        value = _TORCH_LAYOUT.get((kind, leaf), np.asarray)(sources[source])
        if value.shape != tuple(shape):
            errors.append(f"{source} -> {key}: shape {value.shape}, expected {tuple(shape)}")
            continue
        out[key] = np.ascontiguousarray(value, np.float32)
        used.add(source)
    unused = sorted(set(sources) - used)
    if errors:
        raise ValueError("the variables do not fit the module:\n  " + "\n  ".join(errors))
    if unfilled or unused:
        raise KeyError(
            f"variables and module disagree: {len(unfilled)} tensors unfilled {unfilled}; "
            f"{len(unused)} variables unused {unused}"
        )
    return out


# `convert`'s leaf names backwards: kind -> Flax leaf -> PyTorch leaf.
_TORCH_LEAVES = {
    kind: {rule[0]: leaf for leaf, rule in leaves.items() if rule is not None}
    for kind, leaves in _LEAVES.items()
}
# A rule's capturing groups (not `(?:...)` or other extensions).
_GROUP = re.compile(r"\((?!\?)[^()]*\)")


def _backwards(rule: Rule) -> tuple[re.Pattern, Callable[[re.Match], str]] | None:
    """(regex over our module paths, their source module path) of a rule with a template
    target; None for a drop rule. Each `\\N` of the target matches what the source's group N
    matches."""
    pattern, target, _ = rule
    if target is None:
        return None
    if callable(target):
        raise ValueError(f"rule {pattern!r}: a computed target cannot be read backwards")
    groups = [g[1:-1] for g in _GROUP.findall(pattern)]
    regex, seen = "", set()
    for i, part in enumerate(re.split(r"\\(\d)", target)):
        if i % 2 == 0:
            regex += re.escape(part)
            continue
        n = int(part)
        regex += f"(?P=g{n})" if n in seen else f"(?P<g{n}>{groups[n - 1]})"
        seen.add(n)
    if seen != set(range(1, len(groups) + 1)):
        raise ValueError(f"rule {pattern!r}: its target does not name every group")

    def source(match: re.Match) -> str:
        values = iter(match[f"g{n}"] for n in range(1, len(groups) + 1))
        key = re.sub(r"\\(.)", r"\1", _GROUP.sub(lambda _: next(values), pattern))
        if not re.fullmatch(pattern, key):
            raise ValueError(f"rule {pattern!r} cannot be read backwards (it gives {key!r})")
        return key

    return re.compile(regex), source


def state_dict_template(
    abstract: Mapping[str, Any], rules: Sequence[Rule]
) -> dict[str, tuple[int, ...]]:
    """The PyTorch keys and shapes `rules` read the variables `abstract` from: a template for
    `to_state_dict` where no PyTorch module is at hand. Rules with computed targets cannot be
    read backwards (ValueError); a variable no rule writes is a KeyError."""
    readers = [(_backwards(rule), rule[2]) for rule in rules if rule[2] != "drop"]
    template = {}
    for path, leaf in traverse_util.flatten_dict(abstract).items():
        module_path, name = "/".join(path[1:-1]), path[-1]
        for (regex, source), kind in readers:
            match = regex.fullmatch(module_path)
            if match and name in _TORCH_LEAVES[kind]:
                torch_leaf = _TORCH_LEAVES[kind][name]
                layout = _TORCH_LAYOUT.get((kind, torch_leaf))
                # A zero-stride view: the layout's shape without its memory.
                view = np.broadcast_to(np.float32(0), leaf.shape)
                template[f"{source(match)}.{torch_leaf}"] = (layout(view) if layout else view).shape
                break
        else:
            raise KeyError(f"{'/'.join(path)}: no rule writes this variable")
    return template


def resnet_from_torch(state_dict: Mapping[str, Any], module: resnet.ResNet) -> dict[str, Any]:
    """torchvision/timm ResNet state dict -> variables of `module` (its `norm` decides where
    BatchNorm tensors go). The classifier `fc` is dropped, and so are the stages after a
    trunk's `last_stage`."""
    if module.last_stage is not None:
        after_the_trunk = re.compile(rf"layer([{module.last_stage + 1}-9])\.")
        state_dict = {k: v for k, v in state_dict.items() if not after_the_trunk.match(k)}
    return convert(state_dict, TORCHVISION_RESNET_RULES, abstract_variables(module))


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Tensors from a checkpoint directory (model.safetensors, else pytorch_model.bin) or a
    single .safetensors / .pth / .bin file; torch files are read with weights_only=True, never
    as arbitrary pickles."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "model.safetensors", path / "pytorch_model.bin"]
        path = next((c for c in candidates if c.exists()), None)
        if path is None:
            raise FileNotFoundError(
                f"{candidates[0].parent}: neither model.safetensors nor pytorch_model.bin"
            )
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return load_file(path)
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state.get("model", state))
    return {k: to_numpy(v) for k, v in state.items()}


def require(ok: bool, field: str, value: Any, supported: str) -> None:
    """Raises a ValueError naming the config.json `field` unless `ok`."""
    if not ok:
        raise ValueError(f"config.json: {field}={value!r} is not supported ({supported})")


def timm_backbone(cfg: Any) -> tuple[str, bool]:
    """(resnet.ARCHS name, dilation) of a `timm_backbone` config."""
    # Pretrained tags ("resnet50.a1_in1k") and hub prefixes ("timm/") name the same layout.
    name = cfg.backbone.split("/")[-1].split(".")[0]
    require(name in resnet.ARCHS, "backbone", cfg.backbone, f"one of {sorted(resnet.ARCHS)}")
    out_indices = list(cfg.out_indices or [4])
    require(out_indices[-1] == 4, "out_indices", out_indices, "last must be 4")
    stride = cfg.output_stride or 32
    require(stride in (16, 32), "output_stride", stride, "16 or 32")
    return name, stride == 16


def hf_backbone(cfg: Any, dtype: Any) -> resnet.ResNet:
    """A `resnet.ResNet` for a transformers `ResNetConfig`."""
    require(cfg.layer_type in resnet.BLOCKS, "layer_type", cfg.layer_type, "basic or bottleneck")
    require(cfg.hidden_act == "relu", "hidden_act", cfg.hidden_act, "relu")
    require(not cfg.downsample_in_first_stage, "downsample_in_first_stage", True, "False")
    # Only the torchvision "v1.5" stride placement (in the 3x3) is implemented.
    require(not cfg.downsample_in_bottleneck, "downsample_in_bottleneck", True, "False")
    require(cfg.out_features[-1] == "stage4", "out_features", cfg.out_features, "last stage4")
    expansion = resnet.BLOCKS[cfg.layer_type].expansion
    return resnet.ResNet(
        stage_sizes=tuple(cfg.depths),
        block=cfg.layer_type,
        planes=tuple(h // expansion for h in cfg.hidden_sizes),
        stem_width=cfg.embedding_size,
        norm="frozen",
        dtype=dtype,
    )
