"""`ood-jax eval-mllm` against servers that answer every way a real one does: what a reply said
is kept per prediction and counted by outcome, `<think>` is taken out before parsing, the
preflight checks the model, request options are part of the run's identity, a run where every
request fails stops early, and the exit status says how a run went."""

from __future__ import annotations

import json

import pytest
from test_client_load import Letters, right_answer
from test_clients import ChatServer, completion, prompt_text

from ood_jax import cli
from ood_jax.cli import mllm as eval_cli
from ood_jax.eval import store

USAGE = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}


def _chat(message: dict, finish_reason: str = "stop") -> dict:
    return {
        "id": "x", "object": "chat.completion", "model": "served-id", "usage": USAGE,
        "choices": [{"index": 0, "finish_reason": finish_reason, "message": message}],
    }  # fmt: skip


def every_kind_of_reply(body, attempt):
    """Item k's reply, by k % 7: the shapes real servers send."""
    right = right_answer(body)
    kind = int(prompt_text(body).split()[-1]) % 7
    if kind == 0:
        return 200, {}, _chat({"content": f"{right} because the"}, "length")
    if kind == 1:
        return 200, {}, _chat({"content": None, "refusal": "I can't help with that."})
    if kind == 2:
        return 200, {}, _chat({"content": None, "reasoning_content": "Let me look."})
    if kind == 3:
        return 200, {}, _chat({"content": f"<think>It is {right}.</think>\n\n{right}"})
    if kind == 4:
        return 200, {}, _chat({"content": "<think>First, the image shows"}, "length")
    if kind == 5:
        return 400, {}, {"error": {"message": "image too large"}}
    return 200, {}, _chat({"content": right})


@pytest.fixture
def letters(monkeypatch):
    """eval-mllm's benchmark becomes Letters(n): `letters(n)` sets n; argv needs no data."""
    size = {"n": 14}
    monkeypatch.setattr(eval_cli.tasks, "make_benchmark", lambda *a, **k: Letters(size["n"]))
    return lambda n: size.update(n=n)


def argv(server_url: str, out, *extra: str) -> list[str]:
    return ["eval-mllm", "foci", "--data-dir", "unused", "--endpoint", server_url, "--model",
            "m", "--output", str(out), "--no-progress", "--backoff", "0.005", *extra]  # fmt: skip


def main(args: list[str]):
    """cli.main's exit status: 0 when it returns, else its SystemExit code."""
    try:
        cli.main(args)
    except SystemExit as e:
        return e.code
    return 0


def test_every_reply_keeps_what_the_server_said_and_counts_apart(letters, tmp_path, capsys):
    out = tmp_path / "run"
    with ChatServer(every_kind_of_reply) as server:
        assert main(argv(server.url, out)) == eval_cli.EXIT_INCOMPLETE
    records = store.PredictionStore(out / store.PREDICTIONS_FILE).records
    by_kind = {k: records[f"q{k}"] for k in range(7)}
    assert [by_kind[k]["outcome"] for k in range(7)] == [
        "truncated", "refused", "empty", "answered", "truncated", "error", "answered"
    ]  # fmt: skip
    # Finding 5: a cut reply is kept as truncated, not only as wrong.
    assert by_kind[0]["finish_reason"] == "length" and by_kind[0]["parsed"] == 0
    assert by_kind[1]["refusal"] == "I can't help with that." and by_kind[1]["reply"] == ""
    assert by_kind[1]["error"] is None
    assert by_kind[2]["reasoning"] == "Let me look." and by_kind[2]["parsed"] is None
    # <think> is taken out before parsing, and kept.
    assert by_kind[3]["reply"] == "D" and by_kind[3]["correct"] is True
    assert by_kind[3]["reasoning"] == "It is D."
    assert by_kind[4]["reply"] == "" and by_kind[4]["reasoning"] == "First, the image shows"
    assert by_kind[5]["error_kind"] == "HTTP 400" and "image too large" in by_kind[5]["error"]
    answered = by_kind[6]
    assert answered["usage"] == USAGE and answered["model"] == "served-id"
    assert answered["attempts"] == 1 and answered["latency_s"] >= 0

    results = json.loads((out / store.RESULTS_JSON).read_text())
    assert results["outcomes"] == {
        "answered": 4, "truncated": 4, "refused": 2, "empty": 2, "error": 2
    }  # fmt: skip
    assert results["usage"] == {k: 12 * v for k, v in USAGE.items()}
    assert results["complete"] is False and results["strip_think"] is True
    markdown = (out / store.RESULTS_MD).read_text()
    assert markdown.endswith(
        'Replies: 4 answered, 4 truncated at the token budget (finish_reason "length"), '
        "2 refused, 2 with no answer text, 2 failed requests. Tokens: 120 prompt, "
        "24 completion.\n"
    )
    err = capsys.readouterr().err
    assert "note: 4 replies were cut at the token budget" in err
    assert "note: the model refused 2 requests" in err
    assert "note: 2 replies had no answer text" in err


def test_think_kept_in_the_reply_when_asked_and_the_identity_says_so(letters, tmp_path):
    letters(7)
    kept = tmp_path / "kept"
    with ChatServer(every_kind_of_reply) as server:
        main(argv(server.url, kept, "--no-strip-think"))
        record = store.PredictionStore(kept / store.PREDICTIONS_FILE).records["q3"]
        # Finding 5: left in, <think> makes the reply unreadable.
        assert record["reply"].startswith("<think>") and record["parsed"] is None
        assert json.loads((kept / store.RUN_FILE).read_text())["strip_think"] is False
        hits = server.hits
        code = main(argv(server.url, kept))
    assert code == f"error: {kept} holds predictions of another run (strip_think: False there, True now); use another --output"  # fmt: skip
    assert server.hits == hits


def test_request_options_reach_the_server_and_a_resume_cannot_mix_them(letters, tmp_path):
    letters(4)
    out = tmp_path / "run"
    options = ["--token-param", "max_completion_tokens", "--temperature", "none"]
    options += ["--extra-body", '{"top_k": 1, "chat_template_kwargs": {"enable_thinking": false}}']
    answer = lambda body, attempt: (200, {}, completion(right_answer(body)))  # noqa: E731
    with ChatServer(answer) as server:
        assert main(argv(server.url, out, *options)) == 0
        for _, _, body in server.requests:
            assert body["max_completion_tokens"] == 8 and "max_tokens" not in body
            assert "temperature" not in body
            assert body["top_k"] == 1 and body["chat_template_kwargs"] == {"enable_thinking": False}
        identity = json.loads((out / store.RUN_FILE).read_text())
        assert identity["token_param"] == "max_completion_tokens"
        assert identity["temperature"] is None and identity["extra_body"]["top_k"] == 1
        hits = server.hits
        assert main(argv(server.url, out, *options[:4], "--extra-body", '{"top_k": 2}')) == (
            f"error: {out} holds predictions of another run (extra_body: {{'top_k': 1, "
            "'chat_template_kwargs': {'enable_thinking': False}} there, {'top_k': 2} now); "
            "use another --output"
        )
        assert main(argv(server.url, out, "--extra-body", options[-1])).startswith(
            f"error: {out} holds predictions of another run (temperature: None there, 0.0 now, "
            "token_param: 'max_completion_tokens' there, 'max_tokens' now)"
        )
        assert server.hits == hits


@pytest.mark.parametrize(
    "value, message",
    [
        ("{top_k: 1}", "error: --extra-body is not JSON (Expecting property name enclosed in "
         "double quotes at character 1): '{top_k: 1}'"),
        ("[1, 2]", "error: --extra-body must be a JSON object, got list"),
        ('{"max_tokens": 5}', "error: --extra-body may not set max_tokens: the client sets them"),
    ],
)  # fmt: skip
def test_a_bad_extra_body_is_one_error_line(letters, tmp_path, value, message):
    code = main(argv("http://127.0.0.1:9/v1", tmp_path, "--extra-body", value))
    assert code.startswith(message) and "\n" not in code


def test_options_of_the_endpoint_refused_elsewhere(letters, tmp_path):
    local = ["eval-mllm", "foci", "--data-dir", "x", "--local", str(tmp_path), "--output",
             str(tmp_path / "o")]  # fmt: skip
    assert main([*local, "--temperature", "none"]) == (
        "error: --temperature applies to --endpoint only"
    )
    assert main([*local, "--extra-body", "{}"]) == "error: --extra-body applies to --endpoint only"


def test_an_older_run_directory_resumes_with_the_options_it_had(letters, tmp_path):
    letters(4)
    out = tmp_path / "old"
    out.mkdir()
    # run.json as written before request options and <think> stripping existed.
    older = {"benchmark": "letters", "client": "openai", "model": "m", "max_tokens": 8}
    (out / store.RUN_FILE).write_text(json.dumps(older))
    answer = lambda body, attempt: (200, {}, completion(right_answer(body)))  # noqa: E731
    with ChatServer(answer) as server:
        assert "strip_think: False there, True now" in main(argv(server.url, out))
        assert main(argv(server.url, out, "--no-strip-think")) == 0
    assert server.hits == 4


# --- fail fast, exit honestly ------------------------------------------------------------------


@pytest.mark.parametrize(
    "status, headers, fix",
    [
        (500, {}, "To fix: the server fails: see its log"),
        (429, {"Retry-After": "3600"}, "To fix: rate limited: lower --concurrency"),
        (400, {}, "To fix: the server rejects the request: check --model, --max-tokens, "
         "--token-param"),
    ],
)  # fmt: skip
def test_a_run_where_every_request_fails_stops_early(
    letters, tmp_path, capsys, monkeypatch, status, headers, fix
):
    """Finding 3: 12 items of a misspelled model took 72 requests and the run exited 0."""
    letters(40)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    out = tmp_path / "run"
    failing = lambda body, attempt: (status, headers, {"error": "no such model"})  # noqa: E731
    with ChatServer(failing) as server:
        assert main(argv(server.url, out)) == eval_cli.EXIT_STOPPED
    # Five items in a row, a window of requests out, and the retries the budget allows.
    assert server.hits <= 25
    lines = (out / store.PREDICTIONS_FILE).read_text().splitlines()
    assert len(lines) >= 5 and all(json.loads(line)["error"] for line in lines)
    assert not (out / store.RESULTS_JSON).exists()
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [
        "note: $OPENAI_API_KEY is not set; sending no API key",
        f"note: {server.url}/models answers HTTP 404: the server lists no models; "
        "the model name 'm' is not checked",
    ]
    assert len(err) == 3
    assert err[-1].startswith(f"stopped: 5 items in a row failed with HTTP {status} (the last: ")
    assert f"0 replies kept in {out / store.PREDICTIONS_FILE}. {fix}" in err[-1]
    assert err[-1].endswith("then rerun the same command to continue")


def test_a_misspelled_model_fails_before_any_request(letters, tmp_path):
    answer = lambda body, attempt: (200, {}, completion("A"))  # noqa: E731
    with ChatServer(answer, models=["Qwen/Qwen2-VL-2B-Instruct"]) as server:
        args = argv(server.url, tmp_path, "--model", "Qwen2-VL-2B-Instruct")
        code = main(args)
        assert code.startswith(
            f"error: model 'Qwen2-VL-2B-Instruct' is not served by {server.url} "
            "(did you mean 'Qwen/Qwen2-VL-2B-Instruct'?); it lists 'Qwen/Qwen2-VL-2B-Instruct'"
        )
        assert server.hits == 0 and server.model_queries == 1
        # The check can be skipped (a proxy that serves models it does not list).
        assert main([*args, "--no-model-check"]) == 0
        assert server.model_queries == 1 and server.hits == 14


def test_a_complete_run_exits_0_and_a_server_that_cannot_be_reached_1(letters, tmp_path):
    answer = lambda body, attempt: (200, {}, completion(right_answer(body)))  # noqa: E731
    with ChatServer(answer, models=["m"]) as server:
        assert main(argv(server.url, tmp_path / "run")) == 0
    results = json.loads((tmp_path / "run" / store.RESULTS_JSON).read_text())
    assert results["complete"] and results["outcomes"]["answered"] == 14
    # The server is gone: the preflight says so before anything else.
    code = main(argv(server.url, tmp_path / "gone"))
    assert code.startswith(f"error: cannot reach {server.url}/models: ")
    assert "is the server running" in code


def test_bad_load_options_are_one_error_line(letters, tmp_path):
    base = argv("http://127.0.0.1:9/v1", tmp_path)
    for flags, message in (
        (["--retry-budget", "-1"], "error: --retry-budget must be at least 0, got -1"),
        (["--max-consecutive-failures", "-2"], "error: --max-consecutive-failures must be at "
         "least 0, got -2"),
        (["--timeout", "0"], "error: --timeout must be positive, got 0.0"),
        (["--max-retry-after", "-1"], "error: --max-retry-after must be non-negative, got -1.0"),
    ):  # fmt: skip
        assert main([*base, *flags]) == message
