"""MLLM runs split over machines: `eval-mllm --shard I/N` asks the I-th of N disjoint parts of a
benchmark's items (by a hash of the item's id, a question's rotations together), and `merge`
joins the parts' directories into the one a single run would have written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
from collections.abc import Iterable, Sequence

from ood_jax import files, manifest
from ood_jax.eval import accounting, judge, store, tasks
from ood_jax.eval import results as run_results
from ood_jax.eval.store import RunError
from ood_jax.eval.tasks.base import JUDGE_MODE, Item, scored

ALL_ITEMS_FILE = "all_items.jsonl"
_SPEC = re.compile(r"(\d+)/(\d+)")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Part `index` of `count` (0 <= index < count)."""

    index: int
    count: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"--shard {self.index}/{self.count}: expected I/N with 0 <= I < N")

    @classmethod
    def parse(cls, spec: str) -> Shard:
        match = _SPEC.fullmatch(spec.strip())
        if match is None:
            raise ValueError(
                f"--shard {spec!r}: expected I/N, e.g. 0/4 for the first of four parts"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def holds(self, item: Item) -> bool:
        key = item.meta.get("rotation_of", item.id) if isinstance(item.meta, dict) else item.id
        digest = hashlib.sha256(str(key).encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.count == self.index

    def to_json(self) -> dict:
        return {"index": self.index, "count": self.count}


def write_all_items(directory: pathlib.Path, pairs: Iterable[tuple[str, str]]) -> None:
    text = "".join(json.dumps([item_id, digest]) + "\n" for item_id, digest in pairs)
    files.write_atomic(directory / ALL_ITEMS_FILE, text)


def _all_items(directory: pathlib.Path) -> list[tuple[str, str]]:
    path = directory / ALL_ITEMS_FILE
    if not path.is_file():
        raise RunError(f"{path}: not found; is {directory} a finished --shard run?")
    try:
        return [tuple(json.loads(line)) for line in path.read_text().splitlines()]
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise RunError(f"{path}: not what eval-mllm --shard writes ({e})") from None


@dataclasses.dataclass
class _Part:
    directory: pathlib.Path
    run: dict
    results: dict
    records: list[dict]


def _read_part(directory: pathlib.Path) -> _Part:
    run = store.read_run_file(directory)
    if run is None:
        raise RunError(f"{directory / store.RUN_FILE}: not found; is {directory} a run directory?")
    if not isinstance(run.get("shard"), dict):
        raise RunError(f"{directory}: not a part of a split run (its run.json has no 'shard')")
    path = directory / store.RESULTS_JSON
    if not path.is_file():
        raise RunError(f"{path}: not found; finish the part (rerun its eval-mllm command) first")
    finished = store.read_results(path)
    return _Part(directory, run, finished, store.finished_records(directory, finished, path))


def _common(parts: Sequence[_Part], field: str, describe: str) -> object:
    """The value of run.json `field` all parts share; RunError naming the first that differs."""
    first = parts[0].run.get(field)
    for part in parts[1:]:
        if part.run.get(field) != first:
            raise RunError(
                f"{part.directory} and {parts[0].directory} differ in {describe} "
                f"({part.run.get(field)!r} and {first!r}): not parts of one run"
            )
    return first


def merge(part_dirs: Sequence[str | pathlib.Path], output: str | pathlib.Path) -> tuple[dict, str]:
    """Joins the parts of one split run into `output`: predictions.jsonl (in the benchmark's
    order), run.json, judge.jsonl (the judge mode's verdicts), results.json and results.md as a
    single run writes them, and a manifest naming the parts. Returns (results, markdown)."""
    parts = [_read_part(pathlib.Path(d)) for d in part_dirs]
    output = pathlib.Path(output)
    if any(output.resolve() == part.directory.resolve() for part in parts):
        raise RunError(f"--output {output} is one of the parts; merge into another directory")
    identity = {k: v for k, v in store.run_identity(parts[0].run).items() if k != "shard"}
    for part in parts[1:]:
        other = {k: v for k, v in store.run_identity(part.run).items() if k != "shard"}
        if other != identity:
            differs = sorted(
                k for k in identity.keys() | other.keys() if identity.get(k) != other.get(k)
            )
            raise RunError(
                f"{part.directory} and {parts[0].directory} are runs of another benchmark, model "
                f"or options (they differ in {', '.join(differs)}): not parts of one run"
            )
    counts = {part.run["shard"]["count"] for part in parts}
    indices = sorted(part.run["shard"]["index"] for part in parts)
    if len(counts) != 1 or indices != list(range(len(parts))) or counts != {len(parts)}:
        shards = ", ".join(f"{p.run['shard']['index']}/{p.run['shard']['count']}" for p in parts)
        raise RunError(f"the parts are shards {shards}: merge needs every shard I/N of one N once")
    items = _all_items(parts[0].directory)
    for part in parts[1:]:
        if _all_items(part.directory) != items:
            raise RunError(
                f"{part.directory / ALL_ITEMS_FILE} and {parts[0].directory / ALL_ITEMS_FILE} "
                "differ: the parts asked different items (another dataset build or item file)"
            )
    parse_mode = _common(parts, "parse_mode", "parse mode")
    judge_identity = _common(parts, "judge", "judge")
    prices = _common(parts, "prices", "prices")
    warnings = parts[0].results.get("warnings", [])

    digests = dict(items)
    by_id: dict[str, dict] = {}
    for part in parts:
        for record in part.records:
            if digests.get(record["id"]) != record["digest"]:
                raise RunError(
                    f"{part.directory / store.PREDICTIONS_FILE}: item {record['id']!r} is not "
                    f"in {ALL_ITEMS_FILE} with that digest"
                )
            if record["id"] in by_id:
                raise RunError(f"item {record['id']!r} was answered by two parts")
            by_id[record["id"]] = record
    missing = [item_id for item_id, _ in items if item_id not in by_id]
    if missing:
        raise RunError(
            f"{len(missing)} items have no record in any part (the first: {missing[0]!r}); "
            "finish every part first"
        )

    scoring_keys = {"parse_mode": parse_mode, "judge": judge_identity, "prices": prices}
    run = {**identity, **{k: v for k, v in scoring_keys.items() if v is not None}}
    try:
        scoring = tasks.scoring_for(run)
    except ValueError as e:
        raise RunError(f"{parts[0].directory / store.RUN_FILE}: {e}") from None

    output.mkdir(parents=True, exist_ok=True)
    about = manifest.collect(
        "merge",
        parts=[_part_manifest(p) for p in parts],
        items={"count": len(items), "digest": manifest.items_digest(items)},
    )
    with manifest.recording(output, about):
        files.write_atomic(output / store.RUN_FILE, json.dumps(run, indent=2) + "\n")
        if judge_identity is not None:
            scoring = scoring.reading(JUDGE_MODE, _merged_verdicts(parts, judge_identity, output))
        else:
            scoring = scoring.reading(parse_mode)
        records = [scored(scoring, by_id[item_id]) for item_id, _ in items]
        text = "".join(json.dumps(r) + "\n" for r in records)
        files.write_atomic(output / store.PREDICTIONS_FILE, text)
        results, markdown = run_results.build_results(
            scoring,
            identity,
            records,
            None,
            warnings,
            accounting.stored_prices(run, output / store.RUN_FILE),
        )
        files.write_atomic(output / store.RESULTS_JSON, json.dumps(results, indent=2) + "\n")
        files.write_atomic(output / store.RESULTS_MD, markdown)
    return results, markdown


def _part_manifest(part: _Part) -> dict:
    path = part.directory / manifest.MANIFEST_FILE
    return {
        "directory": str(part.directory.resolve()),
        "shard": part.run["shard"],
        "manifest_sha256": manifest.file_sha256(path) if path.is_file() else None,
    }


def _merged_verdicts(
    parts: Sequence[_Part], identity: dict, output: pathlib.Path
) -> judge.Verdicts:
    """The parts' judge.jsonl joined into OUTPUT's: every verdict of the run's judge."""
    records: dict[str, dict] = {}
    for part in parts:
        path = part.directory / judge.JUDGE_FILE
        if path.exists():
            records.update(store.PredictionStore(path, repair=False).records)
    text = "".join(json.dumps(r) + "\n" for r in records.values())
    files.write_atomic(output / judge.JUDGE_FILE, text)
    return judge.Verdicts(identity, records)
