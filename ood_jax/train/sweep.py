"""`ood-jax sweep`: N seeds of a detector config, and the checkpoint each model-selection protocol
(selection.py) selects in them, as mean +- std over the seeds (or by DomainBed's conventions).

A sweep is a list of jobs (SWEEP_DIR/sweep.json, kept from the sweep's start), each an ordinary
resumable training run in SWEEP_DIR/<job>/; aggregating reads their evaluations.json into
SWEEP_DIR/results.json and results.md. Jobs, flags and outputs: docs/guide/model-selection.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from ood_jax import files
from ood_jax.data import counts
from ood_jax.train import selection, train

DEFAULT_PROTOCOLS = ("last", "training_domain", "oracle")  # one run per seed
VAL_FRACTION = 0.2  # DomainBed's holdout_fraction: training-domain validation's default share
PLAN_FILE = "sweep.json"
# What a sweep directory's plan must keep: the jobs and what is selected over them.
_PLAN_KEYS = ("seeds", "protocols", "leave_out", "targets", "val_fraction", "jobs")


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    seed: int
    leave_out: str = ""  # a training domain this run does not train on


def plan(
    config: ml_collections.ConfigDict,
    seeds: int,
    protocols: Sequence[str] = DEFAULT_PROTOCOLS,
    leave_out: Sequence[str] = (),
) -> dict[str, Any]:
    """sweep.json's content: `seeds` seeds from config.seed, the protocols, and the jobs."""
    unknown = [p for p in protocols if p not in selection.PROTOCOLS]
    if unknown or not protocols:
        raise ValueError(
            f"--protocols: unknown {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(selection.PROTOCOLS)}"
        )
    if seeds < 1:
        raise ValueError(f"--seeds: must be >= 1, got {seeds}")
    if set(protocols) - {"last"} and not config.eval_every:
        raise ValueError(
            "config.eval_every: 0, so a run is evaluated at its last step only and every "
            "protocol would select it; set it (e.g. --config.eval_every=1000)"
        )
    targets = counts.ordered_domains(config.dataset.target_domains)
    sources = [d for d in counts.DOMAINS if d not in targets]
    loo = "leave_one_domain_out" in protocols
    left_out = counts.ordered_domains(leave_out) if loo and leave_out else ()
    if loo and not left_out:
        left_out = tuple(sources)
    if set(left_out) - set(sources):
        raise ValueError(f"--leave-out: {', '.join(set(left_out) - set(sources))} is a target")
    val_fraction = config.selection.val_fraction
    if "training_domain" in protocols and not val_fraction:
        val_fraction = VAL_FRACTION
    first = config.seed
    jobs = [Job(f"seed{s}", s) for s in range(first, first + seeds)]
    jobs += [Job(f"seed{s}_loo_{d}", s, d) for s in range(first, first + seeds) for d in left_out]
    return {
        "model_name": config.model_name,
        "seeds": list(range(first, first + seeds)),
        "protocols": list(protocols),
        "leave_out": list(left_out),
        "targets": list(targets),
        "val_fraction": val_fraction,
        "oracle_fraction": config.selection.oracle_fraction,
        "jobs": [dataclasses.asdict(job) for job in jobs],
    }


def jobs_of(sweep: Mapping[str, Any]) -> list[Job]:
    return [Job(**job) for job in sweep["jobs"]]


def job_config(
    config: ml_collections.ConfigDict, sweep: Mapping[str, Any], job: Job
) -> ml_collections.ConfigDict:
    """The config of one job: `config` with the job's seed, left-out domain and the sweep's
    validation slice."""
    config = config.copy_and_resolve_references()
    config.seed = job.seed
    config.selection.leave_out = job.leave_out
    config.selection.val_fraction = sweep["val_fraction"]
    return config


def start(sweep_dir: pathlib.Path, sweep: Mapping[str, Any]) -> None:
    """Writes sweep.json, or checks that the directory's holds the same jobs."""
    path = sweep_dir / PLAN_FILE
    if path.is_file():
        stored = json.loads(path.read_text())
        changed = [k for k in _PLAN_KEYS if stored.get(k) != sweep[k]]
        if changed:
            raise ValueError(
                f"--workdir {sweep_dir} holds a sweep with other {', '.join(changed)} "
                f"({path}); use the same flags, or a fresh --workdir"
            )
        return
    files.write_json_atomic(path, sweep)


def run_job(config: ml_collections.ConfigDict, sweep_dir: pathlib.Path, sweep, job: Job) -> None:
    """Trains one job in SWEEP_DIR/<job>, unless it has finished already."""
    workdir = sweep_dir / job.name
    if _finished(workdir) == config.total_steps:
        print(f"sweep: {job.name} has finished (step {config.total_steps}); kept", flush=True)
        return
    print(f"sweep: {job.name} -> {workdir}", flush=True)
    train.train_and_evaluate(job_config(config, sweep, job), str(workdir))


def _finished(workdir: pathlib.Path) -> int | None:
    """The step a job's results and evaluations were last written at together, if any."""
    results = workdir / "results.json"
    records = selection.read_evaluations(workdir)
    if not results.is_file() or not records:
        return None
    step = json.loads(results.read_text())["step"]
    return step if step == max(r["step"] for r in records) else None


def aggregate(sweep_dir: str | pathlib.Path, conventions: str = "ours") -> dict[str, Any]:
    """results.json's content from the jobs' evaluations: per protocol and seed the selected
    step, the value it was selected by, its in-domain AP, each target's AP and their average;
    and the mean and spread of those over the seeds: the sample standard deviation (n - 1),
    or with DomainBed's `conventions` its standard error. ValueError naming the jobs that have
    not finished."""
    sweep_dir = pathlib.Path(sweep_dir)
    path = sweep_dir / PLAN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: start the sweep first (ood-jax sweep)")
    sweep = json.loads(path.read_text())
    jobs = jobs_of(sweep)
    unfinished = [job.name for job in jobs if _finished(sweep_dir / job.name) is None]
    if unfinished:
        raise ValueError(
            f"{sweep_dir}: {', '.join(unfinished)} not finished (no results.json at their last "
            "evaluation); run them first (ood-jax sweep ... --job=NAME)"
        )
    records = {job.name: selection.read_evaluations(sweep_dir / job.name) for job in jobs}
    protocols = {}
    for protocol in sweep["protocols"]:
        per_seed = []
        for seed in sweep["seeds"]:
            left_out = {
                job.leave_out: records[job.name]
                for job in jobs
                if job.seed == seed and job.leave_out
            }
            chosen = selection.select(protocol, records[f"seed{seed}"], left_out, conventions)
            per_seed.append(
                {
                    "seed": seed,
                    "step": chosen.step,
                    "value": chosen.value,
                    "iid": chosen.record["iid"]["AP"],
                    "per_domain": {
                        t: chosen.record["per_domain"][t]["AP"] for t in sweep["targets"]
                    },
                    "ood_average": chosen.record["ood_average"]["AP"],
                }
            )
        protocols[protocol] = {
            "label": selection.PROTOCOLS[protocol],
            "per_seed": per_seed,
            **mean_and_spread(per_seed, sweep["targets"], conventions),
        }
    kept = {k: sweep[k] for k in ("model_name", "seeds", "targets")}
    return {**kept, "conventions": conventions, "protocols": protocols}


SPREADS = {"ours": "std", "domainbed": "standard_error"}


def mean_and_spread(
    per_seed: Sequence[Mapping[str, Any]], targets: Sequence[str], conventions: str
) -> dict[str, Any]:
    """{"mean": ..., SPREADS[conventions]: ...} of the APs over seeds. Ours is the sample std,
    None with one seed; DomainBed's (collect_results.py) np.std(values / sqrt(n)), 0 with one.
    """

    def columns(entry: Mapping[str, Any]) -> dict[str, float]:
        return {
            "iid": entry["iid"],
            **{t: entry["per_domain"][t] for t in targets},
            "ood_average": entry["ood_average"],
        }

    values = {k: np.array([columns(e)[k] for e in per_seed]) for k in columns(per_seed[0])}
    if conventions == "domainbed":
        spread = {k: float(np.std(v / np.sqrt(len(v)))) for k, v in values.items()}
    else:
        spread = {k: float(v.std(ddof=1)) if len(v) > 1 else None for k, v in values.items()}
    return {"mean": {k: float(v.mean()) for k, v in values.items()}, SPREADS[conventions]: spread}


def _number(value: float) -> str:
    """0.123, but a tiny value keeps a digit (2.1e-05, not 0.000): short runs score that low."""
    text = f"{value:.3f}"
    return text if value == 0 or text not in ("0.000", "-0.000") else f"{value:.1e}"


def _cell(mean: float, std: float | None) -> str:
    return _number(mean) if std is None else f"{_number(mean)} ± {_number(std)}"


def results_markdown(results: Mapping[str, Any]) -> str:
    """Per protocol the mean ± std of each AP over seeds, then every seed's choice."""
    targets = results["targets"]
    columns = ["iid", *targets, "ood_average"]
    names = ["IID mAP", *[t.capitalize() for t in targets], "Avg"]
    seeds = ", ".join(str(s) for s in results["seeds"])
    conventions = results.get("conventions", "ours")
    spread = SPREADS[conventions]
    by = "sample std" if conventions == "ours" else "standard error, by DomainBed's conventions"
    lines = [
        f"Model selection for {results['model_name']}: {len(results['seeds'])} seeds ({seeds}).",
        "",
        f"COCO mAP@[.5:.95] of the step each protocol selects, mean ± {by} over seeds; "
        "targets on their whole test splits. The COUNTS paper reports the last checkpoint.",
        "",
        "| Protocol | Steps | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for p in results["protocols"].values():
        steps = ", ".join(str(e["step"]) for e in p["per_seed"])
        cells = [_cell(p["mean"][c], p[spread][c]) for c in columns]
        lines.append(f"| {p['label']} | {steps} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per seed (value: what the step was selected by; AP on the validation slice, the mean "
        "AP on the left-out domains, or the mean AP on the targets' oracle slices):",
        "",
        "| Protocol | Seed | Step | Value | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for p in results["protocols"].values():
        for e in p["per_seed"]:
            value = "-" if e["value"] is None else _number(e["value"])
            cells = [e["iid"], *[e["per_domain"][t] for t in targets], e["ood_average"]]
            lines.append(
                f"| {p['label']} | {e['seed']} | {e['step']} | {value} | "
                + " | ".join(map(_number, cells))
                + " |"
            )
    return "\n".join(lines) + "\n"


def write_results(sweep_dir: str | pathlib.Path, conventions: str = "ours") -> dict[str, Any]:
    """Aggregates (`aggregate`) into SWEEP_DIR/results.json and results.md."""
    results = aggregate(sweep_dir, conventions)
    files.write_json_atomic(pathlib.Path(sweep_dir) / "results.json", results)
    files.write_atomic(pathlib.Path(sweep_dir) / "results.md", results_markdown(results))
    return results


def sweep(
    config: ml_collections.ConfigDict | None,
    sweep_dir: str | pathlib.Path,
    *,
    seeds: int = 1,
    protocols: Sequence[str] = DEFAULT_PROTOCOLS,
    leave_out: Sequence[str] = (),
    job: str | None = None,
    list_jobs: bool = False,
    aggregate_only: bool = False,
    conventions: str = "ours",
) -> dict[str, Any] | None:
    """`ood-jax sweep`: runs the jobs one after the other (a finished one is kept, an
    interrupted one resumes), then aggregates; `job` (a name or an index) runs one job only,
    `list_jobs` prints them, `aggregate_only` only aggregates, by `conventions`
    (`selection.CONVENTIONS`). Returns the aggregated results when it aggregated."""
    sweep_dir = pathlib.Path(sweep_dir)
    if conventions not in selection.CONVENTIONS:
        raise ValueError(
            f"--conventions: {conventions!r}; choose from {', '.join(selection.CONVENTIONS)}"
        )
    if aggregate_only:
        return write_results(sweep_dir, conventions)
    if config is None:
        raise ValueError("--config: required unless --aggregate-only")
    planned = plan(config, seeds, protocols, leave_out)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    start(sweep_dir, planned)
    jobs = jobs_of(planned)
    if list_jobs:
        print("\n".join(j.name for j in jobs))
        return None
    if job is not None:
        names = [j.name for j in jobs]
        if job not in names and not (job.isdigit() and int(job) < len(jobs)):
            raise ValueError(f"--job: {job} is none of the {len(jobs)} jobs: {', '.join(names)}")
        run_job(config, sweep_dir, planned, jobs[names.index(job) if job in names else int(job)])
        return None
    for j in jobs:
        run_job(config, sweep_dir, planned, j)
    return write_results(sweep_dir, conventions)
