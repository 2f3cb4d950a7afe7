"""Trained DETRs as transformers directories (`ood-jax export --format transformers`).

`write_detr` writes what `DetrForObjectDetection.from_pretrained` loads with no missing or
unexpected keys: config.json (the `DetrConfig` of our model config, id2label from the dataset's
classes), model.safetensors (our variables by `convert.DETR_RULES` read backwards,
`convert_torch.to_state_dict`) and preprocessor_config.json (`DetrImageProcessor` with our
normalization and evaluation sizes). `convert.detr_from_hf` reads the directory back to the
variables it was written from.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ood_jax import files
from ood_jax.models import convert, convert_torch

# Our ResNets by the name timm gives the same layout (TORCHVISION_RESNET_RULES reads both).
TIMM_BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")


def detr_config(args: Mapping[str, Any], class_names: Sequence[str] | None):
    """The `DetrConfig` of our DETR's model args (config.model.args); ValueError naming the
    field transformers cannot express."""
    from transformers import DetrConfig

    backbone = args.get("backbone", "resnet50")
    if backbone not in TIMM_BACKBONES:
        raise ValueError(
            f"config.model.args.backbone={backbone!r}: transformers' DETR takes a ResNet "
            f"({', '.join(TIMM_BACKBONES)}), so this model cannot be exported in its format"
        )
    num_classes = int(args["num_classes"])
    names = list(class_names or [f"class_{k}" for k in range(num_classes)])
    if len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for {num_classes} classes")
    dropout = float(args.get("dropout", 0.1))
    return DetrConfig(
        use_timm_backbone=True,
        backbone=backbone,
        use_pretrained_backbone=False,
        dilation=bool(args.get("dilation", False)),
        num_queries=int(args.get("num_queries", 100)),
        d_model=int(args.get("hidden_dim", 256)),
        encoder_layers=int(args.get("num_encoder_layers", 6)),
        decoder_layers=int(args.get("num_decoder_layers", 6)),
        encoder_attention_heads=int(args.get("num_heads", 8)),
        decoder_attention_heads=int(args.get("num_heads", 8)),
        encoder_ffn_dim=int(args.get("ffn_dim", 2048)),
        decoder_ffn_dim=int(args.get("ffn_dim", 2048)),
        # Ours drops attention weights, the FFN's hidden layer and each residual branch at once.
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        # transformers' decoder with auxiliary_loss normalizes between its layers.
        auxiliary_loss=bool(args.get("norm_between_decoder_layers", False)),
        num_labels=num_classes,
        id2label=dict(enumerate(names)),
        label2id={name: k for k, name in enumerate(names)},
        architectures=["DetrForObjectDetection"],
    )


def inference_variables(args: Mapping[str, Any], variables: Mapping[str, Any]) -> dict[str, Any]:
    """The variables inference reads: Group DETR's query groups after the first are training's
    alone (`detr.DETR.num_query_groups`), so only the first group's queries go out."""
    num_queries = int(args.get("num_queries", 100))
    params = dict(variables["params"])
    queries = dict(params["query_position_embeddings"])
    queries["embedding"] = np.asarray(queries["embedding"])[:num_queries]
    params["query_position_embeddings"] = queries
    return {**variables, "params": params}


def write_detr(
    out_dir: str | pathlib.Path,
    args: Mapping[str, Any],
    input_config: Mapping[str, Any],
    variables: Mapping[str, Any],
    class_names: Sequence[str] | None,
    mean: Sequence[float],
    std: Sequence[float],
    extra_files: Mapping[str, str] | None = None,
) -> pathlib.Path:
    """Writes the DETR of model args `args` and `variables`, and `extra_files` (name -> text),
    as a transformers directory, whole or not at all (`files.replaced_directory`); returns its
    absolute path. An `out_dir` holding anything but a transformers model is refused."""
    import torch
    from transformers import DetrForObjectDetection

    config = detr_config(args, class_names)
    model = DetrForObjectDetection(config).eval()
    live = model.state_dict()
    # The rules name transformers' checkpoint keys; its modules may name some otherwise.
    canonical = {convert.canonical_detr_key(key): key for key in live}
    _, rules = convert.detr_module_from_config(config)
    state = convert_torch.to_state_dict(
        inference_variables(args, variables),
        rules,
        {key: tuple(live[name].shape) for key, name in canonical.items()},
    )
    model.load_state_dict({canonical[k]: torch.from_numpy(v) for k, v in state.items()})
    out_dir = pathlib.Path(out_dir).absolute()
    if out_dir.exists() and not (out_dir / "config.json").is_file():
        raise FileExistsError(
            f"--out {out_dir}: exists and is no transformers model (no config.json); name a new "
            "directory"
        )
    with files.replaced_directory(out_dir) as staging:
        _save(model, staging, input_config, mean, std)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
    return out_dir


def _save(model, directory: pathlib.Path, input_config, mean, std) -> None:
    from transformers import DetrImageProcessor

    model.save_pretrained(directory, safe_serialization=True)
    DetrImageProcessor(
        do_resize=True,
        size={
            "shortest_edge": int(input_config["eval_size"]),
            "longest_edge": int(input_config["max_size"]),
        },
        do_normalize=True,
        image_mean=list(mean),
        image_std=list(std),
        do_pad=True,
    ).save_pretrained(directory)
