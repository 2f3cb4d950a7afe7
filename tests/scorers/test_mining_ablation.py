"""The oodbench-ablation job: four scorers, groups and the series against a numpy reference of the
split rule, the consistency table against direct numpy, one encoding pass per scorer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_mining_oodbench import CATEGORIES, FakeScorer, _coco_source, _reference_splits

from ood_jax.mining import jobs, oodbench

GROUPS = {"I": ("clip", "blip2"), "II": ("blip2", "groupvit"), "III": ("groupvit", "lit")}
SERIES = ("clip", "blip2", "groupvit", "lit")


class CountingScorer(FakeScorer):
    """Counts the images it encodes, to show each scorer's pass over the images is one."""

    def __init__(self, *args):
        super().__init__(*args)
        self.images_encoded = 0

    def encode_images(self, images, batch_size=None):
        self.images_encoded += len(images)
        return super().encode_images(images, batch_size)


def _scorers():
    # Two softmax and two sigmoid kinds stand in for CLIP, BLIP-2, GroupViT and LiT.
    return {
        "clip": CountingScorer("clip", "a", 30.0, None),
        "blip2": CountingScorer("siglip", "b", 10.0, -2.0),
        "groupvit": CountingScorer("clip", "c", 20.0, None),
        "lit": CountingScorer("siglip", "d", 8.0, -1.0),
    }


def _numpy_labels(scores, members, threshold):
    """The paper's rule, independently: OOD-H when every scorer gives S < T, OOD-S when some do."""
    below = np.array([scores[m] < threshold for m in members])
    count = below.sum(0)
    labels = np.full(below.shape[1], "ID", dtype=object)
    labels[(count > 0) & (count < len(members))] = "OOD-S"
    labels[count == len(members)] = "OOD-H"
    return labels


def _numpy_consistency(labels):
    """Agreement and Jaccard overlaps of every two divisions, computed directly."""
    sets = {"OOD-S": {"OOD-S"}, "OOD-H": {"OOD-H"}, "OOD": {"OOD-S", "OOD-H"}}
    names, want = list(labels), []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            row = {"agreement": np.mean(labels[a] == labels[b])}
            for s, members in sets.items():
                x = {k for k, v in enumerate(labels[a]) if v in members}
                y = {k for k, v in enumerate(labels[b]) if v in members}
                row[s] = len(x & y) / len(x | y) if x | y else None
            want.append((a, b, row))
    return want


def _run(scorers, source, out, cache=None, **options):
    job = jobs.OodbenchAblation(
        source=str(source), out=str(out),
        scoring=jobs.PairScoring(threshold=0.2, templates=("{}",), cache=cache),
        encoding=jobs.Encoding(quiet=True), **options,
    )  # fmt: skip
    jobs.run_oodbench_ablation(job, scorer_factory=lambda path: scorers[path])


def _paper(root, out, cache=None):
    """The paper's ablation: Groups I-III and the series of four."""
    return dict(
        source=root, out=out, cache=cache, scorer=tuple((name, name) for name in SERIES),
        group=tuple(GROUPS.items()), series=SERIES,
    )  # fmt: skip


def test_ablation_end_to_end_matches_numpy(tmp_path, capsys):
    root, out = tmp_path / "coco", tmp_path / "ablation"
    present = _coco_source(root)
    scorers = _scorers()
    _run(scorers, **_paper(root, out))
    printed = capsys.readouterr().out

    pairs, scores, _, _ = _reference_splits(root, present, _scorers(), 0.2, None, 0)
    images = sum(bool(c) for c in present.values())
    assert {n: s.images_encoded for n, s in scorers.items()} == dict.fromkeys(scorers, images)

    divisions = {f"group-{n}": m for n, m in GROUPS.items()}
    divisions |= {f"series-{k}": SERIES[:k] for k in range(1, 5)}
    labels = {n: _numpy_labels(scores, m, 0.2) for n, m in divisions.items()}
    names = {v: k for k, v in CATEGORIES.items()}
    for name, members in divisions.items():
        lines = [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
        # No downsampling: every pair is written once, ID then OOD-S then OOD-H, in pair order.
        want = [
            (*pairs[i], s)
            for s in oodbench.SPLITS
            for i in np.flatnonzero(labels[name] == s).tolist()
        ]
        assert [(r["image_id"], names[r["category"]], r["split"]) for r in lines] == want
        assert all(set(r["scores"]) == set(members) for r in lines)
    # The fixture's scores give the divisions something to disagree about.
    assert len({tuple(v) for v in labels.values()}) > 2
    assert all((labels[n] != "ID").any() for n in labels)

    table = json.loads((out / "consistency.json").read_text())
    assert table["pairs"] == len(pairs) and table["threshold"] == 0.2
    assert table["divisions"] == {n: list(m) for n, m in divisions.items()}
    for name in divisions:
        for s in oodbench.SPLITS:
            assert table["sizes"][name][s] == int((labels[name] == s).sum())
    want = _numpy_consistency(labels)
    assert len(table["comparisons"]) == len(want) == 21
    for got, (a, b, row) in zip(table["comparisons"], want):
        assert (got["a"], got["b"]) == (a, b)
        assert got["agreement"] == pytest.approx(row["agreement"])
        for s in ("OOD-S", "OOD-H", "OOD"):
            assert got["sets"][s]["jaccard"] == pytest.approx(row[s])
    markdown = (out / "consistency.md").read_text()
    assert markdown in printed and "| group-I | group-II |" in markdown
    assert jobs.manifest_path(out, directory=True).is_file()


def test_consistency_of_hand_made_divisions():
    labels = {
        "a": np.array(["ID", "OOD-S", "OOD-H", "OOD-H"]),
        "b": np.array(["ID", "OOD-H", "OOD-H", "ID"]),
        "c": np.array(["ID", "ID", "ID", "ID"]),
    }
    table = oodbench.consistency(labels)
    ab, ac, bc = table["comparisons"]
    assert ab["agreement"] == 0.5 and ab["sets"]["OOD-H"] == {
        "both": 1,
        "either": 3,
        "jaccard": 1 / 3,
    }
    assert ab["sets"]["OOD-S"]["jaccard"] == 0.0 and ab["sets"]["OOD"]["jaccard"] == 2 / 3
    # Neither has an OOD-S pair: undefined, not a perfect 1.
    assert bc["sets"]["OOD-S"] == {"both": 0, "either": 0, "jaccard": None}
    assert ac["agreement"] == 0.25 and table["sizes"]["a"] == {
        "ID": 1, "OOD-S": 1, "OOD-H": 2, "OOD": 3
    }  # fmt: skip
    with pytest.raises(ValueError, match="differ in length"):
        oodbench.consistency({"a": labels["a"], "b": labels["b"][:3]})


def test_errors_name_the_flag(tmp_path):
    root = tmp_path / "coco"
    _coco_source(root, num_images=4)
    clip = ("clip", "clip")
    cases = [
        ({}, "give at least one --group or a --series"),
        ({"group": (("I", ("clip", "blip2")),)}, r"--group I: blip2 is not a --scorer NAME"),
        ({"series": ("clip", "clip")}, r"--series: a scorer is repeated"),
        ({"scorer": (clip, ("lit", "lit")), "series": ("clip",)}, r"--scorer lit: in no --group"),
        ({"scorer": (clip, ("clip", "x")), "series": ("clip",)}, r"--scorer clip is given twice"),
        ({"group": (("I", ("clip",)), ("I", ("clip",)))}, r"--group I is given twice"),
    ]
    scorers = {"clip": FakeScorer("clip", "a", 30.0, None)}
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            _run(scorers, root, tmp_path / "o", **{"scorer": (clip,), **options})
    assert not (tmp_path / "o").exists()


def test_cache_rerun_encodes_nothing(tmp_path):
    root, cache = tmp_path / "coco", tmp_path / "cache"
    _coco_source(root, num_images=8)
    first = _scorers()
    for name, scorer in first.items():
        scorer.identity = {"name": name}  # what EmbeddingCache keys a scorer's features by
    _run(first, **_paper(root, tmp_path / "a", str(cache)))
    again = _scorers()
    for name, scorer in again.items():
        scorer.identity = {"name": name}
    _run(again, **_paper(root, tmp_path / "b", str(cache)))
    assert all(s.images_encoded > 0 for s in first.values())
    assert all(s.images_encoded == 0 for s in again.values())
    # Each scorer keeps its own cache, under its --scorer NAME.
    assert sorted(p.name for p in cache.iterdir()) == sorted(SERIES)
    for name in ("consistency.json", "group-I.jsonl", "series-4.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
