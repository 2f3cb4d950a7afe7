"""DINO-4scale with a ViT-S/16 backbone on COUNTS, O(OD)^2 protocol (see counts_dino_r50.py).

The plain ViT's stride-16 map becomes the levels through a simple feature pyramid (upsampled,
as is, pooled), plus the extra stride-64 level.

  ood-jax train --config=configs/counts_dino_vit.py --workdir=workdirs/counts_dino_vit \\
      --config.model.backbone_weights=/weights/vit_small_patch16_224.safetensors
"""

import ml_collections

from ood_jax import config_files


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = config_files.load(config_files.sibling(__file__, "counts_dino_r50.py"), arg)
    vit = config_files.load(config_files.sibling(__file__, "counts_detr_vit.py"), arg)
    config.model_name = "DINO-4scale-ViT-S/16"
    config.model.args.backbone = vit.model.args.backbone
    config.model.args.backbone_frozen_stages = 0
    config.optim.frozen_pattern = vit.optim.frozen_pattern
    config.input = vit.input
    return config
