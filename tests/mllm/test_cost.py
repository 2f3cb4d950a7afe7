"""Cost and usage of `ood-jax eval-mllm` against the loopback chat server of test_clients: the
token usage the server reports, priced by --price-in / --price-out, in results.json, results.md
and manifest.json; --max-requests and --max-cost stop a run with exit 4 and every reply kept,
and a rerun continues where it stopped."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
from test_client_load import Letters, right_answer
from test_clients import ChatServer, prompt_text

from ood_jax import cli, manifest
from ood_jax.cli import mllm as eval_cli
from ood_jax.eval import store


def item_number(body: dict) -> int:
    return int(prompt_text(body).split()[-1])


def usage_of(k: int) -> dict:
    """Item k's usage: different for every item, so a sum over the wrong items shows."""
    prompt, completion = 100 + 7 * k, 1 + k % 3
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def reply(body: dict, usage: dict | None) -> dict:
    return {
        "id": "x", "object": "chat.completion", "model": "served",
        **({"usage": usage} if usage is not None else {}),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"content": right_answer(body)}}],
    }  # fmt: skip


def priced(body, attempt):
    return 200, {}, reply(body, usage_of(item_number(body)))


def one_unit(body, attempt):
    """Every reply costs exactly 1 at --price-in 1000 --price-out 0."""
    return 200, {}, reply(body, {"prompt_tokens": 1000, "completion_tokens": 5})


@pytest.fixture
def letters(monkeypatch):
    size = {"n": 20}
    monkeypatch.setattr(eval_cli.tasks, "make_benchmark", lambda *a, **k: Letters(size["n"]))
    return lambda n: size.update(n=n)


def argv(url: str, out: pathlib.Path, *extra: str) -> list[str]:
    return ["eval-mllm", "foci", "--data-dir", "unused", "--endpoint", url, "--model", "m",
            "--output", str(out), "--no-progress", "--no-model-check", *extra]  # fmt: skip


def main(args: list[str]):
    """cli.main's exit status: 0 when it returns, else its SystemExit code."""
    try:
        cli.main(args)
    except SystemExit as e:
        return e.code
    return 0


def read(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# ---------------------------------------------------------------------------------------------
# Prices
# ---------------------------------------------------------------------------------------------


def test_prices_times_the_reported_usage_is_the_cost(letters, tmp_path):
    out = tmp_path / "run"
    with ChatServer(priced) as server:
        assert main(argv(server.url, out, "--price-in", "2.5", "--price-out", "10")) == 0
    # The reference: a plain loop over what the server said, priced per million tokens.
    prompt = sum(usage_of(k)["prompt_tokens"] for k in range(20))
    completion = sum(usage_of(k)["completion_tokens"] for k in range(20))
    expected = prompt * 2.5 / 1e6 + completion * 10 / 1e6
    results = read(out / store.RESULTS_JSON)
    assert results["usage"]["prompt_tokens"] == prompt
    assert results["usage"]["completion_tokens"] == completion
    cost = results["cost"]
    assert math.isclose(cost["total"], expected, rel_tol=1e-12)
    assert math.isclose(cost["input"], prompt * 2.5 / 1e6, rel_tol=1e-12)
    assert cost["prices"] == {"input": 2.5, "output": 10.0, "per_tokens": 1_000_000}
    assert cost["replies_without_usage"] == 0
    markdown = (out / store.RESULTS_MD).read_text()
    assert (
        f"Cost: {expected:.4f} ({prompt} prompt tokens at 2.5 and {completion} completion "
        "tokens at 10 per 1,000,000)." in markdown
    )
    totals = read(out / manifest.MANIFEST_FILE)["totals"]
    assert totals["tokens"]["prompt_tokens"] == prompt
    assert math.isclose(totals["cost"], expected, rel_tol=1e-12)

    # The prices are no part of the run's identity: a rerun without them keeps them, and
    # other prices re-price the same replies without asking the model anything.
    with ChatServer(priced) as server:
        assert main(argv(server.url, out)) == 0
        assert math.isclose(read(out / store.RESULTS_JSON)["cost"]["total"], expected)
        assert main(argv(server.url, out, "--price-in", "1", "--price-out", "0")) == 0
        assert server.hits == 0
    repriced = read(out / store.RESULTS_JSON)["cost"]
    assert math.isclose(repriced["total"], prompt / 1e6, rel_tol=1e-12)
    assert read(out / store.RUN_FILE)["prices"]["input"] == 1


def test_replies_without_usage_are_counted_apart(letters, tmp_path):
    letters(6)
    out = tmp_path / "run"
    unreported = lambda body, attempt: (  # noqa: E731
        200,
        {},
        reply(body, usage_of(1) if item_number(body) % 2 else None),
    )
    with ChatServer(unreported) as server:
        assert main(argv(server.url, out, "--price-in", "1", "--price-out", "1")) == 0
    cost = read(out / store.RESULTS_JSON)["cost"]
    assert cost["replies_without_usage"] == 3
    assert math.isclose(cost["total"], 3 * (usage_of(1)["prompt_tokens"] + 2) / 1e6)
    assert "3 replies reported no token counts" in (out / store.RESULTS_MD).read_text()


# ---------------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------------


def test_max_requests_stops_after_that_many_and_a_rerun_continues(letters, tmp_path, capsys):
    out = tmp_path / "run"
    predictions = out / store.PREDICTIONS_FILE
    with ChatServer(priced) as server:
        assert main(argv(server.url, out, "--max-requests", "5")) == eval_cli.EXIT_STOPPED
        assert server.hits == 5 and lines(predictions) == 5
        assert not (out / store.RESULTS_JSON).exists()
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"stopped: --max-requests 5 reached: this run sent 5 requests; 5 replies kept in "
            f"{predictions}; rerun the same command to continue"
        )
        stopped = read(out / manifest.MANIFEST_FILE)
        assert stopped["status"] == "stopped"
        assert stopped["reason"].startswith("--max-requests 5 reached")
        assert stopped["totals"]["requests"] == 5 and stopped["request"]["max_requests"] == 5

        # The limit is per invocation: the same command sends the next five.
        assert main(argv(server.url, out, "--max-requests", "5")) == eval_cli.EXIT_STOPPED
        assert server.hits == 10 and lines(predictions) == 10
        assert main(argv(server.url, out)) == 0
        # Every item was asked exactly once.
        asked = sorted(item_number(body) for _, _, body in server.requests)
        assert asked == list(range(20))
    results = read(out / store.RESULTS_JSON)
    assert results["complete"] and results["outcomes"]["answered"] == 20
    assert [h["status"] for h in read(out / manifest.MANIFEST_FILE)["previous"]] == [
        "stopped", "stopped"
    ]  # fmt: skip


def test_max_requests_that_covers_the_run_finishes_it(letters, tmp_path):
    with ChatServer(priced) as server:
        assert main(argv(server.url, tmp_path, "--max-requests", "20")) == 0
        assert server.hits == 20


def test_max_cost_stops_once_the_spent_cost_reaches_it(letters, tmp_path, capsys):
    out = tmp_path / "run"
    prices = ["--price-in", "1000", "--price-out", "0", "--concurrency", "1"]
    with ChatServer(one_unit) as server:
        # 1 per reply: the third reply reaches 3, so no fourth request goes out.
        code = main(argv(server.url, out, *prices, "--max-cost", "3"))
        assert code == eval_cli.EXIT_STOPPED and server.hits == 3
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith("stopped: --max-cost 3 reached: this run spent 3; 3 replies kept")
        # Under the limit after two replies (2 < 2.5), reached after the third.
        assert main(argv(server.url, out, *prices, "--max-cost", "2.5")) == eval_cli.EXIT_STOPPED
        assert server.hits == 6
        # A limit already reached before the first request sends nothing.
        assert main(argv(server.url, out, *prices, "--max-cost", "0")) == eval_cli.EXIT_STOPPED
        assert server.hits == 6
        assert main(argv(server.url, out, *prices)) == 0
        assert server.hits == 20
    manifest_now = read(out / manifest.MANIFEST_FILE)
    assert [h["totals"]["cost"] for h in manifest_now["previous"]] == [3, 3, 0]
    assert manifest_now["totals"]["cost"] == 14


def test_max_cost_with_concurrency_spends_at_most_a_window_more(letters, tmp_path):
    with ChatServer(one_unit) as server:
        args = ["--price-in", "1000", "--price-out", "0", "--concurrency", "4"]
        code = main(argv(server.url, tmp_path, *args, "--max-cost", "3"))
        assert code == eval_cli.EXIT_STOPPED
        # Requests out when the limit is reached finish: up to 2 * 4 - 2 more.
        assert 3 <= server.hits <= 3 + 6
    assert lines(tmp_path / store.PREDICTIONS_FILE) == server.hits


def test_max_cost_cannot_be_kept_without_usage(letters, tmp_path, capsys):
    silent = lambda body, attempt: (200, {}, reply(body, None))  # noqa: E731
    with ChatServer(silent) as server:
        args = ["--price-in", "1", "--price-out", "1", "--concurrency", "1", "--max-cost", "5"]
        assert main(argv(server.url, tmp_path, *args)) == eval_cli.EXIT_STOPPED
        assert server.hits == 1
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(
            "stopped: --max-cost 5 cannot be kept: the reply to item 'q0' reports no prompt and "
            "completion token counts; 1 replies kept"
        )
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--price-in", "-1", "--price-out", "1"],
         "--price-in must be a non-negative number, got -1.0"),
        (["--price-in", "1", "--price-out", "nan"],
         "--price-out must be a non-negative number, got nan"),
        (["--price-in", "1", "--price-out", "1", "--max-cost", "-0.5"],
         "--max-cost must be a non-negative number, got -0.5"),
        (["--max-cost", "inf", "--price-in", "1", "--price-out", "1"],
         "--max-cost must be a non-negative number, got inf"),
        (["--max-requests", "-1"], "--max-requests must be at least 0, got -1"),
        (["--price-in", "1"], "--price-in and --price-out go together"),
        (["--max-cost", "1"], "--max-cost needs prices: --price-in and --price-out"),
    ],
)  # fmt: skip
def test_bad_cost_arguments_are_one_error_line(letters, tmp_path, flags, message):
    # Nothing listens there: an argument error must come before any request.
    code = main(argv("http://127.0.0.1:9/v1", tmp_path / "run", *flags))
    assert isinstance(code, str) and code.startswith(f"error: {message}")
    assert "\n" not in code


def test_cost_flags_are_refused_with_clip(tmp_path):
    code = main(["eval-mllm", "foci", "--data-dir", "unused", "--clip", "models/clip",
                 "--output", str(tmp_path), "--max-requests", "3"])  # fmt: skip
    assert code == (
        "error: --price-in, --price-out, --max-requests and --max-cost apply to --endpoint and "
        "--local, not --clip"
    )
