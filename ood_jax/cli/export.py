"""`ood-jax export`: a training run's checkpoint as a self-contained inference artifact."""

from __future__ import annotations

import argparse

from ood_jax.cli import help_text


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="a self-contained inference checkpoint of a training run",
        epilog=help_text.examples(
            "ood-jax export --workdir workdirs/synthetic_detr --out exported/detr",
            "ood-jax export --workdir workdirs/run --out exported/run_step20 --step 20",
            "ood-jax export --workdir workdirs/synthetic_detr --out exported/detr_stablehlo "
            "--format stablehlo",
            "ood-jax export --workdir workdirs/synthetic_detr --out exported/detr_hf "
            "--format transformers",
            "ood-jax export --workdir workdirs/counts_dino --out exported/dino_idea --format pytorch",
            "ood-jax export --workdir workdirs/counts_dino --out exported/dino_onnx --format onnx",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument(
        "--format",
        choices=("msgpack", "stablehlo", "onnx", "transformers", "pytorch"),
        default="msgpack",
        help="msgpack: one file for ood_jax.models.load_exported (default); stablehlo: a "
        "directory with the predict function as a jax.export artifact for cpu, cuda and tpu "
        "and its input contract, loadable with jax alone; onnx: a directory with the same "
        "function as an ONNX graph (opset 17) for onnxruntime and other ONNX runtimes; "
        "transformers (DETR, Deformable DETR): a directory transformers' from_pretrained loads (safetensors, config.json, "
        "preprocessor_config.json); pytorch (DINO): a directory with IDEA-Research/DINO's "
        "checkpoint.pth and the config fields it needs (dino_args.json). Every directory "
        "carries the model's card (README.md)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="with --format stablehlo or onnx: a fixed batch size (default: any, a symbolic batch)",
    )
    p.set_defaults(run=_export)


def _export(args: argparse.Namespace) -> None:
    from ood_jax.train import export

    path = export.export(
        args.workdir,
        args.out,
        step=args.step,
        file_format=args.format,
        batch_size=args.batch_size,
    )
    print(f"exported {args.workdir} -> {path}")
