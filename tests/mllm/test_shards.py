"""MLLM runs split over machines (ood_jax/eval/shards.py): `--shard I/N` parts of a circular FOCI
run, asked by a scripted model, merged by `ood-jax merge` into the directory one run over every
item writes (the same predictions.jsonl and results.json, byte for byte); a question's rotations
stay in one part; merge refuses what is not every part of one finished run, naming why. Through
the command, against a loopback server, on test_eval_runner's tiny FOCI build: `eval-mllm
--shard` parts and their merge, and a job of 2 processes (`ood-jax launch`), which splits the
items by itself, each equal to one run."""

from __future__ import annotations

import json
import pathlib
import shutil

import subprocess

import pytest
from test_circular import Scripted, TextFoci, hashed
from test_clients import ChatServer, completion, prompt_text
from test_eval_runner import foci_data, foci_reply  # noqa: F401 (a fixture)
from test_multiprocess import HANG_GUARD_S, REPO, environ, launch_command

from ood_jax import cli
from ood_jax.eval import runner, shards, store

PARTS = 3


def run(out: pathlib.Path, shard: shards.Shard | None = None, model: str = "m") -> dict:
    client = Scripted(hashed)
    client.identity = lambda: {"client": "scripted", "model": model}
    options = runner.RunOptions(concurrency=2, progress=False, shard=shard)
    return runner.run(TextFoci(10, circular=4), client, out, options)


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("split")
    run(root / "single")
    for k in range(PARTS):
        run(root / f"part{k}", shards.Shard(k, PARTS))
    return root


def records(directory: pathlib.Path) -> list[dict]:
    lines = (directory / store.PREDICTIONS_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_parts_split_the_items_and_keep_rotations_together(split):
    ids = [[r["id"] for r in records(split / f"part{k}")] for k in range(PARTS)]
    every = [r["id"] for r in records(split / "single")]
    assert sorted(i for part in ids for i in part) == sorted(every)
    assert all(ids)  # 10 questions over 3 parts: none empty
    for part in ids:
        questions = {i.split("#")[0] for i in part}
        assert len(part) == 4 * len(questions)  # all four rotations of each question
    run_file = json.loads((split / "part1" / store.RUN_FILE).read_text())
    assert run_file["shard"] == {"index": 1, "count": PARTS}


def test_merged_parts_equal_one_run(split, tmp_path, capsys):
    parts = [str(split / f"part{k}") for k in (2, 0, 1)]  # any order
    cli.main(["merge", *parts, "--output", str(tmp_path / "merged")])
    assert "Replies:" in capsys.readouterr().out
    for name in (store.PREDICTIONS_FILE, store.RESULTS_JSON, store.RESULTS_MD, store.RUN_FILE):
        merged = (tmp_path / "merged" / name).read_text()
        assert merged == (split / "single" / name).read_text(), name
    manifest = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert [p["shard"]["index"] for p in manifest["parts"]] == [2, 0, 1]


def test_merge_refuses_what_is_not_one_whole_run(split, tmp_path):
    parts = [split / f"part{k}" for k in range(PARTS)]
    out = str(tmp_path / "out")

    def refused(*dirs) -> str:
        with pytest.raises(SystemExit) as stop:
            cli.main(["merge", *map(str, dirs), "--output", out])
        return str(stop.value)

    assert "merge needs every shard I/N of one N once" in refused(*parts[:2])
    assert "merge needs every shard I/N of one N once" in refused(parts[0], parts[0], parts[1])
    assert "not a part of a split run" in refused(split / "single", *parts[1:])
    with pytest.raises(SystemExit, match="is one of the parts"):
        cli.main(["merge", *map(str, parts), "--output", str(parts[0])])

    other = tmp_path / "other"
    run(other, shards.Shard(0, PARTS), model="another")
    assert "they differ in model" in refused(other, *parts[1:])

    unfinished = tmp_path / "unfinished"
    shutil.copytree(parts[0], unfinished)
    (unfinished / store.RESULTS_JSON).unlink()
    assert "finish the part" in refused(unfinished, *parts[1:])

    lost = tmp_path / "lost"
    shutil.copytree(parts[0], lost)
    lines = (lost / store.PREDICTIONS_FILE).read_text().splitlines()
    (lost / store.PREDICTIONS_FILE).write_text("\n".join(lines[:-1]) + "\n")
    result = json.loads((lost / store.RESULTS_JSON).read_text())
    (lost / store.RESULTS_JSON).write_text(json.dumps({**result, "num_items": len(lines) - 1}))
    assert "items have no record in any part" in refused(lost, *parts[1:])
    assert not (tmp_path / "out" / store.RESULTS_JSON).exists()


def test_a_rerun_asks_the_same_part(split, tmp_path):
    part = tmp_path / "part"
    shutil.copytree(split / "part0", part)
    with pytest.raises(store.RunError, match="shard"):
        run(part, shards.Shard(1, PARTS))
    run(part, shards.Shard(0, PARTS))  # resumes: nothing left to ask


@pytest.mark.parametrize(
    "spec, message",
    [("2/2", "0 <= I < N"), ("1", "expected I/N"), ("-1/2", "expected I/N"), ("0/0", "0 <= I < N")],
)
def test_bad_shards_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        shards.Shard.parse(spec)


def test_a_part_has_no_limit():
    with pytest.raises(ValueError, match="--limit and --shard"):
        runner.RunOptions(limit=5, shard=shards.Shard(0, 2))


@pytest.mark.slow
def test_the_command_splits_and_merges_as_one_run(foci_data, compile_cache, tmp_path):  # noqa: F811
    def reply(body, attempt):
        return 200, {}, completion(foci_reply(prompt_text(body)))

    def eval_mllm(out: pathlib.Path, *extra: str) -> list[str]:
        return ["eval-mllm", "foci", "--data-dir", str(foci_data), "--model", "m",
                "--no-progress", "--no-model-check", "--endpoint", server.url,
                "--output", str(out), *extra]  # fmt: skip

    with ChatServer(reply) as server:
        single = tmp_path / "single"
        parsed = cli.build_parser().parse_args(eval_mllm(single))
        parsed.run(parsed)
        for k in range(2):
            parsed = cli.build_parser().parse_args(
                eval_mllm(tmp_path / f"part{k}", "--shard", f"{k}/2")
            )
            parsed.run(parsed)
        cli.main(
            [
                "merge",
                str(tmp_path / "part0"),
                str(tmp_path / "part1"),
                "--output",
                str(tmp_path / "merged"),
            ]
        )
        job = tmp_path / "job"
        done = subprocess.run(
            launch_command(eval_mllm(job)), env=environ(), cwd=REPO,
            capture_output=True, text=True, timeout=HANG_GUARD_S,
        )  # fmt: skip
        assert done.returncode in (0, 3), done.stdout[-3000:] + done.stderr[-3000:]

    def replies(directory: pathlib.Path) -> list[dict]:  # all but the time each reply took
        return [{**r, "latency_s": None} for r in records(directory)]

    for merged in (tmp_path / "merged", job):
        assert replies(merged) == replies(single)
        for name in (store.RESULTS_JSON, store.RESULTS_MD):
            assert (merged / name).read_text() == (single / name).read_text(), (merged, name)
    assert sorted(p.name for p in (job / "parts").iterdir()) == ["0", "1"]
    assert done.stdout.count("Replies:") == 1  # process 0 alone prints the results
