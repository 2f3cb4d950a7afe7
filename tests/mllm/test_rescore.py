"""`ood-jax rescore` and parse modes outside a run's identity: re-scoring a run's stored replies
gives what a fresh run under that mode gives, sends nothing, never touches a run it is pointed
away from, and reads run directories written when the parse mode was part of the identity; the
parser audit is checked against the parsers run here on the stored replies."""

from __future__ import annotations

import json
import shutil

import pytest
from test_clients import ChatServer, completion, prompt_text
from test_eval_runner import (  # noqa: F401 (foci_data, oodbench_data: fixtures)
    exact_interval,
    foci_data,
    h,
    oodbench_data,
    run_cli,
    yes_no_reply,
)

from ood_jax.eval import parsing, rescore, runner
from ood_jax.eval import store

# Reply shapes the model under test answers with, by the prompt's hash: parse modes disagree.
SHAPES = [
    "B",
    "(C)",
    "Answer: D",
    "The correct answer is (A)",
    "Based on the image, I cannot tell.",
    "Let me think. (A) no. (B) maybe. The answer is (C).",
    "Answer: A\nAnswer: B",
    "I'm sorry, I can't help with that.",
]


def shaped_reply(text: str) -> str:
    return SHAPES[h(text, "shape") % len(SHAPES)]


def shaped(body, attempt):
    return 200, {}, completion(shaped_reply(prompt_text(body)))


@pytest.fixture
def foci(request):
    """The tiny FOCI build of test_eval_runner (23 items in two datasets)."""
    return request.getfixturevalue("foci_data")


@pytest.fixture
def oodbench(request):
    return request.getfixturevalue("oodbench_data")


def foci_argv(data_dir, out, *extra: str) -> list[str]:
    return ["eval-mllm", "foci", "--data-dir", str(data_dir), "--model", "m", "--output",
            str(out), "--no-progress", "--no-model-check", *extra]  # fmt: skip


def eval_foci(url: str, data_dir, out, *extra: str) -> dict:
    argv = foci_argv(data_dir, out, *extra)
    return run_cli([*argv[:4], "--endpoint", url, *argv[4:]])


def snapshot(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.slow
def test_rescore_equals_a_fresh_run_under_each_mode_and_sends_nothing(foci, tmp_path):
    with ChatServer(shaped) as server:
        run = eval_foci(server.url, foci, tmp_path / "run")
        fresh = {m: eval_foci(server.url, foci, tmp_path / m, "--parse-mode", m)
                 for m in ("strict", "last")}  # fmt: skip
    assert run["parse_mode"] == "foci"
    before = snapshot(tmp_path / "run")
    # No server now: whatever rescore did, it could send nothing.
    written = rescore.rescore(tmp_path / "run", ["foci", "strict", "last"])
    assert [(mode, path.name) for mode, path, _, _ in written] == [
        ("foci", "results.json"), ("strict", "results.strict.json"),
        ("last", "results.last.json"),
    ]  # fmt: skip
    by_mode = {mode: results for mode, _, results, _ in written}
    # Under the run's mode: the run's own results, byte for byte.
    assert by_mode["foci"] == run
    assert snapshot(tmp_path / "run")["results.json"] == before["results.json"]
    assert snapshot(tmp_path / "run")["results.md"] == before["results.md"]
    for mode in ("strict", "last"):
        assert by_mode[mode] == fresh[mode]
        md = (tmp_path / "run" / f"results.{mode}.md").read_text()
        assert md == (tmp_path / mode / store.RESULTS_MD).read_text()
    # The stored replies are untouched.
    assert snapshot(tmp_path / "run")["predictions.jsonl"] == before["predictions.jsonl"]
    assert by_mode["foci"]["accuracy"] != by_mode["last"]["accuracy"]


def test_the_audit_matches_the_parsers_on_the_stored_replies(foci, tmp_path):
    with ChatServer(shaped) as server:
        results = eval_foci(server.url, foci, tmp_path / "run", "--parse-mode", "strict")
    records = list(
        store.PredictionStore(tmp_path / "run" / store.PREDICTIONS_FILE).records.values()
    )
    readings = {
        mode: [parsing.read_choice(r["reply"], r["meta"]["options"], mode) for r in records]
        for mode in parsing.CHOICE_MODES
    }
    audit = results["parser_audit"]
    assert audit["reference"] == "strict" and audit["replies"] == len(records) == 15 + 8
    for mode, read in readings.items():
        row = audit["modes"][mode]
        assert row["unread"] == sum(p is None for p in read)
        assert row["differs_from_reference"] == sum(
            a != b for a, b in zip(read, readings["strict"])
        )
        right = sum(p == r["meta"]["answer"] for p, r in zip(read, records))
        assert row["headline"] == pytest.approx(right / len(records))
        assert row["headline_ci"] == pytest.approx(exact_interval(right, len(records)))
    contested = sum(len({readings[m][k] for m in readings}) > 1 for k in range(len(records)))
    assert audit["contested"] == contested > 0
    heads = [audit["modes"][m]["headline"] for m in parsing.CHOICE_MODES]
    assert audit["max_movement"] == pytest.approx(max(heads) - min(heads))
    assert audit["pairwise_differs"]["foci"]["last"] == sum(
        a != b for a, b in zip(readings["foci"], readings["last"])
    )
    markdown = (tmp_path / "run" / store.RESULTS_MD).read_text()
    assert "## Parser audit" in markdown and "| strict (these results) |" in markdown
    assert f"{100 * audit['max_movement']:.2f} points." in markdown


def test_another_mode_in_eval_mllm_rescores_without_asking_and_is_kept(foci, tmp_path):
    out = tmp_path / "run"
    with ChatServer(shaped) as server:
        eval_foci(server.url, foci, out)
        hits = server.hits
        strict = eval_foci(server.url, foci, out, "--parse-mode", "strict")
        assert server.hits == hits
        # A rerun without a mode keeps the one the results were last written with.
        again = eval_foci(server.url, foci, out)
        assert server.hits == hits
    assert strict["parse_mode"] == again["parse_mode"] == "strict" and again == strict
    assert json.loads((out / store.RUN_FILE).read_text())["parse_mode"] == "strict"
    # predictions.jsonl says what the results count.
    records = store.PredictionStore(out / store.PREDICTIONS_FILE).records.values()
    assert sum(bool(r["correct"]) for r in records) == strict["num_correct"]
    # rescore's default is the run's mode now.
    ((mode, path, _, _),) = rescore.rescore(out)
    assert (mode, path.name) == ("strict", "results.json")


def test_rescore_out_leaves_the_run_directory_as_it_was(foci, tmp_path, capsys):
    with ChatServer(shaped) as server:
        eval_foci(server.url, foci, tmp_path / "run")
    before = snapshot(tmp_path / "run")
    capsys.readouterr()
    printed = run_cli(
        ["rescore", str(tmp_path / "run"), "--parse-mode", "last", "--out", str(tmp_path / "o")]
    )
    assert snapshot(tmp_path / "run") == before
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "results.last.json", "results.last.md"
    ]  # fmt: skip
    assert printed == [json.loads((tmp_path / "o" / "results.last.json").read_text())]
    out = capsys.readouterr().out
    assert out.startswith(f"# {tmp_path / 'o' / 'results.last.json'} (parse mode last)")
    assert "| last (these results) |" in out


def test_an_older_run_directory_with_the_parse_mode_in_its_identity(foci, tmp_path):
    out = tmp_path / "old"
    with ChatServer(shaped) as server:
        eval_foci(server.url, foci, out, "--parse-mode", "strict", "--limit", "10")
        hits = server.hits
        # run.json as written when the parse mode was part of the identity (and before request
        # options existed), with only the first 10 items answered.
        older = {"benchmark": "foci", "parse_mode": "strict", "client": "openai", "model": "m",
                 "max_tokens": 10}  # fmt: skip
        (out / store.RUN_FILE).write_text(json.dumps(older))
        # It resumes: the stored mode is the default, no other mode is refused.
        resumed = run_cli(
            [*foci_argv(foci, out, "--no-strip-think")[:4], "--endpoint", server.url,
             *foci_argv(foci, out, "--no-strip-think")[4:]]
        )  # fmt: skip
        assert server.hits == 23 and resumed["parse_mode"] == "strict"
        foci = eval_foci(server.url, foci, out, "--no-strip-think", "--parse-mode", "foci")
        assert server.hits == 23 and foci["parse_mode"] == "foci"
    assert hits == 10
    # It now holds the whole identity it matched, and the mode of its latest results.
    assert json.loads((out / store.RUN_FILE).read_text()) == {
        **{k: v for k, v in older.items() if k != "parse_mode"}, "token_param": "max_tokens",
        "temperature": 0, "extra_body": {}, "strip_think": False, "parse_mode": "foci",
    }  # fmt: skip
    ((_, _, rescored, _),) = rescore.rescore(out, ["strict"])
    assert rescored == resumed


def test_rescore_of_a_limited_run(foci, tmp_path):
    with ChatServer(shaped) as server:
        limited = eval_foci(server.url, foci, tmp_path / "run", "--limit", "6")
    ((_, path, again, markdown),) = rescore.rescore(tmp_path / "run", limit=6)
    assert path.name == "results.limit6.json" and again == limited
    assert markdown.startswith("Subset: the first 6 items only")
    ((_, path, _, _),) = rescore.rescore(tmp_path / "run", ["last"], limit=6)
    assert path.name == "results.limit6.last.json"
    with pytest.raises(store.RunError, match=r"results\.json: not found"):
        rescore.rescore(tmp_path / "run")


def test_a_task_read_one_way_rescores_and_refuses_modes(oodbench, tmp_path):
    respond = lambda body, attempt: (200, {}, completion(yes_no_reply(prompt_text(body))))  # noqa: E731
    with ChatServer(respond) as server:
        results = run_cli(
            ["eval-mllm", "oodbench", "--data-dir", str(oodbench), "--endpoint", server.url,
             "--model", "m", "--output", str(tmp_path), "--no-progress"]
        )  # fmt: skip
    assert "parse_mode" not in results and "parser_audit" not in results
    ((mode, _, again, _),) = rescore.rescore(tmp_path)
    assert mode is None and again == results
    with pytest.raises(store.RunError, match="oodbench reads its replies one way"):
        rescore.rescore(tmp_path, ["last"])
    code = None
    try:
        run_cli(["eval-mllm", "oodbench", "--data-dir", str(oodbench), "--endpoint",
                 "http://127.0.0.1:9/v1", "--model", "m", "--output", str(tmp_path),
                 "--parse-mode", "strict"])  # fmt: skip
    except SystemExit as e:
        code = e.code
    assert (
        code
        == "error: --parse-mode applies to foci, counts-oodg: oodbench reads its replies one way"
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / store.RUN_FILE).unlink(), r"run\.json: not found; is .* a run directory"),
        (lambda d: (d / store.RUN_FILE).write_text("{"), r"run\.json: malformed JSON"),
        (
            lambda d: (d / store.RUN_FILE).write_text('{"benchmark": "mmbench"}'),
            r"run\.json: benchmark 'mmbench' is none of",
        ),
        (
            lambda d: (d / store.PREDICTIONS_FILE).write_text(
                "".join((d / store.PREDICTIONS_FILE).read_text().splitlines(True)[:5])
            ),
            r"predictions\.jsonl holds 5 records, fewer than the 23 items .*results\.json counts",
        ),
        (
            lambda d: (d / store.RESULTS_JSON).write_text('{"num_items": "x"}'),
            r"results\.json: field 'num_items' must be a count",
        ),
    ],
)
def test_rescore_errors_name_the_file(foci, tmp_path, damage, message):
    with ChatServer(shaped) as server:
        eval_foci(server.url, foci, tmp_path / "run")
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "run", broken)
    damage(broken)
    with pytest.raises(store.RunError, match=message):
        rescore.rescore(broken)
    with pytest.raises(SystemExit, match="^error: "):
        run_cli(["rescore", str(broken)])


class CyclingClient:
    """Grounding-style replies in turn, one request at a time (concurrency 1); five of them, so
    that every task's items (every fourth item is one task's) get every shape."""

    REPLIES = ["Answer Choice: [B]", "Answer Choice: cow", "It might be (A), or (C).",
               "(A) no.\nAnswer Choice: [D]", "B"]  # fmt: skip

    def __init__(self):
        self.calls = 0

    def identity(self):
        return {"client": "cycling", "model": "m"}

    def generate(self, request):
        self.calls += 1
        return self.REPLIES[self.calls % len(self.REPLIES)]


def test_counts_oodg_grounding_is_audited_and_rescored(tmp_path):
    from test_eval_runner import write_oodg_items

    from ood_jax.eval import tasks

    items, _ = write_oodg_items(tmp_path / "mined", count=24)
    benchmark = tasks.make_benchmark("counts-oodg", items=str(items))
    run = runner.run(
        benchmark,
        CyclingClient(),
        tmp_path / "run",
        options=runner.RunOptions(concurrency=1, progress=False),
    )
    assert run["parse_mode"] == "strict"
    audit = run["parser_audit"]
    grounding = [json.loads(x) for x in items.read_text().splitlines() if '"grounding"' in x]
    assert audit["headline"] == "grounding accuracy" and audit["replies"] == len(grounding)
    assert set(audit["modes"]) == {"strict", "last"}
    ((_, path, last, _),) = rescore.rescore(tmp_path / "run", ["last"])
    assert path.name == "results.last.json" and last["parse_mode"] == "last"
    assert last["grounding"] != run["grounding"]  # "(A) no. ... [D]" reads D, not nothing
    assert last["mapping"] == run["mapping"] and last["localization"] == run["localization"]
    with pytest.raises(store.RunError, match="counts-oodg reads replies under parse mode"):
        rescore.rescore(tmp_path / "run", ["foci"])


def test_rescore_keeps_the_runs_prices(foci, tmp_path):
    with ChatServer(shaped) as server:
        eval_foci(server.url, foci, tmp_path / "run", "--price-in", "2", "--price-out", "8")
    results = json.loads((tmp_path / "run" / store.RESULTS_JSON).read_text())
    assert results["cost"]["prices"]["input"] == 2
    (rescored,) = run_cli(["rescore", str(tmp_path / "run"), "--parse-mode", "last"])
    assert rescored["cost"] == results["cost"]
