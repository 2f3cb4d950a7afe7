"""DETR-R50 on COUNTS with the paper's O(OD)^2 protocol.

Trains on the 8 domains that are not held out and tests in-domain and on each of the paper's
targets (sky, occlusion, grass, water, dim, handmade). Schedule of the COUNTS paper: 60 epochs,
learning rate decayed by 0.1 at epochs 20 and 34, weight decay 1e-4, batch 32. DETR's own recipe
for the rest: AdamW, backbone at a tenth of the learning rate, ImageNet backbone with frozen
BatchNorm, stem and first stage, gradient clipping at 0.1.

  ood-jax build counts --source /data/COUNTS --data-dir ~/tensorflow_datasets
  ood-jax train --config=configs/counts_detr_r50.py --workdir=workdirs/counts_detr_r50 \\
      --config.model.backbone_weights=/weights/resnet50-0676ba61.pth

Variants: `gpu8` (8 GPUs, one host), `runlocal` (a few steps at small size, to check a setup).
"""

import ml_collections

from ood_jax.data import counts


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "default"
    if variant not in ("default", "gpu8", "runlocal"):
        raise ValueError(f"unknown variant {arg!r}; use '', 'gpu8' or 'runlocal'")
    runlocal = variant == "runlocal"

    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model_name = "DETR-R50"
    config.distributed = False

    config.dataset = ml_collections.ConfigDict()
    config.dataset.name = "counts"
    config.dataset.data_dir = "~/tensorflow_datasets"
    config.dataset.build_if_missing = False
    config.dataset.target_domains = counts.PAPER_TARGET_DOMAINS
    config.dataset.train_split = "train"
    config.dataset.test_split = "test"

    config.input = ml_collections.ConfigDict()
    config.input.image_size = 320 if runlocal else 1333
    config.input.max_size = config.input.get_ref("image_size")
    config.input.scales = (
        (288, 320) if runlocal else (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)
    )
    config.input.eval_size = 320 if runlocal else 800
    config.input.flip_prob = 0.5
    config.input.crop_prob = 0.5
    config.input.crop_min_fraction = 0.5
    config.input.max_boxes = 100
    config.input.batch_size = 2 if runlocal else 32
    config.input.shuffle_buffer = 64 if runlocal else 4096
    # 0: every batch padded to the 1333x1333 square; k > 0: runs of k batches sorted by
    # orientation, on 800x1333 or 1333x800 (data.pipeline.train_canvases; DINO's config).
    config.input.orientation_window = 0
    config.eval_batch_size = 2 if runlocal else 32

    config.model = ml_collections.ConfigDict()
    config.model.name = "detr"
    # Compute dtype of the detector: "float32", or "bfloat16" for mixed precision (parameters,
    # optimizer state, EMA, losses and matching stay float32; ood_jax/models/registry.py). It
    # may change on resume: the checkpoints are float32 either way.
    config.model.dtype = "float32"
    # torchvision/timm ResNet-50 ImageNet weights (.pth or .safetensors); empty: random init.
    config.model.backbone_weights = ""
    config.model.args = ml_collections.ConfigDict()
    config.model.args.num_classes = len(counts.CATEGORIES)
    config.model.args.num_queries = 100
    config.model.args.hidden_dim = 256
    config.model.args.num_heads = 8
    config.model.args.num_encoder_layers = 6
    config.model.args.num_decoder_layers = 6
    config.model.args.ffn_dim = 2048
    config.model.args.dropout = 0.1
    config.model.args.backbone = "resnet50"
    config.model.args.backbone_norm = "frozen"
    # DETR keeps the ImageNet stem and first stage fixed: no gradient is computed for them,
    # and the optimizer leaves them alone (frozen_pattern below).
    config.model.args.backbone_frozen_stages = 1
    config.model.args.dilation = False

    config.optim = ml_collections.ConfigDict()
    config.optim.lr = 1e-4
    config.optim.backbone_lr = 1e-5
    config.optim.backbone_pattern = r"backbone/.*"
    config.optim.frozen_pattern = r"backbone/(stem_.*|stage1_.*)"
    config.optim.weight_decay = 1e-4
    config.optim.clip_norm = 0.1
    config.optim.b1 = 0.9
    config.optim.b2 = 0.999
    config.optim.decay_epochs = (20.0, 34.0)
    config.optim.decay_factor = 0.1
    config.optim.warmup_steps = 0

    # Evaluation and export use an exponential moving average of the parameters when
    # ema_decay > 0 (0: off), with TF's warmup min(ema_decay, (1 + t) / (10 + t)) at step t
    # when ema_warmup (ood_jax/train/optim.py). On or off for good once a workdir has checkpoints.
    config.ema_decay = 0.0
    config.ema_warmup = True

    config.loss = ml_collections.ConfigDict()
    config.loss.eos_coef = 0.1

    # 60 epochs of the training domains at batch 32 (~7.4k images -> ~230 steps per epoch);
    # set from the built dataset's size when it differs.
    config.total_steps = 4 if runlocal else 14_000
    config.log_every = 1 if runlocal else 100
    config.eval_every = 0 if runlocal else 2_000
    config.checkpoint_every = 2 if runlocal else 1_000
    config.keep_checkpoints = 3

    # Model selection (ood_jax/train/selection.py; `ood-jax sweep`). val_fraction > 0 holds that
    # share of each training split out of training, evaluated for training-domain validation
    # (0 here: a run trains on every training image, as the paper's; a sweep with
    # training_domain uses 0.2 unless set); oracle_fraction is the share of each target's test
    # images the test-domain oracle selects on; leave_out, a training domain the run does not
    # train on, evaluated on its training images (a leave-one-domain-out job sets it).
    config.selection = ml_collections.ConfigDict()
    config.selection.val_fraction = 0.0
    config.selection.oracle_fraction = 0.2
    config.selection.leave_out = ""
    # A workdir's checkpoints resume only with the config they were trained with, except for
    # run length, intervals, paths and devices (ood_jax/train/config_checks.py); True lets a
    # changed model, data or optimizer field through.
    config.allow_config_change = False

    config.mesh = [("data", -1)]
    config.partition_rules = [(".*", "replicate")]
    if variant == "gpu8":
        # Shard optimizer state and parameters over the 8 GPUs as well (ZeRO-3 style).
        config.mesh = [("data", 1), ("fsdp", -1)]
        config.partition_rules = [(".*", "fsdp")]
    return config
