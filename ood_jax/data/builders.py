"""The mixins our TFDS builders are made of: `ReportingBuilder` (a build report, one progress
bar, builds on Apache Beam through `ood_jax.data.beam`) and `SourceBuilder` (a release read from
`--source`). The rules they build by are `ood_jax.data.building`'s.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any, Iterable, Iterator, Sequence, TypeVar

from ood_jax.data import building

T = TypeVar("T")


class ReportingBuilder:
    """Mixed into each of our `tfds.core.GeneratorBasedBuilder`s: a `BuildReport`, one progress
    bar over the whole build (`ood_jax.datasets.build` turns it on and TFDS's own per-split bars
    off), and builds on Apache Beam. (A mixin, not a builder subclass, so TFDS registers no
    extra dataset.)

    A builder's `_split_generators` validates its source and plans each split as a list of items
    (in the driver, so bad annotations fail before anything is written) and returns
    `_generate_examples(split, items, example_fn)`. Given a Beam runner or options
    (`tfds.download.DownloadConfig`), the items' examples are made on Beam's workers
    (`ood_jax.data.beam`); otherwise in this process, in order.
    """

    def __init__(self, **kwargs):
        self.report = building.BuildReport()
        self.show_progress = False
        self._progress = None
        self._beam = None  # the Beam build under way (`ood_jax.data.beam.Build`), if any
        super().__init__(**kwargs)

    def _generate_examples(self, split: str, items: Sequence[T], example_fn: building.ExampleFn):
        """What `_split_generators` returns for `split`: `example_fn` applied to each item, as
        a generator or, in a Beam build, a `beam.PTransform`. A split none of whose items gives
        an example fails naming it (`building.no_examples`)."""
        if self._beam is not None:
            return self._beam.split(split, items, example_fn)
        return self._generate(split, items, example_fn)

    def _generate(
        self, split: str, items: Sequence[T], example_fn: building.ExampleFn
    ) -> Iterator[tuple[Any, dict]]:
        written = 0
        for item in self.track(items):
            examples = example_fn(item, self.report)
            written += bool(examples)
            yield from examples
        if not written:
            raise building.no_examples(split, len(items))

    def _download_and_prepare(self, dl_manager, download_config) -> None:
        if download_config.beam_runner is None and download_config.beam_options is None:
            super()._download_and_prepare(dl_manager, download_config)
            return
        from ood_jax.data import beam

        # Inside TFDS's incomplete directory, which a failed build removes.
        self._beam = beam.Build(self.data_dir)
        try:
            with beam.quiet_worker_errors():
                super()._download_and_prepare(dl_manager, download_config)
        except Exception:
            failure = self._beam.failure(self.report)
            if failure is None:
                raise
            raise failure from None
        finally:
            self._beam.remove()
            self._beam = None

    def _process_pipeline_result(self, pipeline_result) -> None:
        # TFDS calls this once the pipeline has run, before it finalizes the splits.
        del pipeline_result
        self._beam.gather(self.report)

    def source_path(self, source: str | None) -> str | None:
        """The source directory a record of this build names; None for a builder reading none."""
        del source
        return None

    def origin(self, source: str | None) -> building.Origin:
        """What this build is made from; compared with a dataset's record on a rebuild."""
        raise NotImplementedError(f"{type(self).__name__} must say what it is built from")

    def start_progress(self, total: int, unit: str) -> None:
        """Opens the build's one bar, over the `total` source items that every split reads."""
        # Beam's workers cannot advance a bar here; the runner shows its own progress.
        if not self.show_progress or self._beam is not None:
            return
        from tqdm import tqdm

        config = f"/{self.builder_config.name}" if self.builder_config else ""
        self._progress = tqdm(
            total=total, desc=f"{self.name}{config}", unit=f" {unit}", file=sys.stderr
        )

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """Iterates over one split's source items, advancing the build's bar past each."""
        for item in items:
            yield item
            if self._progress is not None:
                self._progress.update(1)

    def close_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    # TFDS prints where it writes before and after a build; ood_jax.datasets builds in a
    # staging directory and moves the result, so those lines would name the wrong place.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass


class SourceBuilder(ReportingBuilder):
    """Mixed into a `tfds.core.GeneratorBasedBuilder` that reads a release from `--source`.

    Adds the `on_error` choice; the source directory arrives as TFDS's manual directory. Each
    builder names, in `source_files`, the files other than images that it reads: their digests
    identify the source in the dataset's build record.
    """

    MANUAL_DOWNLOAD_INSTRUCTIONS = "Pass the directory holding the release with --source."

    def __init__(self, *, on_error: str = "fail", **kwargs):
        self.on_error = building.check_on_error(on_error)
        super().__init__(**kwargs)

    def source_files(self, src: pathlib.Path) -> list[pathlib.Path]:
        raise NotImplementedError(f"{type(self).__name__} must name the files it reads")

    def source_path(self, source: str | None) -> str:
        # Resolved, so two spellings of one directory (a symlink, a relative path) are one source.
        return str(self._given_source(source).resolve())

    def origin(self, source: str | None) -> building.Origin:
        src = self._existing_source(source).resolve()
        return building.Origin.of_source(src, self.source_files(src))

    def source_dir(self, dl_manager) -> pathlib.Path:
        return self._existing_source(getattr(dl_manager, "_manual_dir", None))

    def _given_source(self, source) -> pathlib.Path:
        if source is None:
            raise building.BuildError(
                f"{self.name}: pass --source, the directory holding the release"
            )
        return pathlib.Path(source).expanduser()

    def _existing_source(self, source) -> pathlib.Path:
        path = self._given_source(source)
        if not path.is_dir():
            raise building.BuildError(
                f"{self.name}: source directory {source} does not exist (--source)"
            )
        return path
