"""Our TFDS builds on Apache Beam, through TFDS's own Beam support (`--beam-runner`).

The driver plans each split (`_split_generators` reads and validates the annotations, so bad
annotations fail before anything is written) into chunks of work items; workers turn items into
examples with the same per-item function as a single-process build, and TFDS's `BeamWriter`
writes the same keys, examples and shards. What workers skip or meet comes back through files
in a work directory, so the build's report and errors are the single-process build's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import pickle
import shlex
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.options import pipeline_options

from ood_jax import files
from ood_jax.data import building

# Items per plan file, a worker's unit of work: large enough that reading a chunk costs little
# next to reading its images, small enough to spread a build over many workers.
CHUNK_SIZE = 256
# In the directory TFDS writes the dataset to while it is incomplete (`Build`). Workers share a
# filesystem with the driver (TFDS's data_dir must be one: they write its shards), not its
# memory, so what passes between them goes through files here. TFDS removes it with a failed
# build; the driver removes it once the pipeline has run.
WORK_DIR = "ood_jax_beam"


def options(flags: str | Sequence[str]) -> pipeline_options.PipelineOptions:
    """`--beam-options "--opt=v --opt2=v"` (or a list of flags) as Beam pipeline options."""
    return pipeline_options.PipelineOptions(shlex.split(flags) if isinstance(flags, str) else flags)


@dataclasses.dataclass(frozen=True)
class _Split:
    name: str
    num_items: int
    num_chunks: int
    reports: pathlib.Path  # the directory of its chunks' reports


class Build:
    """The driver's side of one Beam build: plans each split, then gathers what came back."""

    def __init__(self, dataset_dir: str | pathlib.Path):
        self._work_dir = pathlib.Path(dataset_dir) / WORK_DIR
        self._failures = self._work_dir / "failures"
        self._failures.mkdir(parents=True)
        self._splits: list[_Split] = []

    def split(self, name: str, items: Sequence[Any], example_fn: building.ExampleFn):
        """What `_split_generators` returns for split `name`: a PTransform of its examples."""
        # The pipeline carries only the chunks' paths: runners cap a job's size (Dataflow's graph
        # at 10 MB), which COUNTS' 222k images with their boxes, embedded by `beam.Create`, exceed.
        plan = self._work_dir / "plan" / name
        plan.mkdir(parents=True)
        chunks = []
        for index, start in enumerate(range(0, len(items), CHUNK_SIZE)):
            path = plan / f"{index:06d}.pkl"
            path.write_bytes(pickle.dumps(list(items[start : start + CHUNK_SIZE])))
            chunks.append((index, str(path)))
        split = _Split(name, len(items), len(chunks), self._work_dir / "reports" / name)
        split.reports.mkdir(parents=True)
        self._splits.append(split)
        worker = _Examples(example_fn, len(self._splits) - 1, split.reports, self._failures)
        return _examples(chunks, worker)

    def gather(self, report: building.BuildReport) -> None:
        """After the pipeline: merges the workers' reports into `report` split by split, in
        plan order, as a single-process build fills it; fails for a split without examples."""
        unreported = self._merge_reports(report)
        if unreported is not None:
            raise building.BuildError(
                f"split {unreported.name}: Beam's workers reported on only some of its items in "
                f"{unreported.reports}; the data dir must be on a filesystem they share"
            )

    def failure(self, report: building.BuildReport) -> building.BuildError | None:
        """Why a failed pipeline failed, as a single-process build would have said it: the
        `BuildError` a worker met first in plan order, or a split none of whose items gave an
        example (TFDS's writer stops the pipeline then), with what was reported until then
        merged into `report`; None for any other failure."""
        # Names are (split, item) positions, zero-padded, so the first name is the first failure.
        failures = sorted(self._failures.glob("*.txt"))
        if failures:
            return building.BuildError(failures[0].read_text())
        try:
            self._merge_reports(report)
        except building.BuildError as error:
            return error
        return None

    def remove(self) -> None:
        shutil.rmtree(self._work_dir)

    def _merge_reports(self, report: building.BuildReport) -> _Split | None:
        """Merges the splits' reports into `report` in plan order, failing at the first split
        without examples, until a split with reports missing, which it returns."""
        # Reports come through files, not Beam metrics (counts, but not which images were
        # skipped and why, and not every runner reports committed metrics) nor a second output
        # of the DoFn (it comes back only if the pipeline succeeds, but TFDS's writer fails a
        # split without examples inside the pipeline, which must still fail with the
        # single-process build's message, naming it). Merged in plan order, the report is the
        # single-process build's, down to the order of the skipped images.
        for split in self._splits:
            paths = sorted(split.reports.glob("*.pkl"))
            if len(paths) < split.num_chunks:
                return split
            written = 0
            for path in paths:
                chunk_report, chunk_written = pickle.loads(path.read_bytes())
                report.merge(chunk_report)
                written += chunk_written
            if not written:
                raise building.no_examples(split.name, split.num_items)
        return None


@beam.ptransform_fn
def _examples(root, chunks: list[tuple[int, str]], worker: _Examples):
    return root | "Plan" >> beam.Create(chunks) | "Examples" >> beam.ParDo(worker)


class _Examples(beam.DoFn):
    """A plan chunk -> its items' (key, example) pairs; its report and failures to files."""

    def __init__(
        self,
        example_fn: building.ExampleFn,
        split_index: int,
        reports: pathlib.Path,
        failures: pathlib.Path,
    ):
        self._example_fn = example_fn
        self._split_index = split_index
        self._reports = reports
        self._failures = failures

    def process(self, chunk: tuple[int, str]) -> Iterator[tuple[Any, dict]]:
        index, path = chunk
        items = pickle.loads(pathlib.Path(path).read_bytes())
        report, written = building.BuildReport(), 0
        for offset, item in enumerate(items):
            try:
                examples = self._example_fn(item, report)
            except building.BuildError as error:
                # A runner hands the driver a worker's exception wrapped in its own, or only as
                # text; the driver raises the first of these files as the BuildError itself.
                name = f"{self._split_index:04d}-{index * CHUNK_SIZE + offset:010d}.txt"
                files.write_atomic(self._failures / name, str(error))
                raise
            written += bool(examples)
            yield from examples
        # Written once the chunk's examples are made, under the chunk's name, so a retried or
        # duplicated bundle rewrites the same report and nothing is counted twice.
        files.write_atomic(self._reports / f"{index:06d}.pkl", pickle.dumps((report, written)))


def _without_tracebacks(record: logging.LogRecord) -> bool:
    return record.exc_info is None


@contextlib.contextmanager
def quiet_worker_errors() -> Iterator[None]:
    """Keeps a runner that runs its workers in this process (DirectRunner) from logging a
    worker's exception with its traceback: it raises the exception here too, where the build
    says what went wrong in one line (`builders.ReportingBuilder._download_and_prepare`)."""
    logger = logging.getLogger("apache_beam.runners.common")
    logger.addFilter(_without_tracebacks)
    try:
        yield
    finally:
        logger.removeFilter(_without_tracebacks)
