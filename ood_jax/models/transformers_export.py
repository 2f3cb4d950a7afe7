"""Trained DETRs and Deformable DETRs as transformers directories (`ood-jax export --format
transformers`).

`write` makes what `DetrForObjectDetection` / `DeformableDetrForObjectDetection.from_pretrained`
load with no missing or unexpected keys: config.json (id2label from the dataset's classes),
model.safetensors (our variables by the importers' rule tables read backwards,
`convert_torch.to_state_dict`) and preprocessor_config.json (our normalization and evaluation
sizes). `convert.detr_from_hf` and `convert_deformable.deformable_detr_from_hf` read the
directory back to the variables it was written from.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ood_jax import files
from ood_jax.models import convert, convert_deformable, convert_torch, deformable_detr
from ood_jax.models.backbones import MULTI_SCALE_STAGES

# Our ResNets by the name timm gives the same layout (TORCHVISION_RESNET_RULES reads both).
TIMM_BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")


def _backbone(args: Mapping[str, Any], family: str) -> str:
    backbone = args.get("backbone", "resnet50")
    if backbone not in TIMM_BACKBONES:
        raise ValueError(
            f"config.model.args.backbone={backbone!r}: transformers' {family} takes a ResNet "
            f"({', '.join(TIMM_BACKBONES)}), so this model cannot be exported in its format"
        )
    if args.get("backbone_norm", "frozen") not in ("frozen", "batch"):
        raise ValueError(
            f"config.model.args.backbone_norm={args['backbone_norm']!r}: transformers' {family} "
            "takes a BatchNorm ResNet"
        )
    if args.get("backbone_last_stage") not in (None, 4):
        raise ValueError(
            f"config.model.args.backbone_last_stage={args['backbone_last_stage']!r}: transformers' "
            f"{family} runs its ResNet to the last stage"
        )
    return backbone


def _labels(num_classes: int, class_names: Sequence[str] | None) -> dict[str, Any]:
    names = list(class_names or [f"class_{k}" for k in range(num_classes)])
    if len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for {num_classes} classes")
    return {
        "num_labels": num_classes,
        "id2label": dict(enumerate(names)),
        "label2id": {name: k for k, name in enumerate(names)},
    }


def _dropouts(dropout: float, attention: float) -> dict[str, float]:
    # Ours drops the FFN's hidden layer and each residual branch with one rate.
    return {"dropout": dropout, "activation_dropout": dropout, "attention_dropout": attention}


def _transformer(args: Mapping[str, Any], ffn_default: int) -> dict[str, int]:
    heads = int(args.get("num_heads", 8))
    ffn = int(args.get("ffn_dim", ffn_default))
    return {
        "d_model": int(args.get("hidden_dim", 256)),
        "encoder_layers": int(args.get("num_encoder_layers", 6)),
        "decoder_layers": int(args.get("num_decoder_layers", 6)),
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": ffn,
    }


def detr_config(args: Mapping[str, Any], class_names: Sequence[str] | None):
    """The `DetrConfig` of our DETR's model args (config.model.args); ValueError naming the
    field transformers cannot express."""
    from transformers import DetrConfig

    dropout = float(args.get("dropout", 0.1))
    return DetrConfig(
        use_timm_backbone=True,
        backbone=_backbone(args, "DETR"),
        use_pretrained_backbone=False,
        dilation=bool(args.get("dilation", False)),
        num_queries=int(args.get("num_queries", 100)),
        **_transformer(args, ffn_default=2048),
        # DETR's attention weights drop with the same rate as the rest.
        **_dropouts(dropout, attention=dropout),
        # transformers' decoder with auxiliary_loss normalizes between its layers.
        auxiliary_loss=bool(args.get("norm_between_decoder_layers", False)),
        **_labels(int(args["num_classes"]), class_names),
        architectures=["DetrForObjectDetection"],
    )


def deformable_detr_config(args: Mapping[str, Any], class_names: Sequence[str] | None):
    """The `DeformableDetrConfig` of our Deformable DETR's model args; ValueError naming the
    field transformers cannot express."""
    from transformers import DeformableDetrConfig
    from transformers.models.timm_backbone import TimmBackboneConfig

    stages = tuple(args.get("backbone_stages", MULTI_SCALE_STAGES))
    last = ("stage1", "stage2", "stage3", "stage4")
    if stages != last[len(last) - len(stages) :]:
        raise ValueError(
            f"config.model.args.backbone_stages={stages}: transformers' Deformable DETR reads "
            "the last stages of its ResNet in order (e.g. stage2, stage3, stage4)"
        )
    two_stage = bool(args.get("two_stage", False))
    box_refine = bool(args.get("with_box_refine", False))
    # One head per layer where transformers shares one cannot be written; one shared head can.
    tied_in_transformers = deformable_detr.shared_heads(two_stage, box_refine)
    for field, tied in zip(("shared_class_head", "shared_box_head"), tied_in_transformers):
        if tied and args.get(field) is False:
            raise ValueError(
                f"config.model.args.{field}=False: transformers' Deformable DETR (two_stage="
                f"{two_stage}, with_box_refine={box_refine}) shares that head across decoder "
                "layers"
            )
    num_queries = int(args.get("num_queries", 300))
    backbone = TimmBackboneConfig(
        backbone=_backbone(args, "Deformable DETR"),
        use_pretrained_backbone=False,
        out_indices=[int(stage.removeprefix("stage")) for stage in stages],
        output_stride=16 if args.get("dilation", False) else None,
        freeze_batch_norm_2d=True,
    )
    return DeformableDetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        num_queries=num_queries,
        two_stage_num_proposals=num_queries,
        **_transformer(args, ffn_default=1024),
        **_dropouts(
            float(args.get("dropout", 0.1)), attention=float(args.get("attention_dropout", 0.0))
        ),
        num_feature_levels=int(args.get("num_feature_levels", 4)),
        encoder_n_points=int(args.get("encoder_points", 4)),
        decoder_n_points=int(args.get("decoder_points", 4)),
        two_stage=two_stage,
        with_box_refine=box_refine,
        **_labels(int(args["num_classes"]), class_names),
        architectures=["DeformableDetrForObjectDetection"],
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


def _deformable_checkpoint_key(config: Any, args: Mapping[str, Any]) -> Callable[[str], str]:
    """Live key -> the key the importer's rules read after it folds tied heads: transformers
    keeps a head under `model.decoder.` too, and a head our model shares is read from layer 0
    (into each of transformers' heads where it keeps one per layer)."""
    layers = config.decoder_layers
    shared_class, shared_box = deformable_detr.shared_heads(
        config.two_stage,
        config.with_box_refine,
        args.get("shared_class_head"),
        args.get("shared_box_head"),
    )
    shared = {"class_embed": shared_class, "bbox_embed": shared_box}

    def checkpoint_key(key: str) -> str:
        key = convert_deformable.canonical_hf_key(key)
        head = re.fullmatch(r"(?:model\.decoder\.)?(class_embed|bbox_embed)\.(\d+)\.(.+)", key)
        if head is None:
            return key
        name, index, leaf = head[1], int(head[2]), head[3]
        if shared[name] and index < layers:
            index = 0
        return f"{name}.{index}.{leaf}"

    return checkpoint_key


@dataclasses.dataclass(frozen=True)
class _Family:
    """How one of our families becomes its transformers model."""

    make_config: Callable[[Mapping[str, Any], Sequence[str] | None], Any]
    model_class: str
    processor_class: str
    rules: Callable[[Any], list[convert_torch.Rule]]  # of the transformers config
    # (transformers config, our model args) -> live key -> the key the rules read
    checkpoint_key: Callable[[Any, Mapping[str, Any]], Callable[[str], str]]
    inference_variables: Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, Any]]


FAMILIES = {
    "detr": _Family(
        detr_config,
        "DetrForObjectDetection",
        "DetrImageProcessor",
        lambda config: convert.detr_module_from_config(config)[1],
        lambda config, args: convert.canonical_detr_key,
        inference_variables,
    ),
    "deformable_detr": _Family(
        deformable_detr_config,
        "DeformableDetrForObjectDetection",
        "DeformableDetrImageProcessor",
        convert_deformable.deformable_detr_rules,
        _deformable_checkpoint_key,
        lambda args, variables: variables,
    ),
}


def write(
    out_dir: str | pathlib.Path,
    model_name: str,
    args: Mapping[str, Any],
    input_config: Mapping[str, Any],
    variables: Mapping[str, Any],
    class_names: Sequence[str] | None,
    mean: Sequence[float],
    std: Sequence[float],
    extra_files: Mapping[str, str] | None = None,
) -> pathlib.Path:
    """Writes the `model_name` ("detr" or "deformable_detr") model of model args `args` and
    `variables`, and `extra_files` (name -> text), as a transformers directory, whole or not
    at all (`files.replaced_directory`); returns its absolute path. An `out_dir` holding
    anything but a transformers model is refused."""
    if model_name not in FAMILIES:
        raise ValueError(
            f"--format transformers: the checkpoint's model is {model_name}; this format is "
            f"written for {' and '.join(FAMILIES)}"
        )
    import torch
    import transformers

    family = FAMILIES[model_name]
    config = family.make_config(args, class_names)
    model = getattr(transformers, family.model_class)(config).eval()
    live = model.state_dict()
    checkpoint_key = family.checkpoint_key(config, args)
    # Tied copies of a tensor are one key of the template, filled once.
    template: dict[str, tuple[int, ...]] = {}
    for key, tensor in live.items():
        template.setdefault(checkpoint_key(key), tuple(tensor.shape))
    state = convert_torch.to_state_dict(
        family.inference_variables(args, variables), family.rules(config), template
    )
    model.load_state_dict({key: torch.from_numpy(state[checkpoint_key(key)]) for key in live})
    out_dir = files.export_directory(out_dir, "transformers model", ["config.json"])
    with files.replaced_directory(out_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        getattr(transformers, family.processor_class)(
            do_resize=True,
            size={
                "shortest_edge": int(input_config["eval_size"]),
                "longest_edge": int(input_config["max_size"]),
            },
            do_normalize=True,
            image_mean=list(mean),
            image_std=list(std),
            do_pad=True,
        ).save_pretrained(staging)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
    return out_dir
