#!/usr/bin/env python
"""Benchmark: onnxruntime's CPU inference of our ONNX export next to our jitted predict.

Each model is exported with `ood_jax.models.onnx_export.write_onnx` (symbolic batch,
parameters as initializers), loaded in an `onnxruntime.InferenceSession` (CPU execution
provider, `--optimization` (default all), `--threads` intra-op threads: default every core)
and run on the same canvases as our `ExportedModel.predict_canvas` (jitted; inputs already on the
device, as the graph's are numpy arrays). Models, random weights of the right shapes:

  * detr_r50: DETR-R50 (d_model 256, 8 heads, 6 + 6 layers, FFN 2048, 100 queries, 91 classes,
    frozen BatchNorm); softmax post-processing.
  * dino_r50: DINO-4scale R50 (6 + 6 layers, FFN 2048, 4 levels x 4 points, 900 queries, 91
    classes); top-300 post-processing.

Inputs: `--batch` canvases of `--size` x `--size` holding random normalized images, the first
on 3/4 of the canvas height (its mask padded, as a landscape photo lies on the canvas), the next
on the whole canvas, alternating. The conversion, session creation and our compile times are
printed, then the largest |difference| of scores and boxes and the share of equal labels
(top-k slots whose score is within 1e-4 of a neighbour's may hold either detection, so they
are left out of the boxes and labels; random weights pack DINO's top 300 that close), then the
timings: median [min-max] seconds per batch of `--steps` runs after `--warmup`, ours and
onnxruntime alternating (`common.time_alternating`) so a change in the machine's load weighs on
both.

    python bench/onnx_inference.py [--models detr_r50,dino_r50] [--size 512] [--batch 1]
                                   [--steps 3] [--warmup 1] [--threads T]
                                   [--optimization basic|extended|all] [--smoke]

`--smoke` runs tiny models (a ResNet of one block per stage at an eighth of the width, 1 + 2
layers, d_model 32) at 64 x 64, to check the script end to end in seconds. The last line is the
result line (`common.result_line`): the first model's figures as the headline, every model's
under "models" ({"name", "ours_s", "peer": "onnxruntime", "peer_s", "ratio"}); ratio =
onnxruntime seconds / ours (above 1: ours faster).

Measured at the defaults (512x512, batch 1, 2 cores, load average 0.8, onnxruntime 1.32.0,
jax 0.10.2, 2026-12-07): detr_r50 ours 0.587 s, onnxruntime 0.456 s (ratio 0.78), scores
within 4.8e-7; dino_r50 ours 2.483 s, onnxruntime 3.130 s (ratio 1.26), scores within 7.6e-5.
Conversion takes 13.8 s and 91.7 s; on this shared machine a busy neighbour moves the figures by
up to 2x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (bench/, the directory of this script)

from ood_jax import malloc  # noqa: E402

NUM_CLASSES = 91
MODELS = {
    "detr_r50": ("detr", dict(num_classes=NUM_CLASSES, backbone="resnet50", dropout=0.0)),
    "dino_r50": ("dino", dict(num_classes=NUM_CLASSES, backbone="resnet50")),
}

# --optimization -> onnxruntime.GraphOptimizationLevel
OPTIMIZATION = {
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
TIE = 1e-4


def _smoke_args(family: str) -> dict:
    from ood_jax.models import resnet

    tiny = dict(
        num_classes=5,
        hidden_dim=32,
        num_heads=4,
        num_encoder_layers=1,
        num_decoder_layers=2,
        ffn_dim=64,
        dropout=0.0,
        backbone=resnet.ResNet(
            stage_sizes=(1, 1, 1, 1), block="basic", planes=(8, 16, 32, 64), stem_width=8
        ),
    )
    if family == "dino":
        tiny.update(num_queries=20, encoder_points=2, decoder_points=2)
    return tiny


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {sorted(MODELS)}"
    )
    parser.add_argument("--size", type=int, default=512, help="canvas side")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed runs per model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    parser.add_argument(
        "--threads", type=int, default=0, help="onnxruntime intra-op threads (0: all cores)"
    )
    parser.add_argument(
        "--optimization",
        choices=sorted(OPTIMIZATION),
        default="all",
        help="onnxruntime graph optimization level",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny models at 64x64")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        parser.error(f"--models {unknown or 'none'}: choose from {sorted(MODELS)}")
    if args.smoke:
        args.size = 64
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.size < 64:
        parser.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --size >= 64")
    return args


def _canvases(args: argparse.Namespace):
    """Images [B, S, S, 3] (zero outside each image) and masks [B, S, S]."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    side = args.size
    images = np.zeros((args.batch, side, side, 3), np.float32)
    mask = np.zeros((args.batch, side, side), bool)
    for i in range(args.batch):
        height = side * 3 // 4 if i % 2 == 0 else side
        images[i, :height] = rng.standard_normal((height, side, 3))
        mask[i, :height] = True
    return images, mask


def _run_model(name: str, args: argparse.Namespace, images, mask, out_dir: str) -> dict:
    import jax
    import jax.numpy as jnp
    import ml_collections
    import numpy as np
    import onnxruntime as ort

    from ood_jax.models import exported, onnx_export, registry
    from ood_jax.testing.random_variables import random_variables

    family, model_args = MODELS[name]
    if args.smoke:
        model_args = _smoke_args(family)
    module = registry.build_model(ml_collections.ConfigDict({"name": family, "args": model_args}))
    model = exported.ExportedModel(
        module,
        random_variables(module, images[:1], mask[:1]),
        None,
        {
            "image_size": args.size,
            "eval_size": args.size,
            "max_size": args.size,
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
        },
        step=0,
        model_name=name,
    )

    start = time.perf_counter()
    path = onnx_export.write_onnx(model, os.path.join(out_dir, name))
    convert_s = time.perf_counter() - start
    graph_file = path / onnx_export.ONNX_FILE
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads or os.cpu_count()
    options.graph_optimization_level = getattr(
        ort.GraphOptimizationLevel, OPTIMIZATION[args.optimization]
    )
    start = time.perf_counter()
    session = ort.InferenceSession(str(graph_file), options, providers=["CPUExecutionProvider"])
    session_s = time.perf_counter() - start

    device_images, device_mask = jnp.asarray(images), jnp.asarray(mask)
    start = time.perf_counter()
    ours = jax.device_get(model.predict_canvas(device_images, device_mask))
    compile_s = time.perf_counter() - start
    feed = {"images": images, "mask": mask}
    theirs = dict(zip(onnx_export.OUTPUT_NAMES, session.run(None, feed)))
    print(
        f"{name}: {graph_file.stat().st_size / 1e6:.0f} MB graph; conversion {convert_s:.1f} s, "
        f"session {session_s:.1f} s, our first call (compile + run) {compile_s:.1f} s"
    )
    # Top-k detections come sorted by score: slots whose score is within TIE of a neighbour's
    # may hold the other detection on either side (their boxes then differ wholly).
    ranked = bool(np.all(np.diff(ours["scores"], axis=-1) <= 0))
    gaps = np.abs(np.diff(ours["scores"], axis=-1)) <= TIE
    tied = np.zeros(ours["scores"].shape, bool)
    if ranked:
        tied[:, 1:] |= gaps
        tied[:, :-1] |= gaps
    box_diff = np.abs(theirs["boxes"] - ours["boxes"]).max(-1)
    print(
        f"  max |onnxruntime - ours| scores {np.abs(theirs['scores'] - ours['scores']).max():.1e}"
        f", boxes {box_diff[~tied].max():.1e} ({tied.sum()} of {tied.size} slots left out: "
        f"score within {TIE:g} of a neighbour's); labels equal "
        f"{100 * (theirs['labels'] == ours['labels'])[~tied].mean():.1f}% of the others"
    )

    times = common.time_alternating(
        {
            "ours": lambda: jax.block_until_ready(model.predict_canvas(device_images, device_mask)),
            "onnxruntime": lambda: session.run(None, feed),
        },
        args.steps,
        args.warmup,
    )
    for runner, t in times.items():
        print(f"  {runner:12s} {common.summary(t)} s per batch of {args.batch}")
    ours_s, peer_s = (statistics.median(times[k]) for k in ("ours", "onnxruntime"))
    return {
        "name": name,
        "ours_s": round(ours_s, 4),
        "peer": "onnxruntime",
        "peer_s": round(peer_s, 4),
        "ratio": round(peer_s / ours_s, 2),
    }


def main() -> None:
    args = _parse_args()
    import jax
    import onnxruntime as ort

    images, mask = _canvases(args)
    threads = args.threads or os.cpu_count()
    print(
        f"ONNX export vs ours, CPU inference: {args.size}x{args.size} canvases, batch "
        f"{args.batch}{' (smoke)' if args.smoke else ''}; jax {jax.__version__}, onnxruntime "
        f"{ort.__version__} ({threads} intra-op threads, optimization {args.optimization}), "
        f"{os.cpu_count()} CPU cores, load "
        f"average {os.getloadavg()[0]:.1f}; median [min-max] of {args.steps} after "
        f"{args.warmup} warm-up, alternating"
    )
    results = []
    with tempfile.TemporaryDirectory() as out_dir:
        for name in args.models:
            results.append(_run_model(name, args, images, mask, out_dir))
    # The headline is the first model's; every model's figures go with it.
    head = results[0]
    common.result_line(
        "onnx_inference",
        head["ours_s"],
        "onnxruntime",
        head["peer_s"],
        common.stat_text(args.steps, args.warmup),
        headline=head["name"],
        models=results,
        size=args.size,
        batch=args.batch,
        smoke=args.smoke,
    )


if __name__ == "__main__":
    malloc.restart_keeping_freed_memory()
    main()
