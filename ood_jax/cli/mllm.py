"""`ood-jax eval-mllm`, `rescore` and `merge`: their flags, read into ood_jax.eval.job's option
records (eval-mllm) or the arguments of ood_jax.eval.rescore and shards (rescore, merge), and what
each prints and exits with (EXIT_CODES)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ood_jax.cli import help_text
from ood_jax.eval import accounting, clients, clip_baseline, http_client, interleaving, job
from ood_jax.eval import judge, rescore, scheduling, shards, store, tasks

EXIT_INCOMPLETE = 3
EXIT_STOPPED = 4
EXIT_CODES = (
    "exit status:\n"
    "  0    the run is complete: every item has a reply\n"
    "  1    a usage or data error, or the preflight failed (one error: line)\n"
    f"  {EXIT_INCOMPLETE}    the run finished with failed requests (or judge requests); rerun "
    "the same command to retry them\n"
    f"  {EXIT_STOPPED}    stopped early: --max-consecutive-failures items in a row failed the "
    "same way, or --max-requests / --max-cost was reached; rerun the same command to continue\n"
    "  130  interrupted (Ctrl-C); rerun the same command to continue"
)

# What to do about a run that stopped early, by the kind of error that stopped it.
_FIXES = {
    "timeout": "the server takes longer than --timeout per request: raise --timeout, or "
    "lower --concurrency (the time a request waits in the server's queue counts)",
    "connection": "is the server running at --endpoint?",
    "malformed reply": "the endpoint does not answer as an OpenAI-compatible chat-completions "
    "server: check --endpoint (its base URL, such as http://127.0.0.1:8000/v1)",
    "TLS": "the server's certificate is not trusted here",
    "HTTP 400": "the server rejects the request: check --model, --max-tokens, --token-param "
    "(o-series models take max_completion_tokens), --temperature and --extra-body",
    "HTTP 401": "the server refuses the API key: check the variable --api-key-env names",
    "HTTP 403": "the server refuses the API key: check the variable --api-key-env names",
    "HTTP 404": "check --endpoint (the base URL, ending in /v1 for most servers) and --model",
    "HTTP 413": "the request is too large for the server (images): raise its body size limit",
    "HTTP 422": "the server rejects the request body: check --token-param, --temperature "
    "and --extra-body",
    "HTTP 429": "rate limited: lower --concurrency, raise --max-retry-after, or rerun later",
}
_SERVER_FIX = (
    "the server fails: see its log (some servers, transformers serve among them, answer a "
    "misspelled --model with HTTP 500)"
)


def fix_for(kind: str) -> str:
    """What to do about a run that stopped early with errors of `kind`."""
    if kind in _FIXES:
        return _FIXES[kind]
    if kind.startswith("HTTP 5"):
        return _SERVER_FIX
    return "see the error above"


def add_parsers(subparsers) -> None:
    _add_eval_mllm(subparsers)
    _add_rescore(subparsers)
    _add_merge(subparsers)


def _fail(message: str) -> SystemExit:
    return SystemExit(f"error: {message}")


# ---------------------------------------------------------------------------------------------
# eval-mllm: the flags
# ---------------------------------------------------------------------------------------------

_EVAL_DESCRIPTION = (
    "Asks a model every item of a benchmark and writes OUTPUT/predictions.jsonl (one line "
    "per item, appended as replies arrive), results.json and results.md. Rerunning into "
    "the same OUTPUT sends only the items still without a reply; Ctrl-C keeps the "
    "replies received. --limit N writes results.limitN.json and results.limitN.md "
    "beside the full results, never over them. With --endpoint, GET {endpoint}/models "
    "must list --model first; each prediction keeps the reply's finish reason, refusal, "
    "reasoning, token usage, latency and attempts, and the results count replies "
    "answered, truncated, refused, empty and failed. A run stops early when "
    "--max-consecutive-failures items in a row fail the same way; the exit status says "
    "how it went. Replies are read under --parse-mode, which is not part of the run's "
    "identity: a rerun with another mode, or `ood-jax rescore OUTPUT`, reads the stored "
    "replies again and asks the model nothing; results.md ends with a parser audit of "
    "every mode, and every accuracy has an exact 95% interval."
)
_EVAL_EXAMPLES = (
    "ood-jax eval-mllm foci --data-dir data/tfds --config food101 \\\n"
    "      --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2-VL-7B-Instruct "
    "--output runs/foci_qwen",
    "ood-jax eval-mllm counts-oodg --items items/items.jsonl --local models/llava "
    "--output runs/oodg --limit 20",
    "ood-jax eval-mllm oodbench --data-dir data/tfds --endpoint "
    "http://127.0.0.1:8000/v1 \\\n      --model Qwen/Qwen2.5-VL-7B-Instruct "
    "--concurrency 32 --output runs/oodbench_qwen",
    "ood-jax eval-mllm foci --data-dir data/tfds --config food101 --endpoint "
    "https://api.openai.com/v1 \\\n      --model o4-mini --token-param "
    "max_completion_tokens --temperature none --max-tokens 2048 \\\n      "
    '--extra-body \'{"reasoning_effort": "low"}\' --output runs/foci_o4mini',
    "ood-jax eval-mllm foci --data-dir data/tfds --config food101 --endpoint "
    "http://127.0.0.1:8000/v1 \\\n      --model Qwen/Qwen2-VL-7B-Instruct --output "
    "runs/foci_qwen --parse-mode judge \\\n      --judge-endpoint "
    "http://127.0.0.1:8001/v1 --judge-model Qwen/Qwen2.5-7B-Instruct",
    "ood-jax eval-mllm foci --data-dir data/tfds --corrupted "
    "corrupted/foci-food101-9bfccb7c34 \\\n      --endpoint http://127.0.0.1:8000/v1 "
    "--model Qwen/Qwen2-VL-7B-Instruct --output runs/foci_qwen_corrupted",
)


def _add_eval_mllm(subparsers) -> None:
    p = subparsers.add_parser(
        "eval-mllm",
        help="evaluate an MLLM on foci, counts-oodg, oodbench or oodbench-bap (resumable)",
        description=help_text.fill(_EVAL_DESCRIPTION),
        epilog=help_text.examples(*_EVAL_EXAMPLES) + "\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _benchmark_flags(p.add_argument_group("what to ask"))
    _model_flags(p.add_argument_group("the model"))
    _run_flags(p.add_argument_group("the run"))
    _request_flags(p.add_argument_group("requests (--endpoint)"))
    _cost_flags(p.add_argument_group("cost and limits (--endpoint, --local)"))
    _reading_flags(p.add_argument_group("reading replies"))
    _judge_flags(p.add_argument_group("the judge (--parse-mode judge)"))
    _clip_flags(p.add_argument_group("the CLIP baseline (--clip)"))
    p.set_defaults(run=run_eval_mllm)


def _benchmark_flags(g) -> None:
    g.add_argument("benchmark", choices=tasks.BENCHMARKS)
    g.add_argument("--data-dir", help="TFDS data directory holding the built benchmark")
    g.add_argument(
        "--config",
        help="builder config: foci dataset(s), comma-separated (default: every built one); "
        "oodbench: default / bap",
    )
    g.add_argument("--items", help="counts-oodg: the items.jsonl written by `ood-jax mine oodg`")
    g.add_argument(
        "--corrupted",
        metavar="corrupted/NAME",
        help="foci, oodbench: ask the items of this corrupted dataset in --data-dir (`ood-jax "
        "build corrupted` of a foci config or oodbench/default), clean and under each "
        "corruption and severity; results add the score per corruption, and OUTPUT gets "
        "corruptions.json (mPC, rPC) for `ood-jax report`. Part of the run's identity",
    )
    g.add_argument(
        "--setting",
        help="oodbench: plain or cot; counts-oodg: zero_shot, iid, covariate_shift, label_shift "
        "or spurious_correlation (default: all in the items file)",
    )
    g.add_argument(
        "--ice", type=int, help="counts-oodg: only items with this many in-context examples"
    )
    g.add_argument("--task", choices=tasks.OODG_TASKS, help="counts-oodg: only this task")
    g.add_argument(
        "--circular",
        type=int,
        metavar="N",
        help="circular evaluation, N times the requests: foci asks every item under N cyclic "
        "shifts of its options (2-4; 4: MMBench's CircularEval), oodbench (N=2) every question "
        "with its answers also listed 'no' first, paired with its negation; results add the "
        "accuracy with every rotation right, the letters picked and the yes-bias. Part of the "
        "run's identity; --limit counts the rotated items",
    )


def _model_flags(g) -> None:
    model = g.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--endpoint",
        action="append",
        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1; repeated for replicas "
        "of one model: requests are spread over them, each with its own --concurrency, and a "
        "replica that keeps failing leaves the rotation (said on stderr)",
    )
    model.add_argument("--local", metavar="PATH", help="a local transformers LVLM directory")
    model.add_argument(
        "--clip", metavar="PATH", help="CLIP/SigLIP baseline: a scorer directory (from_hf)"
    )
    g.add_argument("--model", help="model name sent to the endpoint (required with --endpoint)")
    g.add_argument(
        interleaving.PROBE_FLAG,
        action="store_true",
        help="--endpoint: first measure where the server puts a turn's images (exactly via "
        "vLLM's /tokenize, else from greedy replies) and record it in the results",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        help="generation budget (default: foci 10 as FOCI, oodbench 16, cot 512, bap 32, "
        "counts-oodg 512)",
    )
    g.add_argument(
        "--api-key-env",
        default=clients.DEFAULT_API_KEY_ENV,
        help="environment variable holding the API key (default OPENAI_API_KEY); unset: no key",
    )
    g.add_argument(
        "--allow-plain-http-key",
        action="store_true",
        help="send the API key over plain http:// to a host other than loopback (refused "
        "otherwise: anyone on the path could read it)",
    )


def _run_flags(g) -> None:
    g.add_argument("--output", required=True, help="run directory (predictions and results)")
    g.add_argument(
        "--limit",
        type=int,
        help="only the first N items; their results go to OUTPUT/results.limitN.{json,md}",
    )
    g.add_argument(
        "--shard",
        type=_shard,
        metavar="I/N",
        help="ask the I-th of N disjoint parts of the items (by item id; a question's rotations "
        "stay together), e.g. one part per machine; `ood-jax merge` joins the N parts' OUTPUTs",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        default=clients.DEFAULT_CONCURRENCY,
        help="most requests in flight; fewer while the server signals overload (429, 5xx, "
        f"timeouts), back up one at a time as it copes (default {clients.DEFAULT_CONCURRENCY}, "
        "for one local server; batching servers and hosted APIs take 16-64)",
    )
    g.add_argument(
        "--max-consecutive-failures",
        type=int,
        default=scheduling.DEFAULT_MAX_CONSECUTIVE_FAILURES,
        help="stop the run when this many items in a row fail with the same kind of error, "
        f"keeping every reply (default {scheduling.DEFAULT_MAX_CONSECUTIVE_FAILURES}; 0: never)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _request_flags(g) -> None:
    g.add_argument(
        "--token-param",
        choices=clients.TOKEN_PARAMS,
        default="max_tokens",
        help="the request field of the generation budget (default max_tokens; OpenAI's "
        "o-series and other reasoning models take max_completion_tokens)",
    )
    g.add_argument(
        "--temperature",
        type=_temperature,
        default=0.0,
        metavar="T|none",
        help="sampling temperature (default 0, greedy); none: send no temperature, for "
        "models that reject one",
    )
    g.add_argument(
        "--extra-body",
        metavar="JSON",
        help="a JSON object merged into every request body (vendor sampling parameters such "
        "as top_k, reasoning_effort or chat_template_kwargs); part of the run's identity",
    )
    _retry_flags(g)
    g.add_argument(
        "--no-model-check",
        action="store_true",
        help="skip the preflight GET {endpoint}/models that checks --model is served",
    )


def _retry_flags(g) -> None:
    g.add_argument(
        "--timeout",
        type=float,
        default=clients.DEFAULT_TIMEOUT_S,
        help="seconds an attempt may take, from sending a request to its whole reply; after a "
        "timeout one request at a time goes out until the server catches up, since it may "
        f"still be computing the abandoned one (default {clients.DEFAULT_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--max-attempts",
        type=int,
        default=clients.DEFAULT_MAX_ATTEMPTS,
        help=f"HTTP attempts per item (default {clients.DEFAULT_MAX_ATTEMPTS})",
    )
    g.add_argument(
        "--retry-budget",
        type=int,
        help="retries the whole run may make (default: 10, plus one per 4 items asked), so "
        "that a failing server costs a few requests, not --max-attempts per item",
    )
    g.add_argument(
        "--max-retry-after",
        type=float,
        default=clients.DEFAULT_MAX_RETRY_AFTER_S,
        help="longest Retry-After, in seconds, waited for; a server asking for longer fails "
        f"that item at once, saying so (default {clients.DEFAULT_MAX_RETRY_AFTER_S:g}; 0: "
        "never wait on one)",
    )
    g.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="first retry wait in seconds, doubling per attempt up to 60 s (default 1)",
    )


def _cost_flags(g) -> None:
    g.add_argument(
        "--price-in",
        type=float,
        metavar="PRICE",
        help="price of a million prompt tokens; with --price-out, results.json and results.md "
        "price the token usage the server reports. Not part of the run's identity: OUTPUT "
        "keeps the last prices given",
    )
    g.add_argument(
        "--price-out", type=float, metavar="PRICE", help="price of a million completion tokens"
    )
    g.add_argument(
        "--max-requests",
        type=int,
        metavar="N",
        help="stop (exit 4, every reply kept) before this invocation's request N+1; a request "
        "is one item asked, its retries included; a rerun continues",
    )
    g.add_argument(
        "--max-cost",
        type=float,
        metavar="COST",
        help="stop (exit 4, every reply kept) once this invocation's replies cost this much at "
        "--price-in/--price-out (requests already out still finish); a rerun continues",
    )


def _reading_flags(g) -> None:
    g.add_argument(
        "--strip-think",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take <think>...</think> reasoning out of replies before they are parsed, "
        "keeping it as the prediction's reasoning (default: on; part of the run's identity)",
    )
    g.add_argument(
        "--parse-mode",
        choices=tasks.PARSE_MODES,
        help="how multiple-choice replies are read (foci and counts-oodg): foci, FOCI's rule "
        "(the reply begins with the letter; foci's default); strict, a letter standing alone "
        "or an option named in full (counts-oodg's default); last, the last choice the reply "
        "states (chain-of-thought); judge, strict and then --judge-model for what no rule "
        "reads. Not part of the run's identity: another mode re-reads the stored replies and "
        "asks the model nothing (default: the mode OUTPUT's results were last written with)",
    )


def _judge_flags(g) -> None:
    g.add_argument(
        "--judge-endpoint",
        help="OpenAI-compatible base URL of the judge model, asked only about replies no rule "
        "reads; its verdicts are kept in OUTPUT/judge.jsonl",
    )
    g.add_argument("--judge-model", help="the judge's model name at --judge-endpoint")
    g.add_argument(
        "--judge-api-key-env",
        default=clients.DEFAULT_API_KEY_ENV,
        help="environment variable holding the judge's API key (default OPENAI_API_KEY)",
    )
    g.add_argument(
        "--judge-max-tokens",
        type=int,
        default=judge.DEFAULT_MAX_TOKENS,
        help=f"the judge's generation budget (default {judge.DEFAULT_MAX_TOKENS}: one letter; "
        "more for a reasoning judge); part of the judge's identity",
    )


def _clip_flags(g) -> None:
    g.add_argument(
        "--templates",
        nargs="+",
        help="--clip: text templates with {} for the option (default: 'a photo of a {}.')",
    )
    g.add_argument("--batch-size", type=int, default=64, help="--clip: images per batch")


def _temperature(value: str) -> float | None:
    if value.lower() == "none":
        return None
    try:
        temperature = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'none': {value!r}") from None
    if not (math.isfinite(temperature) and temperature >= 0):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {value!r}")
    return temperature


def _shard(spec: str) -> shards.Shard:
    try:
        return shards.Shard.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--shard {spec!r}: ")) from None


# ---------------------------------------------------------------------------------------------
# eval-mllm: the checks that need more than one flag, and the option records
# ---------------------------------------------------------------------------------------------


def _extra_body(value: str | None) -> dict | None:
    """--extra-body parsed and checked; a bad one is one error line naming the flag."""
    if value is None:
        return None
    try:
        body = json.loads(value)
    except json.JSONDecodeError as e:
        raise _fail(f"--extra-body is not JSON ({e.msg} at character {e.pos}): {value!r}") from None
    try:
        return http_client.check_extra_body(body)
    except ValueError as e:
        raise _fail(str(e)) from None


def _check_model_arguments(args: argparse.Namespace) -> None:
    if args.endpoint and not args.model:
        raise _fail("--endpoint needs --model (the name the server knows the model by)")
    if args.templates and not args.clip:
        raise _fail("--templates applies to --clip only")
    if bool(args.judge_endpoint) != bool(args.judge_model):
        raise _fail("a judge needs both --judge-endpoint and --judge-model")
    if args.judge_endpoint and args.parse_mode != tasks.JUDGE_MODE:
        raise _fail("--judge-endpoint and --judge-model apply to --parse-mode judge only")
    if args.parse_mode == tasks.JUDGE_MODE and not args.judge_endpoint:
        raise _fail("--parse-mode judge needs --judge-endpoint and --judge-model")
    if args.judge_endpoint and args.clip:
        raise _fail("--clip answers with letters: it needs no judge")
    if args.parse_mode and args.clip:
        raise _fail("--clip answers with the letter itself: every --parse-mode reads it alike")


def _check_endpoint_only(args: argparse.Namespace, extra_body: dict | None) -> None:
    if args.endpoint:
        return
    for flag, given in (
        ("--token-param", args.token_param != "max_tokens"),
        ("--temperature", args.temperature != 0),
        ("--extra-body", extra_body is not None),
        (interleaving.PROBE_FLAG, args.check_interleaving),
    ):
        if given:
            raise _fail(f"{flag} applies to --endpoint only")


def _check_ranges(args: argparse.Namespace) -> None:
    for flag, value, least in (
        ("--concurrency", args.concurrency, 1),
        ("--limit", args.limit, 0),
        ("--max-tokens", args.max_tokens, 1),
        ("--max-attempts", args.max_attempts, 1),
        ("--retry-budget", args.retry_budget, 0),
        ("--max-consecutive-failures", args.max_consecutive_failures, 0),
        ("--max-requests", args.max_requests, 0),
        ("--batch-size", args.batch_size, 1),
        ("--judge-max-tokens", args.judge_max_tokens, 1),
    ):
        if value is not None and value < least:
            raise _fail(f"{flag} must be at least {least}, got {value}")
    if not args.timeout > 0:
        raise _fail(f"--timeout must be positive, got {args.timeout}")
    if not args.max_retry_after >= 0:
        raise _fail(f"--max-retry-after must be non-negative, got {args.max_retry_after}")


def _check_cost_arguments(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--price-in", args.price_in),
        ("--price-out", args.price_out),
        ("--max-cost", args.max_cost),
    ):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise _fail(f"{flag} must be a non-negative number, got {value}")
    if (args.price_in is None) != (args.price_out is None):
        raise _fail("--price-in and --price-out go together: the prices of prompt and completion")
    if args.clip and any(v is not None for v in (args.price_in, args.max_requests, args.max_cost)):
        raise _fail(
            "--price-in, --price-out, --max-requests and --max-cost apply to "
            "--endpoint and --local, not --clip"
        )


def eval_job(args: argparse.Namespace) -> job.Job:
    """The job eval-mllm's flags ask for; a flag that does not fit is one error line."""
    _check_model_arguments(args)
    extra_body = _extra_body(args.extra_body)
    _check_endpoint_only(args, extra_body)
    _check_ranges(args)
    _check_cost_arguments(args)
    return job.Job(
        benchmark=job.BenchmarkOptions(
            args.benchmark,
            data_dir=args.data_dir,
            config=args.config,
            items=args.items,
            setting=args.setting,
            ice=args.ice,
            task=args.task,
            circular=args.circular,
            corrupted=args.corrupted,
        ),
        model=_model(args, extra_body),
        output=args.output,
        reading=job.ReadingOptions(args.parse_mode, args.strip_think, _judge(args)),
        schedule=job.ScheduleOptions(
            concurrency=args.concurrency,
            limit=args.limit,
            shard=args.shard,
            retry_budget=args.retry_budget,
            max_consecutive_failures=args.max_consecutive_failures,
            prices=_prices(args),
            limits=accounting.Limits(args.max_requests, args.max_cost),
            progress=not args.no_progress,
        ),
    )


def _model(args: argparse.Namespace, extra_body: dict | None) -> job.Model:
    if args.local:
        return job.LocalOptions(args.local, args.max_tokens)
    if args.clip:
        templates = tuple(args.templates or clip_baseline.DEFAULT_TEMPLATES)
        return job.ClipOptions(args.clip, args.model, templates, args.batch_size)
    return _endpoint(
        args,
        args.endpoint,
        args.model,
        args.api_key_env,
        args.max_tokens,
        token_param=args.token_param,
        temperature=args.temperature,
        extra_body=extra_body,
        check_interleaving=args.check_interleaving,
    )


def _judge(args: argparse.Namespace) -> job.EndpointOptions | None:
    """The judge's endpoint: greedy, with the run's timeouts and retries."""
    if not args.judge_endpoint:
        return None
    return _endpoint(
        args, [args.judge_endpoint], args.judge_model, args.judge_api_key_env, args.judge_max_tokens
    )


def _endpoint(
    args: argparse.Namespace, urls, model: str, api_key_env: str, max_tokens, **request
) -> job.EndpointOptions:
    return job.EndpointOptions(
        tuple(urls),
        model,
        max_tokens=max_tokens,
        api_key_env=api_key_env,
        allow_plain_http_key=args.allow_plain_http_key,
        timeout_s=args.timeout,
        max_attempts=args.max_attempts,
        backoff_s=args.backoff,
        max_retry_after_s=args.max_retry_after,
        check_model=not args.no_model_check,
        **request,
    )


def _prices(args: argparse.Namespace) -> accounting.Prices | None:
    if args.price_in is None:
        return None
    return accounting.Prices(args.price_in, args.price_out)


# ---------------------------------------------------------------------------------------------
# eval-mllm: the run and what it says
# ---------------------------------------------------------------------------------------------


def run_eval_mllm(args: argparse.Namespace) -> dict:
    try:
        outcome = job.run(eval_job(args))
    except (job.JobError, store.RunError, tasks.ItemsError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    except scheduling.LimitReached as e:
        print(f"stopped: {e}; rerun the same command to continue", file=sys.stderr)
        raise SystemExit(EXIT_STOPPED) from None
    except scheduling.RunStopped as e:
        print(
            f"stopped: {e}. To fix: {fix_for(e.kind)}; then rerun the same command to continue",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_STOPPED) from None
    if not outcome.primary:
        return outcome.results
    _print_results(outcome)
    _note_outcomes(outcome.results)
    if not outcome.results["complete"]:
        _say_incomplete(outcome)
        raise SystemExit(EXIT_INCOMPLETE)
    return outcome.results


def _print_results(outcome: job.Outcome) -> None:
    """results.md on stdout; where the numbers went on stderr."""
    results, output = outcome.results, outcome.directory
    json_name, md_name = store.results_files(results.get("limit"))
    print((output / md_name).read_text())
    if outcome.robustness is not None:
        print(f"mPC and rPC -> {outcome.robustness}", file=sys.stderr)
    if "limit" in results:
        full = output / store.RESULTS_JSON
        rest = (
            f"{full} (every item) is unchanged"
            if full.exists()
            else f"a run without --limit writes {full}"
        )
        print(
            f"results of the first {results['limit']} items -> {output / json_name}; {rest}",
            file=sys.stderr,
        )


def _note_outcomes(results: dict) -> None:
    """Says on stderr what the scores alone would hide: replies cut short, refused or empty."""
    counts = results["outcomes"]
    if counts["truncated"]:
        print(
            f"note: {counts['truncated']} replies were cut at the token budget "
            '(finish_reason "length") and scored as they are; a reasoning model needs a '
            "larger --max-tokens",
            file=sys.stderr,
        )
    if counts["refused"]:
        print(f"note: the model refused {counts['refused']} requests", file=sys.stderr)
    if counts["empty"]:
        print(
            f"note: {counts['empty']} replies had no answer text (only reasoning, or nothing)",
            file=sys.stderr,
        )


def _say_incomplete(outcome: job.Outcome) -> None:
    results = outcome.results
    failed = results["outcomes"]["error"]
    if failed:
        print(
            f"{failed} of {results['num_items']} items failed; rerun the same command to retry "
            f"them (details in {outcome.directory / store.PREDICTIONS_FILE})",
            file=sys.stderr,
        )
    unjudged = results.get("judge", {}).get("without_verdict", 0)
    if unjudged:
        print(
            f"{unjudged} replies have no verdict: their judge requests failed; rerun the "
            f"same command to retry them (details in {outcome.directory / judge.JUDGE_FILE})",
            file=sys.stderr,
        )


# ---------------------------------------------------------------------------------------------
# rescore
# ---------------------------------------------------------------------------------------------


def _add_rescore(subparsers) -> None:
    p = subparsers.add_parser(
        "rescore",
        help="an eval-mllm run's results again from its stored replies, under any parse "
        "modes (sends nothing)",
        description=help_text.fill(
            "Reads RUN_DIR/predictions.jsonl and computes the results again with the code "
            "eval-mllm uses, sending nothing to any model. Under the run's own parse mode (the "
            "default) they replace RUN_DIR/results.json and results.md; under another mode they "
            "go beside them, to results.MODE.json and results.MODE.md; with --out, all of them "
            "go to OUT and RUN_DIR is left as it was. Each results.md ends with the parser "
            "audit: per parse mode, the replies it cannot read, those it reads differently and "
            "the headline number it gives. --parse-mode judge reads the verdicts "
            "RUN_DIR/judge.jsonl keeps from the run's judge."
        ),
        epilog=help_text.examples(
            "ood-jax rescore runs/foci_qwen",
            "ood-jax rescore runs/foci_qwen --parse-mode strict last",
            "ood-jax rescore runs/oodg --parse-mode last --out runs/oodg_last",
            "ood-jax rescore runs/oodg --limit 20 --json",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="an eval-mllm --output directory")
    p.add_argument(
        "--parse-mode",
        nargs="+",
        choices=tasks.PARSE_MODES,
        default=[],
        metavar="MODE",
        help=f"parse modes to score under ({', '.join(tasks.PARSE_MODES)}; default: the run's)",
    )
    p.add_argument("--out", help="write the results here instead of RUN_DIR")
    p.add_argument(
        "--limit",
        type=int,
        help="re-score the results of an eval-mllm --limit N run (results.limitN.json)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run_rescore)


def run_rescore(args: argparse.Namespace) -> list[dict]:
    if args.limit is not None and args.limit < 0:
        raise _fail(f"--limit must be at least 0, got {args.limit}")
    try:
        written = rescore.rescore(args.run_dir, args.parse_mode, args.out, args.limit)
    except (store.RunError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    if args.json:
        print(json.dumps({str(path): results for _, path, results, _ in written}, indent=2))
    else:
        for k, (mode, path, _, markdown) in enumerate(written):
            mode_note = f" (parse mode {mode})" if mode else ""
            print(("\n" if k else "") + f"# {path}{mode_note}\n")
            print(markdown.rstrip("\n"))
    return [results for _, _, results, _ in written]


# ---------------------------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------------------------


def _add_merge(subparsers) -> None:
    p = subparsers.add_parser(
        "merge",
        help="join the parts of an eval-mllm run split with --shard I/N into one run directory",
        description=help_text.fill(
            "Checks that the PART directories are every shard I/N of one run (the same benchmark, "
            "model and options, the same items: each part's all_items.jsonl), that together they "
            "answer every item once, and writes OUTPUT as one run over every item writes it: "
            "predictions.jsonl in the benchmark's order, run.json, results.json and results.md, "
            "judge.jsonl for the judge parse mode, and a manifest naming the parts."
        ),
        epilog=help_text.examples(
            "ood-jax merge runs/foci_qwen.0 runs/foci_qwen.1 --output runs/foci_qwen",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("parts", nargs="+", metavar="PART", help="eval-mllm --shard output directories")
    p.add_argument("--output", required=True, help="the merged run directory")
    p.set_defaults(run=run_merge)


def run_merge(args: argparse.Namespace) -> dict:
    try:
        results, markdown = shards.merge(args.parts, args.output)
    except (store.RunError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    print(markdown.rstrip("\n"))
    return results
