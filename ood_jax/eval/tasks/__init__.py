"""The tasks `ood-jax eval-mllm` runs, by name: `make_benchmark(name, ...)`.

foci          FOCI multiple choice (tasks/foci.py)
oodbench      OODBench yes/no questions, plain or chain-of-thought (tasks/oodbench.py)
oodbench-bap  OODBench Basic-to-Advanced Progression questions (tasks/oodbench.py)
counts-oodg   COUNTS OODG grounding, localization and mapping items (tasks/counts_oodg.py)

What every task shares (Item, the Benchmark interface the runner drives, reading built TFDS
datasets, summaries and tables) is in tasks/base.py.
"""

from __future__ import annotations

from ood_jax.eval.tasks.base import Benchmark, Item, ItemsError, dataset_dir
from ood_jax.eval.tasks.counts_oodg import OODG_SETTINGS, OODG_TASKS, CountsOodg, read_oodg_items
from ood_jax.eval.tasks.foci import PARSE_MODES, Foci
from ood_jax.eval.tasks.oodbench import OODBENCH_SETTINGS, OodBench, OodBenchBap

BENCHMARKS = ("foci", "counts-oodg", "oodbench", "oodbench-bap")

__all__ = [
    "BENCHMARKS",
    "OODBENCH_SETTINGS",
    "OODG_SETTINGS",
    "OODG_TASKS",
    "PARSE_MODES",
    "Benchmark",
    "CountsOodg",
    "Foci",
    "Item",
    "ItemsError",
    "OodBench",
    "OodBenchBap",
    "dataset_dir",
    "make_benchmark",
    "read_oodg_items",
]


def make_benchmark(
    name: str,
    data_dir: str | None = None,
    config: str | None = None,
    items: str | None = None,
    setting: str | None = None,
    ice: int | None = None,
    task: str | None = None,
    parse_mode: str = "foci",
) -> Benchmark:
    """The benchmark `name` of BENCHMARKS over the user's data; bad combinations fail clearly."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {BENCHMARKS}")
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
        return Foci(data_dir, configs, parse_mode)
    if name == "oodbench":
        return OodBench(data_dir, config or "default", setting or "plain")
    if setting is not None:
        raise ValueError("oodbench-bap has no settings")
    return OodBenchBap(data_dir, config or "bap")
