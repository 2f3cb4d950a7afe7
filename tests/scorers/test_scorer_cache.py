"""EmbeddingCache: resumable shards keyed by id, refused under another scorer identity."""

import json
import zlib

import numpy as np
import pytest
import torch
import transformers

from ood_jax import scorers
from ood_jax.scorers import EmbeddingCache

IDENTITY = {"path": "/models/clip", "config_sha256": "abc", "dtype": "float32"}
DIM = 8


def fetch(ids: list[str]) -> list[str]:
    return [f"image:{i}" for i in ids]


def encode(items: list[str]) -> np.ndarray:
    """Deterministic per-item embeddings (a seeded draw per item), like a real encoder."""
    rows = [np.random.default_rng(zlib.crc32(item.encode())).normal(size=DIM) for item in items]
    return np.asarray(rows, np.float32)


class Recorder:
    """encode_fn that records what it encoded and dies on call number `fail_on` (1-based)."""

    def __init__(self, fail_on: int | None = None):
        self.fail_on = fail_on
        self.calls: list[list[str]] = []

    def __call__(self, items: list[str]) -> np.ndarray:
        self.calls.append(list(items))
        if len(self.calls) == self.fail_on:
            raise KeyboardInterrupt("killed")
        return encode(items)


IDS = [f"img{i:03d}" for i in range(23)]


def test_compute_equals_direct_encoding(tmp_path) -> None:
    cache = EmbeddingCache(tmp_path, shard_size=5, identity=IDENTITY)
    out = cache.compute(IDS, fetch, encode)
    np.testing.assert_array_equal(out, encode(fetch(IDS)))
    assert out.dtype == np.float32
    assert [p.name for p in cache.shard_paths()] == [f"shard-{i:06d}.npz" for i in range(5)]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["identity"] == IDENTITY and manifest["shape"] == [DIM]


def test_killed_run_resumes_without_recomputing_finished_shards(tmp_path) -> None:
    uninterrupted = EmbeddingCache(tmp_path / "a", shard_size=5, identity=IDENTITY)
    expected = uninterrupted.compute(IDS, fetch, encode)

    killed = Recorder(fail_on=3)
    with pytest.raises(KeyboardInterrupt):
        EmbeddingCache(tmp_path / "b", shard_size=5, identity=IDENTITY).compute(IDS, fetch, killed)
    assert len(killed.calls) == 3
    # Two finished shards and nothing half-written next to them.
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "manifest.json",
        "shard-000000.npz",
        "shard-000001.npz",
    ]

    rerun = Recorder()
    resumed = EmbeddingCache(tmp_path / "b", shard_size=5, identity=IDENTITY)
    out = resumed.compute(IDS, fetch, rerun)
    np.testing.assert_array_equal(out, expected)
    done = set(killed.calls[0] + killed.calls[1])
    encoded = [f"image:{i}" for i in IDS]
    assert sum(rerun.calls, []) == [x for x in encoded if x not in done]

    # Everything is cached now: any order, subset or repetition encodes nothing.
    nothing = Recorder(fail_on=1)
    order = [IDS[7], IDS[0], IDS[22], IDS[7]]
    np.testing.assert_array_equal(resumed.compute(order, fetch, nothing), expected[[7, 0, 22, 7]])
    assert nothing.calls == []


def test_partial_shard_files_are_ignored(tmp_path) -> None:
    cache = EmbeddingCache(tmp_path, shard_size=4, identity=IDENTITY)
    cache.compute(IDS[:4], fetch, encode)
    # What a process killed inside the write leaves behind: a temporary, never a shard name.
    (tmp_path / ".shard-000001.npz.tmp-999").write_bytes(b"PK\x03\x04 truncated")
    recorder = Recorder()
    out = cache.compute(IDS[:8], fetch, recorder)
    np.testing.assert_array_equal(out, encode(fetch(IDS[:8])))
    assert recorder.calls == [fetch(IDS[4:8])]


def test_ids_are_strings_and_repeats_are_encoded_once(tmp_path) -> None:
    cache = EmbeddingCache(tmp_path, shard_size=10, identity=IDENTITY)
    recorder, fetched = Recorder(), []
    out = cache.compute([3, 1, 3, "1"], lambda ids: fetched.append(ids) or fetch(ids), recorder)
    assert fetched == [[3, 1]]  # as given (ints), the first occurrence of each
    assert recorder.calls == [["image:3", "image:1"]]
    np.testing.assert_array_equal(out, encode(["image:3", "image:1", "image:3", "image:1"]))


def test_another_identity_is_refused(tmp_path) -> None:
    EmbeddingCache(tmp_path, identity=IDENTITY).compute(IDS[:3], fetch, encode)
    other = {**IDENTITY, "config_sha256": "def"}
    with pytest.raises(ValueError, match="manifest.json: this cache holds embeddings of another"):
        EmbeddingCache(tmp_path, identity=other)
    # Tuples read back from JSON as lists: the same identity either way.
    EmbeddingCache(tmp_path / "t", identity={**IDENTITY, "templates": ("{}", "a {}")})
    EmbeddingCache(tmp_path / "t", identity={**IDENTITY, "templates": ["{}", "a {}"]})


def test_bad_encoder_output_and_stray_shards(tmp_path) -> None:
    cache = EmbeddingCache(tmp_path / "a", shard_size=4, identity=IDENTITY)
    with pytest.raises(ValueError, match=r"shape \(3, 8\) for 4 ids"):
        cache.compute(IDS[:4], fetch, lambda items: encode(items)[:3])
    cache.compute(IDS[:4], fetch, encode)
    with pytest.raises(ValueError, match=r"shape \[5\]; .*manifest.json says \[8\]"):
        cache.compute(IDS[4:8], fetch, lambda items: encode(items)[:, :5])

    stray = tmp_path / "b"
    stray.mkdir()
    (stray / "shard-000000.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="shards without a manifest.json"):
        EmbeddingCache(stray, identity=IDENTITY)


def test_several_embeddings_per_id(tmp_path) -> None:
    # BLIP-2 embeds an image as one vector per query token: [n, Q, D] shards, same resume rules.
    def encode_queries(items: list[str]) -> np.ndarray:
        return np.stack([encode(items), 2 * encode(items), -encode(items)], axis=1)

    cache = EmbeddingCache(tmp_path, shard_size=5, identity=IDENTITY)
    out = cache.compute(IDS[:12], fetch, encode_queries)
    assert out.shape == (12, 3, DIM)
    np.testing.assert_array_equal(out, encode_queries(fetch(IDS[:12])))
    again = EmbeddingCache(tmp_path, shard_size=5, identity=IDENTITY)
    calls = []
    np.testing.assert_array_equal(
        again.compute(IDS, fetch, lambda items: calls.append(len(items)) or encode_queries(items)),
        encode_queries(fetch(IDS)),
    )
    assert calls == [5, 5, 1]  # only the 11 ids not cached yet
    with pytest.raises(ValueError, match=r"shape \[8\]; .*says \[3, 8\]"):
        again.compute(["new"], fetch, encode)


def test_reads_format_1_caches(tmp_path) -> None:
    # Format 1 manifests recorded a width "dim"; their shards stay readable.
    EmbeddingCache(tmp_path, shard_size=5, identity=IDENTITY).compute(IDS[:7], fetch, encode)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shape"]
    manifest.update(format_version=1, dim=DIM)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cache = EmbeddingCache(tmp_path, shard_size=5, identity=IDENTITY)
    np.testing.assert_array_equal(
        cache.compute(IDS[:7], fetch, Recorder(fail_on=1)), encode(fetch(IDS[:7]))
    )


def save_tiny_clip(path, seed: int) -> None:
    config = transformers.CLIPConfig(
        text_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=50,
            max_position_embeddings=8,
        ),
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
        ),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    transformers.CLIPModel(config).save_pretrained(path)


def test_with_a_scorer_identity(tmp_path) -> None:
    save_tiny_clip(tmp_path / "model_a", seed=0)
    save_tiny_clip(tmp_path / "model_b", seed=1)
    scorer = scorers.from_hf(tmp_path / "model_a", batch_size=4)
    rng = np.random.default_rng(0)
    images = {f"im{i}": rng.integers(0, 256, (20 + i, 18, 3), dtype=np.uint8) for i in range(6)}

    cache = EmbeddingCache(tmp_path / "cache", shard_size=4, identity=scorer.identity)
    out = cache.compute(images, lambda ids: [images[i] for i in ids], scorer.encode_images)
    np.testing.assert_allclose(out, scorer.encode_images(list(images.values())), atol=1e-5)
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["shape"] == [16]

    other = scorers.from_hf(tmp_path / "model_b")
    with pytest.raises(ValueError, match="another scorer"):
        EmbeddingCache(tmp_path / "cache", shard_size=4, identity=other.identity)
