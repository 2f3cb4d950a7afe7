"""An eval-mllm job from option records: the benchmark, the client (endpoints, a local model or
the CLIP baseline) and the judge they describe, the run, or this process's part of a job of
several processes (`ood-jax launch`) with process 0 merging the parts, and corruptions.json."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Mapping
from typing import Union

import jax

from ood_jax import multihost
from ood_jax.eval import accounting, clients, clip_baseline, http_client, interleaving, judge
from ood_jax.eval import local_client, probe, replicas, runner, scheduling, shards, tasks
from ood_jax.eval.tasks import corrupted, foci, oodbench
from ood_jax.metrics import robustness

# The tasks whose items `corrupted` asks over a corrupted dataset.
CORRUPTED_TASKS = ("foci", "oodbench")
PARTS_DIR = "parts"  # OUTPUT/parts/I: process I's part of a job of several processes


class JobError(ValueError):
    """What stops a job before it asks anything (its options, data, model or server); one line."""


# ---------------------------------------------------------------------------------------------
# The option records
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchmarkOptions:
    """What to ask: a benchmark of tasks.BENCHMARKS over the user's data (tasks.make_benchmark),
    or over a `corrupted` dataset in `data_dir` (foci, oodbench); `circular`: N orders each."""

    benchmark: str
    data_dir: str | None = None
    config: str | None = None
    items: str | None = None
    setting: str | None = None
    ice: int | None = None
    task: str | None = None
    circular: int | None = None
    corrupted: str | None = None


@dataclasses.dataclass(frozen=True)
class EndpointOptions:
    """An OpenAI-compatible model at `urls` (several: replicas of one model), or the judge.

    `max_tokens` None: the benchmark's default budget. `check_model`: the preflight GET
    {url}/models; `check_interleaving`: ood_jax.eval.probe first measures where the server
    puts a turn's images. The rest are http_client.OpenAIChatClient's options.
    """

    urls: tuple[str, ...]
    model: str
    max_tokens: int | None = None
    api_key_env: str = clients.DEFAULT_API_KEY_ENV
    allow_plain_http_key: bool = False
    token_param: str = "max_tokens"
    temperature: float | None = 0.0
    extra_body: Mapping | None = None
    timeout_s: float = clients.DEFAULT_TIMEOUT_S
    max_attempts: int = clients.DEFAULT_MAX_ATTEMPTS
    backoff_s: float = 1.0
    max_retry_after_s: float = clients.DEFAULT_MAX_RETRY_AFTER_S
    check_model: bool = True
    check_interleaving: bool = False


@dataclasses.dataclass(frozen=True)
class LocalOptions:
    """A local transformers LVLM directory (local_client.TransformersClient)."""

    path: str
    max_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class ClipOptions:
    """The CLIP/SigLIP baseline (ood_jax.eval.clip_baseline): a scorer directory (from_hf).
    `name`: the model name its results carry (None: the directory's path)."""

    path: str
    name: str | None = None
    templates: tuple[str, ...] = clip_baseline.DEFAULT_TEMPLATES
    batch_size: int = 64


Model = Union[EndpointOptions, LocalOptions, ClipOptions]


@dataclasses.dataclass(frozen=True)
class ReadingOptions:
    """How replies are read: `parse_mode` (None: the run's, else the benchmark's default),
    `<think>` taken out or not, and the judge of the judge mode (its endpoint and budget)."""

    parse_mode: str | None = None
    strip_think: bool = True
    judge: EndpointOptions | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """How the run goes: requests in flight (per replica), the first `limit` items or a
    `shard` of them, retries, the failures in a row that stop it, prices and this invocation's
    limits, and progress on stderr."""

    concurrency: int = clients.DEFAULT_CONCURRENCY
    limit: int | None = None
    shard: shards.Shard | None = None
    retry_budget: int | None = None
    max_consecutive_failures: int = scheduling.DEFAULT_MAX_CONSECUTIVE_FAILURES
    prices: accounting.Prices | None = None
    limits: accounting.Limits = accounting.Limits()
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Job:
    """Ask `benchmark` of `model` into the run directory `output`."""

    benchmark: BenchmarkOptions
    model: Model
    output: str
    reading: ReadingOptions = ReadingOptions()
    schedule: ScheduleOptions = ScheduleOptions()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The results of a job, in `directory`. `robustness`: the corruptions.json it wrote.
    `primary`: False on a process other than 0 of a job, which leaves the report to process 0."""

    results: dict
    directory: pathlib.Path
    robustness: pathlib.Path | None = None
    primary: bool = True


# ---------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------


def run(job: Job) -> Outcome:
    """Runs `job` (runner.run, or the CLIP baseline's run_batched); raises JobError before the
    run, and what the run raises (scheduling.RunStopped, store.RunError, ...)."""
    benchmark = make_benchmark(job.benchmark)
    check_parse_mode(benchmark, job.reading.parse_mode)
    shard, output = process_part(job.schedule, job.output)
    # What every kind of model's run takes: the items it asks, and progress on process 0 only.
    part = runner.RunOptions(
        limit=job.schedule.limit,
        progress=job.schedule.progress and multihost.is_primary(),
        shard=shard,
    )
    answer = _run_clip if isinstance(job.model, ClipOptions) else _ask
    results = answer(job, benchmark, part, output)
    directory = pathlib.Path(job.output)
    if jax.process_count() > 1:
        # Every part answered: process 0 joins them into OUTPUT, as `ood-jax merge` does.
        multihost.barrier("eval-mllm: every part answered")
        if not multihost.is_primary():
            return Outcome(results, directory, primary=False)
        parts = [directory / PARTS_DIR / str(i) for i in range(jax.process_count())]
        results, _ = shards.merge(parts, directory)
    # A --limit run's numbers are a subset's: they never replace the run's corruptions.json.
    written = "limit" not in results and corrupted.write_robustness(directory, results)
    return Outcome(results, directory, directory / robustness.FILE if written else None)


def _ask(job: Job, benchmark: tasks.Benchmark, part: runner.RunOptions, output: str) -> dict:
    schedule = job.schedule
    client = make_client(job.model, benchmark, schedule.concurrency)
    options = dataclasses.replace(
        part,
        # Replicas each take `concurrency` requests at a time.
        concurrency=schedule.concurrency * len(getattr(client, "endpoints", [None])),
        retry_budget=schedule.retry_budget,
        max_consecutive_failures=schedule.max_consecutive_failures,
        strip_think=job.reading.strip_think,
        warnings=tuple(interleaving_warnings(job.model, benchmark)),
        parse_mode=job.reading.parse_mode,
        prices=schedule.prices,
        limits=schedule.limits,
    )
    return runner.run(benchmark, client, output, options, make_judge(job, output))


def process_part(schedule: ScheduleOptions, output: str) -> tuple[shards.Shard | None, str]:
    """(the shard, the output directory) of this process: in a job of N processes (`ood-jax
    launch`, one process per GPU for --local models) process I asks shard I/N into
    OUTPUT/parts/I, and process 0 merges the parts into OUTPUT."""
    count = jax.process_count()
    if count == 1:
        return schedule.shard, output
    if schedule.shard is not None:
        raise JobError(f"--shard in a job of {count} processes: each process asks its own part")
    if schedule.limit is not None:
        raise JobError(f"--limit in a job of {count} processes: the processes split every item")
    shard = shards.Shard(jax.process_index(), count)
    return shard, str(pathlib.Path(output) / PARTS_DIR / str(shard.index))


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def make_benchmark(options: BenchmarkOptions) -> tasks.Benchmark:
    """The task's benchmark, over the corrupted dataset's items when one is given."""
    try:
        return _benchmark(options)
    except ValueError as e:
        raise JobError(str(e)) from None


def _benchmark(o: BenchmarkOptions) -> tasks.Benchmark:
    if not o.corrupted:
        return tasks.make_benchmark(
            o.benchmark,
            data_dir=o.data_dir,
            config=o.config,
            items=o.items,
            setting=o.setting,
            ice=o.ice,
            task=o.task,
            circular=o.circular,
        )
    if o.benchmark not in CORRUPTED_TASKS:
        raise ValueError(f"--corrupted applies to {' and '.join(CORRUPTED_TASKS)} only")
    for flag, value in (("--ice", o.ice), ("--task", o.task), ("--items", o.items)):
        if value is not None:
            raise ValueError(f"{flag} applies to counts-oodg only")
    if o.data_dir is None:
        raise ValueError("--corrupted names a dataset in --data-dir: pass --data-dir")
    if o.config is not None:
        raise ValueError("--corrupted asks the one dataset it was built from: drop --config")
    if o.benchmark == "foci":
        if o.setting is not None:
            raise ValueError("foci has no settings (see --parse-mode)")
        return foci.CorruptedFoci(o.data_dir, o.corrupted, o.circular)
    return oodbench.CorruptedOodBench(o.data_dir, o.corrupted, o.setting or "plain", o.circular)


def check_parse_mode(benchmark: tasks.Benchmark, parse_mode: str | None) -> None:
    """JobError unless `benchmark` reads its replies under `parse_mode` (None: its own)."""
    if not parse_mode or parse_mode in benchmark.parse_modes:
        return
    if not benchmark.parse_modes:
        readable = ", ".join(
            b for b in tasks.BENCHMARKS if tasks.scoring_for({"benchmark": b}).parse_modes
        )
        raise JobError(
            f"--parse-mode applies to {readable}: {benchmark.name} reads its replies one way"
        )
    raise JobError(
        f"{benchmark.name} reads replies under --parse-mode "
        f"{', '.join(benchmark.parse_modes)}, not {parse_mode}"
    )


# ---------------------------------------------------------------------------------------------
# The clients
# ---------------------------------------------------------------------------------------------


def make_client(model: Model, benchmark: tasks.Benchmark, concurrency: int) -> scheduling.Client:
    """The client of `model`: a local model, one endpoint's, or the replicas of several, each
    taking `concurrency` requests at a time; the endpoints' model checked (the preflight)."""
    if isinstance(model, LocalOptions):
        return local_client.TransformersClient(
            model.path,
            max_new_tokens=model.max_tokens or benchmark.default_max_tokens,
            task=benchmark.name,
        )
    if not isinstance(model, EndpointOptions):
        raise TypeError(f"no chat client for {type(model).__name__}")
    model = dataclasses.replace(model, max_tokens=model.max_tokens or benchmark.default_max_tokens)
    endpoints = [endpoint_client(model, url) for url in dict.fromkeys(model.urls)]
    if len(endpoints) == 1:
        return endpoints[0]
    return replicas.Replicas(endpoints, concurrency)


def endpoint_client(options: EndpointOptions, url: str) -> http_client.OpenAIChatClient:
    """The client of one endpoint, its model checked unless `check_model` is off."""
    budget = {} if options.max_tokens is None else {"max_tokens": options.max_tokens}
    try:
        client = http_client.OpenAIChatClient(
            url,
            options.model,
            **budget,
            api_key_env=options.api_key_env,
            timeout_s=options.timeout_s,
            max_attempts=options.max_attempts,
            backoff_base_s=options.backoff_s,
            max_retry_after_s=options.max_retry_after_s,
            token_param=options.token_param,
            temperature=options.temperature,
            extra_body=dict(options.extra_body) if options.extra_body is not None else None,
            allow_plain_http_key=options.allow_plain_http_key,
        )
    except ValueError as e:
        raise JobError(str(e)) from None
    if not client.has_api_key:
        print(f"note: ${options.api_key_env} is not set; sending no API key", file=sys.stderr)
    if options.check_model:
        try:
            note = client.check_model()
        except clients.ClientError as e:
            raise JobError(str(e)) from None
        if note:
            print(f"note: {note}", file=sys.stderr)
    return client


def make_judge(job: Job, output: str) -> judge.Judge | None:
    """The judge of the judge parse mode, keeping its verdicts in `output` (this process's run
    directory, whose judge.jsonl `ood-jax merge` joins)."""
    options = job.reading.judge
    if options is None:
        return None
    client = endpoint_client(options, options.urls[0])
    return judge.Judge(client, output, concurrency=job.schedule.concurrency)


def interleaving_warnings(model: Model, benchmark: tasks.Benchmark) -> list[str]:
    """What the results must say about where an endpoint's model saw the images: the probe's
    finding with `check_interleaving`, else that nobody checked (multi-image items only)."""
    if not isinstance(model, EndpointOptions):
        return []  # a local model keeps images in place or refuses (interleaving.LocalPrompts)
    found = None
    if model.check_interleaving:
        found = probe.probe_endpoint(
            model.urls[0], model.model, api_key_env=model.api_key_env, timeout_s=model.timeout_s
        )
        print(f"{interleaving.PROBE_FLAG}: {found.detail}", file=sys.stderr)
    most = benchmark.max_images_per_item()
    if most < 2 or (found is not None and found.keeps_images_in_place):
        return []
    if found is not None and found.keeps_images_in_place is False:
        return [
            f"{benchmark.name}: items carry up to {most} images between their texts, and "
            f"{interleaving.PROBE_FLAG} found that {found.detail}; the model saw them away "
            "from the texts they belong to"
        ]
    warning = interleaving.endpoint_warning(benchmark.name, most)
    if found is not None:
        warning += f" (it could not tell here: {found.detail})"
    return [warning]


def _run_clip(job: Job, benchmark: tasks.Benchmark, part: runner.RunOptions, output: str) -> dict:
    options: ClipOptions = job.model  # type: ignore[assignment]
    try:
        from ood_jax.scorers import from_hf
    except ImportError as e:
        raise JobError(f"the CLIP baseline needs ood_jax.scorers ({e})") from None
    scorer = from_hf(options.path)
    return clip_baseline.run_clip_baseline(
        benchmark,
        scorer,
        output,
        scorer_name=options.name or str(pathlib.Path(options.path).resolve()),
        templates=tuple(options.templates),
        batch_size=options.batch_size,
        options=part,
    )
