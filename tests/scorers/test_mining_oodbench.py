"""OODBench scores against transformers' CLIP / SigLIP logits, split rules, and the mine -> build trip."""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
import torch
from PIL import Image
from scipy import special

from ood_jax import datasets
from ood_jax.mining import jobs, oodbench

_TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
    num_attention_heads=2, max_position_embeddings=12, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip
_VISION = dict(
    image_size=16, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
    num_attention_heads=2,
)  # fmt: skip


def _pairs(rng, num_images, num_categories, num_pairs):
    images = rng.integers(0, num_images, num_pairs)
    categories = rng.integers(0, num_categories, num_pairs)
    return images, categories


@torch.no_grad()
def test_clip_probability_matches_transformers_softmax():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(_TEXT, projection_dim=16),
        vision_config=dict(_VISION, projection_dim=16),
        projection_dim=16,
    )
    model = CLIPModel(config).eval()
    model.logit_scale.fill_(np.log(40.0))
    out = model(input_ids=torch.randint(3, 60, (7, 12)), pixel_values=torch.randn(5, 3, 16, 16))
    want = torch.softmax(out.logits_per_image, dim=-1).numpy()  # [images, categories]
    rng = np.random.default_rng(0)
    images, categories = _pairs(rng, 5, 7, 301)
    # Unnormalized copies: the function normalizes itself.
    image_features = out.image_embeds.numpy()[images] * rng.uniform(0.5, 3, (301, 1))
    got = oodbench.clip_probability(
        image_features, out.text_embeds.numpy() * 2.0, categories,
        model.logit_scale.exp().item(), chunk_size=64,
    )  # fmt: skip
    np.testing.assert_allclose(got, want[images, categories], rtol=1e-5, atol=1e-7)


@torch.no_grad()
def test_siglip_probability_matches_transformers_sigmoid():
    from transformers import SiglipConfig, SiglipModel

    torch.manual_seed(1)
    model = SiglipModel(SiglipConfig(text_config=_TEXT, vision_config=_VISION)).eval()
    model.logit_scale.fill_(np.log(12.0))
    model.logit_bias.fill_(-2.5)
    ids = torch.randint(3, 60, (6, 12))
    out = model(input_ids=ids, pixel_values=torch.randn(4, 3, 16, 16))
    want = torch.sigmoid(out.logits_per_image).numpy()
    images, categories = _pairs(np.random.default_rng(1), 4, 6, 130)
    got = oodbench.siglip_probability(
        out.image_embeds.numpy()[images], out.text_embeds.numpy(), categories,
        model.logit_scale.exp().item(), model.logit_bias.item(), chunk_size=32,
    )  # fmt: skip
    np.testing.assert_allclose(got, want[images, categories], rtol=1e-5, atol=1e-7)


def test_probabilities_match_numpy_on_random_features():
    rng = np.random.default_rng(2)
    images, texts = rng.normal(size=(999, 24)), rng.normal(size=(80, 24))
    categories = rng.integers(0, 80, 999)
    cosine = (images / np.linalg.norm(images, axis=1, keepdims=True)) @ (
        texts / np.linalg.norm(texts, axis=1, keepdims=True)
    ).T
    softmax = special.softmax(100.0 * cosine, axis=1)[np.arange(999), categories]
    np.testing.assert_allclose(
        oodbench.clip_probability(images, texts, categories, 100.0, chunk_size=256),
        softmax, rtol=2e-5, atol=1e-8,
    )  # fmt: skip
    sigmoid = special.expit(10.0 * cosine[np.arange(999), categories] - 3.0)
    np.testing.assert_allclose(
        oodbench.siglip_probability(images, texts, categories, 10.0, -3.0, chunk_size=256),
        sigmoid, rtol=2e-5,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"categories\[0\] = 80 is outside \[0, 80\)"):
        oodbench.clip_probability(images, texts, np.full(999, 80), 100.0)


@torch.no_grad()
def test_blip2_probability_matches_transformers_itc_softmax():
    # BLIP-2's contrastive logits (best query per image-text pair), softmaxed over categories at
    # 1 / temperature; each image stored once and indexed by its pairs.
    from transformers import Blip2Config, Blip2ForImageTextRetrieval

    torch.manual_seed(2)
    config = Blip2Config(
        vision_config=dict(_VISION, intermediate_size=40),
        qformer_config=dict(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=37, encoder_hidden_size=32, max_position_embeddings=12,
            use_qformer_text_input=True,
        ),
        num_query_tokens=5, image_text_hidden_size=16,
    )  # fmt: skip
    model = Blip2ForImageTextRetrieval(config).eval()
    model.query_tokens.normal_()
    ids = torch.randint(3, 60, (7, 12))
    out = model(pixel_values=torch.randn(4, 3, 16, 16), input_ids=ids)
    scale = 1 / 0.07
    want = torch.softmax(scale * out.logits_per_image, dim=-1).numpy()
    images, categories = _pairs(np.random.default_rng(3), 4, 7, 90)
    got = oodbench.clip_probability(
        out.image_embeds.numpy() * 3.0, out.text_embeds.numpy(), categories, scale,
        chunk_size=32, image_rows=images,
    )  # fmt: skip
    np.testing.assert_allclose(got, want[images, categories], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"image_rows\[\d+\] = 4 is outside \[0, 4\)"):
        oodbench.clip_probability(
            out.image_embeds.numpy(), out.text_embeds.numpy(), categories, scale,
            image_rows=np.where(images == 0, 4, images),
        )  # fmt: skip


def test_assign_splits_table():
    t = oodbench.THRESHOLD
    scores = {
        "clip": np.array([0.9, 0.01, 0.01, 0.9, t, 0.049999, 0.0]),
        "siglip": np.array([0.9, 0.9, 0.01, 0.01, 0.01, t, 0.0]),
    }
    want = ["ID", "OOD-S", "OOD-H", "OOD-S", "OOD-S", "OOD-S", "OOD-H"]
    assert oodbench.assign_splits(scores).tolist() == want
    # Exactly T is not below T: both at T is ID.
    assert oodbench.assign_splits({"a": [t], "b": [t]}).tolist() == ["ID"]
    three = {"a": [0.0, 0.0, 1.0], "b": [0.0, 1.0, 1.0], "c": [0.0, 0.0, 1.0]}
    assert oodbench.assign_splits(three).tolist() == ["OOD-H", "OOD-S", "ID"]
    assert oodbench.assign_splits({"a": [0.2, 0.01]}, threshold=0.3).tolist() == ["OOD-H"] * 2
    with pytest.raises(ValueError, match="differ in length"):
        oodbench.assign_splits({"a": [0.1], "b": [0.1, 0.2]})
    with pytest.raises(ValueError, match=r"scores\['b'\]\[1\] is NaN"):
        oodbench.assign_splits({"a": [0.1, 0.1], "b": [0.1, np.nan]})


def test_sampling_excludes_ood_and_is_seeded():
    rng = np.random.default_rng(3)
    labels = rng.choice(np.array(oodbench.SPLITS), size=20_000, p=[0.6, 0.33, 0.07])
    assert (labels == "OOD-S").sum() > 6000 > (labels == "OOD-H").sum()
    kept = oodbench.sample_splits(labels, max_per_split=6000, seed=7)
    assert len(kept["ID"]) == 6000 and (labels[kept["ID"]] == "ID").all()
    assert len(kept["OOD-S"]) == 6000 and (labels[kept["OOD-S"]] == "OOD-S").all()
    # A split at most the cap keeps every pair.
    np.testing.assert_array_equal(kept["OOD-H"], np.flatnonzero(labels == "OOD-H"))
    for members in kept.values():
        assert (np.diff(members) > 0).all()
    again = oodbench.sample_splits(labels, max_per_split=6000, seed=7)
    assert all(np.array_equal(kept[s], again[s]) for s in oodbench.SPLITS)
    other = oodbench.sample_splits(labels, max_per_split=6000, seed=8)
    assert not np.array_equal(kept["ID"], other["ID"])
    everything = oodbench.sample_splits(labels, max_per_split=None)
    assert sum(len(v) for v in everything.values()) == len(labels)
    # The draw is uniform: early and late ID pairs are kept equally often (6000 / n_ID).
    draws = np.zeros(len(labels))
    for seed in range(30):
        draws[oodbench.sample_splits(labels, 6000, seed)["ID"]] += 1
    rates = [half.mean() / 30 for half in np.array_split(draws[labels == "ID"], 2)]
    assert rates == pytest.approx([6000 / (labels == "ID").sum()] * 2, abs=0.01)


# ---------------------------------------------------------------------------------------------
# The `mine oodbench` job -> splits.jsonl -> oodbench builder
# ---------------------------------------------------------------------------------------------

CATEGORIES = {1: "cat", 2: "dog", 3: "traffic_light", 4: "zebra", 5: "person", 6: "kite"}


class FakeScorer:
    """Hash-seeded features; the kind picks softmax (CLIP) or sigmoid with bias (SigLIP)."""

    def __init__(self, kind: str, salt: str, scale: float, bias: float | None):
        self.kind, self.salt, self.logit_scale, self.logit_bias = kind, salt, scale, bias
        self.templates = None

    def _vector(self, data: bytes) -> np.ndarray:
        digest = hashlib.sha256(self.salt.encode() + data).digest()
        v = np.random.default_rng(int.from_bytes(digest[:8], "big")).normal(size=8)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def encode_images(self, images, batch_size=None):
        return np.stack([self._vector(np.ascontiguousarray(im).tobytes()) for im in images])

    def encode_texts(self, texts, templates=("{}",)):
        self.templates = templates
        return np.stack([self._vector(templates[0].format(t).encode()) for t in texts])


def _coco_source(root: pathlib.Path, num_images: int = 40) -> dict[int, list[int]]:
    """A COCO tree with random images; returns image id -> present category ids."""
    rng = np.random.default_rng(4)
    images, annotations, present = [], [], {}
    for image_id in range(1, num_images + 1):
        pixels = rng.integers(0, 256, (12, 14, 3), dtype=np.uint8)
        (root / "images").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(root / "images" / f"{image_id:04d}.jpg", format="JPEG")
        images.append({"id": image_id, "file_name": f"{image_id:04d}.jpg"})
        cats = sorted(rng.choice(list(CATEGORIES), rng.integers(0, 4), replace=False).tolist())
        present[image_id] = cats
        for c in cats:
            for _ in range(int(rng.integers(1, 3))):
                crowd = int(rng.random() < 0.1)
                annotations.append({"image_id": image_id, "category_id": c, "iscrowd": crowd})
    for i, a in enumerate(annotations):
        a.update(id=i + 1, bbox=[1.0, 1.0, 4.0, 4.0])
    categories = [{"id": k, "name": v} for k, v in CATEGORIES.items()]
    data = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations.json").write_text(json.dumps(data))
    return present


def _reference_splits(root, present, scorers, threshold, cap, seed):
    ids = sorted(CATEGORIES)
    pairs = [(i, c) for i in sorted(present) for c in present[i]]
    scores = {}
    for name, s in scorers.items():
        texts = s.encode_texts([CATEGORIES[c].replace("_", " ") for c in ids], ("{}",))
        texts /= np.linalg.norm(texts, axis=1, keepdims=True)
        cos = []
        for i, _ in pairs:
            pixels = np.asarray(Image.open(root / "images" / f"{i:04d}.jpg").convert("RGB"))
            cos.append(s.encode_images([pixels])[0] @ texts.T)
        cos = np.array(cos, np.float64)
        column = np.array([ids.index(c) for _, c in pairs])
        if s.kind == "clip":
            scores[name] = special.softmax(s.logit_scale * cos, axis=1)[
                np.arange(len(pairs)), column
            ]
        else:
            scores[name] = special.expit(
                s.logit_scale * cos[np.arange(len(pairs)), column] + s.logit_bias
            )
    below = np.stack([v < threshold for v in scores.values()])
    labels = np.where(below.all(0), "OOD-H", np.where(below.any(0), "OOD-S", "ID"))
    kept = oodbench.sample_splits(labels, cap, seed)  # sampling itself is tested above
    return pairs, scores, labels, kept


def _run(scorers, scoring=jobs.PairScoring(), **options):
    job = jobs.OodbenchMining(scoring=scoring, encoding=jobs.Encoding(quiet=True), **options)
    jobs.run_oodbench(job, scorer_factory=lambda path: scorers[path])


def test_mine_oodbench_round_trip_through_the_builder(tmp_path, capsys):
    root = tmp_path / "coco"
    present = _coco_source(root)
    scorers = {
        "clip": FakeScorer("clip", "a", 30.0, None),
        "siglip": FakeScorer("siglip", "b", 10.0, -2.0),
    }
    scoring = jobs.PairScoring(threshold=0.2, templates=("{}",))
    _run(scorers, scoring, source=str(root), scorer=("clip", "siglip"), max_per_split=12, seed=3)
    printed = capsys.readouterr().out
    pairs, scores, labels, kept = _reference_splits(root, present, scorers, 0.2, 12, 3)
    lines = [json.loads(line) for line in (root / "splits.jsonl").read_text().splitlines()]
    # Every split occurs and at least one was downsampled, so both paths are exercised.
    counts = collections.Counter(labels.tolist())
    assert set(counts) == set(oodbench.SPLITS) and max(counts.values()) > 12
    want = [
        (pairs[i][0], CATEGORIES[pairs[i][1]], split)
        for split in oodbench.SPLITS
        for i in kept[split].tolist()
    ]
    assert [(r["image_id"], r["category"], r["split"]) for r in lines] == want
    for r in lines:
        i = pairs.index(
            (r["image_id"], [k for k, v in CATEGORIES.items() if v == r["category"]][0])
        )
        assert r["scores"] == pytest.approx({n: scores[n][i] for n in scores}, rel=1e-4, abs=1e-7)
    # Only present categories are paired, and no ID pair is an OOD one.
    assert all(
        [k for k, v in CATEGORIES.items() if v == r["category"]][0] in present[r["image_id"]]
        for r in lines
    )
    for split in oodbench.SPLITS:
        assert f"{split}: {counts[split]} pairs, {len(kept[split])} written" in printed

    datasets.build("oodbench", str(tmp_path / "data"), source=str(root))
    reread = tfds.builder_from_directory(str(tmp_path / "data" / "oodbench" / "default" / "1.0.0"))
    for split, tfds_split in (("ID", "id"), ("OOD-S", "ood_s"), ("OOD-H", "ood_h")):
        examples = list(tfds.as_numpy(reread.as_dataset(split=tfds_split)))
        built = collections.Counter((int(e["image/id"]), e["category"].decode()) for e in examples)
        # Two questions (contain / not contain) per instance, both about a present category.
        assert built == {(i, c): 2 for i, c, s in want if s == split}
        assert all(e["answer"] == (e["kind"].decode() == "existential") for e in examples)


def test_default_template_and_bad_scorer_kind(tmp_path):
    root = tmp_path / "coco"
    _coco_source(root, num_images=6)
    clip = FakeScorer("clip", "a", 30.0, None)
    _run({"clip": clip}, source=str(root), scorer=("clip",), out=str(tmp_path / "s.jsonl"))
    assert clip.templates == oodbench.DEFAULT_TEMPLATES
    assert (tmp_path / "s.jsonl").is_file() and not (root / "splits.jsonl").exists()
    with pytest.raises(ValueError, match=r"scorer kind 'flamingo'"):
        _run({"x": FakeScorer("flamingo", "a", 1.0, None)}, source=str(root), scorer=("x",))
    with pytest.raises(ValueError, match=r"annotations\.json: file not found"):
        _run({"clip": clip}, source=str(tmp_path), scorer=("clip",))
