"""Our DINO as an IDEA-Research/DINO checkpoint (the `{"model": state_dict}` its main.py saves).

`official_state_dict`: the importer's rules (`convert_deformable.DINO_RULES`, torchvision's ResNet
rules) read backwards by `convert_torch.to_state_dict` on keys and shapes derived from the
module's abstract variables, then IDEA's packed in_proj, bare `level_embed` and decoder heads under
four names. `write_official_dino` writes checkpoint.pth and dino_args.json (config fields the
weights cannot tell); `convert_deformable.load_official_dino` reads it back bitwise.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Mapping
from typing import Any, NoReturn

import ml_collections
import numpy as np

from ood_jax import files
from ood_jax.models import convert_deformable, convert_torch, dino, registry

CHECKPOINT_FILE = "checkpoint.pth"
ARGS_FILE = "dino_args.json"

# IDEA's backbone.py builds only these ResNets (and Swin / ConvNeXt, which we do not have).
IDEA_BACKBONES = ("resnet50", "resnet101")
# Its `return_interm_indices` (it accepts these three) by the stages our neck reads.
_INTERM_INDICES = {
    ("stage1", "stage2", "stage3", "stage4"): [0, 1, 2, 3],
    ("stage2", "stage3", "stage4"): [1, 2, 3],
    ("stage4",): [3],
}
# gen_sineembed_for_position hard-codes 128 features per anchor coordinate, which feed
# ref_point_head's 2 * d_model inputs: IDEA's decoder runs at d_model 256 only.
IDEA_HIDDEN_DIM = 256

# The importer's renames of IDEA's names, undone. (Its `module.` strip, for checkpoints saved
# from a DistributedDataParallel wrapper, has nothing to undo: main.py saves the bare model.)
_OFFICIAL_NAMES = [
    (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."),
    (r"^transformer\.level_embed\.weight$", "transformer.level_embed"),
]
_HEADS = re.compile(r"(class_embed|bbox_embed)\.(\d+)\.(.+)")
_QKV = re.compile(r"(.*\.self_attn)\.([qkv])_proj\.(weight|bias)")


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    raise ValueError(
        f"config.model.args.{field}={value!r}: {why}, so IDEA-Research/DINO cannot load it"
    )


def _interm_indices(module: dino.DINO) -> list[int]:
    """IDEA's `return_interm_indices` for `module`; ValueError naming the field its DINO cannot
    express (its backbone and decoder take less than ours)."""
    spec = module.backbone_config
    arch = spec.arch if isinstance(spec.arch, str) else type(spec.arch).__name__
    if arch not in IDEA_BACKBONES:
        _refuse("backbone", arch, f"IDEA's DINO ResNets are {' and '.join(IDEA_BACKBONES)}")
    stages = tuple(spec.stages)
    if stages not in _INTERM_INDICES:
        _refuse("backbone_stages", stages, f"IDEA's backbone reads one of {list(_INTERM_INDICES)}")
    # Its DINO asserts two_stage_type 'no' for one level; its queries are two-stage.
    if module.num_feature_levels < 2:
        _refuse("num_feature_levels", module.num_feature_levels, "IDEA's DINO needs at least 2")
    if module.hidden_dim != IDEA_HIDDEN_DIM:
        _refuse(
            "hidden_dim",
            module.hidden_dim,
            f"IDEA's decoder embeds anchors for d_model {IDEA_HIDDEN_DIM} only",
        )
    return _INTERM_INDICES[stages]


def _abstract(module: dino.DINO) -> dict[str, Any]:
    # Mixed query selection needs num_queries positions; the first level has stride <= 32.
    size = max(64, 32 * math.ceil(math.sqrt(module.num_queries)))
    return convert_torch.abstract_variables(module, size)


def _official_names(
    canonical: Mapping[str, np.ndarray], module: dino.DINO
) -> dict[str, np.ndarray]:
    """The importer's canonical keys as IDEA's module names them."""
    out, packed, heads = {}, {}, {}
    for key, value in canonical.items():
        if match := _QKV.fullmatch(key):
            packed.setdefault(f"{match[1]}.in_proj_{match[3]}", {})[match[2]] = value
        elif match := _HEADS.fullmatch(key):
            heads[(match[1], int(match[2]), match[3])] = value
        else:
            for pattern, repl in _OFFICIAL_NAMES:
                key = re.sub(pattern, repl, key)
            out[key] = value
    for key, parts in packed.items():
        # nn.MultiheadAttention stacks q, k and v along the output axis.
        out[key] = np.concatenate([parts[name] for name in "qkv"])
    # IDEA's model holds one ModuleList of decoder heads (a shared head repeated in it) and
    # hangs it on transformer.decoder too, so state_dict() names every head twice per layer.
    for head, _, leaf in [k for k in heads if k[1] == 0]:
        for i in range(module.num_decoder_layers):
            value = heads[(head, 0 if module.shared_decoder_heads else i, leaf)]
            for prefix in ("", "transformer.decoder."):
                out[f"{prefix}{head}.{i}.{leaf}"] = value
    return out


def official_state_dict(module: dino.DINO, variables: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """`variables` of `module` in IDEA-Research/DINO's state dict layout (float32 arrays; a
    shared decoder head's names hold one array). ValueError naming the field IDEA's DINO cannot
    express; KeyError / ValueError when `variables` do not fit `module`."""
    _interm_indices(module)
    rules = convert_deformable.dino_rules()
    template = convert_torch.state_dict_template(_abstract(module), rules)
    canonical = convert_torch.to_state_dict(variables, rules, template)
    return _official_names(canonical, module)


def idea_config(module: dino.DINO) -> dict[str, Any]:
    """The IDEA config fields (config/DINO/DINO_4scale.py names) `module`'s checkpoint needs
    besides DINO_4scale's own: what its shapes cannot tell, or tell only by equal values."""
    return {
        "backbone": module.backbone_config.arch,
        "dilation": bool(module.backbone_config.dilation),
        "return_interm_indices": _interm_indices(module),
        "num_classes": module.num_classes,
        "num_queries": module.num_queries,
        "hidden_dim": module.hidden_dim,
        "nheads": module.num_heads,
        "enc_layers": module.num_encoder_layers,
        "dec_layers": module.num_decoder_layers,
        "dim_feedforward": module.ffn_dim,
        "dropout": module.dropout,
        "num_feature_levels": module.num_feature_levels,
        "enc_n_points": module.encoder_points,
        "dec_n_points": module.decoder_points,
        "pe_temperatureH": module.position_temperature,
        "pe_temperatureW": module.position_temperature,
        # label_enc has dn_labelbook_size + 1 rows.
        "dn_labelbook_size": (module.num_label_embeddings or module.num_classes + 1) - 1,
        "dec_pred_class_embed_share": module.shared_decoder_heads,
        "dec_pred_bbox_embed_share": module.shared_decoder_heads,
        # Our encoder's proposal heads are always their own.
        "two_stage_class_embed_share": False,
        "two_stage_bbox_embed_share": False,
    }


def write_official_dino(
    out_dir: str | pathlib.Path,
    module_args: Mapping[str, Any],
    variables: Mapping[str, Any],
    extra_files: Mapping[str, str] | None = None,
) -> pathlib.Path:
    """Writes the DINO of model args `module_args` (config.model.args) and `variables` as
    IDEA-Research/DINO's checkpoint.pth (`{"model": state_dict}`, torch tensors), its
    dino_args.json (`idea_config`) and `extra_files` (name -> text), whole or not at all
    (`files.replaced_directory`); returns the directory's absolute path. An `out_dir` holding
    anything but such an export is refused."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "writing IDEA-Research/DINO's checkpoint.pth needs PyTorch (pip install torch)"
        ) from e

    module = registry.build_model(
        ml_collections.ConfigDict({"name": "dino", "args": dict(module_args)})
    )
    out_dir = files.export_directory(out_dir, "DINO export", [ARGS_FILE])
    config = idea_config(module)
    state = official_state_dict(module, variables)
    # One tensor per array: a shared head's names then share one storage in the file, as in
    # IDEA's own (copied: the arrays may be read-only views of device buffers).
    tensors: dict[int, Any] = {}
    model = {}
    for key, value in state.items():
        if id(value) not in tensors:
            tensors[id(value)] = torch.tensor(value)
        model[key] = tensors[id(value)]
    with files.replaced_directory(out_dir) as staging:
        torch.save({"model": model}, staging / CHECKPOINT_FILE)
        (staging / ARGS_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
    return out_dir
