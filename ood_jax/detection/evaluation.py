"""O(OD)^2 evaluation of a detector: COCO numbers in-domain and on each held-out domain.

Ground truth comes straight from the TFDS split (no JSON round trip); predictions go through
`metrics.coco.evaluate_arrays`. Results are written as results.json, a results.md table laid out
like COUNTS' Table 2, and a PNG bar chart of per-domain AP. Every AP comes with an interval from
a bootstrap over images (`metrics.bootstrap`, from the evaluation's own per-image matches),
centered on the estimate (`bootstrap.centered_interval` says why), the OOD average's from
resampling each domain's images independently; the matches are kept in matches.npz, from which
`ood-jax compare-detectors` pairs two workdirs.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import sys
from typing import Any, Callable, Mapping

import jax
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from ood_jax import boxes as box_lib
from ood_jax import files, progress, sharding
from ood_jax.data import iteration, pipeline
from ood_jax.detection import compare
from ood_jax.metrics import bootstrap, coco

RESAMPLES = 1000
CONFIDENCE = 0.95


def coco_ground_truth(builder: tfds.core.DatasetBuilder, split: str) -> coco.GroundTruth:
    """The COCO ground truth of a detection split, read as arrays without decoding its images.

    Annotation ids are numbered from 1 in record order: pycocotools (and so `metrics.coco`)
    treats a match to an annotation with id 0 as no match.
    """
    dataset = builder.as_dataset(
        split=split, decoders={"image": tfds.decode.SkipDecoding()}, shuffle_files=False
    )
    dataset = dataset.map(
        lambda ex: {
            "id": ex["image/id"],
            "size": tf.image.extract_jpeg_shape(ex["image"])[:2],
            "bbox": ex["objects"]["bbox"],
            "label": ex["objects"]["label"],
            "area": ex["objects"]["area"],
            "is_crowd": ex["objects"]["is_crowd"],
        }
    )
    image_ids, columns = [], {"image_id": [], "label": [], "xywh": [], "area": [], "is_crowd": []}
    for ex in iteration.numpy_iterator(dataset):
        height, width = (int(v) for v in ex["size"])
        image_ids.append(int(ex["id"]))
        columns["image_id"].append(np.full(len(ex["label"]), ex["id"], np.int64))
        columns["xywh"].append(
            box_lib.xyxy_to_xywh(box_lib.scale(box_lib.yxyx_to_xyxy(ex["bbox"]), height, width))
            .astype(np.float64)
            .reshape(-1, 4)
        )
        columns["label"].append(ex["label"])
        columns["area"].append(ex["area"])
        columns["is_crowd"].append(ex["is_crowd"])
    column = {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in columns.items()}
    names = builder.info.features["objects"]["label"].names
    return coco.GroundTruth.from_arrays(
        image_ids=np.array(image_ids, np.int64),
        categories=list(enumerate(names)),
        annotation_image_ids=column["image_id"],
        annotation_category_ids=column["label"],
        boxes=column["xywh"],
        area=column["area"],
        is_crowd=column["is_crowd"],
        annotation_ids=np.arange(1, len(column["label"]) + 1),
    )


@dataclasses.dataclass(frozen=True)
class EvalSplit:
    """One evaluated split: its COCO ground truth and this process's rows of its batches. A run
    builds it once and iterates it at each evaluation: building a tf.data pipeline traces its
    functions (about half a second a split on CPU)."""

    ground_truth: coco.GroundTruth
    batches: tf.data.Dataset


def split_batches(
    builder: tfds.core.DatasetBuilder,
    split: str,
    input_config: ml_collections.ConfigDict,
    data_sharding: jax.sharding.NamedSharding,
) -> tf.data.Dataset:
    """This process's rows of `split`'s global evaluation batches (`pipeline.eval_dataset`)."""
    rows = sharding.process_rows(data_sharding, input_config.batch_size)
    return pipeline.eval_dataset(builder, split, input_config, rows=rows)


def load_split(
    builder: tfds.core.DatasetBuilder,
    split: str,
    input_config: ml_collections.ConfigDict,
    data_sharding: jax.sharding.NamedSharding,
) -> EvalSplit:
    """`split`'s ground truth and this process's batches of it, for `evaluate_split`."""
    return EvalSplit(
        coco_ground_truth(builder, split),
        split_batches(builder, split, input_config, data_sharding),
    )


def evaluate_split(
    predict: Callable[[dict[str, jax.Array]], dict[str, jax.Array]],
    split: EvalSplit,
    data_sharding: jax.sharding.NamedSharding,
    name: str | None = None,
) -> coco.CocoEvalResult:
    """COCO evaluation of `predict` (a jitted batch -> postprocessed outputs) on one split.

    With a `name`, process 0 says how far it is ("evaluating sky: 120/400 images").
    """
    ground_truth = split.ground_truth
    bar = SplitProgress(name, len(ground_truth.image_ids)) if name else None
    image_ids, boxes, scores, labels = [], [], [], []
    batches = sharding.start_global(
        iteration.numpy_iterator(split.batches),
        data_sharding,
        host_keys=(*pipeline.HOST_ONLY_KEYS, "valid", "orig_size"),
    )
    for batch, host in batches:
        out = predict(batch)
        out = {k: sharding.to_host_local(v, data_sharding) for k, v in out.items()}
        gathered = sharding.process_allgather(
            {
                "valid": host["valid"],
                "image_id": host["image_id"],
                "boxes": pipeline.coco_boxes(out["boxes"], host["orig_size"]),
                "scores": out["scores"],
                "labels": out["labels"],
            }
        )
        keep = np.asarray(gathered["valid"], bool)
        image_ids.append(np.asarray(gathered["image_id"])[keep])
        boxes.append(np.asarray(gathered["boxes"])[keep])
        scores.append(np.asarray(gathered["scores"])[keep])
        labels.append(np.asarray(gathered["labels"])[keep])
        if bar:
            bar.update(int(keep.sum()))
    if bar:
        bar.close()
    boxes = np.concatenate(boxes).astype(np.float64)
    # Degenerate predicted boxes cannot be COCO detections; give them a sliver of size rather
    # than drop them, so every query still counts against precision.
    boxes[..., 2:] = np.maximum(boxes[..., 2:], 1e-3)
    return coco.evaluate_arrays(
        ground_truth,
        np.concatenate(image_ids),
        boxes,
        np.concatenate(scores),
        np.concatenate(labels),
    )


class SplitProgress(progress.Progress):
    """`evaluating NAME: i/N images` on stdout, from process 0, while a split is evaluated, and
    one line when it is done (no rate: the first batch's compilation would skew it; it
    announces itself, `train.compiled.CompiledOnFirstCall`)."""

    def __init__(self, name: str, total: int, **options: Any):
        super().__init__(
            name,
            total,
            unit="image",
            stream=sys.stdout,
            enabled=jax.process_index() == 0,
            rate=False,
            **options,
        )


def summarize(
    step: int,
    iid: coco.CocoEvalResult,
    per_domain: Mapping[str, coco.CocoEvalResult],
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """results.json's content: the 12 numbers in-domain, per held-out domain, and their mean,
    with bootstrap intervals of the AP stats (`ap_intervals`).

    The per-split matches ride along under "matches" (not JSON): `write_results` saves them as
    matches.npz, which `compare-detectors` reads.
    """
    results: dict[str, Any] = {
        "step": int(step),
        "iid": iid.stats,
        "per_domain": {domain: r.stats for domain, r in per_domain.items()},
    }
    if per_domain:
        results["ood_average"] = {
            name: float(np.mean([r.stats[name] for r in per_domain.values()]))
            for name in coco.STAT_NAMES
        }
    matches, estimates = {}, {}
    for name, r in {"iid": iid, **per_domain}.items():
        if r.matches is None:
            raise ValueError(f"the evaluation of '{name}' carries no per-image matches")
        matches[name], estimates[name] = r.matches, r.stats
    results["intervals"] = ap_intervals(matches, estimates, resamples, seed, confidence)
    results["matches"] = matches
    return results


def ap_intervals(
    matches: Mapping[str, coco.Matches],
    estimates: Mapping[str, Mapping[str, float]],
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """Bootstrap intervals of `bootstrap.STATS` for "iid", each other split (a
    held-out domain) and the OOD average over the domains, whose resample b averages every
    domain's resample b (domains drawn independently). `estimates` holds each split's plain
    numbers, against which each stat's bootstrap bias (mean of the resamples - estimate) is
    given with its standard error. Numbers are null where undefined (no ground truth)."""
    resampled = {
        name: bootstrap.split_resamples(m, resamples, seed, split=name)
        for name, m in matches.items()
    }
    domains = [name for name in matches if name != "iid"]
    out: dict[str, Any] = {
        "method": "estimate -/+ z * bootstrap s.e. over images (percentile bounds beside)",
        "resamples": resamples,
        "confidence": confidence,
        "seed": seed,
    }
    if "iid" in resampled:
        out["iid"] = _intervals(resampled["iid"], estimates["iid"], confidence)
    out["per_domain"] = {d: _intervals(resampled[d], estimates[d], confidence) for d in domains}
    if domains:
        average = {k: float(np.mean([estimates[d][k] for d in domains])) for k in bootstrap.STATS}
        out["ood_average"] = _intervals(
            bootstrap.average([resampled[d] for d in domains]), average, confidence
        )
    return out


def _intervals(
    resampled: Mapping[str, np.ndarray], estimate: Mapping[str, float], confidence: float
) -> dict[str, Any]:
    """Per stat: the interval centered on the estimate (`bootstrap.centered_interval`, what
    results.md shows), the percentile bounds, the bootstrap s.e. and bias."""
    out = {}
    for name, values in resampled.items():
        centered = bootstrap.centered_interval(estimate[name], values, confidence)
        percentile = bootstrap.percentile_interval(values, confidence)
        values = values[~np.isnan(values)]
        defined = centered is not None and estimate[name] >= 0
        out[name] = {
            "low": centered[0] if defined else None,
            "high": centered[1] if defined else None,
            "percentile_low": percentile[0] if defined else None,
            "percentile_high": percentile[1] if defined else None,
            "se": float(np.std(values, ddof=1)) if defined else None,
            "bias": float(np.mean(values) - estimate[name]) if defined else None,
        }
    return out


def results_markdown(results: Mapping[str, Any], model_name: str) -> str:
    """A table laid out like COUNTS' Table 2: in-domain mAP, each held-out domain, and Avg, each
    with its bootstrap interval when results.json has them."""
    domains = list(results["per_domain"])
    intervals = results.get("intervals")
    header = ["Model", "IID mAP", *[d.capitalize() for d in domains], "Avg"]
    cells = [
        _ap_cell(results["iid"]["AP"], intervals and intervals.get("iid")),
        *[
            _ap_cell(results["per_domain"][d]["AP"], intervals and intervals["per_domain"].get(d))
            for d in domains
        ],
        _ap_cell(
            results.get("ood_average", {}).get("AP", float("nan")),
            intervals and intervals.get("ood_average"),
        ),
    ]
    lines = [
        f"Results at step {results['step']} (COCO mAP@[.5:.95]; AP50 in-domain "
        f"{results['iid']['AP50']:.3f}).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        "| " + " | ".join([model_name, *cells]) + " |",
    ]
    if intervals:
        lines += [
            "",
            f"[low, high]: {100 * intervals['confidence']:g}% intervals, AP -/+ z s.e. with the "
            f"s.e. from a bootstrap over images ({intervals['resamples']} resamples, seed "
            f"{intervals['seed']}); Avg's resamples draw each domain's images independently. "
            "They are centered on the estimate because resampled AP is biased upwards (a "
            "resample holds about 63% distinct images, and AP grows on fewer); results.json "
            "also has the percentile bounds and each bias.",
        ]
    return "\n".join(lines) + "\n"


def _ap_cell(value: float, interval: Mapping[str, Any] | None) -> str:
    if not interval:
        return f"{value:.3f}"
    bounds = interval["AP"]
    if bounds["low"] is None:
        return f"{value:.3f} [n/a]"
    return f"{value:.3f} [{bounds['low']:.3f}, {bounds['high']:.3f}]"


def write_results(workdir: str | pathlib.Path, results: Mapping[str, Any], model_name: str) -> None:
    """results.json, results.md, per_domain_ap.png and (when `summarize` put the per-split
    matches in `results`) matches.npz in `workdir`; each written atomically."""
    workdir = pathlib.Path(workdir)
    matches = results.get("matches")
    results = {k: v for k, v in results.items() if k != "matches"}
    if matches is not None:
        compare.write_matches(workdir, matches)
    else:  # an older evaluation's matches would no longer match results.json
        (workdir / compare.MATCHES_FILE).unlink(missing_ok=True)
    files.write_json_atomic(workdir / "results.json", results)
    files.write_atomic(workdir / "results.md", results_markdown(results, model_name))
    files.write_atomic(workdir / "per_domain_ap.png", _bar_chart(results))


def bar_chart_figure(results: Mapping[str, Any]):
    """per_domain_ap.png's figure: AP in-domain and on each held-out domain, each bar labelled
    with its value (as results.md prints it) on a y axis from 0 in plain numbers.

    Tiny APs (early or smoke runs) otherwise get ticks relative to a multiplier or offset
    printed apart at the axis' top ("1e-6"), easily missed, so 3e-6 reads as 3.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = ["in-domain", *results["per_domain"]]
    values = [results["iid"]["AP"], *[r["AP"] for r in results["per_domain"].values()]]
    # COCO's AP is -1 where a split has no ground truth: no bar, and a label that says so.
    heights = [max(v, 0.0) for v in values]
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(names), 3.2), dpi=100)
    bars = ax.bar(names, heights, color=["#4c72b0"] + ["#dd8452"] * (len(names) - 1))
    ax.bar_label(bars, labels=[_ap_label(v) for v in values], fontsize=8)
    ax.set_ylim(0, 1.15 * max(heights) if max(heights) > 0 else 1.0)  # room for the labels
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.set_ylabel("COCO AP")
    ax.set_title(f"AP in-domain and on held-out domains (step {results['step']})")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


def _ap_label(value: float) -> str:
    """As results.md prints it (0.123), but a tiny AP keeps a digit (2.1e-05, not 0.000)."""
    if value < 0:
        return "n/a"
    text = f"{value:.3f}"
    return text if value == 0 or text != "0.000" else f"{value:.1e}"


def _bar_chart(results: Mapping[str, Any]) -> bytes:
    from matplotlib import pyplot as plt

    fig = bar_chart_figure(results)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
