#!/usr/bin/env python
"""Benchmark: requests/s of the MLLM harness's HTTP client against a loopback server, this
checkout's `OpenAIChatClient` next to a baseline version of it (ood_jax/eval/http_client.py, or
clients.py in revisions from before the client had a module of its own).

The server answers every POST with a fixed chat completion (HTTP/1.1, keep-alive), at once or
after `--reply-ms`, in a process of its own, so what is timed is the client: encoding, the HTTP
exchange, decoding, and the run's shared RunControl (adaptive concurrency, retry budget).
`--concurrency` threads call `generate` over `--requests` text-only requests, as the runner
does with --concurrency; the baseline's rounds and ours alternate, `--rounds` of each after
`--warmup`.

    python bench/client_throughput.py [--baseline HEAD|REV|FILE] [--concurrency 32]
        [--requests 2000] [--rounds 5] [--warmup 1] [--reply-ms 0] [--smoke]

`--baseline`: a git revision of this repository or a file holding the client. Both clients are
loaded (the baseline from git) before the timing, and get the same warm-up rounds and statistic.
The last line is `common.result_line`'s: median seconds per round of ours and of the baseline,
ratio baseline / ours (= our rate / the baseline's), and both rates.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402  (bench/, the directory of this script)

from ood_jax.eval import http_client  # noqa: E402

REPLY = "B"
_BODY = json.dumps(
    {"object": "chat.completion", "choices": [{"message": {"content": REPLY}}]}
).encode()
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(_BODY)}\r\n\r\n".encode()
    + _BODY
)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="a git revision or a client's file")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each client")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of each client")
    parser.add_argument(
        "--reply-ms", type=float, default=0.0, help="how long the server takes over a reply"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny rounds: for the tests")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.requests, args.rounds, args.warmup = 4, 20, 1, 1
    if min(args.concurrency, args.requests, args.rounds) < 1 or min(args.warmup, args.reply_ms) < 0:
        parser.error("need --concurrency, --requests, --rounds >= 1, --warmup, --reply-ms >= 0")
    return args


# ---------------------------------------------------------------- the server (--serve)


async def _answer(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply_s: float
) -> None:
    """Answers each request on one connection until the client closes it."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    await reader.readexactly(int(value))
            if reply_s:
                await asyncio.sleep(reply_s)
            writer.write(_RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the client closed the connection: the end of every connection, not a failure
    finally:
        writer.close()


async def _serve(reply_s: float) -> None:
    answer = functools.partial(_answer, reply_s=reply_s)
    server = await asyncio.start_server(answer, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def _start_server(reply_ms: float) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, os.path.abspath(__file__), "--serve", "--reply-ms", str(reply_ms)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    port = process.stdout.readline().strip()
    if not port:
        raise SystemExit(f"the loopback server exited with {process.wait()}")
    return process, f"http://127.0.0.1:{port}/v1"


# ---------------------------------------------------------------- the clients


def _baseline_module(source: str):
    """The client's module as of `source` (a file, or a git revision), as a module."""
    if os.path.isfile(source):
        return _load("baseline_client", source)
    for path in ("ood_jax/eval/http_client.py", "ood_jax/eval/clients.py"):
        shown = subprocess.run(
            ["git", "show", f"{source}:{path}"], cwd=REPO, capture_output=True, text=True
        )
        if shown.returncode == 0 and "class OpenAIChatClient" in shown.stdout:
            break
    else:
        raise SystemExit(f"--baseline {source}: no OpenAIChatClient there ({shown.stderr.strip()})")
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "baseline_client.py")
        with open(path, "w") as f:
            f.write(shown.stdout)
        return _load("baseline_client", path)


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Dataclasses look their module up by name.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _round(module, url: str, pool: ThreadPoolExecutor, args: argparse.Namespace):
    """A round of `--requests` requests through `module`'s client from `pool`'s threads, as a
    function to time. One client and RunControl serve every round, as they serve a whole run.
    Fails on a wrong reply."""
    client = module.OpenAIChatClient(url, "bench-model", max_attempts=1)
    control = module.RunControl(args.concurrency)

    def ask(k: int) -> None:
        reply = client.generate(module.Request(f"question {k}"), control)
        if reply.text != REPLY:
            raise RuntimeError(f"request {k}: got {reply.text!r}")

    def run() -> None:
        for _ in pool.map(ask, range(args.requests)):
            pass

    return run


def main() -> None:
    args = _parse_args()
    if args.serve:
        asyncio.run(_serve(args.reply_ms / 1000))
        return
    baseline = _baseline_module(args.baseline)
    server, url = _start_server(args.reply_ms)
    load_before = os.getloadavg()[0]
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            times = common.time_alternating(
                {
                    "baseline": _round(baseline, url, pool, args),
                    "ours": _round(http_client, url, pool, args),
                },
                args.rounds,
                args.warmup,
            )
    finally:
        server.terminate()
        server.wait()
    median = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: args.requests / median[name] for name, t in times.items()}
    print(
        f"OpenAIChatClient, {args.requests} text requests per round at concurrency "
        f"{args.concurrency} against a loopback keep-alive server replying in "
        f"{args.reply_ms:g} ms; baseline: {args.baseline}"
    )
    print(
        f"  {os.cpu_count()} CPU cores, load average {load_before:.1f} before / "
        f"{os.getloadavg()[0]:.1f} after (shared machine: figures move with the load); median "
        f"[min-max] s per round of {args.rounds} after {args.warmup} warm-up, alternating"
    )
    for name, t in times.items():
        print(f"  {name:8s} {common.summary(t)} s: {rate[name]:8.1f} requests/s")
    common.result_line(
        "client_throughput",
        median["ours"],
        f"OpenAIChatClient at {args.baseline}",
        median["baseline"],
        common.stat_text(args.rounds, args.warmup),
        concurrency=args.concurrency,
        requests=args.requests,
        reply_ms=args.reply_ms,
        baseline=args.baseline,
        baseline_rps=round(rate["baseline"], 1),
        ours_rps=round(rate["ours"], 1),
    )


if __name__ == "__main__":
    main()
