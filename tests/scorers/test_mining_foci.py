"""FOCI hard-choice mining against a plain-numpy ranking, and the foci job -> foci builder."""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from ood_jax import mining
from ood_jax import datasets
from ood_jax.mining import foci, jobs


def reference_options(images, texts, labels, num_options=4):
    """Numpy ranking in float64: wrong classes by (-cosine, class index), most similar k kept."""
    images = images / np.linalg.norm(images, axis=1, keepdims=True)
    texts = texts / np.linalg.norm(texts, axis=1, keepdims=True)
    similarity = images.astype(np.float64) @ texts.T.astype(np.float64)
    rows = []
    for row, label in zip(similarity, labels):
        wrong = [c for c in range(len(texts)) if c != label]
        ranked = sorted(wrong, key=lambda c: (-row[c], c))[: num_options - 1]
        rows.append([label, *ranked[::-1]])
    return np.array(rows), similarity


def test_mine_options_matches_numpy_on_random_features():
    rng = np.random.default_rng(0)
    n, c, d = 1000, 37, 16  # n is not a multiple of the chunk
    images = rng.normal(size=(n, d)).astype(np.float32)
    texts = rng.normal(size=(c, d)).astype(np.float32) * rng.uniform(0.5, 2, (c, 1))
    labels = rng.integers(0, c, n)
    got = foci.mine_options(images, texts, labels, chunk_size=128)
    want, similarity = reference_options(images, texts, labels)
    assert got.shape == (n, 4) and got.dtype == np.int64
    assert (got[:, 0] == labels).all()
    # Rows where float32 and float64 could order two classes differently are left out.
    ordered = np.sort(np.where(np.eye(c, dtype=bool)[labels], -np.inf, similarity), axis=1)
    margin = np.diff(ordered[:, -5:], axis=1).min(axis=1)
    clear = margin > 1e-5
    assert clear.mean() > 0.98
    np.testing.assert_array_equal(got[clear], want[clear])
    # Negatives never repeat the truth or each other, and rise in similarity.
    assert all(len(set(row)) == 4 for row in got.tolist())
    taken = np.take_along_axis(similarity, got[:, 1:], axis=1)
    assert (np.diff(taken, axis=1) >= -1e-6).all()


def test_exact_ties_go_to_the_lower_class_index():
    # Dyadic unit vectors (four entries of +-1/2): norms and dot products are exact in float32,
    # so many classes tie exactly and only the tie rule decides.
    rng = np.random.default_rng(1)

    def dyadic(rows, dim=8):
        out = np.zeros((rows, dim), np.float32)
        for row in out:
            row[rng.choice(dim, 4, replace=False)] = rng.choice([-0.5, 0.5], 4)
        return out

    images, texts = dyadic(300), dyadic(12)
    texts[7] = texts[2]  # identical classes tie with every image
    labels = rng.integers(0, 12, 300)
    got = foci.mine_options(images, texts, labels, chunk_size=64)
    want, similarity = reference_options(images, texts, labels)
    np.testing.assert_array_equal(got, want)
    # The tie rule was exercised: some kept negatives tie with a class left out or kept after it.
    negatives_tied = [
        len({similarity[i, c] for c in row[1:]}) < 3 for i, row in enumerate(got.tolist())
    ]
    assert sum(negatives_tied) > 10


def test_chunks_compile_once_and_chunk_size_does_not_matter():
    rng = np.random.default_rng(2)
    images, texts = rng.normal(size=(777, 8)), rng.normal(size=(20, 8))
    labels = rng.integers(0, 20, 777)
    before = foci._hard_negatives._cache_size()
    small = foci.mine_options(images, texts, labels, chunk_size=50)  # 16 chunks, the last padded
    assert foci._hard_negatives._cache_size() == before + 1
    np.testing.assert_array_equal(small, foci.mine_options(images, texts, labels, chunk_size=4096))
    np.testing.assert_array_equal(
        small, foci.mine_options(images, texts, labels, num_options=4, chunk_size=777)
    )


def test_one_device_mesh_gives_the_same_options():
    import jax

    from ood_jax import sharding

    rng = np.random.default_rng(3)
    images, texts = rng.normal(size=(130, 8)), rng.normal(size=(9, 8))
    labels = rng.integers(0, 9, 130)
    mesh = sharding.make_mesh([("data", -1)], jax.devices()[:1])
    np.testing.assert_array_equal(
        foci.mine_options(images, texts, labels, chunk_size=32, mesh=mesh),
        foci.mine_options(images, texts, labels, chunk_size=32),
    )


def _numpy_accuracy(images, texts, labels, options):
    _, similarity = reference_options(images, texts, labels)
    over_all = np.argmax(similarity, axis=1)  # first maximum: the lower index
    picked = []
    for row, opts in zip(similarity, options):
        best = max(row[o] for o in opts)
        picked.append(min(o for o in opts if row[o] == best))
    return (over_all == labels).mean(), (np.array(picked) == labels).mean()


def test_zero_shot_accuracy_matches_numpy():
    rng = np.random.default_rng(4)
    n, c, d = 500, 30, 12
    texts = rng.normal(size=(c, d))
    labels = rng.integers(0, c, n)
    # Images near their class's text, so accuracy is neither 0 nor 1.
    images = texts[labels] + rng.normal(scale=1.2, size=(n, d))
    mined = foci.mine_options(images, texts, labels, chunk_size=128)
    result = foci.zero_shot_accuracy(images, texts, labels, mined, chunk_size=128)
    all_classes, over_options = _numpy_accuracy(images, texts, labels, mined)
    assert 0.1 < all_classes < 0.9
    assert result["all_classes"] == pytest.approx(all_classes)
    # With the miner's own features the top wrong class is always an option: equal accuracies.
    assert result["options"] == pytest.approx(over_options) == pytest.approx(all_classes)
    # Options mined by another model: the restricted accuracy is higher and still matches numpy.
    other = foci.mine_options(rng.normal(size=(n, d)), texts, labels, chunk_size=128)
    result = foci.zero_shot_accuracy(images, texts, labels, other, chunk_size=128)
    expected = _numpy_accuracy(images, texts, labels, other)
    assert (result["all_classes"], result["options"]) == pytest.approx(expected)
    assert result["options"] > result["all_classes"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, t, y: (x[:, :3], t, y), r"image_features has dimension 3, expected 4"),
        (lambda x, t, y: (np.where(x == x[5, 1], np.nan, x), t, y), r"image_features row 5"),
        (lambda x, t, y: (x, t, np.where(np.arange(10) == 2, 6, y)), r"labels\[2\] = 6 is"),
        (lambda x, t, y: (x, np.zeros_like(t), y), r"text_features row 0 is all zeros"),
        (lambda x, t, y: (x, t[:3], y % 3), r"num_options must be in \[2, 3\]"),
        (lambda x, t, y: (x, t, y[:-1]), r"labels must have shape \(10,\)"),
    ],
)
def test_bad_inputs_are_named(change, message):
    rng = np.random.default_rng(5)
    x, t, y = rng.normal(size=(10, 4)), rng.normal(size=(6, 4)), rng.integers(0, 6, 10)
    with pytest.raises(ValueError, match=message):
        foci.mine_options(*change(x, t, y))


def test_map_rows_in_chunks_handles_empty_and_mismatched_rows():
    import jax

    double = jax.jit(lambda a: a * 2)
    (out,) = mining.map_rows_in_chunks(double, [np.zeros((0, 3), np.float32)], chunk_size=4)
    assert out.shape == (0, 3)
    with pytest.raises(ValueError, match="differ in length"):
        mining.map_rows_in_chunks(double, [np.zeros((2, 3)), np.zeros(3)], chunk_size=4)


# ---------------------------------------------------------------------------------------------
# The `mine foci` job -> options file -> foci builder
# ---------------------------------------------------------------------------------------------


class FakeScorer:
    """Deterministic features: a hash of the pixels or of the formatted texts seeds a vector."""

    kind = "clip"
    logit_scale, logit_bias = 100.0, None

    def __init__(self, dim: int = 16, fail_after_batches: int | None = None):
        self.dim = dim
        self.texts_seen: list[list[str]] = []
        self.identity = {"fake": dim}
        self.images_encoded = 0
        self.batches_left = fail_after_batches

    def _vector(self, data: bytes) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
        v = np.random.default_rng(seed).normal(size=self.dim)
        return v / np.linalg.norm(v)

    def encode_images(self, images, batch_size=None):
        if self.batches_left is not None:
            if self.batches_left == 0:
                raise KeyboardInterrupt("killed")
            self.batches_left -= 1
        self.images_encoded += len(images)
        return np.stack([self._vector(np.ascontiguousarray(im).tobytes()) for im in images])

    def encode_texts(self, texts, templates=("{}",)):
        self.texts_seen.append([t.format(x) for x in texts for t in templates])
        rows = [np.mean([self._vector(t.format(x).encode()) for t in templates], 0) for x in texts]
        rows = np.stack(rows)
        return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def _write_image(path: pathlib.Path, seed: int) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (10 + seed % 7, 12, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")
    return pixels


def _run(scorer: FakeScorer, batch_size: int = 256, **options) -> None:
    job = jobs.FociMining(scorer="fake", encoding=jobs.Encoding(batch_size, quiet=True), **options)
    jobs.run_foci(job, scorer_factory=lambda path: scorer)


def _expected(scorer, root, images, labels, class_names, templates):
    features = scorer.encode_images(
        [np.asarray(Image.open(root / i).convert("RGB")) for i in images]
    )
    texts = scorer.encode_texts(class_names, templates)
    index = [class_names.index(label) for label in labels]
    rows, _ = reference_options(features, texts, np.array(index))
    return {image: [class_names[c] for c in row] for image, row in zip(images, rows.tolist())}


def _read_built(data_dir: pathlib.Path, config: str) -> dict[str, dict]:
    builder = tfds.builder_from_directory(str(data_dir / "foci" / config / "1.0.0"))
    return {
        ex["image/filename"].decode(): ex for ex in tfds.as_numpy(builder.as_dataset(split="test"))
    }


def test_mine_custom_folders_round_trip_through_the_builder(tmp_path):
    src = tmp_path / "src"
    folders = {"c0": "snow leopard", "c1": "lynx", "c2": "ocelot", "c3": "serval", "c4": "puma"}
    images, labels = [], []
    for k, folder in enumerate(sorted(folders) * 4):
        name = f"images/{folder}/{k:03d}.png"
        _write_image(src / name, k)
        images.append(name)
        labels.append(folders[folder])
    (src / "images" / "c1" / "notes.txt").write_text("not an image")
    (src / "class_names.json").write_text(json.dumps(folders))
    scorer = FakeScorer()
    templates = ["a photo of a {}", "an image of a {}"]
    _run(scorer, dataset="custom", source=str(src), templates=tuple(templates))
    assert scorer.texts_seen[0][:2] == ["a photo of a snow leopard", "an image of a snow leopard"]

    written = json.loads((src / "options.json").read_text())
    order = sorted(images)
    expected = _expected(scorer, src, order, [labels[images.index(i)] for i in order],
                         [folders[f] for f in sorted(folders)], templates)  # fmt: skip
    entries = {e["image"]: e for group in written.values() for e in group}
    assert {i: e["options"] for i, e in entries.items()} == expected
    assert all(e["groundtruth"] == e["options"][0] for e in entries.values())
    assert list(written) == [folders[f] for f in sorted(folders)]  # grouped by class, in order

    datasets.build("foci", str(tmp_path / "data"), source=str(src), config="custom")
    records = _read_built(tmp_path / "data", "custom")
    assert sorted(records) == sorted(images)
    for image, record in records.items():
        options = [o.decode() for o in record["options"]]
        assert sorted(options) == sorted(expected[image])
        assert options[record["answer"]] == record["label"].decode() == expected[image][0]


def test_mine_a_release_split_round_trip(tmp_path):
    # Food-101's layout: meta/test.json names the test images; the classes are the file's keys.
    src = tmp_path / "food"
    raw = ["apple_pie", "beef_tartare", "bibimbap", "churros", "donuts"]
    entries = {c: [f"{c}/{100 + k}" for k in range(3)] for c in raw}
    (src / "meta").mkdir(parents=True)
    (src / "meta" / "test.json").write_text(json.dumps(entries))
    for k, entry in enumerate(e for c in raw for e in entries[c]):
        _write_image(src / "images" / f"{entry}.jpg", k)  # PNG bytes under .jpg: PIL reads them
    scorer = FakeScorer()
    _run(scorer, dataset="foci/food101", source=str(src))
    assert scorer.texts_seen[0][0] == "an image of a apple pie"  # FOCI's template, literally

    images = sorted(f"images/{e}.jpg" for c in raw for e in entries[c])
    labels = [i.split("/")[1].replace("_", " ") for i in images]
    expected = _expected(scorer, src, images, labels, sorted(set(labels)), foci.DEFAULT_TEMPLATES)
    written = json.loads((src / "foci_options.json").read_text())
    assert {e["image"]: e["options"] for g in written.values() for e in g} == expected

    datasets.build("foci", str(tmp_path / "data"), source=str(src), config="food101")
    records = _read_built(tmp_path / "data", "food101")
    assert {i: sorted(o.decode() for o in r["options"]) for i, r in records.items()} == {
        i: sorted(o) for i, o in expected.items()
    }


def test_imagenet_folders_need_class_names(tmp_path, capsys):
    src = tmp_path / "in21k"
    _write_image(src / "images" / "n01322508" / "a.JPEG", 0)
    with pytest.raises(ValueError, match=r"class_names\.json: file not found"):
        _run(FakeScorer(), dataset="imagenet21k_animal", source=str(src))
    (src / "class_names.json").write_text(json.dumps({"n0000": "x"}))
    with pytest.raises(ValueError, match=r"no class name for folder 'n01322508'"):
        _run(FakeScorer(), dataset="imagenet21k_animal", source=str(src))
    with pytest.raises(ValueError, match=r"unknown FOCI config 'imagenet'"):
        _run(FakeScorer(), dataset="imagenet", source=str(src))


def test_unreadable_image_is_named(tmp_path):
    src = tmp_path / "src"
    for k, folder in enumerate(["a", "b", "c", "d"]):
        _write_image(src / "images" / folder / "0.png", k)
    (src / "images" / "c" / "0.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"images/c/0\.png: corrupt or unreadable image"):
        _run(FakeScorer(), dataset="custom", source=str(src))


def test_killed_mining_resumes_from_its_cache(tmp_path):
    src = tmp_path / "src"
    for k in range(10):
        _write_image(src / "images" / f"c{k % 5}" / f"{k:03d}.png", k)
    given = dict(dataset="custom", source=str(src), batch_size=3)
    _run(FakeScorer(), **given, out=str(tmp_path / "plain.json"))

    cache = dict(cache=str(tmp_path / "cache"), out=str(tmp_path / "cached.json"))
    with pytest.raises(KeyboardInterrupt) as interrupt:
        _run(FakeScorer(fail_after_batches=2), **given, **cache)
    # The one line ood_jax.cli prints says what was kept and how to continue.
    assert str(interrupt.value) == (
        f"image features computed so far are kept in {tmp_path / 'cache'}; "
        f"{tmp_path / 'cached.json'} was not written; rerun the same command to continue from them"
    )
    assert not (tmp_path / "cached.json").exists()
    resumed = FakeScorer()
    _run(resumed, **given, **cache)
    # Two shards of 3 were finished before the kill; only the other 4 images are encoded again.
    assert resumed.images_encoded == 4
    assert (tmp_path / "cached.json").read_text() == (tmp_path / "plain.json").read_text()

    other = FakeScorer(dim=8)
    with pytest.raises(ValueError, match="identity|another|scorer"):
        _run(other, **given, **cache)
