#!/usr/bin/env python
"""Benchmark: our jitted DETR-R50 train step and inference next to transformers' PyTorch DETR.

One process, one device, one input: a batch of random ImageNet-normalized images (default 2 at
320x320, all pixels real) with 3 to 6 random target boxes each over 91 classes (+ no object),
DETR-R50 with 100 queries and frozen BatchNorm, as in the paper. Timed:

  * ours: `ood_jax.train.train.train_step` (forward, in-graph Hungarian matching over the final
    and the 5 auxiliary decoder outputs, loss, backward, AdamW with clipping and the lower
    backbone learning rate from `optim.make_optimizer`), jitted with the state donated; and
    `train.predict_step` (forward + DETR's post-processing), jitted.
  * torch: `transformers.DetrForObjectDetection` (timm resnet50 backbone, random init,
    `auxiliary_loss=True` so its loss covers the same 6 decoder outputs): forward with labels ->
    loss (scipy matching), backward, gradient clipping, `torch.optim.AdamW` with the same two
    parameter groups; inference in eval mode under `torch.no_grad()` with the same
    post-processing. `torch.set_num_threads(os.cpu_count())` unless `--torch-threads`.

The weights are the same: the torch model is saved with `save_pretrained` and converted with
`ood_jax.models.convert.detr_from_hf`, and the eval-mode outputs of both are compared once.
Both keep the stem and the first stage fixed, DETR's recipe: transformers freezes them
(`requires_grad_(False)`), ours stops their gradient (`backbone_frozen_stages=1`) and the
optimizer leaves them alone (`frozen_pattern`); `--train-stem` trains the whole backbone on both
sides instead. Warm-up runs are excluded; our compile time is reported separately; each figure
is the median of `--steps` timed runs, ours and torch alternating so that a change in the
machine's load weighs on both.

    python bench/detr_train_step.py [--steps 5] [--warmup 1] [--size 320] [--batch 2]
                                    [--dtype float32|bfloat16] [--no-torch] [--torch-threads T]
                                    [--train-stem] [--compile-only] [--smoke]

`--dtype bfloat16` runs ours in bfloat16 and torch in float32 (the header and the result line
name each side's dtype). `--smoke`: a toy DETR (resnet18, d_model 32, one encoder and one
decoder layer, 5 queries) at 64x64, batch 1, one step after one warm-up, for the tests.

`--no-torch` times only ours and never imports torch or transformers (for accelerators; the
weights are then our own random init). The summary line of ratios is followed by two
"device figures:" lines (`common.device_figures`), one per step kind: median step seconds,
images/s, GFLOP per step from XLA's cost analysis, achieved TFLOP/s, MFU against the device's
dense peak (`common.PEAK_TFLOPS`, or `PEAK_TFLOPS` in the environment; on CPU, which has no
datasheet figure, a 4096^2 `jnp.dot` in the same dtype timed in the same run after the steps),
the compiled step's memory_analysis() peak and the device's measured peak (`memory_stats()`;
"n/a" on CPU): for the train line the max over both steps, for the predict line before any
train step. The result line carries them too (`train_tflops`, `train_mfu`, `predict_tflops`,
`predict_mfu` as a fraction, `peak_tflops`, `peak_source`, ...). `--compile-only` compiles our
two steps without running them and prints only those lines (their FLOPs and compiled memory;
the time-based figures n/a).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (bench/, the directory of this script)

from ood_jax import malloc  # noqa: E402

NUM_CLASSES = 91  # COCO's label space as DETR uses it; the model adds the "no object" logit
NUM_QUERIES = 100
MAX_BOXES = 8  # target slots per image; 3 to 6 of them real
BACKBONE_LR, LR, WEIGHT_DECAY, CLIP_NORM = 1e-5, 1e-4, 1e-4, 0.1  # DETR's recipe
BACKBONE = "resnet50"
# DetrConfig fields on top of the defaults (DETR-R50's sizes); --smoke shrinks them.
TORCH_SIZES: dict[str, Any] = {}
SMOKE_SIZES = dict(
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed runs per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    parser.add_argument("--size", type=int, default=320, help="image height and width")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true", help="time only ours")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="only compile our steps and print their FLOPs and compiled memory (no timings; "
        "implies --no-torch)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads (default: os.cpu_count()); on a loaded machine fewer "
        "threads than cores can be much faster, as one descheduled thread stalls the others",
    )
    parser.add_argument(
        "--train-stem",
        action="store_true",
        help="train the stem and the first stage too, on both sides (DETR keeps them fixed)",
    )
    parser.add_argument("--smoke", action="store_true", help="a toy DETR, 1 step: for tests")
    args = parser.parse_args()
    if args.smoke:
        global NUM_QUERIES, BACKBONE
        NUM_QUERIES, BACKBONE = 5, "resnet18"
        TORCH_SIZES.update(SMOKE_SIZES)
        args.steps, args.warmup, args.size, args.batch = 1, 1, 64, 1
    args.no_torch = args.no_torch or args.compile_only
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.size < 64:
        parser.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --size >= 64")
    if args.torch_threads < 0:
        parser.error("--torch-threads must be >= 0 (0: os.cpu_count())")
    return args


def _optim_config(train_stem: bool):
    import ml_collections

    # Constant rates: one decay far beyond the run, no warm-up.
    return ml_collections.ConfigDict(
        {
            "lr": LR,
            "backbone_lr": BACKBONE_LR,
            "backbone_pattern": r"backbone/.*",
            "frozen_pattern": "" if train_stem else r"backbone/(stem_.*|stage1_.*)",
            "weight_decay": WEIGHT_DECAY,
            "clip_norm": CLIP_NORM,
            "b1": 0.9,
            "b2": 0.999,
            "decay_epochs": (200.0,),
            "decay_factor": 0.1,
            "warmup_steps": 0,
        }
    )


# --------------------------------------------------------------------------------------------
# torch side
# --------------------------------------------------------------------------------------------


def _torch_model(args: argparse.Namespace):
    import torch
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.DetrConfig(
        use_timm_backbone=True,
        backbone=BACKBONE,
        use_pretrained_backbone=False,
        num_labels=NUM_CLASSES,
        num_queries=NUM_QUERIES,
        auxiliary_loss=True,
        **TORCH_SIZES,
    )
    model = transformers.DetrForObjectDetection(config)
    if args.train_stem:
        for p in model.parameters():
            p.requires_grad_(True)
    return model


def _torch_runner(model, inputs, args: argparse.Namespace) -> dict[str, Any]:
    """{"predict", "train"}: blocking callables; "detections" of the untrained weights."""
    import torch

    pixel_values, pixel_mask, targets = common.torch_detection_batch(inputs)
    optimizer, trainable = common.torch_adamw(model, LR, BACKBONE_LR, WEIGHT_DECAY)

    def predict():
        model.eval()
        with torch.no_grad():
            out = model(pixel_values=pixel_values, pixel_mask=pixel_mask)
            probs = out.logits.softmax(-1)[..., :-1]
            scores, classes = probs.max(-1)
        return scores, classes, out.pred_boxes

    # Before any step changes the weights.
    scores, _, pred_boxes = predict()

    def step():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss = model(pixel_values=pixel_values, pixel_mask=pixel_mask, labels=targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP_NORM)
        optimizer.step()
        return loss.detach()

    losses = []
    return {
        "predict": predict,
        "train": lambda: losses.append(step().item()),
        "losses": losses,
        "detections": {"scores": scores.numpy(), "boxes": pred_boxes.numpy()},
    }


# --------------------------------------------------------------------------------------------
# our side
# --------------------------------------------------------------------------------------------


def _our_runner(module, variables, inputs, args: argparse.Namespace) -> dict[str, Any]:
    """As `_torch_runner`, plus the compile times of both jitted functions."""
    import jax
    import jax.numpy as jnp
    import ml_collections

    from ood_jax.models import detr
    from ood_jax.train import optim, train

    images, boxes, labels, mask = inputs
    batch = {
        "image": jnp.asarray(images),
        "image_mask": jnp.ones(images.shape[:3], bool),
        "boxes": jnp.asarray(boxes),
        "labels": jnp.asarray(labels),
        "box_mask": jnp.asarray(mask),
    }
    params = variables["params"]
    optimizer, _ = optim.make_optimizer(
        _optim_config(args.train_stem), params, steps_per_epoch=1000.0
    )
    state = train.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        model_state={k: v for k, v in variables.items() if k != "params"},
        opt_state=jax.jit(optimizer.init)(params),
    )
    rng = jax.random.key(args.seed)

    start = time.perf_counter()
    predict = (
        jax.jit(functools.partial(train.predict_step, model=module)).lower(state, batch).compile()
    )
    compile_predict = time.perf_counter() - start
    detections = None if args.compile_only else jax.device_get(predict(state, batch))

    start = time.perf_counter()
    step = (
        jax.jit(
            functools.partial(
                train.train_step,
                loss_fn=detr.make_loss(ml_collections.ConfigDict(), module),
                optimizer=optimizer,
            ),
            donate_argnums=(0,),
        )
        .lower(state, batch, rng)
        .compile()
    )
    compile_train = time.perf_counter() - start

    # The train step donates the state it is given: predict has to read the current one.
    current = [state]
    losses = []

    def run_step():
        current[0], metrics = step(current[0], batch, rng)
        losses.append(float(metrics["loss"]))  # blocks until the step is done

    return {
        "predict": lambda: jax.block_until_ready(predict(current[0], batch)),
        "train": run_step,
        "losses": losses,
        "compile_train": compile_train,
        "compile_predict": compile_predict,
        "compiled_train": step,
        "compiled_predict": predict,
        "detections": detections,
    }


def _native_model(args: argparse.Namespace, dtype):
    """Our DETR-R50 with our own random init (the --no-torch path)."""
    import jax
    import jax.numpy as jnp

    from ood_jax.models import detr

    module = detr.DETR(
        num_classes=NUM_CLASSES,
        num_queries=NUM_QUERIES,
        backbone=BACKBONE,
        backbone_norm="frozen",
        backbone_frozen_stages=0 if args.train_stem else 1,
        norm_between_decoder_layers=True,  # as detr_from_hf builds transformers' aux-loss model
        dtype=dtype,
        **_smoke_native_sizes(),
    )
    images = jnp.zeros((1, args.size, args.size, 3), jnp.float32)
    variables = jax.jit(module.init)(jax.random.key(args.seed), images)
    return module, variables


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _smoke_native_sizes() -> dict[str, Any]:
    """`SMOKE_SIZES` as our module's fields, when --smoke set them."""
    if not TORCH_SIZES:
        return {}
    return dict(
        hidden_dim=TORCH_SIZES["d_model"],
        num_heads=TORCH_SIZES["encoder_attention_heads"],
        num_encoder_layers=TORCH_SIZES["encoder_layers"],
        num_decoder_layers=TORCH_SIZES["decoder_layers"],
        ffn_dim=TORCH_SIZES["encoder_ffn_dim"],
    )


def _compile_only_report(args: argparse.Namespace, ours: dict[str, Any]) -> dict[str, Any]:
    """--compile-only: prints the compiled steps' FLOPs and memory, nothing run, and returns
    them as result-line keys."""
    import jax

    device = jax.devices()[0]
    print(
        f"DETR-R50 train step and inference, compiled only (not run): batch {args.batch}, "
        f"{args.size}x{args.size}, ours in {args.dtype} on {device.platform} "
        f"({device.device_kind})"
    )
    print(
        f"  ours compile: train step {ours['compile_train']:.1f} s, "
        f"predict {ours['compile_predict']:.1f} s"
    )
    return common.device_figures(
        ours["compiled_train"], ours["compiled_predict"], None, None, args.batch, args.dtype
    )


def main() -> None:
    args = _parse_args()
    torch_threads = args.torch_threads or os.cpu_count()
    if not args.no_torch:
        # torch (and the timm/torchvision it drags in) must load before tensorflow, which
        # ood_jax.train.train imports: triton segfaults when it loads after TF.
        import timm  # noqa: F401
        import torch
        import torchvision  # noqa: F401

        torch.set_num_threads(torch_threads)

    import jax
    import jax.numpy as jnp
    import numpy as np

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    inputs = common.random_detection_input(args.seed, args.batch, args.size, MAX_BOXES, NUM_CLASSES)
    load = os.getloadavg()[0]

    runners = {}
    if args.no_torch:
        module, variables = _native_model(args, dtype)
        runners["ours"] = _our_runner(module, variables, inputs, args)
        if args.compile_only:
            figures = _compile_only_report(args, runners["ours"])
            common.result_line(
                "detr_train_step", None, None, None, "compiled only, not run",
                ours_dtype=args.dtype, batch=args.batch, size=args.size, **figures,
            )  # fmt: skip
            return
    else:
        from ood_jax.models import convert

        model = _torch_model(args)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            module, variables = convert.detr_from_hf(tmp, dtype=dtype)
        module = module.clone(backbone_frozen_stages=0 if args.train_stem else 1)
        runners["ours"] = _our_runner(module, variables, inputs, args)
        runners["torch"] = _torch_runner(model, inputs, args)
    # Inference first: the train steps change the weights. The device's peak memory is read
    # after the inference timings too, before any train step.
    times = {}
    for key in ("predict", "train"):
        fns = {name: r[key] for name, r in runners.items()}
        times[key] = common.time_alternating(fns, args.steps, args.warmup)
        if key == "predict":
            predict_device_peak = common.device_peak_bytes()
    ours, theirs = runners["ours"], runners.get("torch")

    device = jax.devices()[0]
    print(
        f"DETR-R50 train step and inference: batch {args.batch}, {args.size}x{args.size}, "
        f"{NUM_CLASSES} classes + no object, {NUM_QUERIES} queries, frozen BN, aux loss on 6 "
        f"decoder outputs{' (toy sizes: --smoke)' if args.smoke else ''}; ours in {args.dtype} "
        f"on {device.platform} ({device.device_kind})"
        + ("" if theirs is None else ", torch in float32 on CPU")
    )
    threads = "" if theirs is None else f" (torch threads {torch_threads})"
    alternating = "" if theirs is None else ", ours and torch alternating"
    print(
        f"  {os.cpu_count()} CPU cores{threads}, malloc {malloc.describe()}, load average "
        f"{load:.1f} before / {os.getloadavg()[0]:.1f} after; median [min-max] of {args.steps} runs after "
        f"{args.warmup} warm-up{alternating}"
    )
    print(
        f"  ours compile: train step {ours['compile_train']:.1f} s, "
        f"predict {ours['compile_predict']:.1f} s (not in the timings)"
    )
    if theirs is not None:
        diff = {
            k: float(np.abs(ours["detections"][k] - theirs["detections"][k]).max())
            for k in ("scores", "boxes")
        }
        frozen = "trained" if args.train_stem else "frozen"
        print(
            f"  same weights: eval max |ours - torch| scores {diff['scores']:.1e}, boxes "
            f"{diff['boxes']:.1e}; first-step loss ours {ours['losses'][0]:.4f}, torch "
            f"{theirs['losses'][0]:.4f} (dropout differs); stem and first stage {frozen} on both"
        )
    header = f"  {'':12s} {'ours (s)':>24s}"
    if theirs is not None:
        header += f" {'torch (s)':>24s} {'torch/ours':>11s}"
    print(header)
    rows = (("train", "train step"), ("predict", "inference"))
    medians = {key: {n: statistics.median(t) for n, t in times[key].items()} for key, _ in rows}
    for key, name in rows:
        row = f"  {name:12s} {common.summary(times[key]['ours']):>24s}"
        if theirs is not None:
            ratio = medians[key]["torch"] / medians[key]["ours"]
            row += f" {common.summary(times[key]['torch']):>24s} {ratio:10.2f}x"
        print(row)

    parts = []
    for key, name in rows:
        part = f"{name}: ours {medians[key]['ours']:.3f} s"
        if theirs is not None:
            ratio = medians[key]["torch"] / medians[key]["ours"]
            part += f", torch {medians[key]['torch']:.3f} s, ratio torch/ours {ratio:.2f}"
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
        smoke=args.smoke,
    )
    peer = None if theirs is None else "transformers DetrForObjectDetection (PyTorch)"
    common.result_line(
        "detr_train_step",
        medians["train"]["ours"],
        peer,
        medians["train"].get("torch"),
        common.stat_text(args.steps, args.warmup),
        unit="s per train step",
        batch=args.batch,
        size=args.size,
        ours_dtype=args.dtype,
        peer_dtype=None if theirs is None else "float32",
        predict={
            "ours_s": medians["predict"]["ours"],
            "peer_s": medians["predict"].get("torch"),
        },
        **figures,
    )


if __name__ == "__main__":
    malloc.restart_keeping_freed_memory()
    main()
