"""`ood-jax rescore RUN_DIR`: a run's results computed again from its stored replies, by the code
the run used, under its own parse mode or others, sending nothing to any model. Where the
results go: docs/guide/mllm.md, "Parse modes and rescoring"."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from ood_jax import files
from ood_jax.eval import accounting, judge, store, tasks
from ood_jax.eval import results as run_results
from ood_jax.eval.store import RunError
from ood_jax.eval.tasks.base import JUDGE_MODE, Scoring, scored


def _judged(directory: pathlib.Path, run: dict, scoring: Scoring, records: list) -> Scoring:
    """`scoring` in the judge mode, reading the run's judge's kept verdicts."""
    if "judge" not in run:
        raise RunError(
            f"{directory / store.RUN_FILE}: no judge was used in this run, so parse mode judge "
            "has no verdicts to read (eval-mllm --parse-mode judge asks one)"
        )
    verdicts = judge.Verdicts.load(directory, run["judge"])
    judging = scoring.reading(JUDGE_MODE, verdicts)
    missing = [
        r["id"]
        for r in records
        if (options := judging.needs_judge(r)) is not None
        and not verdicts.lookup(options, r["reply"])[0]
    ]
    if missing:
        raise RunError(
            f"{directory / judge.JUDGE_FILE}: {len(missing)} replies no rule reads have no "
            f"verdict of the run's judge (the first: item {missing[0]!r}); rescore sends "
            "nothing: rerun eval-mllm with --parse-mode judge to ask the judge"
        )
    return judging


def rescore(
    directory: str | pathlib.Path,
    parse_modes: Sequence[str] = (),
    out: str | pathlib.Path | None = None,
    limit: int | None = None,
) -> list[tuple[str | None, pathlib.Path, dict, str]]:
    """Re-scores the run in `directory` under each of `parse_modes` (none: the run's mode) and
    writes the results; returns (mode, results.json path, results, markdown) per mode."""
    directory = pathlib.Path(directory)
    run = store.read_run_file(directory)
    if run is None:
        raise RunError(f"{directory / store.RUN_FILE}: not found; is {directory} a run directory?")
    try:
        scoring = tasks.scoring_for(run)
    except ValueError as e:
        raise RunError(f"{directory / store.RUN_FILE}: {e}") from None
    run_mode = run.get("parse_mode") or scoring.parse_mode
    json_name, _ = store.results_files(limit)
    results_path = directory / json_name
    finished = store.read_results(results_path)
    records = store.finished_records(directory, finished, results_path)
    warnings = finished.get("warnings", [])
    target = pathlib.Path(out) if out is not None else directory
    written = []
    for mode in dict.fromkeys(parse_modes or [run_mode]):
        if mode == JUDGE_MODE and JUDGE_MODE in scoring.parse_modes:
            reading = _judged(directory, run, scoring, records)
        else:
            try:
                reading = scoring.reading(mode)
            except ValueError as e:
                raise RunError(f"{directory}: {e}") from None
        results, markdown = run_results.build_results(
            reading,
            store.run_identity(run),
            [scored(reading, r) for r in records],
            limit if "limit" in finished else None,
            warnings,
            prices=accounting.stored_prices(run, directory / store.RUN_FILE),
        )
        json_name, md_name = store.results_files(limit, None if mode == run_mode else mode)
        files.write_atomic(target / json_name, json.dumps(results, indent=2) + "\n")
        files.write_atomic(target / md_name, markdown)
        written.append((mode, target / json_name, results, markdown))
    return written
