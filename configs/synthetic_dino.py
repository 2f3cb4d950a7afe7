"""DINO on synthetic_shifts: the same data, protocol, backbone pretraining and CPU budget as
synthetic_detr.py, so the two detectors compare directly.

  ood-jax train --config=configs/synthetic_dino.py --workdir=/tmp/synthetic_dino
  ood-jax train --config=configs/synthetic_dino.py:smoke --workdir=/tmp/smoke_dino

Variants (`:arg`): (none) the demo-sized run; `smoke` a few dozen steps on the tiny build.
"""

import ml_collections

from ood_jax import config_files


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = config_files.load(config_files.sibling(__file__, "synthetic_detr.py"), arg)
    smoke = arg == "smoke"
    config.model_name = "DINO-4scale-R18 (synthetic)"

    detr_args = config.model.args
    config.model.name = "dino"
    config.model.args = ml_collections.ConfigDict()
    args = config.model.args
    args.num_classes = detr_args.num_classes
    # Four levels from a 128 px image hold 340 positions (16^2 + 8^2 + 4^2 + 2^2); the two-stage
    # selection takes its queries from them.
    args.num_queries = 30 if smoke else 50
    args.hidden_dim = detr_args.hidden_dim
    args.num_heads = detr_args.num_heads
    args.num_encoder_layers = detr_args.num_encoder_layers
    args.num_decoder_layers = 2
    args.ffn_dim = detr_args.ffn_dim
    args.dropout = 0.0
    args.backbone = detr_args.backbone
    args.backbone_norm = detr_args.backbone_norm
    # Frozen, as in the DETR demo; in the smoke run too, where tests check that it stays so.
    args.freeze_backbone = True
    config.optim.backbone_lr = 0.0
    config.optim.frozen_pattern = r"backbone/.*"

    # Noised copies of the (at most max_boxes) targets: positives and negatives together.
    config.denoising = ml_collections.ConfigDict()
    config.denoising.num_queries = 4 * config.input.max_boxes
    config.denoising.label_noise_ratio = 0.5
    config.denoising.box_noise_scale = 1.0

    # DINO's focal set loss and matching costs (ood_jax.models.focal_set_loss.FocalSetLossConfig).
    config.loss = ml_collections.ConfigDict()
    config.loss.focal_alpha = 0.25
    config.loss.focal_gamma = 2.0

    # The CPU budget of 3000 synthetic_detr.py steps: a DINO step costs about 2.7 times a
    # DETR step here (bench/dino_step.py times the step itself).
    if not smoke:
        config.total_steps = 1100
        config.optim.decay_epochs = (6.0,)
    return config
