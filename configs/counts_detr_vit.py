"""DETR with a ViT-S/16 backbone on COUNTS, O(OD)^2 protocol (see counts_detr_r50.py).

  ood-jax train --config=configs/counts_detr_vit.py --workdir=workdirs/counts_detr_vit \\
      --config.model.backbone_weights=/weights/vit_small_patch16_224.safetensors
"""

import ml_collections

from ood_jax import config_files


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = config_files.load(config_files.sibling(__file__, "counts_detr_r50.py"), arg)
    config.model_name = "DETR-ViT-S/16"
    config.model.args.backbone = "S/16"
    # A plain ViT has no BatchNorm and no stem stages to freeze.
    config.model.args.backbone_frozen_stages = 0
    config.optim.frozen_pattern = ""
    # Patch-16 tokens at 1333 px are too many for global attention on most GPUs.
    if arg != "runlocal":
        config.input.image_size = 1024
        config.input.scales = (512, 576, 640, 704, 768)
        config.input.eval_size = 768
    return config
