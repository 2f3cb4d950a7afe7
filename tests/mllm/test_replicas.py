"""Replicas of one model (`eval-mllm --endpoint URL1 --endpoint URL2`, ood_jax/eval/replicas.py)
on test_eval_runner's tiny FOCI build, against loopback servers: two healthy replicas share the
items and give one endpoint's results; a replica that fails every request leaves the rotation
with one line and the other answers every item; with every replica down the items fail."""

from __future__ import annotations

import json
import pathlib

import pytest
from test_clients import ChatServer, completion, prompt_text
from test_eval_runner import foci_data, foci_reply  # noqa: F401 (a fixture)

from ood_jax import cli
from ood_jax.eval import store


def answer(body, attempt):
    return 200, {}, completion(foci_reply(prompt_text(body)))


def down(body, attempt):
    return 503, {}, b'{"error": "overloaded"}'


def eval_mllm(data_dir: pathlib.Path, out: pathlib.Path, *endpoints: str) -> dict:
    argv = ["eval-mllm", "foci", "--data-dir", str(data_dir), "--model", "m", "--no-progress",
            "--no-model-check", "--backoff", "0.01", "--concurrency", "2", "--output", str(out)]  # fmt: skip
    for url in endpoints:
        argv += ["--endpoint", url]
    parsed = cli.build_parser().parse_args(argv)
    return parsed.run(parsed)


def replies(directory: pathlib.Path) -> list[dict]:
    lines = (directory / store.PREDICTIONS_FILE).read_text().splitlines()
    return [{**json.loads(line), "latency_s": None, "attempts": None} for line in lines]


@pytest.fixture(scope="module")
def single(foci_data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("single")
    with ChatServer(answer) as server:
        eval_mllm(foci_data, out, server.url)
    return out


def test_two_replicas_share_the_items(foci_data, single, tmp_path):  # noqa: F811
    with ChatServer(answer) as one, ChatServer(answer) as two:
        results = eval_mllm(foci_data, tmp_path, one.url, two.url)
    assert results["complete"]
    assert one.hits > 0 and two.hits > 0
    assert one.hits + two.hits == results["num_items"]
    assert replies(tmp_path) == replies(single)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["request"]["endpoints"] == [one.url, two.url]


def test_a_failing_replica_leaves_the_rotation(foci_data, single, tmp_path, capsys):  # noqa: F811
    with ChatServer(down) as failing, ChatServer(answer) as serving:
        results = eval_mllm(foci_data, tmp_path, failing.url, serving.url)
    assert results["complete"] and serving.hits == results["num_items"]
    err = capsys.readouterr().err
    assert err.count("left the rotation") == 1
    assert f"replica {failing.url}/chat/completions left the rotation after 3 failures" in err
    assert "1 of 2 replicas serve on" in err
    assert replies(tmp_path) == replies(single)


def test_every_replica_down_fails_the_items(foci_data, tmp_path, capsys):  # noqa: F811
    with ChatServer(down) as one, ChatServer(down) as two:
        with pytest.raises(SystemExit) as stop:
            eval_mllm(foci_data, tmp_path, one.url, two.url)
    assert stop.value.code == 4  # stopped: items in a row failed alike
    err = capsys.readouterr().err
    assert err.count("left the rotation") == 2
    records = [
        json.loads(line) for line in (tmp_path / store.PREDICTIONS_FILE).read_text().splitlines()
    ]
    assert records and all(r["outcome"] == "error" for r in records)


def test_a_key_goes_over_plain_http_to_loopback_only(foci_data, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with pytest.raises(SystemExit, match="unencrypted over http:// .* --allow-plain-http-key"):
        eval_mllm(foci_data, tmp_path, "http://10.1.2.3:8000/v1")
    with ChatServer(answer) as server:
        assert eval_mllm(foci_data, tmp_path / "loopback", server.url)["complete"]
        sent = [
            {k.lower(): v for k, v in h.items()}.get("authorization") for _, h, _ in server.requests
        ]
    assert sent and set(sent) == {"Bearer sk-test"}
