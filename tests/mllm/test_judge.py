"""The judge parse mode against judge servers started here: only replies no rule reads are sent,
verdicts are cached and resumed like predictions, the judge is part of the run's identity,
failures are retried by the next run, and judged replies are counted apart.

The benchmark is FOCI's scoring over text-only items (no dataset to build); the model under test
and the judge are two loopback chat servers (tests/mllm/test_clients.py)."""

from __future__ import annotations

import json
import re

import pytest
from test_clients import ChatServer, completion, prompt_text

from ood_jax import cli
from ood_jax.cli import mllm as eval_cli
from ood_jax.eval import store
from ood_jax.eval import judge, rescore, runner
from ood_jax.eval.clients import ClientError, Request
from ood_jax.eval.tasks import Foci, Item

OPTIONS = ["Dalmatian", "Bengal", "Chihuahua", "Abyssinian"]
# Item k asks question k, whose answer is option k % 4; the model replies REPLIES[k % 10].
REPLIES = [
    "B",  # rules read it
    "It is clearly a Bengal, given the rosettes.",  # the judge: B
    "(C)",  # rules
    "I think this is a Chihuahua.",  # the judge: C
    "I'm sorry, I can't tell.",  # the judge: none
    "",  # empty: nothing to judge
    "Abyssinian",  # rules (option text)
    "Maybe a Dalmatian, or a Chihuahua.",  # the judge: none (two options)
    "It is clearly a Bengal, given the rosettes.",  # the same reply again: judged once
    "Answer: D",  # rules
]
RULE_READ = {0, 2, 6, 9}
EMPTY = {5}


class TextFoci(Foci):
    """FOCI's scoring over n text-only items: what a FOCI run's records hold, without images."""

    def __init__(self, n: int = 20):
        self.n = n

    def count(self) -> int:
        return self.n

    def items(self):
        for k in range(self.n):
            meta = {"dataset": "custom", "options": OPTIONS, "answer": k % 4, "label": "x"}
            yield Item(f"custom/{k}", Request(f"question {k}"), meta)


def model(body, attempt):
    k = int(prompt_text(body).split()[-1])
    return 200, {}, completion(REPLIES[k % len(REPLIES)])


def judged_reply(prompt: str) -> str:
    """The reply a judge prompt asks about (between its lines of dashes)."""
    return re.search(r"----------\n(.*)\n----------", prompt, re.DOTALL).group(1)


def judge_verdict(prompt: str) -> str:
    """The test judge: the letter of the one option the reply names, else Z."""
    named = [k for k, o in enumerate(OPTIONS) if o.lower() in judged_reply(prompt).lower()]
    return "ABCD"[named[0]] if len(named) == 1 else "Z"


def judge_server(body, attempt):
    return 200, {}, completion(judge_verdict(prompt_text(body)))


def expected_parsed(k: int) -> int | None:
    reply = REPLIES[k % len(REPLIES)]
    if k % len(REPLIES) in RULE_READ:
        return {"B": 1, "(C)": 2, "Abyssinian": 3, "Answer: D": 3}[reply]
    if k % len(REPLIES) in EMPTY:
        return None
    verdict = judge_verdict(f"----------\n{reply}\n----------")
    return None if verdict == "Z" else "ABCD".index(verdict)


@pytest.fixture
def text_foci(monkeypatch):
    monkeypatch.setattr(eval_cli.tasks, "make_benchmark", lambda *a, **k: TextFoci())


def argv(model_url: str, out, *extra: str) -> list[str]:
    return ["eval-mllm", "foci", "--data-dir", "unused", "--endpoint", model_url, "--model",
            "m", "--output", str(out), "--no-progress", "--backoff", "0.005",
            "--no-model-check", *extra]  # fmt: skip


def judge_flags(judge_url: str, model: str = "judge-1") -> list[str]:
    return ["--parse-mode", "judge", "--judge-endpoint", judge_url, "--judge-model", model]


def main(args: list[str]):
    try:
        cli.main(args)
    except SystemExit as e:
        return e.code
    return 0


def test_only_replies_no_rule_reads_go_to_the_judge_and_are_cached(text_foci, tmp_path):
    out = tmp_path / "run"
    with ChatServer(model) as served, ChatServer(judge_server) as judging:
        assert main(argv(served.url, out, *judge_flags(judging.url))) == 0
        asked = [judged_reply(prompt_text(b)) for _, _, b in judging.requests]
        # Every reply no rule reads, once each (item 8 repeats item 1's reply), and nothing
        # else: neither what the rules read nor the empty reply.
        unread = {REPLIES[k] for k in range(len(REPLIES)) if k not in RULE_READ | EMPTY}
        assert sorted(asked) == sorted(unread)
        assert all(b["max_tokens"] == judge.DEFAULT_MAX_TOKENS for _, _, b in judging.requests)
        assert all(b["model"] == "judge-1" for _, _, b in judging.requests)
        model_hits, judge_hits = served.hits, judging.hits
        # A rerun sends nothing to either: replies and verdicts are kept.
        assert main(argv(served.url, out, *judge_flags(judging.url))) == 0
        assert (served.hits, judging.hits) == (model_hits, judge_hits)

    results = json.loads((out / store.RESULTS_JSON).read_text())
    records = store.PredictionStore(out / store.PREDICTIONS_FILE).records
    for k in range(20):
        record = records[f"custom/{k}"]
        assert record["parsed"] == expected_parsed(k), k
        assert record["correct"] == (expected_parsed(k) == k % 4)
    assert results["parse_mode"] == "judge" and results["complete"] is True
    assert results["accuracy"] == pytest.approx(
        sum(expected_parsed(k) == k % 4 for k in range(20)) / 20
    )
    judged = [k for k in range(20) if k % 10 not in RULE_READ | EMPTY]
    named = [k for k in judged if expected_parsed(k) is not None]
    assert results["judge"] == {
        "model": "judge-1", "max_tokens": judge.DEFAULT_MAX_TOKENS, "token_param": "max_tokens",
        "temperature": 0, "extra_body": {}, "prompt_version": judge.PROMPT_VERSION,
        "judged": len(judged), "named_an_option": len(named),
        "named_none": len(judged) - len(named), "without_verdict": 0,
        "judged_correct": sum(expected_parsed(k) == k % 4 for k in judged),
    }  # fmt: skip
    markdown = (out / store.RESULTS_MD).read_text()
    assert f"{len(judged)} replies no rule could read went to the judge" in markdown
    assert "| judge (these results) |" in markdown
    # judge.jsonl: one line per distinct question, with the judge's identity and its reply.
    lines = [json.loads(x) for x in (out / judge.JUDGE_FILE).read_text().splitlines()]
    assert len(lines) == len(unread)
    assert {line["said"] for line in lines} == {"choice", "none"}
    run_file = json.loads((out / store.RUN_FILE).read_text())
    assert run_file["judge"]["model"] == "judge-1" and run_file["parse_mode"] == "judge"

    # Re-scored from the kept verdicts, sending nothing: the run's own results again.
    before = (out / store.RESULTS_JSON).read_bytes()
    ((_, path, again, _),) = rescore.rescore(out, ["judge"])
    assert path == out / store.RESULTS_JSON and again == results
    assert path.read_bytes() == before


def test_the_judge_is_part_of_the_run_and_another_mode_needs_none(text_foci, tmp_path):
    out = tmp_path / "run"
    with ChatServer(model) as served, ChatServer(judge_server) as judging:
        assert main(argv(served.url, out, *judge_flags(judging.url))) == 0
        hits = judging.hits
        code = main(argv(served.url, out, *judge_flags(judging.url, model="judge-2")))
        assert code.startswith(f"error: {out}'s replies were judged by another judge (")
        # Without a mode the run keeps judging, so it needs its judge.
        code = main(argv(served.url, out))
        assert code.startswith("error: replies are read under parse mode judge (")
        assert "run.json says so" in code
        # Another mode needs no judge and asks nobody anything.
        model_hits = served.hits
        assert main(argv(served.url, out, "--parse-mode", "strict")) == 0
        assert (served.hits, judging.hits) == (model_hits, hits)
    strict = json.loads((out / store.RESULTS_JSON).read_text())
    assert strict["parse_mode"] == "strict" and "judge" not in strict
    assert json.loads((out / store.RUN_FILE).read_text())["judge"]["model"] == "judge-1"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--parse-mode", "judge"], "--parse-mode judge needs --judge-endpoint and --judge-model"),
        (["--judge-endpoint", "http://127.0.0.1:9/v1"], "a judge needs both --judge-endpoint"),
        (
            ["--parse-mode", "last", "--judge-endpoint", "http://x/v1", "--judge-model", "j"],
            "--judge-endpoint and --judge-model apply to --parse-mode judge only",
        ),
    ],
)
def test_judge_flags_that_do_not_fit_are_one_error_line(text_foci, tmp_path, flags, message):
    code = main(argv("http://127.0.0.1:9/v1", tmp_path, *flags))
    assert code == f"error: {message}" or code.startswith(f"error: {message}")


def test_failed_judge_requests_leave_the_run_incomplete_and_are_retried(
    text_foci, tmp_path, capsys
):
    out = tmp_path / "run"

    def flaky_judge(body, attempt):
        if judged_reply(prompt_text(body)) == REPLIES[3]:  # items 3 and 13
            return 400, {}, {"error": "no"}
        return judge_server(body, attempt)

    with ChatServer(model) as served, ChatServer(flaky_judge) as judging:
        code = main(argv(served.url, out, *judge_flags(judging.url)))
    assert code == eval_cli.EXIT_INCOMPLETE
    results = json.loads((out / store.RESULTS_JSON).read_text())
    assert results["complete"] is False and results["judge"]["without_verdict"] == 2
    assert "2 replies have no verdict: their judge requests failed" in capsys.readouterr().err
    with pytest.raises(store.RunError, match="2 replies no rule reads have no verdict"):
        rescore.rescore(out, ["judge"], out=tmp_path / "elsewhere")

    with ChatServer(model) as served, ChatServer(judge_server) as judging:
        assert main(argv(served.url, out, *judge_flags(judging.url))) == 0
        # Only the failed question was asked again.
        assert [judged_reply(prompt_text(b)) for _, _, b in judging.requests] == [REPLIES[3]]
        assert served.hits == 0
    assert json.loads((out / store.RESULTS_JSON).read_text())["judge"]["without_verdict"] == 0


class ScriptedJudge:
    """A judge client without a server: "B" to everything, Ctrl-C at its `interrupt_at`-th call."""

    def __init__(self, interrupt_at: int | None = None):
        self.interrupt_at, self.calls = interrupt_at, 0

    def identity(self):
        return {"client": "scripted", "model": "j"}

    def generate(self, request):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return "B"


class ScriptedModel:
    def identity(self):
        return {"client": "scripted", "model": "m"}

    def generate(self, request):
        return f"Reply {request.prompt} names no option"


def test_ctrl_c_while_judging_keeps_the_verdicts(tmp_path):
    benchmark, client = TextFoci(12), ScriptedModel()
    judging = judge.Judge(ScriptedJudge(interrupt_at=4), tmp_path, concurrency=1)
    with pytest.raises(KeyboardInterrupt) as stopped:
        runner.run(benchmark, client, tmp_path, judge=judging, options=runner.RunOptions(concurrency=1, progress=False, parse_mode="judge"))  # fmt: skip
    # The verdicts before Ctrl-C, and any that came back alongside it.
    kept = len((tmp_path / judge.JUDGE_FILE).read_text().splitlines())
    assert kept >= 3
    assert str(stopped.value) == (
        f"{kept} judge verdicts kept in {tmp_path / judge.JUDGE_FILE}; rerun the same command "
        "to continue"
    )
    assert not (tmp_path / store.RESULTS_JSON).exists()
    resumed = ScriptedJudge()
    results = runner.run(benchmark, client, tmp_path, judge=judge.Judge(resumed, tmp_path, concurrency=1), options=runner.RunOptions(concurrency=1, progress=False, parse_mode="judge"))  # fmt: skip
    assert resumed.calls == 12 - kept
    assert results["judge"]["named_an_option"] == 12 and results["num_correct"] == 3


@pytest.mark.parametrize(
    "text, verdict",
    [
        ("B", ("choice", 1)),
        ("(C)", ("choice", 2)),
        ("The answer is D.", ("choice", 3)),
        ("<think>It names the rabbit.</think>A", ("choice", 0)),
        ("Z", ("none", None)),
        ("(Z)", ("none", None)),
        ("E", ("unreadable", None)),  # beyond the four options
        ("I think it is the second one", ("unreadable", None)),
        ("", ("unreadable", None)),
    ],
)
def test_read_verdict(text, verdict):
    assert judge.read_verdict(text, 4) == verdict


def test_the_prompt_and_the_cache_key():
    prompt = judge.judge_prompt(OPTIONS, "It is a Bengal.")
    assert "A. Dalmatian\nB. Bengal\nC. Chihuahua\nD. Abyssinian" in prompt
    assert "----------\nIt is a Bengal.\n----------" in prompt
    with pytest.raises(ValueError, match="1 to 25 options"):
        judge.judge_prompt([f"o{k}" for k in range(26)], "x")
    one = judge.Verdicts({"model": "a", "prompt_version": judge.PROMPT_VERSION}, {})
    other = judge.Verdicts({"model": "b", "prompt_version": judge.PROMPT_VERSION}, {})
    assert one.key(OPTIONS, "x") == one.key(list(OPTIONS), "x")
    assert len({one.key(OPTIONS, "x"), one.key(OPTIONS, "y"), other.key(OPTIONS, "x")}) == 3
    assert one.key(OPTIONS, "x") != one.key(OPTIONS[::-1], "x")


def test_a_judge_that_fails_in_a_row_stops_asking(tmp_path):
    class Down:
        def identity(self):
            return {"client": "scripted", "model": "j"}

        def generate(self, request):
            raise ClientError("HTTP 503 from judge", "HTTP 503")

    benchmark = TextFoci(40)
    results = runner.run(benchmark, ScriptedModel(), tmp_path, judge=judge.Judge(Down(), tmp_path, concurrency=1, max_consecutive_failures=3), options=runner.RunOptions(concurrency=1, progress=False, parse_mode="judge"))  # fmt: skip
    lines = (tmp_path / judge.JUDGE_FILE).read_text().splitlines()
    # Three in a row, and the one already out when the third came back; not all forty.
    assert len(lines) == 4 and all(json.loads(x)["error_kind"] == "HTTP 503" for x in lines)
    assert results["complete"] is False and results["judge"]["without_verdict"] == 40
