"""Evaluates a trained detector's workdir on a corrupted dataset (`ood-jax build corrupted`).

The newest checkpoint that restores is evaluated as `ood-jax evaluate` evaluates it (same
config, mesh, predict step and input pipeline) on the corrupted copies of the splits it
evaluates, in-domain and each held-out domain, and the workdir gets corruptions.json,
corruptions/{split}.json, results_corruptions.md and corruptions_severity.png
(`detection.corruption_eval`). The corrupted dataset must have been built from the run's own
dataset; a split whose corrupted copies are not all there (a build with --splits) is left out,
saying which splits it lacks.
"""

from __future__ import annotations

import pathlib

import jax
import ml_collections

from ood_jax import datasets
from ood_jax.data import building, counts
from ood_jax.detection import corruption_eval
from ood_jax.train import resume, train


def _checked_source(builder, config: ml_collections.ConfigDict, dataset: str) -> None:
    record = building.BuildRecord.read(pathlib.Path(builder.data_dir))
    source = (record.settings or {}).get("dataset") if record else None
    if source != config.dataset.name:
        raise ValueError(
            f"--dataset {dataset}: built from {source or 'an unrecorded dataset'}, but the run "
            f"trained on {config.dataset.name}; build one with `ood-jax build corrupted "
            f"--dataset {config.dataset.name} ...`"
        )


def evaluate_corrupted(
    config: ml_collections.ConfigDict, workdir: str | pathlib.Path, dataset: str
) -> dict[str, dict]:
    """{evaluated split: its corruptions.json summary} of the workdir's newest checkpoint on
    the corrupted dataset `dataset` ("corrupted/CONFIG" in config.dataset.data_dir)."""
    workdir = pathlib.Path(workdir)
    builder = datasets.load(dataset, config.dataset.data_dir)
    _checked_source(builder, config, dataset)
    experiment = train.setup(config, workdir)
    ckpt = experiment.checkpointer
    resume.check_workdir_config(config, workdir, ckpt)
    restored = resume.restore_newest(
        experiment.checkpointer, experiment.abstract_state, "evaluating step"
    )
    if restored is None:
        raise FileNotFoundError(
            f"no checkpoint in {ckpt.directory}: train first (`ood-jax train` on this --workdir)"
        )
    names = ["iid", *(counts.canonical_domain(d) for d in config.dataset.target_domains)]
    splits, missing = corruption_eval.covered(
        builder, {name: experiment.splits[name] for name in names}
    )
    for name, lacking in missing.items():
        print(f"left out {name}: {dataset} has no {', '.join(lacking)}", flush=True)
    if not splits:
        raise ValueError(
            f"--dataset {dataset}: holds no split this run evaluates in full; build it with "
            "--splits covering the test splits"
        )
    eval_input = ml_collections.ConfigDict(config.input.to_dict())
    eval_input.batch_size = config.eval_batch_size
    summaries = corruption_eval.evaluate(
        lambda batch: experiment.predict(restored.state, batch),
        builder,
        splits,
        input_config=eval_input,
        data_sharding=experiment.data_sharding,
    )
    if jax.process_index() == 0:
        corruption_eval.write(workdir, summaries, config.model_name, dataset)
    ckpt.close()
    return summaries
