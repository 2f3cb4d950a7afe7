"""Circular evaluation (`eval-mllm --circular N`, ood_jax/eval/tasks/circular.py): FOCI items
under cyclic shifts of their options and OODBench questions in both answer orders, paired with
their negations. Scripted models whose answers are known in advance (a fixed letter, always
right, always "yes", the first-listed answer, a hash of the prompt) against numbers worked out
here from the prompts they were sent, with the rotations and verdicts recomputed independently;
resume, --limit, rescore, compare and the run's identity over circular runs.

Most benchmarks here are FOCI's and OODBench's own item-building (`asked`) over a few text
questions and a 2x2 image; the last test runs the command over test_eval_runner's tiny builds
through a loopback server."""

from __future__ import annotations

import hashlib
import json
import re
import threading

import numpy as np
import pytest
from scipy import stats as sps
from test_clients import ChatServer, completion, prompt_text
from test_eval_runner import SPLIT_LINES, foci_data, oodbench_data  # noqa: F401 (fixtures)

from ood_jax import cli, prompts
from ood_jax.cli import mllm as eval_cli
from ood_jax.eval import store
from ood_jax.eval import compare, job, rescore, runner
from ood_jax.eval.clients import ImageInput
from ood_jax.eval.tasks import Foci, FociScoring, ItemsError, OodBench, OodBenchScoring
from ood_jax.eval.tasks import circular as circular_eval
from ood_jax.eval.tasks import make_benchmark, scoring_for

IMAGE = ImageInput.from_array(np.zeros((2, 2, 3), np.uint8)).data
DATASETS = ("pets", "cars")


class TextFoci(Foci):
    """n FOCI questions without a dataset: question k, of dataset DATASETS[k % 2], has options
    "right k" at position k % 4 and "wrong k j" elsewhere."""

    def __init__(self, n: int = 8, circular: int | None = None):
        FociScoring.__init__(self, circular)
        self.n = n

    def count(self) -> int:
        return self.n * circular_eval.asked_per_question(self.circular)

    def items(self):
        for k in range(self.n):
            options = [f"right {k}" if j == k % 4 else f"wrong {k} {j}" for j in range(4)]
            dataset = DATASETS[k % 2]
            meta = {"dataset": dataset, "options": options, "answer": k % 4, "label": f"right {k}"}
            yield from self.asked(f"{dataset}/{k}", dataset, meta, IMAGE)


# (split, image id, category, present): each gives a question and its negation.
INSTANCES = [("id", 1, "cat", True), ("id", 2, "dog", False), ("ood_s", 3, "zebra", True),
             ("ood_s", 4, "cat", False), ("ood_s", 5, "traffic_light", True)]  # fmt: skip


class TextOodBench(OodBench):
    """OODBench's yes/no questions of INSTANCES, without a dataset."""

    def __init__(self, circular: int | None = None, setting: str = "plain"):
        OodBenchScoring.__init__(self, setting, circular)
        self.directory = "text-oodbench"

    def count(self) -> int:
        return 2 * len(INSTANCES) * circular_eval.asked_per_question(self.circular)

    def items(self):
        for split, image_id, category, present in INSTANCES:
            for negated in (False, True):
                kind = "negated existential" if negated else "existential"
                question = prompts.oodbench_question(
                    category.replace("_", " "), negated, self.setting == "cot"
                )
                meta = {"split": split, "answer": present != negated, "category": category,
                        "kind": kind, "image_id": image_id}  # fmt: skip
                yield from self.asked(
                    f"{split}/{image_id}/{category}/{kind}", question, meta, IMAGE
                )


class Scripted:
    """A client without a server: `answer(prompt)` is its reply; it counts its calls and raises
    KeyboardInterrupt at call `interrupt_at` (Ctrl-C while that request is out)."""

    def __init__(self, answer, interrupt_at: int | None = None):
        self.answer, self.interrupt_at = answer, interrupt_at
        self.prompts: list[str] = []
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        return len(self.prompts)

    def identity(self):
        return {"client": "scripted", "model": "m"}

    def generate(self, request):
        with self._lock:
            self.prompts.append(request.prompt)
            call = self.calls
        if call == self.interrupt_at:
            raise KeyboardInterrupt
        return self.answer(request.prompt)


def listed(prompt: str) -> dict[str, str]:
    """A FOCI prompt's listing: letter -> option."""
    return dict(re.findall(r"^([A-D])\. (.*)$", prompt, re.MULTILINE))


def always_a(prompt: str) -> str:
    return "A"


def always_right(prompt: str) -> str:
    return next(letter for letter, option in listed(prompt).items() if option.startswith("right"))


def hashed(prompt: str) -> str:
    """Right unless the prompt's hash says otherwise, then a hash-chosen letter."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return always_right(prompt) if digest[0] % 3 else "ABCD"[digest[1] % 4]


def run(benchmark, client, out, concurrency: int = 2, **options) -> dict:
    options = runner.RunOptions(concurrency=concurrency, progress=False, **options)
    return runner.run(benchmark, client, out, options)


def exact_interval(k: int, n: int) -> list[float]:
    ci = sps.binomtest(k, n).proportion_ci(0.95, method="exact")
    return [ci.low, ci.high]


# ---------------------------------------------------------------------------------------------
# Rotations
# ---------------------------------------------------------------------------------------------


def test_rotations_are_the_cyclic_shifts_seeded_per_item_and_nested():
    every = list(circular_eval.rotations("pets/0", 4, 4))
    assert [r.id for r in every] == ["pets/0", "pets/0#rot1", "pets/0#rot2", "pets/0#rot3"]
    assert [r.apply("ABCD") for r in every] == [list("ABCD"), list("BCDA"), list("CDAB"),
                                               list("DABC")]  # fmt: skip
    # Where option 0 went, for every shift: once at each position.
    assert sorted(r.position(0) for r in every) == [0, 1, 2, 3]
    assert every[0].tags == {"rotation": 0, "rotation_of": "pets/0"}
    # A plain run asks the item itself, untagged.
    assert [(r.id, r.shift, r.tags) for r in circular_eval.rotations("pets/0", None, 4)] == [
        ("pets/0", 0, {})
    ]
    # Fewer rotations than options: the same draw every time, a superset for a larger N, and
    # the other shifts drawn about equally often across items.
    drawn = []
    for k in range(600):
        two, three = ([r.shift for r in circular_eval.rotations(f"x/{k}", n, 4)] for n in (2, 3))
        assert two == [r.shift for r in circular_eval.rotations(f"x/{k}", 2, 4)]
        assert two[0] == 0 and set(two) < set(three) and len(set(three)) == 3
        drawn.append(two[1])
    counts = np.bincount(drawn, minlength=4)[1:]
    assert sps.chisquare(counts).pvalue > 1e-3, counts
    # The documented draw: shifts sorted by SHA-256 of (SEED, id, shift), the first N - 1
    # taken. It is pinned: another would change the prompts, so every stored digest.
    for k in range(50):
        key = {s: hashlib.sha256(f"ood-jax circular v1\0x/{k}\0{s}".encode()).digest()
               for s in (1, 2, 3)}  # fmt: skip
        draw = sorted(key, key=key.get)
        for n in (2, 3):
            shifts = [r.shift for r in circular_eval.rotations(f"x/{k}", n, 4)]
            assert shifts == [0, *sorted(draw[: n - 1])]
    assert [r.shift for r in circular_eval.rotations("pets/0", 2, 4)] == [0, 2]


@pytest.mark.parametrize("n", [1, 5, 0, -1])
def test_foci_takes_two_to_four_rotations(n):
    with pytest.raises(ValueError, match=rf"^--circular takes 2 to 4 for foci .*got {n}$"):
        FociScoring(n)


def test_oodbench_takes_two_orders_and_other_tasks_none():
    with pytest.raises(ValueError, match=r"^--circular takes 2 for oodbench .*got 3$"):
        OodBenchScoring("plain", 3)
    for name in ("counts-oodg", "oodbench-bap"):
        with pytest.raises(ValueError, match="^--circular applies to foci and oodbench only$"):
            make_benchmark(name, items="x.jsonl", data_dir="d", circular=2)


def test_rotated_foci_items_move_the_answer_with_its_option():
    items = list(TextFoci(4, circular=4).items())
    assert len(items) == 16 and len({i.digest for i in items}) == 16
    for item in items:
        options, shift = item.meta["options"], item.meta["rotation"]
        k = int(item.meta["rotation_of"].split("/")[1])
        original = [f"right {k}" if j == k % 4 else f"wrong {k} {j}" for j in range(4)]
        assert options == original[shift:] + original[:shift]
        assert options[item.meta["answer"]] == f"right {k}"
        assert listed(item.request.prompt) == dict(zip("ABCD", options))
    # Rotation 0 is the plain run's item: same id, prompt and image.
    plain = {i.id: i for i in TextFoci(4).items()}
    for item in items:
        if item.meta["rotation"] == 0:
            assert item.digest == plain[item.id].digest
            assert {k: item.meta[k] for k in plain[item.id].meta} == plain[item.id].meta


# ---------------------------------------------------------------------------------------------
# FOCI
# ---------------------------------------------------------------------------------------------


def test_a_fixed_letter_is_right_a_quarter_of_the_time_and_never_circularly(tmp_path):
    results = run(TextFoci(8, circular=4), Scripted(always_a), tmp_path)
    assert results["circular"] == 4 and results["num_items"] == 32
    # Over every rotation the answer is at A once per item: 25% exactly.
    assert results["accuracy"] == 0.25
    summary = results["circular_eval"]
    overall = summary["all_items"]
    assert overall["all_right"] == 0.0 and overall["groups"] == 8 and overall["incomplete"] == 0
    assert overall["all_right_ci"] == pytest.approx(exact_interval(0, 8))
    # In the original order the answers of items 0 and 4 are at A.
    assert overall["original_order"] == 0.25
    assert overall["original_order_ci"] == pytest.approx(exact_interval(2, 8))
    assert overall["positions"] == {
        "picked": {"A": 1.0, "B": 0.0, "C": 0.0, "D": 0.0},
        "answer": {"A": 0.25, "B": 0.25, "C": 0.25, "D": 0.25},
        "read": 32,
    }
    assert set(summary["per_dataset"]) == set(DATASETS)
    markdown = (tmp_path / store.RESULTS_MD).read_text()
    assert "### Circular evaluation (4 rotations)" in markdown
    assert "| all items | 25.00 [3.19, 65.09] | 0.00 [0.00, 36.94] | 8 |" in markdown
    assert "| picked, all items | 100.00 | 0.00 | 0.00 | 0.00 | 32 |" in markdown
    assert "| the answer, all items | 25.00 | 25.00 | 25.00 | 25.00 | 32 |" in markdown


def test_always_right_is_right_under_every_rotation(tmp_path):
    results = run(TextFoci(8, circular=4), Scripted(always_right), tmp_path)
    overall = results["circular_eval"]["all_items"]
    assert results["accuracy"] == 1.0
    assert overall["all_right"] == overall["original_order"] == 1.0
    assert overall["positions"]["picked"] == overall["positions"]["answer"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_circular_accuracy_against_the_prompts_the_model_was_sent(tmp_path, n):
    client = Scripted(hashed)
    results = run(TextFoci(24, circular=n), client, tmp_path)
    # The reference: each question's group worked out from the prompts sent, by the letters
    # of their listings alone.
    groups: dict[str, list[bool]] = {}
    picked = np.zeros(4)
    for prompt in client.prompts:
        letters = listed(prompt)
        k = int(next(o for o in letters.values() if o.startswith("right")).split()[1])
        groups.setdefault(f"{DATASETS[k % 2]}/{k}", []).append(
            hashed(prompt) == always_right(prompt)
        )
        picked["ABCD".index(hashed(prompt))] += 1
    assert all(len(g) == n for g in groups.values()) and len(groups) == 24
    right = sum(all(g) for g in groups.values())
    overall = results["circular_eval"]["all_items"]
    assert overall["all_right"] == right / 24
    assert overall["all_right_ci"] == pytest.approx(exact_interval(right, 24))
    assert list(overall["positions"]["picked"].values()) == pytest.approx(picked / picked.sum())
    for dataset in DATASETS:
        mine = [all(g) for k, g in groups.items() if k.startswith(dataset)]
        assert results["circular_eval"]["per_dataset"][dataset]["all_right"] == sum(mine) / 12


def test_a_limit_leaves_cut_groups_out_and_says_so(tmp_path):
    results = run(TextFoci(8, circular=4), Scripted(always_right), tmp_path, limit=6)
    overall = results["circular_eval"]["all_items"]
    assert results["num_items"] == 6 and results["limit"] == 6
    assert (overall["groups"], overall["incomplete"]) == (1, 1)
    markdown = (tmp_path / "results.limit6.md").read_text()
    assert "Left out of them: items not asked under every rotation (cut by --limit), 1." in (
        markdown
    )


def test_resume_sends_nothing_and_a_killed_run_sends_only_the_rest(tmp_path):
    benchmark = TextFoci(8, circular=4)
    client = Scripted(hashed, interrupt_at=9)
    with pytest.raises(KeyboardInterrupt):
        run(benchmark, client, tmp_path, concurrency=1)
    # The 8 replies before it, and the next one when it came back before the run ended.
    kept = len((tmp_path / store.PREDICTIONS_FILE).read_text().splitlines())
    assert 8 <= kept <= 9
    client.interrupt_at, asked = None, client.calls
    first = run(benchmark, client, tmp_path)
    assert client.calls - asked == 32 - kept
    calls = client.calls
    assert run(benchmark, client, tmp_path) == first and client.calls == calls
    # The resumed run's numbers are a fresh run's.
    fresh = tmp_path / "fresh"
    assert run(benchmark, Scripted(hashed), fresh) == first


def test_rescore_reproduces_a_circular_run(tmp_path):
    results = run(TextFoci(8, circular=3), Scripted(hashed), tmp_path)
    assert json.loads((tmp_path / store.RUN_FILE).read_text())["circular"] == 3
    markdown = (tmp_path / store.RESULTS_MD).read_text()
    out = tmp_path / "rescored"
    [(_, _, again, again_md)] = rescore.rescore(tmp_path, out=out)
    assert again == results and again_md == markdown
    # Under another mode too, the circular numbers are there.
    [(_, _, strict, _)] = rescore.rescore(tmp_path, ["strict"], out=out)
    assert strict["circular_eval"]["rotations"] == 3
    assert scoring_for({"benchmark": "foci", "circular": 3}).identity() == {
        "benchmark": "foci",
        "circular": 3,
    }


def test_compare_pairs_two_circular_runs(tmp_path):
    run(TextFoci(8, circular=4), Scripted(always_a), tmp_path / "a")
    run(TextFoci(8, circular=4), Scripted(always_right), tmp_path / "b")
    result = compare.compare_runs(tmp_path / "a", tmp_path / "b", num_bootstrap=200)
    assert result["items"]["compared"] == 32
    overall = [row for row in result["rows"] if row["group"] == "all items"]
    assert overall and overall[0]["a"]["score"] == 0.25 and overall[0]["b"]["score"] == 1.0


# ---------------------------------------------------------------------------------------------
# The run's identity, through the command line
# ---------------------------------------------------------------------------------------------


def argv(out, *extra: str) -> list[str]:
    # --endpoint only satisfies the parser: job.make_client is replaced by a scripted client.
    return ["eval-mllm", "foci", "--data-dir", "unused", "--endpoint", "http://127.0.0.1:9/v1",
            "--model", "m", "--output", str(out), "--no-progress", *extra]  # fmt: skip


@pytest.fixture
def text_cli(monkeypatch):
    """eval-mllm's foci becomes TextFoci with the command's --circular; returns the client."""
    client = Scripted(always_a)
    monkeypatch.setattr(
        eval_cli.tasks, "make_benchmark", lambda *a, circular=None, **k: TextFoci(8, circular)
    )
    monkeypatch.setattr(job, "make_client", lambda *a, **k: client)
    return client


def run_cli(args: list[str]):
    parsed = cli.build_parser().parse_args(args)
    return parsed.run(parsed)


def test_circular_and_plain_runs_never_share_a_directory(text_cli, tmp_path):
    plain, circular = tmp_path / "plain", tmp_path / "circular"
    assert run_cli(argv(plain))["num_items"] == 8
    assert run_cli(argv(circular, "--circular", "4"))["num_items"] == 32
    assert text_cli.calls == 8 + 32
    for out, flags, detail in (
        (plain, ["--circular", "4"], "circular: None there, 4 now"),
        (circular, [], "circular: 4 there, None now"),
        (circular, ["--circular", "2"], "circular: 4 there, 2 now"),
    ):
        with pytest.raises(SystemExit) as refused:
            run_cli(argv(out, *flags))
        assert str(refused.value) == (
            f"error: {out} holds predictions of another run ({detail}); use another --output"
        )
    assert text_cli.calls == 40


def test_a_bad_circular_is_one_error_line(tmp_path):
    for name, n, expected in (
        ("foci", "5", "--circular takes 2 to 4 for foci"),
        ("oodbench", "4", "--circular takes 2 for oodbench"),
        ("oodbench-bap", "2", "--circular applies to foci and oodbench only"),
    ):
        args = argv(tmp_path, "--circular", n)
        args[1] = name
        with pytest.raises(SystemExit) as refused:
            run_cli(args)
        assert str(refused.value).startswith(f"error: {expected}")


# ---------------------------------------------------------------------------------------------
# OODBench
# ---------------------------------------------------------------------------------------------


def test_oodbench_asks_each_question_in_both_answer_orders():
    items = list(TextOodBench(circular=2).items())
    assert len(items) == 4 * len(INSTANCES)
    first = {i.meta["rotation_of"]: i for i in items if i.meta["rotation"] == 0}
    for item in items:
        if item.meta["rotation"] == 1:
            assert item.id == item.meta["rotation_of"] + "#rot1"
            assert item.request.prompt == first[item.meta["rotation_of"]].request.prompt.replace(
                "(yes or no)", "(no or yes)"
            )
    cot = [i.request.prompt for i in TextOodBench(circular=2, setting="cot").items()]
    assert cot[1] == prompts.IMAGE_PLACEHOLDER + (
        "Does this image contain cat? No or Yes? " + prompts.OODBENCH_COT_SUFFIX
    )
    with pytest.raises(ValueError, match="must list its answers once"):
        prompts.oodbench_answers_swapped("Is it a cat?")


def test_a_question_without_its_answer_listing_names_the_item():
    benchmark = TextOodBench(circular=2)
    with pytest.raises(ItemsError, match=r"^text-oodbench: item 'id/1/cat/existential': the q"):
        list(benchmark.asked("id/1/cat/existential", "Cat?", {"split": "id"}, IMAGE))


def first_listed(prompt: str) -> str:
    return "No." if "(no or yes)" in prompt else "Yes."


@pytest.mark.parametrize(
    "answer, said_yes, first, questions",
    [
        # Always "yes": right on every question whose answer is yes, in both orders (half of
        # them), and on no instance, since of a question and its negation one answer is no.
        (lambda prompt: "Yes, it does.", 1.0, 0.5, 0.5),
        # The first-listed answer: no yes-bias, but right in one order only.
        (first_listed, 0.5, 1.0, 0.0),
    ],
)
def test_oodbench_biases_and_the_swapped_question(tmp_path, answer, said_yes, first, questions):
    results = run(TextOodBench(circular=2), Scripted(answer), tmp_path)
    assert results["circular"] == 2 and results["num_items"] == 20
    splits = results["circular_eval"]["splits"]
    for split, r in splits.items():
        n = sum(s == split for s, *_ in INSTANCES)
        assert r["yes_rate"] == said_yes and r["answer_yes_rate"] == 0.5
        assert r["yes_bias"] == pytest.approx(said_yes - 0.5)
        assert r["positions"] == {
            "picked": {"first": first, "second": 1 - first},
            "answer": {"first": 0.5, "second": 0.5},
            "read": 4 * n,
        }
        assert r["questions"]["all_right"] == questions and r["questions"]["groups"] == 2 * n
        # In the original order both say yes to every question.
        assert r["questions"]["original_order"] == 0.5
        assert r["instances"]["all_right"] == 0.0 and r["instances"]["groups"] == n
        assert r["instances"]["original_order"] == 0.0
        # The main table counts every asked item: half of them right.
        assert results["splits"][split]["accuracy"] == 0.5
    markdown = (tmp_path / store.RESULTS_MD).read_text()
    assert "### Circular evaluation (both answer orders, and the negated question)" in markdown
    bias = f"{100 * (said_yes - 0.5):+.2f}"
    assert f"| ID | {100 * said_yes:.2f} | 50.00 | {bias} | {100 * first:.2f} |" in markdown


def test_oodbench_circular_run_rescores_and_keeps_its_identity(tmp_path):
    results = run(TextOodBench(circular=2), Scripted(first_listed), tmp_path)
    [(_, _, again, _)] = rescore.rescore(tmp_path, out=tmp_path / "again")
    assert again == results
    with pytest.raises(store.RunError, match=r"circular: 2 there, None now"):
        run(TextOodBench(), Scripted(first_listed), tmp_path)


# ---------------------------------------------------------------------------------------------
# The built datasets, end to end
# ---------------------------------------------------------------------------------------------


def test_built_foci_and_oodbench_through_the_command(request, tmp_path):
    foci_dir = request.getfixturevalue("foci_data")
    oodbench_dir = request.getfixturevalue("oodbench_data")

    def reply(body, attempt):
        text = prompt_text(body)
        return 200, {}, completion("Yes." if "yes" in text.lower() else "A")

    common = ["--model", "m", "--no-progress", "--no-model-check"]
    with ChatServer(reply) as server:
        plain = run_cli(["eval-mllm", "foci", "--data-dir", str(foci_dir), *common,
                         "--output", str(tmp_path / "plain"), "--endpoint", server.url])  # fmt: skip
        foci = run_cli(["eval-mllm", "foci", "--data-dir", str(foci_dir), *common,
                        "--output", str(tmp_path / "foci"), "--endpoint", server.url,
                        "--circular", "4"])  # fmt: skip
        n = plain["num_items"]
        assert server.hits == 5 * n and foci["num_items"] == 4 * n
        oodbench = run_cli(["eval-mllm", "oodbench", "--data-dir", str(oodbench_dir), *common,
                            "--output", str(tmp_path / "oodbench"), "--endpoint", server.url,
                            "--circular", "2"])  # fmt: skip
        assert server.hits == 5 * n + 4 * len(SPLIT_LINES)
        swapped = [b for _, _, b in server.requests if "(no or yes)" in prompt_text(b)]
        assert len(swapped) == 2 * len(SPLIT_LINES)
    # Rotation 0 is the plain run's item: the same prompt and image.
    plain_records, circular_records = (
        store.PredictionStore(tmp_path / name / store.PREDICTIONS_FILE).records
        for name in ("plain", "foci")
    )
    for item_id, record in plain_records.items():
        assert circular_records[item_id]["digest"] == record["digest"]
    # "A" to everything: a quarter of the asked items, no item under every rotation.
    overall = foci["circular_eval"]["all_items"]
    assert foci["accuracy"] == 0.25 and overall["all_right"] == 0.0
    assert (overall["groups"], overall["incomplete"]) == (n, 0)
    assert overall["positions"]["picked"]["A"] == 1.0
    # "Yes." to everything: every instance missed through its negation.
    for split, r in oodbench["circular_eval"]["splits"].items():
        label = {"id": "ID", "ood_s": "OOD-S", "ood_h": "OOD-H"}[split]
        assert r["instances"]["groups"] == sum(s == label for *_, s in SPLIT_LINES)
        assert r["instances"]["all_right"] == 0.0 and r["yes_rate"] == 1.0
