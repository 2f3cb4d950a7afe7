"""manifest.json of every kind of run: eval-mllm against the loopback chat server of
test_clients, mining with test_mining_foci's fake scorer, and a one-step training run with its
evaluation; the git state, the digests, and the status a run ends with, whichever way it ends."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import shutil
import subprocess
import time

import pytest
from test_client_load import Letters, right_answer
from test_clients import ChatServer, completion, prompt_text
from test_eval_runner import ScriptedClient, foci_data, foci_reply  # noqa: F401 (a fixture)
from test_mining_foci import FakeScorer, _write_image

from ood_jax import cli, datasets, manifest, prompts
from ood_jax.cli import mllm as eval_cli
from ood_jax.eval import compare, parsing, runner, scheduling, store, tasks
from ood_jax.eval.clients import ClientError, Request
from ood_jax.eval.http_client import OpenAIChatClient
from ood_jax.eval.tasks.base import Item
from ood_jax.mining import foci, jobs

REPO = pathlib.Path(__file__).resolve().parents[2]
USAGE = {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32}
KEY_ENV, KEY = "OOD_JAX_MANIFEST_KEY", "sk-manifest-test-secret"


def read_manifest(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def git(directory: pathlib.Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


# ---------------------------------------------------------------------------------------------
# The git state
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="the tests run outside a checkout")
def test_the_commit_of_this_checkout_is_its_head():
    before = git(REPO, "rev-parse", "HEAD")
    state = manifest.collect("test")["ood_jax"]["git"]
    # Others may commit meanwhile: the head is the one before or the one after.
    assert state["commit"] in {before, git(REPO, "rev-parse", "HEAD")}
    assert isinstance(state["dirty"], bool)


def test_dirty_means_a_changed_tracked_file_or_a_new_one_in_the_package(tmp_path):
    repo, package = tmp_path / "repo", tmp_path / "repo" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (repo / "README").write_text("readme\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    head = git(repo, "rev-parse", "HEAD")
    assert manifest.git_state(package) == {"commit": head, "dirty": False}
    # Outputs written into the checkout are not the package's source.
    (repo / "runs").mkdir()
    (repo / "runs" / "results.json").write_text("{}")
    assert manifest.git_state(package)["dirty"] is False
    (package / "new_module.py").write_text("y = 2\n")
    assert manifest.git_state(package)["dirty"] is True
    (package / "new_module.py").unlink()
    (repo / "README").write_text("changed\n")
    assert manifest.git_state(package) == {"commit": head, "dirty": True}


def test_no_checkout_or_no_git_is_no_commit_and_no_error(tmp_path, monkeypatch):
    copy = tmp_path / "copy" / "ood_jax"
    copy.mkdir(parents=True)
    shutil.copy(REPO / "ood_jax" / "__init__.py", copy / "__init__.py")
    assert manifest.git_state(copy) is None
    # Installed into a checkout it is no part of (a wheel in a venv inside a repository).
    repo = tmp_path / "repo"
    (repo / "venv" / "ood_jax").mkdir(parents=True)
    (repo / "README").write_text("readme\n")
    git(repo, "init", "-q")
    git(repo, "add", "README")
    git(repo, "commit", "-q", "-m", "first")
    assert manifest.git_state(repo / "venv" / "ood_jax") is None
    # No git at all.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert manifest.git_state(REPO / "ood_jax") is None
    assert manifest.collect("test")["ood_jax"]["git"] is None


# ---------------------------------------------------------------------------------------------
# Writing, resuming, ending
# ---------------------------------------------------------------------------------------------


def test_a_resumed_run_keeps_the_heads_of_the_earlier_ones(tmp_path):
    first = manifest.collect("test", totals={"requests": 3})
    manifest.write(tmp_path, first)
    assert read_manifest(tmp_path / manifest.MANIFEST_FILE)["status"] == "running"
    manifest.finish(tmp_path, first, "stopped", reason="a limit")
    second = manifest.collect("test", totals={"requests": 4})
    manifest.write(tmp_path, second)
    manifest.finish(tmp_path, second, manifest.COMPLETE)
    written = read_manifest(tmp_path / manifest.MANIFEST_FILE)
    assert written["status"] == "complete" and written["totals"] == {"requests": 4}
    assert written["duration_s"] >= 0 and written["ended"] >= written["started"]
    [head] = written["previous"]
    assert head["status"] == "stopped" and head["reason"] == "a limit"
    assert head["totals"] == {"requests": 3} and head["started"] == first["started"]
    assert set(head) == {"kind", "started", "ended", "status", "reason", "ood_jax", "host",
                         "totals"}  # fmt: skip
    third = manifest.collect("test")
    manifest.write(tmp_path, third)
    assert [h["totals"] for h in third["previous"]] == [{"requests": 3}, {"requests": 4}]


@pytest.mark.parametrize(
    "error, status, reason",
    [
        (None, "complete", None),
        (KeyboardInterrupt("3 replies kept in X"), "interrupted", "3 replies kept in X"),
        (ValueError("bad data"), "failed", "ValueError: bad data"),
        (SystemExit("error: no such file"), "failed", "error: no such file"),
    ],
)
def test_recording_ends_with_the_status_of_what_ended_the_run(tmp_path, error, status, reason):
    path = tmp_path / "out.manifest.json"
    started = manifest.collect("test")
    try:
        with manifest.recording(tmp_path, started, name=path.name) as record:
            assert read_manifest(path)["status"] == "running"
            record["added"] = 1
            if error is not None:
                raise error
    except BaseException as e:
        assert e is error
    written = read_manifest(path)
    assert written["status"] == status and written.get("reason") == reason
    assert written["added"] == 1 and written["ended"] is not None


def test_a_manifest_that_cannot_be_read_is_named(tmp_path):
    (tmp_path / manifest.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(manifest.ManifestError, match=r"manifest\.json: not the JSON manifest"):
        manifest.write(tmp_path, manifest.collect("test"))


def test_digests_follow_names_and_contents(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    weights = manifest.weights_digest(model)
    expected = hashlib.sha256(
        f"model.safetensors\t{hashlib.sha256(b'weights').hexdigest()}\n".encode()
    ).hexdigest()
    assert weights == {"sha256": expected, "files": 1, "bytes": 7}
    # Not a weight file: it changes the tree, not the weights.
    tree = manifest.tree_digest(model)
    (model / "config.json").write_text('{"a": 1}')
    assert manifest.weights_digest(model) == weights
    assert manifest.tree_digest(model) != tree
    (model / "model.safetensors").write_bytes(b"weightz")
    assert manifest.weights_digest(model) != weights
    (model / "model.safetensors").rename(model / "other.safetensors")
    assert manifest.weights_digest(model)["sha256"] != expected
    assert manifest.weights_digest(model / "other.safetensors")["files"] == 1
    assert manifest.weights_digest(tmp_path / "missing") is None
    # Items: the same (id, digest) pairs in any order, and nothing else.
    pairs = [("q1", "a"), ("q0", "b")]
    assert manifest.items_digest(pairs) == manifest.items_digest(pairs[::-1])
    assert manifest.items_digest(pairs) != manifest.items_digest([("q1", "a"), ("q0", "c")])


# ---------------------------------------------------------------------------------------------
# eval-mllm
# ---------------------------------------------------------------------------------------------


def chat(body, attempt):
    return 200, {}, {
        "id": "x", "object": "chat.completion", "model": "served-id", "usage": USAGE,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"content": right_answer(body)}}],
    }  # fmt: skip


@pytest.fixture
def letters(monkeypatch):
    size = {"n": 14}
    monkeypatch.setattr(eval_cli.tasks, "make_benchmark", lambda *a, **k: Letters(size["n"]))
    return lambda n: size.update(n=n)


def eval_argv(url: str, out: pathlib.Path, *extra: str) -> list[str]:
    return ["eval-mllm", "foci", "--data-dir", "unused", "--endpoint", url, "--model", "m",
            "--output", str(out), "--no-progress", "--api-key-env", KEY_ENV, *extra]  # fmt: skip


def records_of(out: pathlib.Path) -> list[dict]:
    return list(store.PredictionStore(out / store.PREDICTIONS_FILE).records.values())


def test_eval_mllm_manifest_against_the_loopback_server(letters, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    out = tmp_path / "run"
    with ChatServer(chat, models=["m"]) as server:
        cli.main(eval_argv(server.url, out, "--timeout", "30", "--concurrency", "2"))
        hits = server.hits
    text = (out / manifest.MANIFEST_FILE).read_text()
    assert KEY not in text
    written = json.loads(text)
    assert written["kind"] == "eval-mllm" and written["status"] == "complete"
    assert written["ood_jax"]["version"] == "0.1.0" and written["host"]["hostname"]
    # An HTTP evaluation starts no jax backend: it could take the server's GPU.
    assert written["devices"] is None
    assert {"jax", "jaxlib", "flax"} <= written["packages"].keys()
    assert written["benchmark"] == {"benchmark": "letters"}
    assert written["dataset"] == {"name": "letters"}
    assert written["model"] == {
        "client": "openai", "model": "m", "max_tokens": 8, "token_param": "max_tokens",
        "temperature": 0.0, "extra_body": {},
    }  # fmt: skip
    assert written["served_models"] == ["served-id"]
    request = written["request"]
    assert request["endpoint"] == server.url and request["timeout_s"] == 30
    assert request["concurrency"] == 2 and request["max_requests"] is None
    assert written["prompts"] == {"version": prompts.PROMPTS_VERSION}
    assert written["parser"] == {"version": parsing.PARSER_VERSION, "parse_mode": None}
    records = records_of(out)
    assert written["items"] == {
        "count": 14,
        "digest": manifest.items_digest((r["id"], r["digest"]) for r in records),
    }
    assert written["totals"] == {
        "requests": hits, "replies": 14, "failures": 0, "attempts": 14,
        "tokens": {k: 14 * v for k, v in USAGE.items()},
    }  # fmt: skip
    assert written["results"]["usage"] == written["totals"]["tokens"]
    assert "previous" not in written

    # A rerun has nothing to send: its own totals are zero, the first run's are kept.
    with ChatServer(chat, models=["m"]) as server:
        cli.main(eval_argv(server.url, out))
        assert server.hits == 0
    again = read_manifest(out / manifest.MANIFEST_FILE)
    assert again["totals"]["requests"] == 0 and again["status"] == "complete"
    assert [h["totals"] for h in again["previous"]] == [written["totals"]]
    assert again["items"] == written["items"]


class Reworded(Letters):
    """Letters whose item `changed` asks another question under the same id."""

    def __init__(self, n: int, changed: str):
        super().__init__(n)
        self.changed = changed

    def items(self):
        for item in super().items():
            if item.id == self.changed:
                item = Item(item.id, Request(item.request.prompt + " again"), item.meta)
            yield item


@pytest.mark.slow
def test_the_items_digest_differs_exactly_when_compare_refuses(tmp_path):
    def run(benchmark, name: str, model: str) -> str:
        with ChatServer(chat) as server:
            client = OpenAIChatClient(server.url, model)
            runner.run(
                benchmark, client, tmp_path / name, options=runner.RunOptions(progress=False)
            )
        return read_manifest(tmp_path / name / manifest.MANIFEST_FILE)["items"]["digest"]

    a = run(Letters(6), "a", "m1")
    b = run(Letters(6), "b", "m2")
    reworded = run(Reworded(6, "q3"), "reworded", "m2")
    fewer = run(Letters(5), "fewer", "m2")
    assert a == b
    compare.pair_items(compare.load_run(tmp_path / "a"), compare.load_run(tmp_path / "b"))
    assert reworded != a and fewer != a
    with pytest.raises(ValueError, match="ask different questions"):
        compare.pair_items(
            compare.load_run(tmp_path / "a"), compare.load_run(tmp_path / "reworded")
        )
    with pytest.raises(ValueError, match="hold different items"):
        compare.pair_items(compare.load_run(tmp_path / "a"), compare.load_run(tmp_path / "fewer"))


def test_a_tfds_benchmark_names_its_builds(foci_data, tmp_path):  # noqa: F811
    benchmark = tasks.make_benchmark("foci", data_dir=str(foci_data), config="custom")

    def respond(body, attempt):
        return 200, {}, completion(foci_reply(prompt_text(body)))

    with ChatServer(respond) as server:
        runner.run(
            benchmark,
            OpenAIChatClient(server.url, "m"),
            tmp_path,
            options=runner.RunOptions(progress=False),
        )
    written = read_manifest(tmp_path / manifest.MANIFEST_FILE)
    directory = tasks.dataset_dir(foci_data, "foci", "custom")
    assert written["dataset"] == {
        "name": "foci",
        "builds": [{
            "name": "foci", "config": "custom", "version": directory.name,
            "path": str(directory.resolve()),
            "digest": manifest.tfds_digest(directory)["sha256"],
        }],
    }  # fmt: skip
    assert written["parser"]["parse_mode"] == "foci"


class Failing:
    """A client whose every request fails (kind "HTTP 500"), or that crashes with `crash`."""

    def __init__(self, crash: BaseException | None = None):
        self.crash = crash

    def identity(self):
        return {"client": "failing", "model": "m"}

    def generate(self, request):
        if self.crash is not None:
            raise self.crash
        raise ClientError("HTTP 500: down", "HTTP 500")


@pytest.mark.parametrize(
    "client, raised, status, reason",
    [
        (ScriptedClient(interrupt_at=3), KeyboardInterrupt, "interrupted", "replies kept in"),
        (Failing(), scheduling.RunStopped, "stopped", "5 items in a row failed with HTTP 500"),
        (Failing(RuntimeError("boom")), RuntimeError, "failed", "RuntimeError: boom"),
    ],
)
def test_a_run_that_ends_early_says_how(tmp_path, client, raised, status, reason):
    with pytest.raises(raised):
        runner.run(
            Letters(20), client, tmp_path, options=runner.RunOptions(concurrency=1, progress=False)
        )
    written = read_manifest(tmp_path / manifest.MANIFEST_FILE)
    assert written["status"] == status and reason in written["reason"]
    assert written["ended"] is not None and "items" not in written
    assert written["totals"]["requests"] >= 1


# ---------------------------------------------------------------------------------------------
# Mining
# ---------------------------------------------------------------------------------------------


def mine(argv: list[str], scorer: FakeScorer, scorer_path: str) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["mine", "foci", *argv, "--scorer", scorer_path, "--quiet"])
    args.run(args, scorer_factory=lambda path: scorer)


def test_mining_manifest_beside_its_output(tmp_path):
    src = tmp_path / "src"
    for k in range(10):
        _write_image(src / "images" / f"c{k % 5}" / f"{k:03d}.png", k)
    weights = tmp_path / "scorer"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"clip weights")
    out, cache = tmp_path / "mined" / "options.json", tmp_path / "cache"
    argv = ["--dataset", "custom", "--source", str(src), "--batch-size", "3", "--out", str(out),
            "--cache", str(cache)]  # fmt: skip
    path = jobs.manifest_path(out)
    assert path == tmp_path / "mined" / "options.manifest.json"

    with pytest.raises(KeyboardInterrupt):
        mine(argv, FakeScorer(fail_after_batches=1), str(weights))
    stopped = read_manifest(path)
    assert stopped["status"] == "interrupted" and "image features" in stopped["reason"]
    assert "outputs" not in stopped

    mine(argv, FakeScorer(), str(weights))
    written = read_manifest(path)
    assert written["kind"] == "mine foci" and written["status"] == "complete"
    source = foci.read_source("custom", src)
    assert written["dataset"] == {
        "name": "custom",
        "source": str(src.resolve()),
        "records": {
            "count": 10,
            "digest": manifest.items_digest(zip(source.images, source.labels)),
        },
    }
    assert written["scorers"] == [{
        "path": str(weights), "kind": "clip", "identity": {"fake": 16},
        "weights": manifest.weights_digest(weights),
    }]  # fmt: skip
    assert written["outputs"] == [{"path": str(out), "sha256": manifest.file_sha256(out)}]
    assert written["options"]["batch_size"] == 3 and written["options"]["cache"] == str(cache)
    assert written["devices"]["count"] >= 1 and written["devices"]["process_count"] == 1
    assert {"all_classes", "options"} <= set(written["accuracy"])
    assert [h["status"] for h in written["previous"]] == ["interrupted"]
    # The cache keeps a manifest.json of its own, which the run's must not replace.
    assert json.loads((cache / "manifest.json").read_text())["identity"] == {"fake": 16}


# ---------------------------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------------------------


def tiny_config(data_dir: pathlib.Path):
    """configs/synthetic_detr.py:smoke cut to what compiles and evaluates fastest: one step, a
    frozen undilated backbone, 64-pixel images, one held-out domain."""
    spec = importlib.util.spec_from_file_location(
        "synthetic_detr", REPO / "configs" / "synthetic_detr.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.dataset.data_dir = str(data_dir)
    config.dataset.target_domains = ("sky",)
    config.total_steps = config.log_every = config.checkpoint_every = 1
    config.input.image_size, config.input.scales = 64, (64,)
    config.eval_batch_size = 16
    config.model.args.update(freeze_backbone=True, dilation=False, num_decoder_layers=1)
    config.optim.update(frozen_pattern="backbone/.*", backbone_lr=0.0)
    return config


@pytest.mark.slow
def test_training_and_evaluation_manifests(tmp_path, compile_cache):
    from ood_jax.detection import compare as detection_compare
    from ood_jax.train import train

    datasets.build("synthetic_shifts", str(tmp_path / "tfds"), config="tiny")
    config = tiny_config(tmp_path / "tfds")
    workdir = tmp_path / "workdir"
    started = time.perf_counter()
    results = train.train_and_evaluate(config, str(workdir))
    trained = read_manifest(workdir / manifest.MANIFEST_FILE)
    train.evaluate(config, str(workdir))
    print(f"train 1 step + evaluate: {time.perf_counter() - started:.1f} s")
    evaluated = read_manifest(workdir / manifest.MANIFEST_FILE)

    assert trained["kind"] == "train" and trained["status"] == "complete"
    assert trained["devices"]["platform"] == "cpu" and trained["devices"]["count"] >= 1
    assert trained["devices"]["process_count"] == 1
    assert {"optax", "orbax-checkpoint", "tensorflow", "tensorflow-datasets"} <= set(
        trained["packages"]
    )
    builder = datasets.load("synthetic_shifts/tiny", str(tmp_path / "tfds"))
    assert trained["dataset"] == {
        **manifest.tfds_dataset(builder),
        "splits": train.experiment_splits(config.dataset, builder),
    }
    assert trained["dataset"]["name"] == "synthetic_shifts"
    assert trained["dataset"]["config"] == "tiny"
    config_json = config.to_json_best_effort(sort_keys=True)
    assert trained["config"]["sha256"] == hashlib.sha256(config_json.encode()).hexdigest()
    assert trained["checkpoint"] == {
        "step": 1,
        "path": str(workdir.absolute() / "checkpoints" / "1"),
        "digest": manifest.tree_digest(workdir / "checkpoints" / "1"),
    }
    matches = detection_compare.read_matches(workdir)
    assert trained["evaluation"]["splits"]["iid"] == {
        "images": len(matches["iid"].image_ids),
        "image_ids_sha256": hashlib.sha256(matches["iid"].image_ids.tobytes()).hexdigest(),
        "ground_truth": matches["iid"].ground_truth,
    }
    assert trained["evaluation"]["iid_AP"] == results["iid"]["AP"]
    assert set(trained["evaluation"]["splits"]) == {"iid", "sky"}

    # evaluate says which checkpoint it evaluated: the one train saved, by its digest.
    assert evaluated["kind"] == "evaluate" and evaluated["status"] == "complete"
    assert evaluated["checkpoint"] == trained["checkpoint"]
    assert evaluated["evaluation"]["splits"] == trained["evaluation"]["splits"]
    [head] = evaluated["previous"]
    assert head["kind"] == "train" and head["checkpoint"] == trained["checkpoint"]


def test_weights_digest_of_a_relative_path(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    relative = manifest.weights_digest("model")
    assert relative == manifest.weights_digest(tmp_path / "model")
    assert relative["files"] == 1 and relative["bytes"] == len(b"weights")
    assert manifest.tree_digest("model") == manifest.tree_digest(tmp_path / "model")
