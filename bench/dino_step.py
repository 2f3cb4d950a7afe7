#!/usr/bin/env python
"""Benchmark: our DINO train and inference step next to transformers' PyTorch Deformable DETR,
and multi-scale deformable attention alone next to transformers' pure-PyTorch op.

Models, at the same size (DINO-4scale R50: d_model 256, 8 heads, 6 + 6 layers, FFN 2048,
4 levels, 4 points, 900 queries, 91 classes, frozen BatchNorm, dropout 0), one batch of random
ImageNet-normalized images (default 2 at 320x320, all pixels real) with 3 to 6 random boxes each
(8 target slots):

  * ours: `ood_jax.models.dino.DINO` with contrastive denoising queries
    (`denoising.make_cdn_queries`, `--dn` of them) and `ood_jax.models.focal_set_loss`
    (in-graph Hungarian matching of the final, 5 auxiliary and the encoder outputs, focal loss,
    L1, GIoU, plus the denoising losses of all 6 layers), backward, global-norm clipping 0.1 and
    AdamW (lr 1e-4, backbone 1e-5, weight decay 1e-4), jitted with the state donated. The stem
    and first ResNet stage are frozen, as DINO and transformers freeze them. Inference: forward
    + top-300 post-processing, jitted.
  * torch: `transformers.DeformableDetrForObjectDetection` with `two_stage=True`,
    `with_box_refine=True`, 900 proposals and `auxiliary_loss=True` (timm resnet50, random
    init): forward with labels -> its loss (scipy matching, focal loss on 6 decoder outputs),
    backward, clipping, torch.optim.AdamW with the same two parameter groups; inference in eval
    mode under no_grad with the same top-300 post-processing.
    `torch.set_num_threads(os.cpu_count())` unless `--torch-threads`.
  Our step does strictly more work than torch's (denoising queries, the encoder-proposal and
  denoising losses). Our weights are random draws of the right shapes (no init compile); the two
  models are different architectures, so their outputs are not compared.

  * the op: `multi_scale_deformable_attention` against transformers'
    `MultiScaleDeformableAttention` (grid_sample), forward and forward+backward (gradients for
    value, sampling locations and attention weights), at DINO's decoder shapes: batch `--batch`,
    900 queries, 8 heads of 32 channels, 4 levels x 4 points, over the 4 levels of an
    `--op-size` image (default 800x1333, COCO's test scale: 100x167, 50x84, 25x42, 13x21).

Warm-up runs are excluded; compile times are reported separately; each figure is the median of
`--steps` timed runs, ours and torch alternating so a change in the machine's load weighs on
both. If `ood_jax.models.focal_set_loss` cannot be imported, both train steps instead time
forward + backward of the sum of all outputs (and say so).

    python bench/dino_step.py [--steps 3] [--warmup 1] [--size 320] [--batch 2] [--dn 100]
                              [--op-size 800x1333] [--dtype float32|bfloat16] [--remat]
                              [--torch-threads T] [--no-torch] [--no-op] [--compile-only]

The summary line gives the ratios (torch time / our time; above 1 means ours is faster); two
"device figures:" lines follow (`common.device_figures`), one per step kind: median step
seconds, images/s, GFLOP per step from XLA's cost analysis, achieved TFLOP/s, MFU against the
device's dense peak (`common.PEAK_TFLOPS` or `PEAK_TFLOPS`; on CPU, which has no datasheet
figure, a 4096^2 `jnp.dot` in the same dtype timed in the same run after the steps), the
compiled step's memory_analysis() peak and the device's measured peak (`memory_stats()`; "n/a"
on CPU): after the train steps the max over both steps, for the predict line before any train
step. The result line carries them too (`train_tflops`, `train_mfu`, `predict_tflops`,
`predict_mfu` as a fraction, `peak_tflops`, `peak_source`, ...).
`--no-op` skips the deformable-attention op (its inputs, compiles and timings);
`--compile-only` compiles our two steps without running anything and prints only those lines
(their FLOPs and compiled memory; the time-based figures n/a).

The malloc decides the CPU ratios (the header names it): XLA:CPU allocates a step's 5.6 GB
temp buffer anew on each call, and glibc's default malloc unmaps it on free, so each step faults
it in again, worse while torch's steps alternate with ours. Like `ood-jax`, the bench restarts
itself under glibc settings that keep freed memory (`ood_jax/malloc.py`). Measured at the
defaults (320x320, batch 2, float32, 2 cores, `--steps 3`): train step 3.24 s against 4.00 s
(1.23x), inference 1.10 s against 1.40 s (1.28x); with `OOD_JAX_MALLOC=system` (glibc's
default) 8.58 s against 5.11 s (0.60x). Those were an earlier day's, under the one-arena malloc;
docs/guide/detectors.md ("Distance from the machine's peak") has the latest.

`--memory [--size 800x1333] [--dtype D]` measures instead the memory one train step
needs at batch `--batch`: ours is `ood-jax train`'s own step (`train.jit_train_step` on
configs/counts_dino_r50.py, whose `input.orientation_window` puts a batch of 800x1333 images
on the 800x1333 rectangle, not the 1333x1333 square), from the compiled step's
`memory_analysis()` (lowered on abstract arguments: compiled, never run) at the size, 3/4 and
1/2 of it in `--dtype` and at the size in the other dtype, with a linear fit in image area to
pick a batch for a GPU; torch's as the peak-RSS increase
(`resource.getrusage`) of one forward + backward + AdamW step at the rectangle itself in its own
process. On CPU the trainer compiles the step without the pass that would undo remat
(`train.step_compiler_options`).

`--dtype bfloat16` runs ours in bfloat16 and torch in float32 (the header and the result line
name each side's dtype). The last line is `common.result_line`'s: the train step (ratio torch /
ours), the other rows (inference, the op) under "rows"; with `--memory`, bytes instead of
seconds (`ours_bytes`, `peer_bytes`; ratio torch / ours). `--smoke`: a toy DINO and Deformable
DETR (resnet18, d_model 32, one layer each, 10 queries) at 64x64, batch 2, one step, for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (bench/, the directory of this script)

from ood_jax import malloc  # noqa: E402

NUM_CLASSES = 91
NUM_QUERIES = 900
MAX_BOXES = 8
TOP_K = 300
HEADS, HEAD_DIM, LEVELS, POINTS = 8, 32, 4, 4
BACKBONE_LR, LR, WEIGHT_DECAY, CLIP_NORM = 1e-5, 1e-4, 1e-4, 0.1  # DINO's recipe
# Parameters DINO and transformers leave frozen: the stem and the first ResNet stage.
FROZEN = ("backbone/stem_", "backbone/stage1_")
BACKBONE = "resnet50"
# Model sizes on top of the defaults (DINO-4scale R50's); --smoke shrinks them.
OUR_SIZES: dict[str, Any] = {}
TORCH_SIZES: dict[str, Any] = {}


def _shrink() -> None:
    """--smoke's toy sizes, on both sides (and in the --memory child, which parses the flag)."""
    global NUM_QUERIES, TOP_K, BACKBONE
    NUM_QUERIES, TOP_K, BACKBONE = 10, 10, "resnet18"
    OUR_SIZES.update(
        hidden_dim=32, num_encoder_layers=1, num_decoder_layers=1, ffn_dim=64, backbone=BACKBONE
    )
    TORCH_SIZES.update(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64, decoder_ffn_dim=64
    )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed runs per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    parser.add_argument("--size", help="image size, S or HxW (default 320, with --memory 800x1333)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dn", type=int, help="denoising query budget (default 100)")
    parser.add_argument("--op-size", default="800x1333", help="HxW image the op's levels tile")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--remat", action="store_true", help="recompute sampling and layers in backward"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true", help="time only ours")
    parser.add_argument(
        "--no-op", action="store_true", help="skip the deformable-attention op timings"
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="only compile our steps and print their FLOPs and compiled memory (no timings; "
        "implies --no-torch --no-op)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="the train step's memory instead of times: the trainer's step on "
        "configs/counts_dino_r50.py, with that config's remat and denoising queries",
    )
    parser.add_argument("--torch-memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="toy models, 1 step: for tests")
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="torch intra-op threads (0: all cores)"
    )
    args = parser.parse_args()
    if args.memory and (args.remat or args.dn is not None):
        parser.error(
            "--memory measures the trainer's step with configs/counts_dino_r50.py's remat and "
            "denoising queries; --remat and --dn apply to the timed steps"
        )
    args.dn = 100 if args.dn is None else args.dn
    if args.smoke:
        _shrink()
        # Batch 2: torch's BatchNorm in training refuses one value per channel (a 1x1 level).
        args.steps, args.warmup, args.batch, args.dn, args.op_size = 1, 1, 2, 4, "64x64"
        args.size = args.size or "64"
    args.no_torch = args.no_torch or args.compile_only
    args.no_op = args.no_op or args.compile_only
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --batch >= 1")
    size = args.size or ("800x1333" if args.memory else "320")
    try:
        args.hw = tuple(int(v) for v in size.lower().split("x")) * (1 if "x" in size else 2)
        assert len(args.hw) == 2
    except (ValueError, AssertionError):
        parser.error(f"--size {size!r}: expected S or HxW")
    # --memory also compiles at half the size.
    smallest = [v // 2 for v in args.hw] if args.memory else args.hw
    if (smallest[0] // 8) * (smallest[1] // 8) < NUM_QUERIES:
        parser.error(f"--size {size} gives fewer encoder positions than {NUM_QUERIES}")
    try:
        args.op_hw = tuple(int(v) for v in args.op_size.lower().split("x"))
        assert len(args.op_hw) == 2 and min(args.op_hw) >= 64
    except (ValueError, AssertionError):
        parser.error(f"--op-size {args.op_size!r}: expected HxW, each at least 64")
    return args


def _inputs(args: argparse.Namespace):
    """`common.random_detection_input` at args.hw (boxes are normalized, so a crop keeps them)."""
    height, width = args.hw
    images, *targets = common.random_detection_input(
        args.seed, args.batch, max(height, width), MAX_BOXES, NUM_CLASSES
    )
    return (images[:, :height, :width], *targets)


def _level_shapes(height: int, width: int) -> list[tuple[int, int]]:
    """The 4 levels (strides 8, 16, 32 and the extra 64) of an image, as ResNet + neck give."""
    shapes, h, w = [], height, width
    for _ in range(2):  # stem conv and max pool
        h, w = (h + 1) // 2, (w + 1) // 2
    for _ in range(LEVELS):
        h, w = (h + 1) // 2, (w + 1) // 2
        shapes.append((h, w))
    return shapes


# --------------------------------------------------------------------------------------------
# torch side
# --------------------------------------------------------------------------------------------


def _torch_runner(args: argparse.Namespace, inputs, use_loss: bool) -> dict[str, Any]:
    import torch
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.DeformableDetrConfig(
        use_timm_backbone=True,
        backbone=BACKBONE,
        use_pretrained_backbone=False,
        num_labels=NUM_CLASSES,
        two_stage=True,
        with_box_refine=True,
        two_stage_num_proposals=NUM_QUERIES,
        num_queries=NUM_QUERIES,
        dropout=0.0,
        auxiliary_loss=True,
        **{"encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, **TORCH_SIZES},
    )
    model = transformers.DeformableDetrForObjectDetection(config)
    pixel_values, pixel_mask, targets = common.torch_detection_batch(inputs)
    optimizer, trainable = common.torch_adamw(model, LR, BACKBONE_LR, WEIGHT_DECAY)

    def predict():
        model.eval()
        with torch.no_grad():
            out = model(pixel_values=pixel_values, pixel_mask=pixel_mask)
            scores, index = out.logits.sigmoid().flatten(1).topk(TOP_K, dim=1)
            boxes = out.pred_boxes.gather(1, (index // NUM_CLASSES)[..., None].expand(-1, -1, 4))
        return scores, index % NUM_CLASSES, boxes

    def step():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        if use_loss:
            loss = model(pixel_values=pixel_values, pixel_mask=pixel_mask, labels=targets).loss
        else:
            out = model(pixel_values=pixel_values, pixel_mask=pixel_mask)
            loss = out.logits.sum() + out.pred_boxes.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP_NORM)
        optimizer.step()
        return float(loss.detach())

    losses = []
    return {"predict": predict, "train": lambda: losses.append(step()), "losses": losses}


def _torch_op_runner(value, shapes, locations, weights) -> dict[str, Any]:
    import torch
    from transformers.models.deformable_detr.modeling_deformable_detr import (
        MultiScaleDeformableAttention,
    )

    op = MultiScaleDeformableAttention()
    spatial = torch.tensor(shapes)
    starts = torch.cat([spatial.new_zeros(1), spatial.prod(1).cumsum(0)[:-1]])
    tensors = [torch.from_numpy(x) for x in (value, locations, weights)]
    grads = [t.clone().requires_grad_(True) for t in tensors]

    def forward():
        with torch.no_grad():
            return op(*tensors[:1], spatial, shapes, starts, *tensors[1:], 64)

    def backward():
        for g in grads:
            g.grad = None
        out = op(grads[0], spatial, shapes, starts, grads[1], grads[2], 64)
        out.sum().backward()
        return [g.grad for g in grads]

    return {"op forward": forward, "op fwd+bwd": backward}


# --------------------------------------------------------------------------------------------
# our side
# --------------------------------------------------------------------------------------------


def _batch(images, boxes, labels, mask) -> dict:
    """The step's batch: every image pixel real."""
    import jax.numpy as jnp

    return {
        "images": images,
        "pixel_mask": jnp.ones(images.shape[:3], bool),
        "boxes": boxes,
        "labels": labels,
        "mask": mask,
    }


def build_train_step(module, variables, num_dn: int, use_loss: bool) -> dict[str, Any]:
    """Our jitted DINO train step and predict step over `variables`, with their arguments.

    Returns {"train": jit(train_step, donating the state), "predict": jit(predict), "state":
    (trainable, optimizer state), "fixed": {"frozen", "model_state"}}, called as
    `train(state, fixed, batch, rng) -> (state, loss)` and `predict(state[0], fixed, batch)`.
    `variables` may be `jax.ShapeDtypeStruct`s: state and fixed then come back abstract, so
    `train.lower(state, fixed, batch, rng).compile()` builds the step without running anything
    (what `--memory` measures).
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import traverse_util

    from ood_jax.models import denoising, dino

    flat = traverse_util.flatten_dict(variables["params"], sep="/")
    frozen = {k: v for k, v in flat.items() if k.startswith(FROZEN)}
    trainable = {k: v for k, v in flat.items() if not k.startswith(FROZEN)}
    group = {k: "backbone" if k.startswith("backbone/") else "rest" for k in trainable}

    def adamw(lr):
        return optax.adamw(lr, weight_decay=WEIGHT_DECAY)

    optimizer = optax.chain(
        optax.clip_by_global_norm(CLIP_NORM),
        optax.multi_transform({"backbone": adamw(BACKBONE_LR), "rest": adamw(LR)}, group),
    )
    # Everything the step reads is an argument, never a closed-over constant: XLA would fold
    # the frozen stem over constant images at compile time and time less than the real work.
    fixed = {"frozen": frozen, "model_state": {k: v for k, v in variables.items() if k != "params"}}

    def apply(trainable, fixed, batch, **kwargs):
        params = traverse_util.unflatten_dict({**trainable, **fixed["frozen"]}, sep="/")
        variables = {"params": params, **fixed["model_state"]}
        return module.apply(variables, batch["images"], batch["pixel_mask"], **kwargs)

    def loss_fn(trainable, fixed, batch, rng):
        denoise = denoising.make_cdn_queries(
            rng,
            batch["labels"],
            batch["boxes"],
            batch["mask"],
            num_classes=NUM_CLASSES,
            num_queries=NUM_QUERIES,
            num_dn_queries=num_dn,
        )
        out = apply(trainable, fixed, batch, train=True, denoise=denoise)
        if not use_loss:
            return sum(jnp.sum(x) for x in jax.tree.leaves(out))
        from ood_jax.models import focal_set_loss

        targets = {k: batch[k] for k in ("boxes", "labels", "mask")}
        config = focal_set_loss.FocalSetLossConfig()
        total, _ = focal_set_loss.focal_set_loss(out, targets, config, denoise)
        return total

    def train_step(state, fixed, batch, rng):
        trainable, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(trainable, fixed, batch, rng)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return (optax.apply_updates(trainable, updates), opt_state), loss

    def predict(trainable, fixed, batch):
        return dino.postprocess(apply(trainable, fixed, batch), TOP_K)

    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(trainable))
    init = jax.eval_shape if abstract else lambda f, x: jax.jit(f)(x)
    return {
        "train": jax.jit(train_step, donate_argnums=(0,)),
        "predict": jax.jit(predict),
        "state": (trainable, init(optimizer.init, trainable)),
        "fixed": fixed,
    }


def _our_runner(args: argparse.Namespace, inputs, dtype, use_loss: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from ood_jax.models import dino
    from ood_jax.testing.random_variables import random_variables

    module = dino.DINO(
        num_classes=NUM_CLASSES, num_queries=NUM_QUERIES, remat=args.remat, dtype=dtype, **OUR_SIZES
    )
    images, boxes, labels, mask = (jnp.asarray(x) for x in inputs)
    steps = build_train_step(module, random_variables(module, images), args.dn, use_loss)
    batch = _batch(images, boxes, labels, mask)
    state, fixed = steps["state"], steps["fixed"]
    rng = jax.random.key(args.seed)
    start = time.perf_counter()
    predict_fn = steps["predict"].lower(state[0], fixed, batch).compile()
    compile_predict = time.perf_counter() - start
    start = time.perf_counter()
    step_fn = steps["train"].lower(state, fixed, batch, rng).compile()
    compile_train = time.perf_counter() - start

    current, losses = [state], []

    def run_step():
        current[0], loss = step_fn(current[0], fixed, batch, rng)
        losses.append(float(loss))  # blocks until the step is done

    return {
        "predict": lambda: jax.block_until_ready(predict_fn(current[0][0], fixed, batch)),
        "train": run_step,
        "losses": losses,
        "compile_train": compile_train,
        "compile_predict": compile_predict,
        "compiled_train": step_fn,
        "compiled_predict": predict_fn,
    }


def _our_op_runner(value, shapes, locations, weights, remat: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from ood_jax.models import deformable_attention as da

    args = [jnp.asarray(x) for x in (value, locations, weights)]

    def op(v, loc, w):
        return da.multi_scale_deformable_attention(v, shapes, loc, w, remat=remat)

    forward = jax.jit(op).lower(*args).compile()
    backward = (
        jax.jit(jax.grad(lambda *a: jnp.sum(op(*a)), argnums=(0, 1, 2))).lower(*args).compile()
    )
    return {
        "op forward": lambda: jax.block_until_ready(forward(*args)),
        "op fwd+bwd": lambda: jax.block_until_ready(backward(*args)),
    }


def _op_inputs(args: argparse.Namespace):
    import numpy as np

    shapes = _level_shapes(*args.op_hw)
    rng = np.random.default_rng(args.seed)
    keys = sum(h * w for h, w in shapes)
    value = rng.standard_normal((args.batch, keys, HEADS, HEAD_DIM)).astype(np.float32)
    locations = rng.uniform(0.0, 1.0, (args.batch, NUM_QUERIES, HEADS, LEVELS, POINTS, 2))
    logits = rng.standard_normal((args.batch, NUM_QUERIES, HEADS, LEVELS * POINTS))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    weights = weights.reshape(locations.shape[:-1])
    return value, shapes, locations.astype(np.float32), weights.astype(np.float32)


# --------------------------------------------------------------------------------------------
# memory (--memory)
# --------------------------------------------------------------------------------------------


def our_step_memory(height: int, width: int, batch: int, dtype: str, smoke: bool) -> dict[str, Any]:
    """Bytes `ood-jax train`'s own step needs (`train.jit_train_step` on
    configs/counts_dino_r50.py, or synthetic_dino.py:smoke with `smoke`) at batch on the
    trainer's landscape canvas for images of height x width (shorter side `height`, longer
    `width`; `pipeline.train_canvases`), from the compiled step's
    `memory_analysis()`: everything is abstract, nothing runs. Remat is the config's (on at
    paper scale), and the trainer itself keeps it effective on CPU
    (`train.step_compiler_options`).

    "peak" is temp + arguments + outputs - aliased: the donated state's outputs reuse its
    argument buffers, so they are counted once.
    """
    import jax

    from ood_jax import config_files, sharding
    from ood_jax.data import pipeline
    from ood_jax.train import train

    configs = pathlib.Path(__file__).resolve().parents[1] / "configs"
    if smoke:
        config = config_files.load(configs / "synthetic_dino.py", "smoke")
        config.model.args.num_queries = 10  # the smoke sizes' smallest image holds 22 positions
    else:
        config = config_files.load(configs / "counts_dino_r50.py")
    config.input.image_size = config.input.max_size = max(height, width)
    config.input.scales = (min(height, width),)
    config.input.batch_size = batch
    config.model.dtype = dtype
    mesh = sharding.make_mesh([("data", 1)], jax.devices()[:1])
    layout = train.build_layout(config, mesh, steps_per_epoch=10.0)
    start = time.perf_counter()
    canvas = pipeline.train_canvases(config.input)[0]
    lowered = train.jit_train_step(config, layout).lower(
        layout.abstract_state, pipeline.batch_spec(config.input, canvas), jax.random.key(0)
    )
    sizes = common.compiled_memory(lowered.compile())
    if sizes is None:
        raise RuntimeError("this backend's compiled step has no memory_analysis()")
    remat = bool(config.model.args.get("remat", False))
    return {**sizes, "compile_s": time.perf_counter() - start, "remat": remat, "canvas": canvas}


def _torch_step_memory(args: argparse.Namespace) -> dict[str, float]:
    """transformers' train step at args.hw in a fresh process (see `_torch_memory_child`)."""
    command = [sys.executable, os.path.abspath(__file__), "--torch-memory-child"]
    command += ["--size", "x".join(map(str, args.hw)), "--batch", str(args.batch)]
    command += ["--seed", str(args.seed), "--torch-threads", str(args.torch_threads)]
    command += ["--smoke"] if args.smoke else []
    # glibc's default malloc, as PyTorch runs: keeping freed memory could only raise its peak.
    done = subprocess.run(command, capture_output=True, text=True, env=malloc.default_environ())
    if done.returncode:
        raise RuntimeError(f"the torch memory run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _torch_memory_child(args: argparse.Namespace) -> None:
    """Prints, as JSON, the peak-RSS increase of one forward + backward + optimizer step of
    transformers' model (`resource.getrusage` before and after it), and its seconds."""
    import gc
    import resource

    import timm  # noqa: F401  (before anything that may load tensorflow; see main)
    import torch

    torch.set_num_threads(args.torch_threads or os.cpu_count())
    runner = _torch_runner(args, _inputs(args), use_loss=True)
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    runner["train"]()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_increase": (after - before) * 1024, "seconds": seconds}))  # KiB


def _memory_report(args: argparse.Namespace) -> None:
    import numpy as np

    height, width = args.hw
    sizes = [(round(height * f), round(width * f)) for f in (0.5, 0.75, 1.0)]
    ours = {hw: our_step_memory(*hw, args.batch, args.dtype, args.smoke) for hw in sizes}
    other_name = "float32" if args.dtype == "bfloat16" else "bfloat16"
    full = our_step_memory(height, width, args.batch, other_name, args.smoke)
    torch_memory = None if args.no_torch else _torch_step_memory(args)

    gb = 1e9
    print(
        f"DINO-4scale R50 train step memory, batch {args.batch}, remat {full['remat']} (ours: "
        "`ood-jax train`'s own step on configs/counts_dino_r50.py, on its training canvas, "
        f"{'x'.join(map(str, full['canvas']))} at {height}x{width}; compiled memory_analysis(), "
        "not run; peak = temp + arguments + outputs - aliased donated state)"
    )
    print(
        f"  {'size':>10s} {'dtype':>9s} {'temp GB':>8s} {'args GB':>8s} {'out GB':>7s} "
        f"{'peak GB':>8s} {'compile s':>9s}"
    )
    rows = [(hw, args.dtype, m) for hw, m in ours.items()] + [((height, width), other_name, full)]
    for (h, w), name, m in rows:
        print(
            f"  {h:>4d}x{w:<5d} {name:>9s} {m['temp'] / gb:8.2f} {m['arguments'] / gb:8.2f} "
            f"{m['outputs'] / gb:7.2f} {m['peak'] / gb:8.2f} {m['compile_s']:9.1f}"
        )
    areas = np.array([h * w / 1e6 for h, w in sizes])
    slope, intercept = np.polyfit(areas, [ours[hw]["peak"] / gb for hw in sizes], 1)
    print(
        f"  ours ({args.dtype}) scales as {intercept:.2f} GB + {slope:.2f} GB per megapixel of "
        f"image area at batch {args.batch}; temp buffers grow about linearly with the batch, "
        f"so a batch of n needs about {ours[sizes[-1]]['arguments'] / gb:.2f} + "
        f"n x {ours[sizes[-1]]['temp'] / args.batch / gb:.2f} GB at {height}x{width}"
    )
    by_dtype = {args.dtype: ours[sizes[-1]]["peak"], other_name: full["peak"]}
    memory_result = dict(
        unit="bytes per train step (peak)",
        stat="ours: compiled memory_analysis(); torch: peak-RSS increase of one step",
        batch=args.batch,
        size=f"{height}x{width}",
        ours_dtype=args.dtype,
        peer_dtype="float32",
        ours_other_dtype_bytes=full["peak"],
    )
    if torch_memory is None:
        common.result_line("dino_step_memory", None, None, None, ours_bytes=by_dtype[args.dtype],
                           **memory_result)  # fmt: skip
        return
    theirs = torch_memory["peak_increase"]
    print(
        f"  torch (transformers two-stage Deformable DETR, fp32): peak RSS +{theirs / gb:.2f} GB "
        f"for one step ({torch_memory['seconds']:.0f} s)"
    )
    # A toy step (--smoke) may fit in memory torch's process already holds: no increase.
    shares = (
        f"ours/torch float32 {by_dtype['float32'] / theirs:.2f}, "
        f"bfloat16 {by_dtype['bfloat16'] / theirs:.2f}"
        if theirs > 0
        else "no torch increase to compare with"
    )
    print(
        f"at {height}x{width}, batch {args.batch}: ours float32 {by_dtype['float32'] / gb:.2f} GB, "
        f"ours bfloat16 {by_dtype['bfloat16'] / gb:.2f} GB, torch {theirs / gb:.2f} GB; {shares}"
    )
    # The ratio is torch / ours like the timings', computed here on bytes: ours_s and peer_s
    # stay null so that no reader takes bytes for seconds.
    common.result_line(
        "dino_step_memory", None, "transformers Deformable DETR two-stage (PyTorch)", None,
        ours_bytes=by_dtype[args.dtype], peer_bytes=theirs,
        bytes_ratio=round(theirs / by_dtype[args.dtype], 4), **memory_result,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def main() -> None:
    args = _parse_args()
    if args.torch_memory_child:
        _torch_memory_child(args)
        return
    torch_threads = args.torch_threads or os.cpu_count()
    if not (args.no_torch or args.memory):  # --memory runs torch in its own process
        # torch (and what it loads) before anything that may import tensorflow: triton
        # segfaults when it loads after TF.
        import timm  # noqa: F401
        import torch
        import torchvision  # noqa: F401

        torch.set_num_threads(torch_threads)

    import jax
    import jax.numpy as jnp

    try:
        from ood_jax.models import focal_set_loss  # noqa: F401

        use_loss, loss_note = True, "DINO loss (focal_set_loss) vs transformers' loss"
    except ImportError as e:
        use_loss = False
        loss_note = (
            f"ood_jax.models.focal_set_loss not importable ({e}): sum of outputs on both sides"
        )

    if args.memory:
        _memory_report(args)
        return
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    inputs = _inputs(args)
    op_inputs = None if args.no_op else _op_inputs(args)
    load = os.getloadavg()[0]

    runners = {"ours": _our_runner(args, inputs, dtype, use_loss)}
    if args.compile_only:
        ours, device = runners["ours"], jax.devices()[0]
        print(
            f"DINO-4scale R50 ({NUM_QUERIES} queries, {args.dn} denoising budget), compiled "
            f"only (not run): batch {args.batch}, {args.hw[0]}x{args.hw[1]}; ours in "
            f"{args.dtype} on {device.platform} ({device.device_kind}), remat {args.remat}"
        )
        print(f"  train loss: {loss_note}")
        print(
            f"  ours compile: train step {ours['compile_train']:.1f} s, predict "
            f"{ours['compile_predict']:.1f} s"
        )
        figures = common.device_figures(
            ours["compiled_train"], ours["compiled_predict"], None, None, args.batch, args.dtype
        )
        common.result_line(
            "dino_step", None, None, None, "compiled only, not run", ours_dtype=args.dtype,
            batch=args.batch, size=f"{args.hw[0]}x{args.hw[1]}", **figures,
        )  # fmt: skip
        return
    op_runners = {} if args.no_op else {"ours": _our_op_runner(*op_inputs, remat=args.remat)}
    if not args.no_torch:
        runners["torch"] = _torch_runner(args, inputs, use_loss)
        if not args.no_op:
            op_runners["torch"] = _torch_op_runner(*op_inputs)
    rows = [("train", "train step"), ("predict", "inference")]
    if not args.no_op:
        rows += [("op forward", "op forward"), ("op fwd+bwd", "op fwd+bwd")]
    times = {}
    # Inference first: the train steps change the weights. The device's peak memory is read
    # after the inference timings too, before any train step (the op runs after both).
    for key in ("predict", "train", *[k for k, _ in rows[2:]]):
        source = op_runners if key.startswith("op") else runners
        fns = {name: r[key] for name, r in source.items()}
        times[key] = common.time_alternating(fns, args.steps, args.warmup)
        if key == "predict":
            predict_device_peak = common.device_peak_bytes()
        elif key == "train":
            train_device_peak = common.device_peak_bytes()

    ours, theirs = runners["ours"], runners.get("torch")
    device = jax.devices()[0]
    print(
        f"DINO-4scale R50 (d 256, 6+6 layers, FFN 2048, {NUM_QUERIES} queries, {args.dn} "
        f"denoising budget) vs transformers Deformable DETR two-stage + box refine (same size): "
        f"batch {args.batch}, {args.hw[0]}x{args.hw[1]}{' (toy sizes: --smoke)' if args.smoke else ''}"
        f"; ours in {args.dtype} on {device.platform} ({device.device_kind}), remat {args.remat}"
        + ("" if theirs is None else "; torch in float32 on CPU")
    )
    threads = "" if theirs is None else f" (torch threads {torch_threads})"
    print(
        f"  {os.cpu_count()} CPU cores{threads}, malloc {malloc.describe()}, load average "
        f"{load:.1f} before / {os.getloadavg()[0]:.1f} after; median [min-max] of {args.steps} runs after "
        f"{args.warmup} warm-up, alternating"
    )
    print(f"  train loss: {loss_note}")
    print(
        f"  ours compile: train step {ours['compile_train']:.1f} s, predict "
        f"{ours['compile_predict']:.1f} s (not in the timings); first losses ours "
        f"{ours['losses'][0]:.3f}"
        + ("" if theirs is None else f", torch {theirs['losses'][0]:.3f}")
    )
    if not args.no_op:
        shapes = op_inputs[1]
        print(
            f"  op: batch {args.batch}, {NUM_QUERIES} queries, {HEADS} heads x {HEAD_DIM}, "
            f"{LEVELS} levels x {POINTS} points over {shapes} ({args.op_size} image)"
        )
    header = f"  {'':12s} {'ours (s)':>24s}"
    if theirs is not None:
        header += f" {'torch (s)':>24s} {'torch/ours':>11s}"
    print(header)
    medians = {key: {n: statistics.median(t) for n, t in times[key].items()} for key, _ in rows}
    parts = []
    for key, name in rows:
        row = f"  {name:12s} {common.summary(times[key]['ours']):>24s}"
        part = f"{name}: ours {medians[key]['ours']:.3f} s"
        if theirs is not None:
            ratio = medians[key]["torch"] / medians[key]["ours"]
            row += f" {common.summary(times[key]['torch']):>24s} {ratio:10.2f}x"
            part += f", torch {medians[key]['torch']:.3f} s, ratio torch/ours {ratio:.2f}"
        print(row)
        parts.append(part)
    print("; ".join(parts))
    figures = common.device_figures(
        ours["compiled_train"],
        ours["compiled_predict"],
        medians["train"]["ours"],
        medians["predict"]["ours"],
        args.batch,
        args.dtype,
        predict_device_peak,
        train_device_peak,
        smoke=args.smoke,
    )
    peer = None if theirs is None else "transformers Deformable DETR two-stage (PyTorch)"
    common.result_line(
        "dino_step",
        medians["train"]["ours"],
        peer,
        medians["train"].get("torch"),
        common.stat_text(args.steps, args.warmup),
        unit="s per train step",
        batch=args.batch,
        size=f"{args.hw[0]}x{args.hw[1]}",
        ours_dtype=args.dtype,
        peer_dtype=None if theirs is None else "float32",
        rows={
            key: {"ours_s": medians[key]["ours"], "peer_s": medians[key].get("torch")}
            for key, _ in rows
            if key != "train"
        },
        **figures,
    )


if __name__ == "__main__":
    malloc.restart_keeping_freed_memory()
    main()
