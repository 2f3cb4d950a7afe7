"""A detector's COCO AP under corruption: clean, per corruption and severity, mPC and rPC.

The splits a run evaluates (in-domain "iid" and each held-out domain) are unions of source
splits ("test_sky+test_water_sky"); on a corrupted dataset (`tfds_builders/corrupted`) the same
union of `{split}__clean` is the clean reference and that of `{split}__{c}_{s}` the images
under corruption c at severity s (`corrupted_expression`). Each is evaluated as
`ood-jax evaluate` evaluates a split (`evaluation.evaluate_split`), against the clean split's
ground truth, read once: the corruptions move no box. `metrics.robustness` turns the APs into
mPC and rPC.

`write` puts in the run directory corruptions.json (the in-domain split, or the first one
evaluated when it was not; every split in corruptions/{split}.json, `metrics.robustness`), results_corruptions.md (a table laid out like
COUNTS' Table 2: one row per split with clean AP, mPC and rPC, then AP per corruption, mean
over severities) and corruptions_severity.png (AP against severity, mean over corruptions,
one line per split).
"""

from __future__ import annotations

import io
import pathlib
from collections.abc import Callable, Mapping

import jax
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from ood_jax import files
from ood_jax.data import corrupted
from ood_jax.detection import evaluation
from ood_jax.metrics import robustness

HEADLINE = "iid"
MARKDOWN = "results_corruptions.md"
PLOT = "corruptions_severity.png"


def corrupted_expression(
    expression: str, corruption: str | None = None, severity: int | None = None
) -> str:
    """A split expression over source splits, as the corrupted dataset's splits of the same
    images, clean or under `corruption` at `severity`."""
    return "+".join(
        corrupted.split_name(split, corruption, severity) for split in expression.split("+")
    )


def grid(builder: tfds.core.DatasetBuilder) -> dict[str, tuple[int, ...]]:
    """corruption -> severities a corrupted dataset holds, in ImageNet-C's order."""
    found: dict[str, set[int]] = {}
    for name in builder.info.splits:
        split = corrupted.parse_split_name(name)
        if split is not None and split.corruption is not None:
            found.setdefault(split.corruption, set()).add(split.severity)
    return {name: tuple(sorted(levels)) for name, levels in found.items()}


def covered(
    builder: tfds.core.DatasetBuilder, splits: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The evaluated splits whose every corrupted split is in `builder`, and, for the others,
    the splits they lack."""
    available = set(builder.info.splits)
    kept, missing = {}, {}
    for name, expression in splits.items():
        wanted = [corrupted_expression(expression)] + [
            corrupted_expression(expression, c, s)
            for c, levels in grid(builder).items()
            for s in levels
        ]
        lacking = sorted({s for w in wanted for s in w.split("+")} - available)
        if lacking:
            missing[name] = lacking
        else:
            kept[name] = expression
    return kept, missing


def evaluate(
    predict: Callable[[dict[str, jax.Array]], dict[str, jax.Array]],
    builder: tfds.core.DatasetBuilder,
    splits: Mapping[str, str],
    input_config: ml_collections.ConfigDict,
    data_sharding: jax.sharding.NamedSharding,
) -> dict[str, dict]:
    """{evaluated split: its corruptions.json summary} of `predict` on the corrupted dataset
    `builder`, for `splits` (name -> expression over source splits), all in `builder`."""
    levels = grid(builder)
    if not levels:
        raise ValueError(f"{builder.name}/{builder.builder_config.name}: no corrupted splits")
    summaries = {}
    for name, expression in splits.items():
        clean_split = corrupted_expression(expression)
        ground_truth = evaluation.coco_ground_truth(builder, clean_split)

        def ap(split: str, what: str, ground_truth=ground_truth) -> float:
            batches = evaluation.split_batches(builder, split, input_config, data_sharding)
            result = evaluation.evaluate_split(
                predict, evaluation.EvalSplit(ground_truth, batches), data_sharding, name=what
            )
            return result.stats[robustness.METRIC]

        clean = ap(clean_split, f"{name} clean")
        scores = {
            c: {s: ap(corrupted_expression(expression, c, s), f"{name} {c} {s}") for s in sev}
            for c, sev in levels.items()
        }
        summaries[name] = robustness.summary(clean, scores)
    return summaries


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def results_markdown(
    summaries: Mapping[str, dict], model_name: str, dataset: str, headline: str
) -> str:
    """results_corruptions.md: clean AP, mPC and rPC per evaluated split, then AP per
    corruption (mean over its severities)."""
    names = list(summaries)
    first = summaries[names[0]]
    corruption_names = list(first["scores"])
    severities = ", ".join(first["scores"][corruption_names[0]])
    lines = [
        f"{model_name} on {dataset}: COCO AP clean and under {len(corruption_names)} "
        f"corruptions at severities {severities}; mPC is the mean AP over them, rPC = mPC / "
        f"clean AP (Michaelis et al., 2019). corruptions.json holds {headline}.",
        "",
        "| Split | clean AP | mPC | rPC |",
        "|---|---|---|---|",
        *(
            f"| {n} | {s['clean']:.3f} | {s['mPC']:.3f} | {_ratio(s['rPC'])} |"
            for n, s in summaries.items()
        ),
        "",
        "AP per corruption, mean over severities:",
        "",
        "| Corruption | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for c in corruption_names:
        means = [np.mean(list(summaries[n]["scores"][c].values())) for n in names]
        lines.append(f"| {c} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines) + "\n"


def severity_figure(summaries: Mapping[str, dict]):
    """AP against severity (0: clean), the mean over corruptions, one line per split."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5), dpi=100)
    for name, s in summaries.items():
        levels = sorted({int(v) for by_severity in s["scores"].values() for v in by_severity})
        means = [np.mean([by[str(v)] for by in s["scores"].values()]) for v in levels]
        ax.plot([0, *levels], [s["clean"], *means], marker="o", label=name)
    ax.set_xlabel("severity (0: clean)")
    ax.set_ylabel("COCO AP, mean over corruptions")
    ax.set_xticks(range(6))
    ax.set_title("AP against corruption severity")
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def write(
    run_dir: str | pathlib.Path, summaries: Mapping[str, dict], model_name: str, dataset: str
) -> None:
    """corruptions.json (and corruptions/), results_corruptions.md, corruptions_severity.png."""
    from matplotlib import pyplot as plt

    run_dir = pathlib.Path(run_dir)
    headline = HEADLINE if HEADLINE in summaries else next(iter(summaries))
    robustness.write(run_dir, summaries, headline)
    files.write_atomic(
        run_dir / MARKDOWN, results_markdown(summaries, model_name, dataset, headline)
    )
    fig = severity_figure(summaries)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    files.write_atomic(run_dir / PLOT, buffer.getvalue())
