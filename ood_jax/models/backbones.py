"""A detector's backbone, once for every family (DETR, Deformable DETR, DINO).

`BackboneConfig` is the one record of a backbone and `BackboneConfig.from_args` the one
translation of the flat config fields (`FLAT_FIELDS`) to it; `BackboneFields` and
`MultiScaleBackboneFields` define those fields once for the families' models. `build_backbone`
and `load_backbone` build and load a ResNet or ViT by name.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from ood_jax.models import convert_torch, convert_vit, resnet, vit

RESNET_STAGES = ("stage1", "stage2", "stage3", "stage4")
# The stages a multi-scale detector (Deformable DETR, DINO) projects by default: C3-C5.
MULTI_SCALE_STAGES = ("stage2", "stage3", "stage4")

# Flat detector field (config.model.args.X) -> BackboneConfig field.
FLAT_FIELDS = {
    "backbone": "arch",
    "backbone_norm": "norm",
    "dilation": "dilation",
    "backbone_frozen_stages": "frozen_stages",
    "freeze_backbone": "freeze",
    "backbone_stages": "stages",
    "backbone_last_stage": "last_stage",
}


def last_map(features: Mapping[str, jax.Array]) -> jax.Array:
    """The map a single-map detector reads: a ViT's "features", else a ResNet's deepest stage
    (stage4, or stage3 of a C4 trunk)."""
    if "features" in features:
        return features["features"]
    return features[max((k for k in features if k.startswith("stage")), key=lambda k: int(k[5:]))]


def nearest_indices(in_size: int, out_size: int) -> np.ndarray:
    """Source index of each output position under torch's legacy "nearest" resize."""
    # torch computes the scale in float32 and floors scale * index; so does this.
    scale = np.float32(in_size) / np.float32(out_size)
    idx = np.floor(np.arange(out_size, dtype=np.float32) * scale).astype(np.int32)
    return np.minimum(idx, in_size - 1)


def resize_mask(mask: jax.Array, size: tuple[int, int]) -> jax.Array:
    """[B, H, W] -> [B, h, w] boolean, by `F.interpolate(mask, size)` (nearest) semantics."""
    rows = nearest_indices(mask.shape[1], size[0])
    cols = nearest_indices(mask.shape[2], size[1])
    return mask[:, rows][:, :, cols].astype(bool)


def build_backbone(
    backbone: str | resnet.ResNet | vit.ViT,
    norm: resnet.Norm = "frozen",
    dilation: bool = False,
    dtype: Any = jnp.float32,
    name: str | None = None,
    frozen_stages: int = 0,
    remat: bool = False,
    last_stage: int | None = None,
) -> nn.Module:
    """A ResNet (`resnet.ARCHS`) or ViT (`vit.VARIANTS`) by name; a module is used as it is.
    `remat` recomputes a ResNet's trained blocks in the backward pass (`resnet.ResNet.remat`);
    `last_stage` ends a ResNet early (`resnet.ResNet.last_stage`)."""
    if isinstance(backbone, (resnet.ResNet, vit.ViT)):
        return backbone
    if backbone in vit.VARIANTS:
        for field, value in (("frozen_stages", frozen_stages), ("last_stage", last_stage)):
            if value:
                raise ValueError(f"{field} applies to ResNets, not to {backbone!r}")
        return vit.vit(backbone, dtype=dtype, name=name)
    return resnet.build(
        backbone,
        norm=norm,
        dilation=dilation,
        last_stage=last_stage,
        frozen_stages=frozen_stages,
        remat=remat,
        dtype=dtype,
        name=name,
    )


@dataclasses.dataclass(frozen=True)
class BackboneConfig:
    """A detector's backbone.

    Attributes:
      arch: a name in `resnet.ARCHS` (built with `norm`, `dilation` and the detector's dtype)
        or in `vit.VARIANTS` (a plain ViT); or a configured `resnet.ResNet` / `vit.ViT` for
        non-standard widths, used as it is.
      norm: a ResNet's BatchNorm: "frozen" (DETR's choice) or "batch".
      dilation: DC5 (last ResNet stage dilated, features at stride 16).
      frozen_stages: a ResNet's stem and first this many stages get no gradient (DETR's recipe
        keeps the stem and the first stage fixed: 1); see `resnet.ResNet`.
      freeze: the whole backbone runs in inference mode behind a stop_gradient, so no gradient
        flows into it (the optimizer should also leave its parameters alone). Training then
        costs about a third as much on CPU, which is what lets a small DETR learn in minutes.
      stages: the ResNet stages a multi-scale detector reads; None for a single-map detector
        (DETR reads the last map).
      last_stage: a ResNet's trunk ends after this stage (None: after stage 4); 3 is a C4
        backbone, whose stage3 DETR reads.
    """

    arch: str | resnet.ResNet | vit.ViT = "resnet50"
    norm: resnet.Norm = "frozen"
    dilation: bool = False
    frozen_stages: int = 0
    freeze: bool = False
    stages: tuple[str, ...] | None = None
    last_stage: int | None = None

    def __post_init__(self):
        unknown = [s for s in self.stages or () if s not in RESNET_STAGES]
        if unknown:
            raise ValueError(
                f"backbone_stages {self.stages}: {', '.join(map(repr, unknown))} is no ResNet "
                f"stage; use names of {', '.join(RESNET_STAGES)}"
            )
        after = [s for s in self.stages or () if self.last_stage and int(s[5:]) > self.last_stage]
        if after:
            raise ValueError(
                f"backbone_stages {self.stages} read {', '.join(after)}, which "
                f"backbone_last_stage={self.last_stage} leaves out"
            )

    @classmethod
    def from_args(cls, args: Mapping[str, Any], **defaults: Any) -> BackboneConfig:
        """The backbone of flat detector fields (`config.model.args`, or a model's own fields).

        Keys of `args` that are no backbone field are ignored; fields `args` does not give take
        `defaults` (record field names, e.g. `stages=MULTI_SCALE_STAGES` for a multi-scale
        family), else the record's own defaults.
        """
        given = {field: args[flat] for flat, field in FLAT_FIELDS.items() if flat in args}
        return cls(**{**defaults, **given})

    def build(
        self, dtype: Any = jnp.float32, name: str | None = None, remat: bool = False
    ) -> nn.Module:
        """The backbone module (see `build_backbone`)."""
        return build_backbone(
            self.arch,
            self.norm,
            self.dilation,
            dtype,
            name=name,
            frozen_stages=self.frozen_stages,
            remat=remat,
            last_stage=self.last_stage,
        )


# Keyword-only, so a family's own fields keep their order and
# `DETR(num_classes=3, backbone="resnet18", backbone_norm="batch")` works.
def _field(default: Any) -> Any:
    return dataclasses.field(default=default, kw_only=True)


class BackboneFields(nn.Module):
    """The backbone fields of every detector family, flat as configs set them; keyword-only.

    Attributes (see `BackboneConfig`, whose defaults they share):
      backbone: `BackboneConfig.arch`.
      backbone_norm: `BackboneConfig.norm`.
      freeze_backbone: `BackboneConfig.freeze`.
      backbone_frozen_stages: `BackboneConfig.frozen_stages`.
      dilation: `BackboneConfig.dilation`.
      backbone_last_stage: `BackboneConfig.last_stage`.
    """

    backbone: str | resnet.ResNet | vit.ViT = _field(BackboneConfig.arch)
    backbone_norm: resnet.Norm = _field(BackboneConfig.norm)
    freeze_backbone: bool = _field(BackboneConfig.freeze)
    backbone_frozen_stages: int = _field(BackboneConfig.frozen_stages)
    dilation: bool = _field(BackboneConfig.dilation)
    backbone_last_stage: int | None = _field(BackboneConfig.last_stage)

    @property
    def backbone_config(self) -> BackboneConfig:
        """This detector's backbone fields as one record."""
        return BackboneConfig.from_args(
            {flat: getattr(self, flat) for flat in FLAT_FIELDS if hasattr(self, flat)}
        )


class MultiScaleBackboneFields(BackboneFields):
    """`BackboneFields` plus `backbone_stages`, the ResNet stages the neck projects (C3-C5 by
    default); a ViT gives its simple feature pyramid instead."""

    backbone_stages: tuple[str, ...] = _field(MULTI_SCALE_STAGES)


def load_backbone(model_args: Mapping[str, Any], path: str | pathlib.Path) -> dict[str, Any]:
    """Pretrained variables ({"params", maybe "batch_stats"}) of the backbone `model_args`
    describe: the variables `pretrain.pretrain_backbone` writes (.msgpack), a timm ViT
    checkpoint for a ViT name, else a torchvision/timm ResNet checkpoint."""
    path = pathlib.Path(path)
    if path.suffix == ".msgpack":
        return serialization.msgpack_restore(path.read_bytes())
    config = BackboneConfig.from_args(model_args)
    if config.arch in vit.VARIANTS:
        _, variables = convert_vit.vit_from_timm(convert_torch.load_state_dict(path))
        return variables
    module = build_backbone(config.arch, config.norm, config.dilation, last_stage=config.last_stage)
    return convert_torch.resnet_from_torch(convert_torch.load_state_dict(path), module)
