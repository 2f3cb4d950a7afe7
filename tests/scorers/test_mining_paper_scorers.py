"""OODBench's four scorers, real ones: `mine oodbench-ablation` over tiny random-weight CLIP, BLIP-2,
GroupViT and LiT checkpoints loaded from disk by `ood_jax.scorers.from_hf`, against reference
scores computed without this project's models (transformers' PyTorch models for CLIP, BLIP-2 and
GroupViT; for LiT-B16B's layout, the numpy forward and WordPiece rule of tests/scorers/test_lit.py) and a
numpy reference of the paper's rule.

Images are the models' own size (32 px), so every image processor only rescales and normalizes
and the references can take transformers' processors' pixels.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from scipy import special
from test_blip2 import every_layer as blip2_config
from test_blip2 import lavis_state_dict, save_bert_tokenizer
from test_groupvit import save as save_groupvit
from test_groupvit import three_stages as groupvit_config
from test_lit import ARCHS as LIT_ARCHS
from test_lit import WORDPIECES, bf16_rounded, lit_reference, lit_tree, published, write_dir
from test_lit import wordpiece_reference
from test_mining_ablation import GROUPS, SERIES, _numpy_labels
from test_scorers import IMAGE_SIZE, clip_config, perturbed, save_clip

from ood_jax.mining import jobs

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow


CATEGORIES = {1: "cat", 2: "dog", 3: "traffic_light", 4: "zebra", 5: "person", 6: "kite"}
NAMES = {name: category_id for category_id, name in CATEGORIES.items()}
TEMPLATE = "a photo of a {}."
BLIP2_SCALE = 14.0  # transformers' BLIP-2 checkpoints carry no temperature: given by flag


def _source(root, num_images: int = 14) -> list[tuple[int, int]]:
    """A COCO tree of 32 px PNG images; returns the (image id, category id) pairs, in order."""
    rng = np.random.default_rng(5)
    (root / "images").mkdir(parents=True)
    images, annotations, pairs = [], [], []
    for image_id in range(1, num_images + 1):
        pixels = rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"{image_id}.png")
        images.append({"id": image_id, "file_name": f"{image_id}.png"})
        for c in sorted(rng.choice(list(CATEGORIES), rng.integers(1, 4), replace=False).tolist()):
            pairs.append((image_id, c))
            annotations.append({"image_id": image_id, "category_id": c, "iscrowd": 0})
    for i, a in enumerate(annotations):
        a.update(id=i + 1, bbox=[1.0, 1.0, 4.0, 4.0])
    categories = [{"id": k, "name": v} for k, v in CATEGORIES.items()]
    data = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations.json").write_text(json.dumps(data))
    return pairs


def save_blip2(path) -> torch.nn.Module:
    """A random-weight BLIP-2 retrieval checkpoint with its tokenizer and image processor."""
    blip2 = perturbed(transformers.Blip2ForImageTextRetrieval(blip2_config()), seed=4)
    blip2.save_pretrained(path)
    save_bert_tokenizer(path)
    processor = transformers.BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(path)
    return blip2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("paper_scorers")
    clip = save_clip(root / "clip", clip_config())
    groupvit = save_groupvit(root / "groupvit", groupvit_config(), seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # GroupViT's text tower is CLIP's
        shutil.copy(root / "clip" / name, root / "groupvit" / name)
    blip2 = save_blip2(root / "blip2")
    arch = LIT_ARCHS["b16b_bert"]
    tree = lit_tree(arch, seed=5)
    write_dir(root / "lit", published(tree, arch["layout"]), vocab=WORDPIECES)
    return {
        "clip": (root / "clip", clip),
        "blip2": (root / "blip2", blip2),
        "groupvit": (root / "groupvit", groupvit),
        "lit": (root / "lit", bf16_rounded(tree, arch["layout"])),
    }


def _inputs(path, texts, images, length):
    processor = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokens = tokenizer(
        texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    )
    return processor(images=images, return_tensors="pt")["pixel_values"], tokens


@torch.no_grad()
def _reference_logits(name, path, model, images) -> np.ndarray:
    """[images, categories] logits of the scorer's S(x, c), from the PyTorch model."""
    texts = [TEMPLATE.format(c.replace("_", " ")) for c in CATEGORIES.values()]
    if name == "lit":  # model is the parameter tree; big_vision's value_range(-1, 1)
        ids = np.array([wordpiece_reference(t, 16) for t in texts])
        pixels = np.stack(images).astype(np.float64) / 127.5 - 1
        return lit_reference(model, pixels, ids, LIT_ARCHS["b16b_bert"])["logits_per_image"]
    if name == "blip2":
        pixels, tokens = _inputs(path, texts, images, 24)
        out = model(pixels, tokens["input_ids"], tokens["attention_mask"])
        return BLIP2_SCALE * out.logits_per_image.numpy()
    pixels, tokens = _inputs(path, texts, images, 16)
    return model(pixel_values=pixels, **tokens).logits_per_image.numpy()


def _threshold(scores: dict[str, np.ndarray]) -> float:
    """A T in the widest gap between the middle scores, so that rounding cannot flip a pair."""
    values = np.sort(np.concatenate(list(scores.values())))
    middle = values[len(values) // 4 : 3 * len(values) // 4 + 1]
    k = int(np.argmax(np.diff(middle)))
    return float((middle[k] + middle[k + 1]) / 2)


def test_ablation_with_four_real_scorers_matches_numpy(tmp_path, checkpoints, capsys) -> None:
    pairs = _source(tmp_path / "coco")
    image_ids = sorted({i for i, _ in pairs})
    images = [np.asarray(Image.open(tmp_path / "coco" / "images" / f"{i}.png")) for i in image_ids]
    rows = np.array([image_ids.index(i) for i, _ in pairs])
    columns = np.array([list(CATEGORIES).index(c) for _, c in pairs])
    want = {}
    for name, (path, model) in checkpoints.items():
        logits = _reference_logits(name, path, model, images)
        want[name] = special.softmax(logits, axis=1)[rows, columns]
    threshold = _threshold(want)

    scoring = jobs.PairScoring(
        threshold=threshold, templates=(TEMPLATE,), logit_scale=(("blip2", BLIP2_SCALE),)
    )
    job = jobs.OodbenchAblation(
        source=str(tmp_path / "coco"), out=str(tmp_path / "out"),
        scorer=tuple((name, str(path)) for name, (path, _) in checkpoints.items()),
        group=tuple(GROUPS.items()), series=SERIES, scoring=scoring,
        encoding=jobs.Encoding(batch_size=4, quiet=True),
    )  # fmt: skip
    jobs.run_oodbench_ablation(job)  # the scorers from their directories, as the command loads them
    capsys.readouterr()

    divisions = {f"series-{k}": SERIES[:k] for k in range(1, len(SERIES) + 1)}
    divisions.update({f"group-{group}": members for group, members in GROUPS.items()})
    seen = set()
    for division, scorers in divisions.items():
        lines = (tmp_path / "out" / f"{division}.jsonl").read_text().splitlines()
        records = {(r["image_id"], NAMES[r["category"]]): r for r in map(json.loads, lines)}
        assert sorted(records) == sorted(pairs), division  # every pair kept: no downsampling
        expected = _numpy_labels(want, scorers, threshold)
        for k, pair in enumerate(pairs):
            assert records[pair]["split"] == expected[k], (division, pair)
            for name in scorers:
                assert abs(records[pair]["scores"][name] - want[name][k]) < 1e-4, (division, name)
        seen.update(expected)
    assert len(seen) >= 2  # the threshold divides: the comparison is not of constants
    manifest = json.loads((tmp_path / "out.manifest.json").read_text())
    blip2 = next(s for s in manifest["scorers"] if s["name"] == "blip2")
    assert blip2["kind"] == "blip2" and blip2["logit_scale"] == {
        "checkpoint": None,
        "given": BLIP2_SCALE,
    }


@torch.no_grad()
def test_blip2_matching_head_scores_pairs(tmp_path, checkpoints, capsys) -> None:
    # --match: S(x, c) is the ITM probability of each pair, averaged over the templates.
    pairs = _source(tmp_path / "coco", num_images=5)
    path, model = checkpoints["blip2"]
    templates = ["a photo of a {}.", "{}"]
    job = jobs.OodbenchMining(
        source=str(tmp_path / "coco"), scorer=(str(path),), max_per_split=0,
        out=str(tmp_path / "splits.jsonl"),
        scoring=jobs.PairScoring(match=("blip2",), templates=tuple(templates)),
        encoding=jobs.Encoding(batch_size=2, quiet=True),
    )  # fmt: skip
    jobs.run_oodbench(job)
    capsys.readouterr()
    lines = (tmp_path / "splits.jsonl").read_text().splitlines()
    got = {
        (r["image_id"], NAMES[r["category"]]): r["scores"]["blip2"] for r in map(json.loads, lines)
    }
    for image_id, category in pairs:
        image = np.asarray(Image.open(tmp_path / "coco" / "images" / f"{image_id}.png"))
        name = CATEGORIES[category].replace("_", " ")
        pixels, tokens = _inputs(path, [t.format(name) for t in templates], [image] * 2, 24)
        out = model(pixels, **tokens, use_image_text_matching_head=True)
        want = torch.softmax(out.logits_per_image, dim=-1)[:, 1].mean().item()
        assert abs(got[image_id, category] - want) < 1e-4


@torch.no_grad()
def test_blip2_from_a_lavis_checkpoint_with_its_temperature(tmp_path, checkpoints, capsys) -> None:
    # --lavis: weights and the learned temperature (0.07 here) from LAVIS; LAVIS' attention has
    # no key bias, so the reference is the transformers model with that bias zeroed.
    pairs = _source(tmp_path / "coco", num_images=6)
    path, model = checkpoints["blip2"]
    lavis = {k: torch.as_tensor(v) for k, v in lavis_state_dict(model).items()}
    torch.save({"model": lavis}, tmp_path / "blip2_pretrained.pth")
    scoring = jobs.PairScoring(
        lavis=(("blip2", str(tmp_path / "blip2_pretrained.pth")),), templates=(TEMPLATE,)
    )
    job = jobs.OodbenchMining(
        source=str(tmp_path / "coco"), scorer=(str(path),), out=str(tmp_path / "splits.jsonl"),
        scoring=scoring, encoding=jobs.Encoding(quiet=True),
    )  # fmt: skip
    jobs.run_oodbench(job)
    capsys.readouterr()

    reference = copy.deepcopy(model)
    for layer in reference.vision_model.encoder.layers:
        bias = layer.self_attn.qkv.bias
        third = len(bias) // 3
        bias[third : 2 * third] = 0
    image_ids = sorted({i for i, _ in pairs})
    images = [np.asarray(Image.open(tmp_path / "coco" / "images" / f"{i}.png")) for i in image_ids]
    logits = _reference_logits("blip2", path, reference, images) / BLIP2_SCALE / 0.07
    probs = special.softmax(logits, axis=1)
    lines = (tmp_path / "splits.jsonl").read_text().splitlines()
    for record in map(json.loads, lines):
        want = probs[image_ids.index(record["image_id"]), list(NAMES).index(record["category"])]
        assert abs(record["scores"]["blip2"] - want) < 1e-4
    manifest = json.loads((tmp_path / "splits.manifest.json").read_text())
    (entry,) = manifest["scorers"]
    assert entry["lavis_checkpoint"]["path"].endswith("blip2_pretrained.pth")
