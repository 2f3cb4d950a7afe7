"""DETR with a ViT-S/16 backbone on COUNTS, O(OD)^2 protocol (see counts_detr_r50.py).

  ood-jax train --config=configs/counts_detr_vit.py --workdir=workdirs/counts_detr_vit \\
      --config.model.backbone_weights=/weights/vit_small_patch16_224.safetensors
"""

import importlib.util
import pathlib

import ml_collections


def _base_config(arg):
    # Config files are loaded by path (not as a package), so the sibling is too.
    path = pathlib.Path(__file__).with_name("counts_detr_r50.py")
    spec = importlib.util.spec_from_file_location("counts_detr_r50", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = _base_config(arg)
    config.model_name = "DETR-ViT-S/16"
    config.model.args.backbone = "S/16"
    # A plain ViT has no BatchNorm and no stem stages to freeze.
    config.optim.frozen_pattern = ""
    # Patch-16 tokens at 1333 px are too many for global attention on most GPUs.
    if arg != "runlocal":
        config.input.image_size = 1024
        config.input.scales = (512, 576, 640, 704, 768)
        config.input.eval_size = 768
    return config
