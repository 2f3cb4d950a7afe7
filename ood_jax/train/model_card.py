"""README.md of an exported model directory: what the model is and where its numbers came from.

Read from the workdir it was exported from: the config saved with the checkpoint, results.json
(when it is the exported step's), evaluations.json (otherwise) and manifest.json (the code,
dataset build and checkpoint digests).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

from ood_jax import manifest
from ood_jax.detection import evaluation
from ood_jax.train import selection

CARD_FILE = "README.md"


def _results_section(workdir: pathlib.Path, step: int, model_name: str) -> list[str]:
    path = workdir / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else None
    if results is not None and results.get("step") == step:
        return [evaluation.results_markdown(results, model_name).rstrip()]
    record = next((r for r in selection.read_evaluations(workdir) if r["step"] == step), None)
    if record is None:
        return [f"Not evaluated at step {step} (`ood-jax evaluate` measures it)."]
    domains = list(record["per_domain"])
    header = ["IID mAP", *[d.capitalize() for d in domains], "Avg"]
    cells = [record["iid"]["AP"], *[record["per_domain"][d]["AP"] for d in domains]]
    cells.append(record["ood_average"]["AP"])
    return [
        f"Evaluated at step {step} during training (COCO mAP@[.5:.95], no intervals: "
        "`ood-jax evaluate --step` adds them):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        "| " + " | ".join(f"{value:.3f}" for value in cells) + " |",
    ]


def _provenance(workdir: pathlib.Path) -> list[str]:
    run = manifest.read(workdir / manifest.MANIFEST_FILE)
    if run is None:
        return [f"{workdir} has no {manifest.MANIFEST_FILE}."]
    dataset, checkpoint = run.get("dataset") or {}, run.get("checkpoint") or {}
    code = run.get("ood_jax") or {}
    git = code.get("git") or {}
    rows = [
        ("ood-jax", f"{code.get('version')} {git.get('commit') or ''}".strip()),
        ("config sha256", (run.get("config") or {}).get("sha256")),
        ("dataset", "/".join(str(dataset.get(k)) for k in ("name", "config", "version"))),
        ("dataset build sha256", (dataset.get("digest") or {}).get("sha256")),
        ("checkpoint evaluated", checkpoint.get("step")),
        ("checkpoint sha256", (checkpoint.get("digest") or {}).get("sha256")),
    ]
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]


def model_card(
    workdir: str | pathlib.Path, config: Mapping[str, Any], step: int, file_format: str
) -> str:
    """The card of `workdir`'s checkpoint `step`, exported as `file_format`."""
    workdir = pathlib.Path(workdir).absolute()
    model, args = config["model"], config["model"]["args"]
    name = config.get("model_name") or model["name"]
    backbone = args.get("backbone", "resnet50")
    lines = [
        f"# {name}",
        "",
        f"A {model['name']} detector with a {backbone} backbone"
        f"{' (dilated last stage)' if args.get('dilation') else ''}, trained with ood-jax on "
        f"{config['dataset']['name']} (held-out domains: "
        f"{', '.join(config['dataset']['target_domains'])}), exported as {file_format} from "
        f"step {step} of {workdir}.",
        "",
        "## Results",
        "",
        *_results_section(workdir, step, name),
        "",
        "## Where it came from",
        "",
        *_provenance(workdir),
        "",
        "## Training config",
        "",
        "```json",
        json.dumps(config, indent=2, sort_keys=True, default=str),
        "```",
    ]
    return "\n".join(lines) + "\n"
