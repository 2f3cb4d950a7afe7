"""`ood-jax eval-mllm` end to end: tiny FOCI and OODBench builds and a COUNTS items file, a
chat-completions server started here that answers deterministically from the prompt (and fails
on purpose), and results checked against sklearn, pycocotools and numpy computed here from the
records and the server's own answers."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import pathlib
import threading

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image
from scipy import stats as sps
from sklearn import metrics as skm
from test_clients import KEY, KEY_ENV, ChatServer, completion, image_parts, prompt_text

from ood_jax import cli, datasets
from ood_jax import prompts
from ood_jax.cli import mllm as eval_cli
from ood_jax.eval import store
from ood_jax.eval import results as run_results
from ood_jax.eval import clip_baseline, job, runner, tasks
from ood_jax.eval.tasks.oodbench import bap_results, yes_no_results
from ood_jax.eval.http_client import OpenAIChatClient


def run_cli(argv: list[str]):
    args = cli.build_parser().parse_args(argv)
    return args.run(args)


def exact_interval(k: int, n: int) -> list[float]:
    """The reference for every accuracy's interval: scipy's exact binomial interval."""
    ci = sps.binomtest(k, n).proportion_ci(0.95, method="exact")
    return [ci.low, ci.high]


def h(text: str, salt: str = "") -> int:
    """A stable hash of a prompt: the test server's 'model' and the expectations share it."""
    return int.from_bytes(hashlib.sha256((salt + text).encode()).digest()[:8], "big")


def _write_image(path: pathlib.Path, seed: int, size=(24, 20), fmt="JPEG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format=fmt)


def _raw_records(directory: pathlib.Path, splits) -> dict[str, list[dict]]:
    builder = tfds.builder_from_directory(str(directory))
    out = {}
    for split in splits:
        if split in builder.info.splits:
            dataset = builder.as_dataset(
                split=split, decoders={"image": tfds.decode.SkipDecoding()}, shuffle_files=False
            )
            out[split] = list(tfds.as_numpy(dataset))
    return out


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


# ---------------------------------------------------------------------------------------------
# FOCI
# ---------------------------------------------------------------------------------------------

FOCI_CLASSES = {"custom": ["cat", "dog", "cow", "hen", "pig"], "imagenet21k_animal": None}
WNIDS = {"n01": "wolf pup", "n02": "lion cub", "n03": "bear cub", "n04": "tiger cub"}


def _foci_source(src: pathlib.Path, classes: list[str], path_of) -> None:
    entries = collections.defaultdict(list)
    for c, label in enumerate(classes):
        for k in range(3 if len(classes) == 5 else 2):
            image = path_of(label, k)
            _write_image(src / image, seed=100 * c + k + len(classes))
            options = [classes[(c + j) % len(classes)] for j in range(4)]
            entries[label].append({"image": image, "options": options, "groundtruth": label})
    (src / "options.json").write_text(json.dumps(entries))


@pytest.fixture(scope="module")
def foci_data(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("foci")
    data_dir = root / "tfds"
    _foci_source(
        root / "custom", FOCI_CLASSES["custom"], lambda label, k: f"photos/{label}/{k}.jpg"
    )
    datasets.build("foci", str(data_dir), source=str(root / "custom"), config="custom")
    wnid = {label: w for w, label in WNIDS.items()}
    _foci_source(
        root / "in21k", list(WNIDS.values()), lambda label, k: f"images/{wnid[label]}/{k}.JPEG"
    )
    datasets.build("foci", str(data_dir), source=str(root / "in21k"), config="imagenet21k_animal")
    return data_dir


def foci_reply(text: str) -> str:
    """The test 'model': a letter from the prompt's hash, or now and then no letter at all."""
    if h(text, "unsure") % 6 == 0:
        return "I am not sure."
    return "ABCD"[h(text) % 4] + ". because"


def failing_image(data_dir: pathlib.Path) -> str:
    """SHA-256 of the one image whose item the server never answers."""
    return hashlib.sha256((data_dir.parent / "custom/photos/pig/0.jpg").read_bytes()).hexdigest()


def foci_server(fail_sha: str):
    def respond(body, attempt):
        text = prompt_text(body)
        if hashlib.sha256(image_parts(body)[0]).hexdigest() == fail_sha:
            return 500, {}, {"error": "this one never works"}
        # The first attempt of many prompts is rate limited or fails; the retry answers.
        if attempt == 1 and h(text, "flaky") % 3 == 0:
            return 429, {"Retry-After": "0"}, {"error": "slow down"}
        if attempt == 1 and h(text, "flaky") % 3 == 1:
            return 502, {}, {"error": "bad gateway"}
        return 200, {}, completion(foci_reply(text))

    return respond


def foci_expectations(data_dir: pathlib.Path) -> dict[str, list[tuple[str, bool, bool]]]:
    """Per dataset: (prompt text, correct, failed) from the records and the server's rules."""
    out, fail_sha = {}, failing_image(data_dir)
    for config in ("custom", "imagenet21k_animal"):
        directory = tasks.dataset_dir(data_dir, "foci", config)
        rows = []
        for record in _raw_records(directory, ["test"])["test"]:
            options = [o.decode() for o in record["options"]]
            text = prompts.foci_multiple_choice(record["dataset"].decode(), options)
            failed = hashlib.sha256(record["image"]).hexdigest() == fail_sha
            reply = foci_reply(text)
            correct = not failed and reply[0] == "ABCD"[record["answer"]] and "." in reply[:2]
            rows.append((text, correct, failed))
        out[config] = rows
    return out


def _no_key_anywhere(directory: pathlib.Path, *texts: str) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text(errors="replace"), path
    for text in texts:
        assert KEY not in text


def test_foci_run_with_a_flaky_server(foci_data, tmp_path, api_key, capsys):
    expected = foci_expectations(foci_data)
    n = sum(len(rows) for rows in expected.values())
    failing = sum(f for rows in expected.values() for _, _, f in rows)
    assert failing == 1 and n == 23
    out = tmp_path / "run"
    argv = ["eval-mllm", "foci", "--data-dir", str(foci_data), "--model", "tiny"]
    argv += ["--output", str(out), "--concurrency", "3", "--max-attempts", "3"]
    # Two first attempts in three fail: more retries than the default budget allows.
    argv += ["--backoff", "0.01", "--retry-budget", "40", "--api-key-env", KEY_ENV]
    argv += ["--no-progress"]
    with ChatServer(foci_server(failing_image(foci_data))) as server:
        with pytest.raises(SystemExit) as failed:
            run_cli(["eval-mllm", "foci", "--endpoint", server.url, *argv[2:]])
    # A run with a failed item does not exit 0.
    assert failed.value.code == eval_cli.EXIT_INCOMPLETE
    results = json.loads((out / store.RESULTS_JSON).read_text())
    printed = capsys.readouterr()
    # Every request: our key as a Bearer header, greedy, FOCI's 10-token budget, image first.
    for _, headers, body in server.requests:
        assert headers["Authorization"] == f"Bearer {KEY}"
        assert body["temperature"] == 0 and body["max_tokens"] == 10 and body["model"] == "tiny"
        assert body["messages"][0]["content"][0]["type"] == "image_url"
    first_attempts = {json.dumps(b, sort_keys=True) for _, _, b in server.requests}
    assert len(first_attempts) == n

    per_dataset = results["per_dataset"]
    for config, rows in expected.items():
        assert per_dataset[config]["accuracy"] == pytest.approx(np.mean([c for _, c, _ in rows]))
        assert per_dataset[config]["num_items"] == len(rows)
        right = sum(c for _, c, _ in rows)
        assert per_dataset[config]["accuracy_ci"] == pytest.approx(exact_interval(right, len(rows)))
    all_rows = [row for rows in expected.values() for row in rows]
    assert results["accuracy"] == pytest.approx(np.mean([c for _, c, _ in all_rows]))
    right = sum(c for _, c, _ in all_rows)
    assert results["accuracy_ci"] == pytest.approx(exact_interval(right, n))
    assert results["intervals"] == {"method": "clopper-pearson", "confidence": 0.95}
    assert results["average_accuracy"] == pytest.approx(
        np.mean([np.mean([c for _, c, _ in rows]) for rows in expected.values()])
    )
    assert results["request_failures"] == 1
    unread = sum(foci_reply(t).startswith("I am") for t, _, f in all_rows if not f)
    assert results["generation_failures"] == 1 + unread
    assert results["complete"] is False
    assert results["outcomes"] == {
        "answered": n - 1, "truncated": 0, "refused": 0, "empty": 0, "error": 1
    }  # fmt: skip

    lines = (out / store.PREDICTIONS_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == n and len({r["id"] for r in records}) == n
    (failure,) = [r for r in records if r["error"] is not None]
    assert failure["error_kind"] == "HTTP 500" and failure["attempts"] == 3
    assert failure["outcome"] == "error"
    assert "## FOCI" in (out / store.RESULTS_MD).read_text()
    _no_key_anywhere(out, printed.out, printed.err)

    # The rerun sends only the failed item; it works now.
    with ChatServer(lambda body, attempt: (200, {}, completion("A"))) as server:
        again = run_cli(["eval-mllm", "foci", "--endpoint", server.url, *argv[2:]])
    assert server.hits == 1
    assert again["complete"] is True and again["request_failures"] == 0
    assert f"1 of {n} items failed; rerun the same command to retry them" in printed.err
    assert len((out / store.PREDICTIONS_FILE).read_text().splitlines()) == n


def _timeless(predictions: pathlib.Path) -> list[dict]:
    """The records of a predictions file, in order, without the one field that varies: latency."""
    records = [json.loads(line) for line in predictions.read_text().splitlines()]
    for record in records:
        assert record["outcome"] == "error" or record["latency_s"] >= 0
        del record["latency_s"]
    return records


class Killed(Exception):
    pass


class KilledAfter:
    """A client that dies (as a killed process would) when asked its (after + 1)-th question."""

    def __init__(self, inner, after: int):
        self.inner, self.after, self.calls = inner, after, 0

    def identity(self):
        return self.inner.identity()

    def generate(self, request):
        self.calls += 1
        if self.calls > self.after:
            raise Killed
        return self.inner.generate(request)


def test_killed_run_resumes_without_resending(foci_data, tmp_path):
    benchmark = tasks.make_benchmark("foci", data_dir=str(foci_data), config="custom")
    respond = lambda body, attempt: (200, {}, completion(foci_reply(prompt_text(body))))  # noqa: E731

    with ChatServer(respond) as server:
        clean = runner.run(
            benchmark,
            OpenAIChatClient(server.url, "m"),
            tmp_path / "clean",
            options=runner.RunOptions(progress=False),
        )
        n = server.hits
    predictions = tmp_path / "killed" / store.PREDICTIONS_FILE
    with ChatServer(respond) as server:
        client = OpenAIChatClient(server.url, "m")
        with pytest.raises(Killed):
            runner.run(
                benchmark,
                KilledAfter(client, 7),
                tmp_path / "killed",
                options=runner.RunOptions(concurrency=1, progress=False),
            )
        assert server.hits == 7
        assert len(predictions.read_text().splitlines()) == 7
        assert not (tmp_path / "killed" / store.RESULTS_JSON).exists()
        # A kill in the middle of writing: the last line is torn.
        predictions.write_bytes(predictions.read_bytes()[:-25])
        resumed = runner.run(
            benchmark,
            client,
            tmp_path / "killed",
            options=runner.RunOptions(concurrency=3, progress=False),
        )
        # Only the items never answered and the torn one were sent.
        assert server.hits == 7 + (n - 7) + 1
    assert resumed == clean
    assert _timeless(predictions) == _timeless(tmp_path / "clean" / store.PREDICTIONS_FILE)

    # A limited run, then the full one: every item is sent exactly once.
    with ChatServer(respond) as server:
        client = OpenAIChatClient(server.url, "m")
        runner.run(
            benchmark,
            client,
            tmp_path / "limited",
            options=runner.RunOptions(limit=5, progress=False),
        )
        assert server.hits == 5
        assert (
            runner.run(
                benchmark, client, tmp_path / "limited", options=runner.RunOptions(progress=False)
            )
            == clean
        )
        assert server.hits == n
        # Nothing left: a third run sends nothing.
        runner.run(
            benchmark, client, tmp_path / "limited", options=runner.RunOptions(progress=False)
        )
        assert server.hits == n


def test_rerun_refuses_another_model_and_a_corrupt_file(foci_data, tmp_path):
    benchmark = tasks.make_benchmark("foci", data_dir=str(foci_data), config="custom")
    with ChatServer(lambda body, attempt: (200, {}, completion("B"))) as server:
        runner.run(
            benchmark,
            OpenAIChatClient(server.url, "m1"),
            tmp_path,
            options=runner.RunOptions(progress=False),
        )
        with pytest.raises(store.RunError, match="model: 'm1' there, 'm2' now"):
            runner.run(
                benchmark,
                OpenAIChatClient(server.url, "m2"),
                tmp_path,
                options=runner.RunOptions(progress=False),
            )
        # Another parse mode is no other run: the stored replies are read again, nothing sent.
        hits = server.hits
        strict = runner.run(benchmark, OpenAIChatClient(server.url, "m1"), tmp_path, options=runner.RunOptions(progress=False, parse_mode="strict"))  # fmt: skip
        assert server.hits == hits and strict["parse_mode"] == "strict"
        assert json.loads((tmp_path / store.RUN_FILE).read_text())["parse_mode"] == "strict"
        path = tmp_path / store.PREDICTIONS_FILE
        lines = path.read_text().splitlines()
        lines[3] = lines[3][:20]  # a complete but broken line is corruption, not a torn tail
        path.write_text("\n".join(lines) + "\n")
        hits = server.hits
        with pytest.raises(store.RunError, match=r"predictions\.jsonl: line 4: malformed JSON"):
            runner.run(
                benchmark,
                OpenAIChatClient(server.url, "m1"),
                tmp_path,
                options=runner.RunOptions(progress=False),
            )
        assert server.hits == hits


# ---------------------------------------------------------------------------------------------
# CLIP baseline
# ---------------------------------------------------------------------------------------------


class FakeScorer:
    """Deterministic 'CLIP': an image is its mean colour through a fixed map; a text a hash."""

    dim = 8

    def __init__(self):
        self.image_calls = self.text_calls = 0
        self.projection = np.random.default_rng(0).normal(size=(self.dim, 3))

    def encode_images(self, images):
        self.image_calls += len(images)
        colours = np.stack(
            [np.asarray(im, np.float64).reshape(-1, 3).mean(0) / 255 for im in images]
        )
        out = colours @ self.projection.T
        return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)

    def encode_texts(self, texts, templates):
        self.text_calls += len(texts)
        rows = []
        for text in texts:
            vectors = [self._text(template.format(text)) for template in templates]
            mean = np.mean([v / np.linalg.norm(v) for v in vectors], axis=0)
            rows.append(mean / np.linalg.norm(mean))
        return np.stack(rows).astype(np.float32)

    def _text(self, text):
        return np.random.default_rng(h(text) % 2**32).normal(size=self.dim)


def test_clip_baseline_with_a_fake_scorer(foci_data, tmp_path):
    benchmark = tasks.make_benchmark("foci", data_dir=str(foci_data))
    scorer, templates = FakeScorer(), ("a photo of a {}.", "an image of {}")
    results = clip_baseline.run_clip_baseline(
        benchmark,
        scorer,
        tmp_path / "clip",
        "fake",
        templates,
        batch_size=5,
        options=runner.RunOptions(progress=False),
    )
    hits, per_item = [], {}
    for config in ("custom", "imagenet21k_animal"):
        directory = tasks.dataset_dir(foci_data, "foci", config)
        for record in _raw_records(directory, ["test"])["test"]:
            pixels = np.asarray(Image.open(io.BytesIO(record["image"])).convert("RGB"))
            image = scorer.encode_images([pixels])[0]
            texts = scorer.encode_texts([o.decode() for o in record["options"]], templates)
            choice = int(np.argmax(texts @ image))
            hits.append(choice == record["answer"])
            per_item[f"{config}/{record['image/filename'].decode()}"] = choice
    assert results["accuracy"] == pytest.approx(np.mean(hits))
    assert 0 < np.mean(hits) < 1
    records = [json.loads(x) for x in (tmp_path / "clip" / store.PREDICTIONS_FILE).open()]
    assert {r["id"]: r["parsed"] for r in records} == per_item
    assert all(r["reply"] == "ABCD"[r["parsed"]] for r in records)
    # Resumed: nothing is scored again.
    before = scorer.image_calls
    clip_baseline.run_clip_baseline(
        benchmark,
        scorer,
        tmp_path / "clip",
        "fake",
        templates,
        options=runner.RunOptions(progress=False),
    )
    assert scorer.image_calls == before

    # FOCI Fig. 4: the LVLM's accuracy where CLIP is right and where it is wrong.
    respond = lambda body, attempt: (200, {}, completion(foci_reply(prompt_text(body))))  # noqa: E731
    with ChatServer(respond) as server:
        lvlm = runner.run(
            benchmark,
            OpenAIChatClient(server.url, "m"),
            tmp_path / "lvlm",
            options=runner.RunOptions(progress=False),
        )
    lvlm_records = {
        r["id"]: r for r in map(json.loads, (tmp_path / "lvlm" / store.PREDICTIONS_FILE).open())
    }
    clip_records = {r["id"]: r for r in records}
    split = run_cli(
        [
            "stats",
            "clip-conditional",
            "--lvlm",
            str(tmp_path / "lvlm"),
            "--clip",
            str(tmp_path / "clip"),
            "--json",
        ]
    )
    for name, clip_right in (("clip_correct", True), ("clip_wrong", False)):
        ids = [i for i in clip_records if clip_records[i]["correct"] == clip_right]
        assert split[name]["count"] == len(ids)
        assert split[name]["lvlm_accuracy"] == pytest.approx(
            np.mean([lvlm_records[i]["correct"] for i in ids])
        )
    assert split["lvlm_accuracy"] == pytest.approx(lvlm["accuracy"])


def test_clip_baseline_refuses_items_it_cannot_answer(tmp_path):
    path, _ = write_oodg_items(tmp_path / "mined")
    for task, ice, message in (("grounding", 1, "has 2 images"), ("localization", 0, "multiple")):
        benchmark = tasks.make_benchmark("counts-oodg", items=str(path), task=task, ice=ice)
        with pytest.raises(tasks.ItemsError, match=message):
            clip_baseline.run_clip_baseline(
                benchmark,
                FakeScorer(),
                tmp_path / task,
                "fake",
                options=runner.RunOptions(progress=False),
            )
    zero_shot = tasks.make_benchmark("counts-oodg", items=str(path), task="grounding", ice=0)
    results = clip_baseline.run_clip_baseline(
        zero_shot, FakeScorer(), tmp_path / "zs", "fake", options=runner.RunOptions(progress=False)
    )
    assert results["grounding"][0]["num_items"] == zero_shot.count()


# ---------------------------------------------------------------------------------------------
# OODBench
# ---------------------------------------------------------------------------------------------

CATEGORIES = {1: "cat", 2: "dog", 3: "traffic_light", 4: "zebra"}
INSTANCES = {1: {1: 2, 2: 1}, 2: {1: 3, 2: 3}, 3: {1: 1, 4: 2}, 4: {2: 2, 3: 1}, 5: {4: 4, 1: 1}}
SPLIT_LINES = [
    (1, "cat", "ID"), (1, "zebra", "ID"), (2, "dog", "ID"), (4, "cat", "ID"),
    (2, "cat", "OOD-S"), (3, "zebra", "OOD-S"), (4, "traffic_light", "OOD-S"), (5, "dog", "OOD-S"),
    (5, "zebra", "OOD-H"), (3, "cat", "OOD-H"), (4, "dog", "OOD-H"),
]  # fmt: skip


@pytest.fixture(scope="module")
def oodbench_data(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("oodbench")
    src, data_dir = root / "src", root / "tfds"
    images, annotations = [], []
    for image_id, counts in INSTANCES.items():
        _write_image(src / "images" / f"{image_id}.jpg", image_id, size=(30 + image_id, 22))
        images.append({"id": image_id, "file_name": f"{image_id}.jpg"})
        for category, n in counts.items():
            for _ in range(n):
                annotations.append(
                    {"id": len(annotations) + 1, "image_id": image_id, "category_id": category,
                     "bbox": [1, 1, 4, 4], "iscrowd": 0}
                )  # fmt: skip
    categories = [{"id": k, "name": v} for k, v in CATEGORIES.items()]
    (src / "annotations.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    lines = [json.dumps({"image_id": i, "category": c, "split": s}) for i, c, s in SPLIT_LINES]
    (src / "splits.jsonl").write_text("\n".join(lines) + "\n")
    datasets.build("oodbench", str(data_dir), source=str(src), config="default")
    datasets.build("oodbench", str(data_dir), source=str(src), config="bap")
    return data_dir


def yes_no_reply(text: str) -> str:
    return ["Yes, it does.", "No.", "It is hard to say."][h(text) % 3 if h(text, "u") % 4 else 2]


def cot_reply(text: str) -> str:
    verdict = ["yes", "no"][h(text) % 2]
    return f"Step 1: look at the image. Yes or no? Step 2: decide. So the answer is {verdict}."


@pytest.mark.parametrize("setting", ["plain", "cot"])
def test_oodbench_metrics_match_sklearn(oodbench_data, tmp_path, setting):
    reply = yes_no_reply if setting == "plain" else cot_reply
    respond = lambda body, attempt: (200, {}, completion(reply(prompt_text(body))))  # noqa: E731
    argv = ["eval-mllm", "oodbench", "--data-dir", str(oodbench_data), "--model", "m"]
    argv += ["--output", str(tmp_path), "--setting", setting, "--no-progress"]
    with ChatServer(respond) as server:
        results = run_cli(argv + ["--endpoint", server.url])
    assert server.hits == 2 * len(SPLIT_LINES)
    if setting == "cot":
        assert all("Let\u2019s break down" in prompt_text(b) for _, _, b in server.requests)
        assert all(b["max_tokens"] == 512 for _, _, b in server.requests)
    directory = tasks.dataset_dir(oodbench_data, "oodbench", "default")
    records = _raw_records(directory, ["id", "ood_s", "ood_h"])
    assert list(results["splits"]) == ["id", "ood_s", "ood_h"]
    for split, split_records in records.items():
        truth, predicted, unread = [], [], 0
        for record in split_records:
            text = record["question"].decode()
            if setting == "cot":
                negated = record["kind"].decode().startswith("negated")
                text = prompts.oodbench_question(
                    record["category"].decode().replace("_", " "), negated, chain_of_thought=True
                )
            answer = reply(text)
            said = (
                None
                if "hard to say" in answer
                else (
                    "yes" in answer.lower().split()[-1]
                    if setting == "cot"
                    else answer.startswith("Yes")
                )
            )
            truth.append(bool(record["answer"]))
            unread += said is None
            predicted.append(said if said is not None else not record["answer"])
        got = results["splits"][split]
        assert got["accuracy"] == pytest.approx(skm.accuracy_score(truth, predicted))
        assert got["precision"] == pytest.approx(
            skm.precision_score(truth, predicted, zero_division=0)
        )
        assert got["recall"] == pytest.approx(skm.recall_score(truth, predicted, zero_division=0))
        assert got["f1"] == pytest.approx(skm.f1_score(truth, predicted, zero_division=0))
        assert got["mcc"] == pytest.approx(skm.matthews_corrcoef(truth, predicted))
        assert got["unanswered"] == unread


def _record(meta, parsed, correct, error=None):
    return {"meta": meta, "parsed": parsed, "correct": correct, "error": error}


def test_yes_no_results_on_random_predictions_match_sklearn():
    rng = np.random.default_rng(0)
    records = []
    for _ in range(400):
        split = ["id", "ood_s", "ood_h"][rng.integers(3)]
        truth = bool(rng.integers(2))
        outcome = rng.integers(10)
        parsed = None if outcome == 0 else bool(rng.integers(2))
        error = "failed" if outcome == 1 else None
        parsed = None if error else parsed
        records.append(_record({"split": split, "answer": truth}, parsed, parsed == truth, error))
    results = yes_no_results(records)["splits"]
    for split in ("id", "ood_s", "ood_h"):
        group = [r for r in records if r["meta"]["split"] == split]
        truth = [r["meta"]["answer"] for r in group]
        predicted = [
            r["parsed"] if r["parsed"] is not None else not r["meta"]["answer"] for r in group
        ]
        assert results[split]["accuracy"] == pytest.approx(skm.accuracy_score(truth, predicted))
        assert results[split]["f1"] == pytest.approx(skm.f1_score(truth, predicted))
        assert results[split]["mcc"] == pytest.approx(skm.matthews_corrcoef(truth, predicted))
        assert results[split]["request_failures"] == sum(r["error"] is not None for r in group)
        assert results[split]["unanswered"] == sum(r["parsed"] is None for r in group)
        right = sum(t == p for t, p in zip(truth, predicted))
        assert results[split]["accuracy_ci"] == pytest.approx(exact_interval(right, len(group)))


def bap_reply(text: str) -> str:
    if text.startswith("How many"):
        return ["There are 1.", "2", "three", "No idea"][h(text) % 4]
    return ["Yes", "No"][h(text) % 2]


def test_bap_metrics(oodbench_data, tmp_path):
    respond = lambda body, attempt: (200, {}, completion(bap_reply(prompt_text(body))))  # noqa: E731
    with ChatServer(respond) as server:
        results = run_cli(
            ["eval-mllm", "oodbench-bap", "--data-dir", str(oodbench_data), "--endpoint",
             server.url, "--model", "m", "--output", str(tmp_path), "--no-progress"]
        )  # fmt: skip
    directory = tasks.dataset_dir(oodbench_data, "oodbench", "bap")
    words = {"1": 1, "2": 2, "three": 3}
    for split, split_records in _raw_records(directory, ["id", "ood_s", "ood_h"]).items():
        by_image = collections.defaultdict(dict)
        for record in split_records:
            level = ["existential", "counting", "logical"][record["level"]]
            reply = bap_reply(record["question"].decode())
            truth = record["answer"].decode()
            if level == "counting":
                said = next(
                    (v for w, v in words.items() if w in reply.replace(".", " ").split()), None
                )
                ok = said == int(truth)
            else:
                ok = reply.lower() == truth
            by_image[int(record["image/id"])].setdefault(level, []).append(ok)
        e = [ok for image in by_image.values() for ok in image.get("existential", [])]
        c = [ok for image in by_image.values() for ok in image.get("counting", [])]
        logical = [
            image["logical"][0] and all(image["counting"])
            for image in by_image.values() if "logical" in image
        ]  # fmt: skip
        everything = [ok for image in by_image.values() for oks in image.values() for ok in oks]
        got = results["splits"][split]
        assert got["e_acc"] == pytest.approx(np.mean(e))
        assert got["c_acc"] == pytest.approx(np.mean(c))
        assert got["l_acc"] == pytest.approx(np.mean(logical))
        assert got["bap"] == pytest.approx(np.mean(everything))
        assert got["logical_samples"] == len(logical)
    assert "E-Acc" in (tmp_path / store.RESULTS_MD).read_text()


def test_bap_l_acc_needs_both_counts_and_the_logical_answer():
    def rec(sample, level, correct):
        return _record({"split": "id", "level": level, "sample": sample}, 1, correct)

    records = [
        rec("a", "existential", False), rec("a", "counting", True), rec("a", "counting", True),
        rec("a", "logical", True),  # one point: existential answers do not matter
        rec("b", "counting", False), rec("b", "counting", True), rec("b", "logical", True),
        rec("c", "counting", True), rec("c", "counting", True), rec("c", "logical", False),
        rec("d", "existential", True), rec("d", "counting", True),  # no logical question
    ]  # fmt: skip
    got = bap_results(records)["splits"]["id"]
    assert got["l_acc"] == pytest.approx(1 / 3)
    assert got["logical_samples"] == 3
    assert got["e_acc"] == pytest.approx(1 / 2)
    assert got["c_acc"] == pytest.approx(6 / 7)
    assert got["bap"] == pytest.approx(9 / 12)
    for metric, (k, n) in {
        "l_acc": (1, 3),
        "e_acc": (1, 2),
        "c_acc": (6, 7),
        "bap": (9, 12),
    }.items():
        assert got[f"{metric}_ci"] == pytest.approx(exact_interval(k, n))


# ---------------------------------------------------------------------------------------------
# COUNTS OODG
# ---------------------------------------------------------------------------------------------

OPTIONS = ["cat", "dog", "cow", "hen"]


def _png_bytes(path: pathlib.Path, seed: int, size=(64, 48)) -> bytes:
    _write_image(path, seed, size, fmt="PNG")
    return path.read_bytes()


def write_oodg_items(
    directory: pathlib.Path, seed: int = 0, count: int = 30
) -> tuple[pathlib.Path, dict]:
    """items.jsonl of every task; returns the path and image digest -> item (for the server)."""
    rng = np.random.default_rng(seed)
    items, by_image = [], {}
    domains, sizes = ["dim", "water"], ["S", "M", "L"]
    for k in range(count):
        task = ["grounding", "grounding", "localization", "mapping"][k % 4]
        setting, ice = ("zero_shot", 0) if k % 3 else ("iid", 1)
        images = [f"images/{k}_{j}.png" for j in range(ice + 1)]
        data = [_png_bytes(directory / p, seed * 1000 + 10 * k + j) for j, p in enumerate(images)]
        record = {
            "id": f"{task}-{k}", "task": task, "setting": setting, "domain": domains[k % 2],
            "size": sizes[(k // 2) % 3], "images": images, "options": None, "answer": None,
            "category": None, "image_size": [64, 48],
        }  # fmt: skip
        if task == "grounding":
            record["options"] = OPTIONS
            record["answer"] = int(rng.integers(4))
            examples = [prompts.InContextExample(OPTIONS, "(B)")] * ice
            record["prompt"] = prompts.counts_grounding(OPTIONS, examples)
        elif task == "mapping":
            record["options"] = OPTIONS
            record["answer"] = [int(v) for v in rng.permutation(4)]
            record["prompt"] = prompts.counts_mapping(OPTIONS)
            if ice:
                record["prompt"] = "Example: " + prompts.IMAGE_PLACEHOLDER + "\n" + record["prompt"]
        else:
            record["category"] = OPTIONS[k % 4]
            xy = rng.uniform(0, 30, (int(rng.integers(1, 4)), 2))
            wh = rng.uniform(3, 30, xy.shape)
            record["answer"] = np.round(np.concatenate([xy, wh], 1), 1).tolist()
            # Table 10 has no <image>: the test image goes before the text.
            localization = prompts.counts_localization(record["category"], 64, 48)
            record["prompt"] = prompts.IMAGE_PLACEHOLDER + "\n" + localization
            if ice:
                record["prompt"] = prompts.IMAGE_PLACEHOLDER + " example\n" + record["prompt"]
        record["size"] = None if task == "localization" else record["size"]
        items.append(record)
        by_image[hashlib.sha256(data[-1]).hexdigest()] = record
    path = directory / "items.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path, by_image


def oodg_reply(record: dict) -> str:
    """The test 'model' for COUNTS: a function of the item (found by its test image)."""
    k = h(record["id"])
    if record["task"] == "grounding":
        letter = "ABCD"[k % 4]
        return [f"Answer Choice: [{letter}]", f"Answer Choice: {OPTIONS[k % 4]}", "dunno"][k % 3]
    if record["task"] == "mapping":
        chosen = [(a + (k >> i) % 2) % 4 for i, a in enumerate(record["answer"])]
        lines = [f"{c} box:[{'ABCD'[v]}]" for c, v in zip(prompts.MAPPING_COLORS, chosen)]
        return "Answer Choice:\n" + "\n".join(lines)
    boxes = [
        [x + (k % 5) - 2, y + 1, w * (1 + (k % 3) / 10), hh] for x, y, w, hh in record["answer"]
    ]
    if k % 4 == 0:
        boxes.append([40.0, 30.0, 8.0, 8.0])  # a false positive
    if k % 7 == 0:
        boxes.append([1.0, 1.0, -3.0, 2.0])  # invalid: dropped and counted
    return "\n".join(f"Box item: [{', '.join(f'{v:.1f}' for v in b)}]" for b in boxes)


def _pycocotools_ap(records: list[dict]) -> dict:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    names = sorted({r["category"] for r in records})
    images, annotations, dets = [], [], []
    for i, r in enumerate(records, start=1):
        images.append({"id": i, "width": 64, "height": 48})
        cid = names.index(r["category"]) + 1
        for b in r["answer"]:
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": cid,
                                "bbox": b, "area": b[2] * b[3], "iscrowd": 0})  # fmt: skip
        for line in oodg_reply(r).splitlines():
            b = [float(v) for v in line.split("[")[1].rstrip("]").split(",")]
            if b[2] > 0 and b[3] > 0:
                dets.append({"image_id": i, "category_id": cid, "bbox": b, "score": 1.0})
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": images, "annotations": annotations,
                      "categories": [{"id": k + 1, "name": n} for k, n in enumerate(names)]}  # fmt: skip
        gt.createIndex()
        evaluator = COCOeval(gt, gt.loadRes(dets), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return dict(zip(["AP", "AP50", "AP75", "APs", "APm", "APl"], evaluator.stats[:6]))


def test_counts_oodg_tables(tmp_path):
    path, by_image = write_oodg_items(tmp_path / "mined")

    def respond(body, attempt):
        images = image_parts(body)
        record = by_image[hashlib.sha256(images[-1]).hexdigest()]
        # Each placeholder got its image, in order.
        files = [(path.parent / p).read_bytes() for p in record["images"]]
        assert images == files
        assert prompt_text(body) == record["prompt"].replace(prompts.IMAGE_PLACEHOLDER, "")
        return 200, {}, completion(oodg_reply(record))

    with ChatServer(respond) as server:
        results = run_cli(
            ["eval-mllm", "counts-oodg", "--items", str(path), "--endpoint", server.url,
             "--model", "m", "--output", str(tmp_path / "run"), "--no-progress"]
        )  # fmt: skip
    items = [json.loads(line) for line in path.read_text().splitlines()]
    assert server.hits == len(items)

    def rows(task):
        return {(row["setting"], row["ice"]): row for row in results[task]}

    for (setting, ice), row in rows("grounding").items():
        group = [r for r in items if r["task"] == "grounding" and r["setting"] == setting
                 and len(r["images"]) - 1 == ice]  # fmt: skip
        k = [h(r["id"]) for r in group]
        correct = np.array([(v % 3 < 2) and v % 4 == r["answer"] for v, r in zip(k, group)])
        assert row["accuracy"] == pytest.approx(correct.mean())
        assert row["generation_failures"] == sum(v % 3 == 2 for v in k)
        for domain in ("dim", "water"):
            for size in ("S", "M", "L"):
                mask = [r["domain"] == domain and r["size"] == size for r in group]
                cell = row["per_domain"].get(domain, {}).get(size)
                if any(mask):
                    assert cell["accuracy"] == pytest.approx(correct[mask].mean())
                    assert cell["count"] == sum(mask)
                    k = int(correct[mask].sum())
                    assert cell["accuracy_ci"] == pytest.approx(exact_interval(k, sum(mask)))
                else:
                    assert cell is None

    for (setting, ice), row in rows("mapping").items():
        group = [r for r in items if r["task"] == "mapping" and r["setting"] == setting
                 and len(r["images"]) - 1 == ice]  # fmt: skip
        per_box = [np.mean([(h(r["id"]) >> i) % 2 == 0 for i in range(4)]) for r in group]
        assert row["accuracy"] == pytest.approx(np.mean(per_box))
        assert row["exact_match"] == pytest.approx(np.mean([p == 1 for p in per_box]))
        exact = sum(p == 1 for p in per_box)
        assert row["exact_match_ci"] == pytest.approx(exact_interval(exact, len(group)))
        assert "accuracy_ci" not in row  # boxes of one reply are no independent trials

    for (setting, ice), row in rows("localization").items():
        group = [r for r in items if r["task"] == "localization" and r["setting"] == setting
                 and len(r["images"]) - 1 == ice]  # fmt: skip
        reference = _pycocotools_ap(group)
        assert row["mAP"] == pytest.approx(reference["AP"], abs=1e-12)
        assert row["coco"]["AP50"] == pytest.approx(reference["AP50"], abs=1e-12)
        assert row["invalid_boxes"] == sum(h(r["id"]) % 7 == 0 for r in group)
        for domain, cell in row["per_domain"].items():
            subset = _pycocotools_ap([r for r in group if r["domain"] == domain])
            assert cell["mAP"] == pytest.approx(subset["AP"], abs=1e-12)
            assert cell["S"]["mAP"] == pytest.approx(subset["APs"], abs=1e-12)
    assert 0 < results["localization"][0]["mAP"] < 1
    table = (tmp_path / "run" / store.RESULTS_MD).read_text()
    assert "## Visual Grounding" in table and "| 2 (iid) | 1 |" in table

    # Filters: one setting, one ICE count, one task.
    with ChatServer(respond) as server:
        only = run_cli(
            ["eval-mllm", "counts-oodg", "--items", str(path), "--endpoint", server.url,
             "--model", "m", "--output", str(tmp_path / "zs"), "--setting", "zero_shot",
             "--ice", "0", "--task", "grounding", "--no-progress"]
        )  # fmt: skip
    assert list(only) == [k for k in only if k != "localization" and k != "mapping"]
    assert only["grounding"][0] == rows("grounding")[("zero_shot", 0)]


def test_changed_item_is_an_error_naming_it(tmp_path):
    path, by_image = write_oodg_items(tmp_path / "mined")

    def respond(body, attempt):
        record = by_image[hashlib.sha256(image_parts(body)[-1]).hexdigest()]
        return 200, {}, completion(oodg_reply(record))

    with ChatServer(respond) as server:
        benchmark = tasks.make_benchmark("counts-oodg", items=str(path))
        runner.run(
            benchmark,
            OpenAIChatClient(server.url, "m"),
            tmp_path / "run",
            options=runner.RunOptions(progress=False),
        )
        hits = server.hits
        records = [json.loads(line) for line in path.read_text().splitlines()]
        records[5]["prompt"] = records[5]["prompt"].replace("Question", "Query")
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        changed = tasks.make_benchmark("counts-oodg", items=str(path))
        with pytest.raises(
            store.RunError, match=f"item '{records[5]['id']}' was answered for another prompt"
        ):
            runner.run(
                changed,
                OpenAIChatClient(server.url, "m"),
                tmp_path / "run",
                options=runner.RunOptions(progress=False),
            )
        assert server.hits == hits


@pytest.mark.parametrize(
    "change, message",
    [
        ({"task": "counting"}, r"field 'task' must be one of"),
        ({"answer": 7}, r"field 'answer' must be an option index in \[0, 4\)"),
        ({"images": []}, r"field 'images' must be a non-empty list"),
        (
            {"prompt": "no placeholder"},
            r"the prompt has 0 <image> placeholders but 'images' lists 1",
        ),
        ({"size": "XL"}, r"field 'size' must be S, M, L or null"),
        ({"image_size": [64]}, r"field 'image_size' must be \[width, height\]"),
        (None, r"missing field 'category'"),
    ],
)
def test_bad_items_name_the_line_and_field(tmp_path, change, message):
    good = {
        "id": "g1", "task": "grounding", "setting": "zero_shot", "domain": "dim", "size": "S",
        "prompt": prompts.counts_grounding(OPTIONS), "images": ["a.png"], "options": OPTIONS,
        "answer": 1, "category": None, "image_size": [64, 48],
    }  # fmt: skip
    bad = dict(good, id="g2")
    if change is None:
        del bad["category"]
    else:
        bad.update(change)
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(tasks.ItemsError, match=r"items\.jsonl: line 2.*" + message):
        tasks.read_oodg_items(path)
    with pytest.raises(SystemExit, match=r"items\.jsonl: line 2"):
        run_cli(["eval-mllm", "counts-oodg", "--items", str(path), "--endpoint",
                 "http://127.0.0.1:9/v1", "--model", "m", "--output", str(tmp_path / "o")])  # fmt: skip


def test_bad_arguments_are_clear(tmp_path, foci_data):
    base = ["--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--output", str(tmp_path)]
    with pytest.raises(SystemExit, match="--data-dir"):
        run_cli(["eval-mllm", "foci", *base])
    with pytest.raises(SystemExit, match="--ice applies to counts-oodg only"):
        run_cli(["eval-mllm", "foci", "--data-dir", str(foci_data), "--ice", "1", *base])
    with pytest.raises(SystemExit, match="oodbench.*no built dataset"):
        run_cli(["eval-mllm", "oodbench", "--data-dir", str(foci_data), *base])
    with pytest.raises(SystemExit, match="--endpoint needs --model"):
        run_cli(["eval-mllm", "foci", "--data-dir", str(foci_data), "--endpoint", "http://x/v1",
                 "--output", str(tmp_path)])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# --limit beside a finished run; Ctrl-C
# ---------------------------------------------------------------------------------------------


class ScriptedClient:
    """A client without a server: one reply to everything, and Ctrl-C (KeyboardInterrupt) at its
    `interrupt_at`-th call, as when a user presses it while that request is out."""

    def __init__(self, interrupt_at: int | None = None):
        self.interrupt_at, self.calls = interrupt_at, 0
        self._lock = threading.Lock()

    def identity(self):
        return {"client": "scripted", "model": "m"}

    def generate(self, request):
        with self._lock:
            self.calls += 1
            call = self.calls
        if call == self.interrupt_at:
            raise KeyboardInterrupt
        return "Answer Choice: [B]"


def _scripted_argv(items: pathlib.Path, out: pathlib.Path, *extra: str) -> list[str]:
    # --endpoint only satisfies the parser: job.make_client is replaced by the scripted client.
    return ["eval-mllm", "counts-oodg", "--items", str(items), "--endpoint",
            "http://127.0.0.1:9/v1", "--model", "m", "--output", str(out), "--no-progress",
            *extra]  # fmt: skip


def _use_client(monkeypatch, client) -> None:
    monkeypatch.setattr(job, "make_client", lambda *a, **k: client)


def test_limit_after_a_finished_run_writes_beside_it(tmp_path, monkeypatch, capsys):
    items, _ = write_oodg_items(tmp_path / "mined", count=40)
    out, client = tmp_path / "run", ScriptedClient()
    _use_client(monkeypatch, client)
    full = run_cli(_scripted_argv(items, out))
    assert client.calls == 40 and full["num_items"] == 40 and full["complete"] is True
    assert "limit" not in full
    kept = [store.RESULTS_JSON, store.RESULTS_MD, store.PREDICTIONS_FILE]
    before = {name: (out / name).read_bytes() for name in kept}
    capsys.readouterr()

    subset = run_cli(_scripted_argv(items, out, "--limit", "5"))
    printed = capsys.readouterr()
    assert client.calls == 40  # all 5 were answered already
    # The full run's results, and the replies of all 40 items, are untouched.
    for name in kept:
        assert (out / name).read_bytes() == before[name], name
    assert len((out / store.PREDICTIONS_FILE).read_text().splitlines()) == 40
    # The subset's results lie beside them, say what they are, and score the first 5 items.
    json_name, md_name = store.results_files(5)
    assert (json_name, md_name) == ("results.limit5.json", "results.limit5.md")
    assert json.loads((out / json_name).read_text()) == subset
    assert subset["num_items"] == 5 and subset["limit"] == 5 and subset["complete"] is True
    first = [json.loads(line) for line in before[store.PREDICTIONS_FILE].splitlines()[:5]]
    scored = tasks.make_benchmark("counts-oodg", items=str(items)).results(first)
    assert {k: subset[k] for k in scored} == json.loads(json.dumps(run_results.json_safe(scored)))
    markdown = (out / md_name).read_text()
    assert markdown.startswith("Subset: the first 5 items only (--limit 5)")
    assert printed.out.startswith(markdown)
    assert f"{out / store.RESULTS_JSON} (every item) is unchanged" in printed.err

    # Limited first, then the full run: it continues from the stored replies.
    fresh, client = tmp_path / "fresh", ScriptedClient()
    _use_client(monkeypatch, client)
    run_cli(_scripted_argv(items, fresh, "--limit", "5"))
    assert client.calls == 5 and not (fresh / store.RESULTS_JSON).exists()
    assert f"a run without --limit writes {fresh / store.RESULTS_JSON}" in capsys.readouterr().err
    assert run_cli(_scripted_argv(items, fresh)) == full
    assert client.calls == 40
    assert (fresh / store.PREDICTIONS_FILE).read_bytes() == before[store.PREDICTIONS_FILE]
    assert (fresh / store.RESULTS_JSON).read_bytes() == before[store.RESULTS_JSON]
    assert json.loads((fresh / json_name).read_text()) == subset
    # A limit that leaves no item out is the full run.
    assert run_cli(_scripted_argv(items, fresh, "--limit", "40")) == full
    assert not (fresh / "results.limit40.json").exists() and client.calls == 40


def test_ctrl_c_says_what_was_kept_and_the_same_command_continues(tmp_path, monkeypatch, capsys):
    items, _ = write_oodg_items(tmp_path / "mined")
    out, client = tmp_path / "run", ScriptedClient(interrupt_at=4)
    _use_client(monkeypatch, client)
    argv = _scripted_argv(items, out, "--concurrency", "1")
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == cli.INTERRUPTED_EXIT_CODE == 130
    predictions = out / store.PREDICTIONS_FILE
    assert capsys.readouterr().err.splitlines() == [
        f"interrupted: 3 replies kept in {predictions}; rerun the same command to continue"
    ]
    assert len(predictions.read_text().splitlines()) == 3
    assert not (out / store.RESULTS_JSON).exists()

    client.interrupt_at = None
    cli.main(argv)
    assert client.calls == 4 + 27  # the interrupted item and the 26 never asked
    results = json.loads((out / store.RESULTS_JSON).read_text())
    assert results["num_items"] == 30 and results["complete"] is True


def test_ctrl_c_with_requests_in_flight_counts_what_it_kept(tmp_path):
    items, _ = write_oodg_items(tmp_path / "mined")
    benchmark = tasks.make_benchmark("counts-oodg", items=str(items))
    client = ScriptedClient(interrupt_at=10)
    with pytest.raises(KeyboardInterrupt) as stopped:
        runner.run(
            benchmark, client, tmp_path, options=runner.RunOptions(concurrency=3, progress=False)
        )
    kept = len((tmp_path / store.PREDICTIONS_FILE).read_text().splitlines())
    assert str(stopped.value) == (
        f"{kept} replies kept in {tmp_path / store.PREDICTIONS_FILE}; "
        "rerun the same command to continue"
    )
    asked = client.calls
    client.interrupt_at = None
    assert runner.run(
        benchmark, client, tmp_path, options=runner.RunOptions(concurrency=3, progress=False)
    )["complete"]
    assert client.calls - asked == 30 - kept


def test_ctrl_c_in_a_batched_run(tmp_path):
    items, _ = write_oodg_items(tmp_path / "mined")
    benchmark = tasks.make_benchmark("counts-oodg", items=str(items))
    batches = []

    def answer(batch):
        batches.append(len(batch))
        if len(batches) == 3:
            raise KeyboardInterrupt
        return ["(A)"] * len(batch)

    predictions = tmp_path / store.PREDICTIONS_FILE
    with pytest.raises(KeyboardInterrupt) as stopped:
        runner.run_batched(
            benchmark,
            {"client": "batch"},
            answer,
            tmp_path,
            4,
            options=runner.RunOptions(progress=False),
        )
    assert str(stopped.value).startswith(f"8 replies kept in {predictions}; rerun")
    assert len(predictions.read_text().splitlines()) == 8
