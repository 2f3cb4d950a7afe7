#!/usr/bin/env python
"""Benchmark: our jitted CLIP ViT-B/16 image tower next to transformers' PyTorch CLIP, and the
share of a mining pass spent outside the encoder.

One process, one device, the same weights: a transformers `CLIPModel` with a ViT-B/16 vision
config (224px, patch 16, width 768, 12 layers, quick GELU, random init; a one-layer text tower,
which is not timed) is saved with `save_pretrained` and loaded with `ood_jax.scorers.from_hf`.
Their image features are compared once.

  * throughput: images/s of `scorer.image_features` (jitted, fixed batch) and of
    `CLIPModel.get_image_features` under `torch.no_grad()` (its default attention), on one
    batch of preprocessed pixels (default 32), ours and torch alternating; median of `--steps`
    runs after `--warmup`, our compile time reported apart.
  * mining pass: `--mining-images` uint8 images of typical dataset sizes (375x500 to 480x640,
    already decoded) through `scorer.encode_images` (resize, crop and normalize in a thread pool
    overlapping the device, then the encoder), then FOCI's hard-choice mining top-k
    (`ood_jax.mining.foci.mine_options` when importable, else a cosine top-k here) over
    `--classes` text embeddings. Timed next to the encoder alone on the same images already
    preprocessed; the difference, as a share of the pass, is the cost of everything but the
    encoder. On a shared machine that difference is noisy, so the share is also bounded from the
    parts timed alone (preprocessing on one thread, no overlap, plus the top-k). Text encoding
    (once per dataset) and image decoding (the data loader's) are left out.

    python bench/scorer_throughput.py [--batch 32] [--steps 3] [--warmup 1]
        [--mining-images 64] [--mining-steps 2] [--classes 1000] [--torch-threads T]
        [--dtype float32|bfloat16] [--no-torch] [--smoke]

Distance from the limit: a "device figures: image_features step" line (`common.step_figures`)
gives the GFLOP of our jitted step from XLA's cost analysis, its achieved TFLOP/s and MFU against
`common.mfu_peak` (the datasheet's peak on an accelerator; on CPU a 4096^2 `jnp.dot` in the same
dtype timed in the same run), and torch's TFLOP/s is that same FLOP count over its time.

`--dtype bfloat16` runs ours in bfloat16 and torch in float32 (the header and the result line
say so per side). The summary line gives both throughputs, their ratio, and the mining overhead;
the last line is `common.result_line`'s (seconds per batch, ratio torch / ours; `ours_tflops`,
`ours_mfu` as a fraction, `peer_tflops`, `peak_tflops`, `peak_source`). `--smoke`: a
one-layer 32-wide tower at 32 px and a couple of images, for the tests.
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

# Sizes (h, w) of typical photos in ImageNet / COCO, the datasets the papers mine.
PHOTO_SIZES = [(375, 500), (480, 640), (333, 500), (500, 375), (427, 640), (480, 480)]


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed throughput runs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    parser.add_argument("--mining-images", type=int, default=64)
    parser.add_argument("--mining-steps", type=int, default=2, help="timed mining passes")
    parser.add_argument("--classes", type=int, default=1000, help="text embeddings to mine over")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-torch", action="store_true", help="time only ours (torch still makes the weights)"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="torch intra-op threads (0: os.cpu_count())"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny tower, 1 step: for tests")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps, args.warmup = 2, 1, 1
        args.mining_images, args.mining_steps, args.classes = 2, 1, 4
    if min(args.batch, args.steps, args.mining_images, args.mining_steps) < 1 or args.warmup < 0:
        parser.error("need --batch, --steps, --mining-images, --mining-steps >= 1, --warmup >= 0")
    if args.classes < 4:
        parser.error("--classes must be >= 4 (FOCI's four options)")
    return args


def _clip_config(smoke: bool = False):
    import transformers

    vision = dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=16,
    )
    if smoke:
        vision.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, image_size=32)
        vision.update(num_attention_heads=2)
    return transformers.CLIPConfig(
        vision_config=vision,
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2
        ),
        projection_dim=32 if smoke else 512,
    )


def _mining_topk():
    """(name, fn(image_embeds, text_embeds, labels) -> options) for the mining step."""
    try:
        from ood_jax.mining.foci import mine_options

        return "ood_jax.mining.foci.mine_options", mine_options
    except ImportError:
        import jax
        import jax.numpy as jnp
        import numpy as np

        @jax.jit
        def hardest(images, texts, labels):
            sims = images @ texts.T
            sims = sims.at[jnp.arange(len(labels)), labels].set(-jnp.inf)
            return jax.lax.top_k(sims, 3)[1]

        def mine(images, texts, labels):
            negatives = np.asarray(hardest(images, texts, labels))
            return np.concatenate([labels[:, None], negatives[:, ::-1]], axis=1)

        return "inline cosine top-k", mine


def main() -> None:
    args = _parse_args()
    # torch, and the triton its compiler loads, before anything that may pull in TensorFlow
    # (ood_jax.scorers does): triton crashes when its library loads after TF's.
    import torch
    import torch._dynamo  # noqa: F401
    import transformers

    torch_threads = args.torch_threads or os.cpu_count()
    torch.set_num_threads(torch_threads)
    transformers.utils.logging.disable_progress_bar()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ood_jax import scorers

    load_before = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    model = transformers.CLIPModel(_clip_config(args.smoke)).eval()
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        scorer = scorers.from_hf(tmp, dtype=dtype, batch_size=args.batch)

    # ---------------------------------------------------------------- throughput
    pixels = rng.standard_normal((args.batch, *scorer.image_size, 3), np.float32)
    start = time.perf_counter()
    ours_features = scorer.image_features(pixels)
    compile_s = time.perf_counter() - start
    compiled = scorer.compiled_image_features(args.batch)  # for XLA's FLOP count
    fns = {"ours": lambda: scorer.image_features(pixels)}
    if not args.no_torch:
        nchw = torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy())

        def torch_features():
            with torch.no_grad():
                return model.get_image_features(pixel_values=nchw).pooler_output

        diff = float(np.abs(ours_features - torch_features().numpy()).max())
        fns["torch"] = torch_features
    times = common.time_alternating(fns, args.steps, args.warmup)
    median = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: args.batch / seconds for name, seconds in median.items()}
    device_peak = common.device_peak_bytes()

    # ---------------------------------------------------------------- mining pass
    sizes = [PHOTO_SIZES[i % len(PHOTO_SIZES)] for i in range(args.mining_images)]
    images = [rng.integers(0, 256, (*s, 3), dtype=np.uint8) for s in sizes]
    texts = rng.standard_normal((args.classes, scorer.dim)).astype(np.float32)
    texts /= np.linalg.norm(texts, axis=-1, keepdims=True)
    labels = rng.integers(0, args.classes, args.mining_images)
    topk_name, topk = _mining_topk()

    start = time.perf_counter()
    prepped = np.stack([scorer.preprocess(image) for image in images])
    preprocess_s = (time.perf_counter() - start) / len(images)
    # Compile the normalized variant and the top-k (for these shapes) before timing.
    scorer.encode_images(images[: args.batch])
    topk(texts[rng.integers(0, args.classes, len(labels))], texts, labels)

    topk_times = []

    def mining_pass():
        embeds = scorer.encode_images(images)
        start = time.perf_counter()
        topk(embeds, texts, labels)
        topk_times.append(time.perf_counter() - start)

    mining = common.time_alternating(
        {"pass": mining_pass, "encoder": lambda: scorer.image_features(prepped)},
        args.mining_steps,
        0,
    )
    pass_s, encoder_s = (statistics.median(mining[k]) for k in ("pass", "encoder"))
    overhead = max(pass_s - encoder_s, 0.0) / pass_s
    # The same share from the parts timed on their own, preprocessing on one thread and not
    # overlapped with the device: an upper bound that the machine's load hardly moves.
    serial_s = preprocess_s * len(images) + statistics.median(topk_times)
    serial_share = serial_s / (encoder_s + serial_s)

    # ---------------------------------------------------------------- report
    device = jax.devices()[0]
    tower = "tiny CLIP tower (--smoke), 32px" if args.smoke else "CLIP ViT-B/16 image tower, 224px"
    print(
        f"{tower}, batch {args.batch}; ours in {args.dtype} on {device.platform} "
        f"({device.device_kind}), torch in float32 on CPU ({torch_threads} threads, "
        f"{model.config._attn_implementation} attention)"
    )
    print(
        f"  {os.cpu_count()} CPU cores, load average {load_before:.1f} before / "
        f"{os.getloadavg()[0]:.1f} after (shared machine: figures move with the load); median "
        f"[min-max] of {args.steps} runs after {args.warmup} warm-up, ours and torch alternating"
    )
    print(f"  ours first call (compile + run) {compile_s:.1f} s, not in the timings")
    if not args.no_torch:
        print(f"  same weights: max |ours - torch| image features {diff:.1e}")
    for name, t in times.items():
        print(
            f"  {name:6s} {statistics.median(t):7.3f} s [{min(t):.3f}-{max(t):.3f}] per batch: "
            f"{rate[name]:6.2f} images/s"
        )
    # The peak is taken here, after the mining pass: on a CPU a matmul timed in this run.
    peak = common.mfu_peak(args.dtype, args.smoke)
    ours = common.step_figures(
        "image_features",
        compiled,
        median["ours"],
        args.batch,
        peak,
        device_peak,
        "after throughput",
    )
    peer_tflops = None
    if not args.no_torch:
        peer_tflops = ours["gflop"] / 1e3 / median["torch"]
        print(
            f"  torch: {peer_tflops:.3f} TFLOP/s (our step's XLA FLOP count over torch's median "
            "time: the same model and batch, not torch's own count)"
        )
    print(
        f"  mining pass over {args.mining_images} decoded photos ({sizes[0][0]}x{sizes[0][1]} to "
        f"480x640) and {args.classes} classes, {topk_name}: median of {args.mining_steps}"
    )
    print(
        f"    encode_images + top-k {pass_s:.3f} s, encoder alone {encoder_s:.3f} s, top-k "
        f"{statistics.median(topk_times) * 1e3:.1f} ms, preprocessing {preprocess_s * 1e3:.1f} "
        f"ms/image on one thread"
    )
    summary = f"ours {rate['ours']:.2f} images/s"
    if not args.no_torch:
        summary += (
            f", torch {rate['torch']:.2f} images/s, ours/torch {rate['ours'] / rate['torch']:.2f}"
        )
    print(
        f"{summary}; mining time outside the encoder: measured {100 * overhead:.1f}% "
        f"(pass - encoder alone), at most {100 * serial_share:.1f}% (preprocessing + top-k, serial)"
    )
    common.result_line(
        "scorer_throughput",
        median["ours"],
        None if args.no_torch else "transformers CLIPModel.get_image_features (PyTorch)",
        median.get("torch"),
        common.stat_text(args.steps, args.warmup),
        unit="s per batch",
        batch=args.batch,
        ours_dtype=args.dtype,
        peer_dtype=None if args.no_torch else "float32",
        ours_images_per_s=rate["ours"],
        peer_images_per_s=rate.get("torch"),
        mining_overhead=overhead,
        mining_overhead_bound=serial_share,
        ours_gflop=ours["gflop"],
        ours_tflops=ours["tflops"],
        ours_mfu=ours["mfu"],
        peer_tflops=peer_tflops,
        peak_tflops=peak["tflops"],
        peak_source=peak["source"],
    )


if __name__ == "__main__":
    malloc.restart_keeping_freed_memory()
    main()
