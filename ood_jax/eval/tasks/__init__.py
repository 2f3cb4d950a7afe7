"""The tasks `ood-jax eval-mllm` runs, by name (`make_benchmark`: foci, oodbench, oodbench-bap,
counts-oodg), and `scoring_for(run)`, a task's scoring from the identity a run.json holds (what
`ood-jax rescore` reads replies with)."""

from __future__ import annotations

from ood_jax.eval.tasks.base import (
    JUDGE_MODE,
    PARSE_MODES,
    Benchmark,
    Item,
    ItemsError,
    Scoring,
    dataset_dir,
)
from ood_jax.eval.tasks.counts_oodg import (
    OODG_SETTINGS,
    OODG_TASKS,
    CountsOodg,
    CountsOodgScoring,
    read_oodg_items,
)
from ood_jax.eval.tasks.foci import Foci, FociScoring
from ood_jax.eval.tasks.oodbench import (
    OODBENCH_SETTINGS,
    OodBench,
    OodBenchBap,
    OodBenchBapScoring,
    OodBenchScoring,
)

BENCHMARKS = ("foci", "counts-oodg", "oodbench", "oodbench-bap")
# The tasks whose questions `--circular` asks under several orders of their options.
CIRCULAR_BENCHMARKS = ("foci", "oodbench")

__all__ = [
    "BENCHMARKS",
    "CIRCULAR_BENCHMARKS",
    "JUDGE_MODE",
    "OODBENCH_SETTINGS",
    "OODG_SETTINGS",
    "OODG_TASKS",
    "PARSE_MODES",
    "Benchmark",
    "CountsOodg",
    "CountsOodgScoring",
    "Foci",
    "FociScoring",
    "Item",
    "ItemsError",
    "OodBench",
    "OodBenchBap",
    "OodBenchBapScoring",
    "OodBenchScoring",
    "Scoring",
    "dataset_dir",
    "make_benchmark",
    "read_oodg_items",
    "scoring_for",
]


def make_benchmark(
    name: str,
    data_dir: str | None = None,
    config: str | None = None,
    items: str | None = None,
    setting: str | None = None,
    ice: int | None = None,
    task: str | None = None,
    circular: int | None = None,
) -> Benchmark:
    """The benchmark `name` of BENCHMARKS over the user's data; bad combinations fail clearly.
    It reads replies under its default parse mode; `Scoring.reading` picks another."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {BENCHMARKS}")
    if circular is not None and name not in CIRCULAR_BENCHMARKS:
        raise ValueError(f"--circular applies to {' and '.join(CIRCULAR_BENCHMARKS)} only")
    if name == "counts-oodg":
        if items is None:
            raise ValueError("counts-oodg reads an items.jsonl: pass --items PATH")
        return CountsOodg(items, setting=setting, ice=ice, task=task)
    for flag, value in (("--ice", ice), ("--task", task), ("--items", items)):
        if value is not None:
            raise ValueError(f"{flag} applies to counts-oodg only")
    if data_dir is None:
        raise ValueError(f"{name} reads a built TFDS dataset: pass --data-dir")
    if name == "foci":
        if setting is not None:
            raise ValueError("foci has no settings (see --parse-mode)")
        configs = [c for c in config.split(",") if c] if config else None
        return Foci(data_dir, configs, circular)
    if name == "oodbench":
        return OodBench(data_dir, config or "default", setting or "plain", circular)
    if setting is not None:
        raise ValueError("oodbench-bap has no settings")
    return OodBenchBap(data_dir, config or "bap")


def scoring_for(run: dict) -> Scoring:
    """The scoring of the benchmark a run's identity (run.json) names, under its default parse
    mode. Raises ValueError for a benchmark this version does not know."""
    name = run.get("benchmark")
    if name == "foci":
        return FociScoring(run.get("circular"))
    if name == "oodbench":
        return OodBenchScoring(run.get("setting", "plain"), run.get("circular"))
    if name == "oodbench-bap":
        return OodBenchBapScoring()
    if name == "counts-oodg":
        return CountsOodgScoring()
    raise ValueError(f"benchmark {name!r} is none of {BENCHMARKS}")
