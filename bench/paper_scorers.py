#!/usr/bin/env python
"""Benchmark: seconds per 1,000 images of each OODBench scorer at its published size, ours next
to transformers' PyTorch model where transformers has one.

Random weights in the published architectures (no checkpoint is downloaded; the compute is the
same): CLIP ViT-L/14 at 224 px (`openai/clip-vit-large-patch14`), BLIP-2's ITC image path, EVA
ViT-g/14 and its 12-layer Q-Former with 32 queries (`Salesforce/blip2-itm-vit-g`), GroupViT
(`nvidia/groupvit-gcc-yfcc`, transformers' GroupViTConfig defaults) and LiT-L16L's image tower
(a ViT-L/16 at 224 px with class-token pooling, which is what LiT runs per image: the text tower
runs once per category). Each transformers model is built from its config, saved with
`save_pretrained` and loaded with `ood_jax.scorers.from_hf`; the outputs are compared once.

Timed: the image features of one batch of preprocessed pixels (`scorer.image_features`, jitted,
fixed batch; PyTorch's `get_image_features` or the ITC branch's query embeddings under
`torch.no_grad()`), ours and PyTorch's alternating, median of `--steps` after `--warmup`, our
compile time apart. Seconds per 1,000 images is 1,000 / (images per second): the rate is
measured, the 1,000 images are not run. Preprocessing and decoding are not included.

    python bench/paper_scorers.py [--scorers clip,blip2,groupvit,lit] [--batch 8] [--steps 3]
        [--warmup 1] [--dtype float32|bfloat16] [--no-torch] [--smoke]

`--dtype bfloat16` runs ours in bfloat16 and PyTorch in float32 (the table and the result line
say so per side). One line per scorer, then the table of docs/guide/scorers-and-mining.md; the
last line is `common.result_line`'s: seconds per 1,000 images summed over the scorers run
(ratio PyTorch / ours), each scorer's under "scorers". `--smoke`: the same four architectures
one layer deep and 32 wide at 28-32 px, batch 2, one step, for the tests.
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

SMALL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)


def _configs(smoke: bool = False):
    """name -> (what it stands for, transformers model class name, config); with `smoke` the
    same architectures at toy sizes."""
    import transformers

    if smoke:
        return _smoke_configs(transformers)

    vit_l = dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        image_size=224,
    )  # fmt: skip
    return {
        "clip": (
            "CLIP ViT-L/14 (openai/clip-vit-large-patch14)",
            "CLIPModel",
            transformers.CLIPConfig(
                vision_config=dict(vit_l, patch_size=14, projection_dim=768),
                text_config=SMALL_TEXT,
                projection_dim=768,
            ),
        ),
        "blip2": (
            "BLIP-2 ITC, EVA ViT-g/14 + Q-Former (Salesforce/blip2-itm-vit-g)",
            "Blip2ForImageTextRetrieval",
            # Blip2VisionConfig's defaults are ViT-g/14 at 224 px; the Q-Former's are BERT-base
            # with cross-attention every other layer.
            transformers.Blip2Config(
                qformer_config=dict(use_qformer_text_input=True), num_query_tokens=32
            ),
        ),
        "groupvit": (
            "GroupViT (nvidia/groupvit-gcc-yfcc)",
            "GroupViTModel",
            transformers.GroupViTConfig(text_config=SMALL_TEXT),
        ),
        "lit": (
            "LiT-L16L's image tower, ViT-L/16 with class-token pooling",
            "CLIPModel",
            transformers.CLIPConfig(
                vision_config=dict(vit_l, patch_size=16, projection_dim=1024),
                text_config=SMALL_TEXT,
                projection_dim=1024,
            ),
        ),
    }


def _smoke_configs(transformers):
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    clip = dict(tiny, image_size=32, patch_size=16, projection_dim=16)
    return {
        "clip": ("tiny CLIP", "CLIPModel", transformers.CLIPConfig(
            vision_config=clip, text_config=SMALL_TEXT, projection_dim=16)),
        "blip2": ("tiny BLIP-2 ITC", "Blip2ForImageTextRetrieval", transformers.Blip2Config(
            vision_config=dict(tiny, image_size=28, patch_size=14),
            qformer_config=dict(tiny, num_hidden_layers=2, encoder_hidden_size=32,
                                use_qformer_text_input=True),
            num_query_tokens=4, image_text_hidden_size=16)),
        "groupvit": ("tiny GroupViT", "GroupViTModel", transformers.GroupViTConfig(
            vision_config=dict(
                hidden_size=32, intermediate_size=64, num_attention_heads=2, depths=[1, 1, 1],
                num_hidden_layers=3,
                num_group_tokens=[4, 2, 0], num_output_groups=[4, 2, 2], image_size=32,
                patch_size=16),
            text_config=SMALL_TEXT, projection_dim=16, projection_intermediate_dim=32)),
        "lit": ("tiny LiT image tower", "CLIPModel", transformers.CLIPConfig(
            vision_config=clip, text_config=SMALL_TEXT, projection_dim=16)),
    }  # fmt: skip


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scorers", default="clip,blip2,groupvit,lit")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed runs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--no-torch", action="store_true", help="time only ours")
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="torch intra-op threads (0: os.cpu_count())"
    )
    parser.add_argument("--smoke", action="store_true", help="toy sizes, 1 step: for the tests")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps, args.warmup = 2, 1, 1
    unknown = set(args.scorers.split(",")) - set(_configs())
    if unknown:
        parser.error(f"unknown scorers {sorted(unknown)}; known: {', '.join(_configs())}")
    if min(args.batch, args.steps) < 1 or args.warmup < 0:
        parser.error("need --batch, --steps >= 1 and --warmup >= 0")
    return args


def _torch_fn(name, model, nchw):
    import torch

    if name == "blip2":
        ids = torch.zeros((1, 4), dtype=torch.long)

        def blip2_queries():
            with torch.no_grad():
                return model(pixel_values=nchw, input_ids=ids).image_embeds

        return blip2_queries

    def features():
        with torch.no_grad():
            out = model.get_image_features(pixel_values=nchw)
            return getattr(out, "pooler_output", out)

    return features


def _measure(name: str, args: argparse.Namespace) -> tuple[str, dict, float | None]:
    """(what it stands for, seconds per 1,000 images by implementation, our speed ratio)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from ood_jax import scorers

    what, cls, config = _configs(args.smoke)[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).eval()
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        scorer = scorers.from_hf(tmp, dtype=dtype, batch_size=args.batch)
    pixels = np.random.default_rng(0).standard_normal(
        (args.batch, *scorer.image_size, 3), np.float32
    )
    start = time.perf_counter()
    ours = scorer.image_features(pixels)
    compile_s = time.perf_counter() - start
    fns = {"ours": lambda: scorer.image_features(pixels)}
    diff = ""
    if not args.no_torch:
        nchw = torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy())
        fns["torch"] = _torch_fn(name, model, nchw)
        theirs = fns["torch"]().numpy()
        if name == "blip2":  # the ITC branch returns normalized query embeddings
            ours = ours / np.linalg.norm(ours, axis=-1, keepdims=True)
        diff = f", max |diff| {float(np.abs(ours - theirs).max()):.1e}"
    times = common.time_alternating(fns, args.steps, args.warmup)
    per_1000 = {k: 1000 * statistics.median(t) / args.batch for k, t in times.items()}
    ratio = per_1000["torch"] / per_1000["ours"] if "torch" in per_1000 else None
    line = f"{name:9s} {what}: ours {per_1000['ours']:8.1f} s / 1,000 images"
    if ratio is not None:
        line += f", torch {per_1000['torch']:8.1f} s (ours {ratio:.2f}x){diff}"
    print(f"{line}; compile {compile_s:.1f} s", flush=True)
    return name, what, per_1000, ratio


def main() -> None:
    args = _parse_args()
    # torch before anything that may pull in TensorFlow (triton crashes after TF's libraries).
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads or os.cpu_count())
    transformers.utils.logging.disable_progress_bar()
    for name in args.scorers.split(","):  # transformers imports its model modules lazily
        getattr(transformers, _configs(args.smoke)[name][1])

    rows = [_measure(name, args) for name in args.scorers.split(",")]
    torch_dtype = "" if args.no_torch else " (float32)"
    print(
        f"\n| scorer | s / 1,000 images, ours ({args.dtype}) | PyTorch{torch_dtype} "
        "| ours / PyTorch speed |"
    )
    print("|---|---|---|---|")
    for _, what, per_1000, ratio in rows:
        torch_s = f"{per_1000['torch']:.0f}" if "torch" in per_1000 else "-"
        speed = f"{ratio:.2f}x" if ratio is not None else "-"
        print(f"| {what} | {per_1000['ours']:.0f} | {torch_s} | {speed} |")
    print(f"\n(batch {args.batch}, {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f})")
    ours_s = sum(per_1000["ours"] for _, _, per_1000, _ in rows)
    peer_s = None if args.no_torch else sum(per_1000["torch"] for _, _, per_1000, _ in rows)
    common.result_line(
        "paper_scorers",
        ours_s,
        None if args.no_torch else "transformers (PyTorch)",
        peer_s,
        common.stat_text(args.steps, args.warmup),
        unit="s per 1,000 images, summed over the scorers",
        batch=args.batch,
        ours_dtype=args.dtype,
        peer_dtype=None if args.no_torch else "float32",
        scorers={
            name: {
                "ours_s": per_1000["ours"],
                "peer_s": per_1000.get("torch"),
                "ratio": None if ratio is None else round(ratio, 4),
            }
            for name, _, per_1000, ratio in rows
        },
    )


if __name__ == "__main__":
    malloc.restart_keeping_freed_memory()
    main()
