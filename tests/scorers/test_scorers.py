"""CLIP / SigLIP scorers against transformers' PyTorch CLIPModel and SiglipModel.

Small random-weight models (hidden 64, 2 layers, 32px images, 8px patches) are saved with
save_pretrained, together with a tokenizer trained here with the `tokenizers` library and the
model's image processor, and loaded back through `ood_jax.scorers.from_hf`.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from ood_jax import scorers
from ood_jax.scorers import convert, preprocess

SENTENCES = [
    "a photo of a cat",
    "a photo of a dog",
    "an image of a red car parked on the street",
    "the quick brown fox jumps over the lazy dog",
    "two zebras grazing in a dry field at sunset",
]
TEXT_LEN = 16
IMAGE_SIZE = 32
# Special tokens first, so their ids are fixed: CLIP's end token is id 1, which makes
# transformers pool at its first occurrence (eos_token_id 2 would select the legacy argmax).
CLIP_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<unk>"]
SIGLIP_SPECIALS = ["<pad>", "</s>", "<unk>"]


def tower(**kwargs) -> dict:
    return dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, **kwargs
    )


def clip_config(eos_token_id: int = 1, **text) -> transformers.CLIPConfig:
    return transformers.CLIPConfig(
        text_config=tower(
            vocab_size=100, max_position_embeddings=TEXT_LEN, eos_token_id=eos_token_id, **text
        ),
        vision_config=tower(image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=48,
    )


def siglip_config() -> transformers.SiglipConfig:
    return transformers.SiglipConfig(
        text_config=tower(vocab_size=100, max_position_embeddings=TEXT_LEN, eos_token_id=1),
        vision_config=tower(image_size=IMAGE_SIZE, patch_size=8),
    )


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    # transformers starts LayerNorms at identity and some biases at zero; perturbing every tensor
    # makes parity see a transposed or misplaced one.
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def train_tokenizer(specials: list[str], template: str) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=90, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(s, tok.token_to_id(s)) for s in specials[:2]]
    )
    return tok


def save_clip(path: Path, config: transformers.CLIPConfig, seed: int = 0) -> torch.nn.Module:
    model = perturbed(transformers.CLIPModel(config), seed)
    model.save_pretrained(path)
    tok = train_tokenizer(CLIP_SPECIALS, "<|startoftext|> $A <|endoftext|>")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",  # OpenAI CLIP pads with its end token
        unk_token="<unk>",
    ).save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(path)
    return model


def save_siglip(path: Path) -> torch.nn.Module:
    model = perturbed(transformers.SiglipModel(siglip_config()))
    model.save_pretrained(path)
    tok = train_tokenizer(SIGLIP_SPECIALS, "$A </s>")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(path)
    transformers.SiglipImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("scorers")
    return {
        "clip": (root / "clip", save_clip(root / "clip", clip_config())),
        "siglip": (root / "siglip", save_siglip(root / "siglip")),
    }


@pytest.fixture(scope="module")
def loaded(checkpoints) -> dict[str, scorers.Scorer]:
    # batch_size 4 so the 6-row inputs below take two calls, the second one padded.
    return {kind: scorers.from_hf(path, batch_size=4) for kind, (path, _) in checkpoints.items()}


def random_ids(
    rng: np.random.Generator, ends: list[int], eos: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids with the end token at `ends[i]`, padding (repeated end tokens) after it."""
    ids = rng.integers(3, 100, size=(len(ends), TEXT_LEN))
    mask = np.zeros_like(ids)
    for i, end in enumerate(ends):
        ids[i, end:] = eos
        mask[i, : end + 1] = 1
    return ids, mask


def torch_features(model, pixels=None, ids=None, mask=None) -> np.ndarray:
    with torch.no_grad():
        if pixels is not None:
            out = model.get_image_features(
                pixel_values=torch.from_numpy(pixels.transpose(0, 3, 1, 2))
            )
        else:
            mask = None if mask is None else torch.from_numpy(mask)
            out = model.get_text_features(input_ids=torch.from_numpy(ids), attention_mask=mask)
    return out.pooler_output.numpy()


def normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_features_match_transformers(kind, checkpoints, loaded) -> None:
    _, model = checkpoints[kind]
    scorer = loaded[kind]
    assert scorer.kind == kind
    rng = np.random.default_rng(1)
    pixels = rng.normal(size=(6, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    ours = scorer.image_features(pixels)
    assert ours.shape == (6, 48 if kind == "clip" else 64) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, torch_features(model, pixels), atol=1e-4, rtol=0)

    # Different lengths: the end token at different positions with padding after it.
    ids, mask = random_ids(rng, [3, 15, 7, 1, 10, 5], eos=1)
    np.testing.assert_allclose(
        scorer.text_features(ids, mask), torch_features(model, ids=ids, mask=mask), atol=1e-4
    )
    np.testing.assert_allclose(
        scorer.text_features(ids), torch_features(model, ids=ids), atol=1e-4, rtol=0
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_logits_match_transformers(kind, checkpoints, loaded) -> None:
    _, model = checkpoints[kind]
    scorer = loaded[kind]
    rng = np.random.default_rng(2)
    pixels = rng.normal(size=(3, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    ids, mask = random_ids(rng, [4, 9, 2, 14], eos=1)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            pixel_values=torch.from_numpy(pixels.transpose(0, 3, 1, 2)),
        )
    expected = out.logits_per_image.numpy()

    np.testing.assert_allclose(scorer.logit_scale, model.logit_scale.exp().item(), rtol=1e-6)
    if kind == "clip":
        assert scorer.logit_bias is None
    else:
        np.testing.assert_allclose(scorer.logit_bias, model.logit_bias.item(), rtol=1e-6)
    # The module's own forward pass.
    logits = jax.jit(scorer.module.apply)(scorer.variables, pixels, ids, mask)["logits_per_image"]
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-5)
    # And the scores the mining code forms from the scorer's attributes and features.
    cosine = (
        normalized(scorer.image_features(pixels)) @ normalized(scorer.text_features(ids, mask)).T
    )
    ours = scorer.logit_scale * cosine + (scorer.logit_bias or 0.0)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-5)
    if kind == "clip":
        probs = torch.from_numpy(expected).softmax(-1).numpy()
        np.testing.assert_allclose(jax.nn.softmax(ours, axis=-1), probs, atol=1e-5)
    else:
        probs = torch.from_numpy(expected).sigmoid().numpy()
        np.testing.assert_allclose(jax.nn.sigmoid(ours), probs, atol=1e-5)


def test_clip_legacy_eos_pools_at_the_largest_id(tmp_path) -> None:
    # Configs from before transformers corrected eos_token_id (2) pool at argmax(input_ids).
    model = perturbed(transformers.CLIPModel(clip_config(eos_token_id=2)), seed=3)
    model.save_pretrained(tmp_path)
    scorer = scorers.from_hf(tmp_path)
    assert scorer.module.text.pool == "argmax"
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 98, size=(4, TEXT_LEN))
    for i, end in enumerate([2, 9, 15, 0]):
        ids[i, end] = 99  # the largest id, once per row
    np.testing.assert_allclose(
        scorer.text_features(ids), torch_features(model, ids=ids), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_encode_texts_with_the_saved_tokenizer(kind, checkpoints, loaded) -> None:
    path, model = checkpoints[kind]
    scorer = loaded[kind]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    templates = ["{}", "a blurry photo of {}.", "art of the {}"]
    texts = ["cat", "red car on the street", "a lazy brown dog grazing at sunset"]

    expected = []
    for template in templates:
        tokens = tokenizer(
            [template.format(t) for t in texts],
            padding="max_length",
            max_length=TEXT_LEN,
            truncation=True,
            return_tensors="np",
        )
        # SigLIP was trained attending to its padding, so its ids go in without the mask.
        mask = tokens["attention_mask"] if kind == "clip" else None
        expected.append(normalized(torch_features(model, ids=tokens["input_ids"], mask=mask)))
    expected = normalized(np.mean(expected, axis=0))

    ours = scorer.encode_texts(texts, templates=templates)
    assert ours.shape == expected.shape and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(ours, expected, atol=1e-5)
    # The plain path: one template, equal to the normalized text features of the ids.
    tokens = scorer.tokenize(texts)
    assert tokens["input_ids"].shape == (3, TEXT_LEN)
    np.testing.assert_allclose(
        scorer.encode_texts(texts),
        normalized(scorer.text_features(**tokens)),
        atol=1e-5,
    )


def processor_and_pixels(kind, path, images) -> tuple[np.ndarray, np.ndarray]:
    processor = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
    ours = preprocess.load_preprocessing(path, kind, IMAGE_SIZE)
    theirs = np.stack(
        [
            processor(images=image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
            for image in images
        ]
    )
    return theirs, np.stack([ours(image) for image in images])


def random_images(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [(50, 70), (31, 20), (32, 32), (100, 33), (17, 90), (240, 320)]
    return [rng.integers(0, 256, size=(*s, 3), dtype=np.uint8) for s in sizes]


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_preprocessing_matches_the_image_processor(kind, checkpoints) -> None:
    path, _ = checkpoints[kind]
    theirs, ours = processor_and_pixels(kind, path, random_images(4))
    assert theirs.shape == ours.shape == (6, IMAGE_SIZE, IMAGE_SIZE, 3)
    # Both resample the uint8 image with Pillow-style antialiased kernels in fixed point and
    # round to uint8: they may disagree by a level or two on a few pixels, never more.
    std = np.asarray(preprocess.OPENAI_CLIP_STD if kind == "clip" else [0.5] * 3, np.float32)
    levels = np.abs(theirs - ours) * std * 255
    assert levels.max() <= 2 + 1e-3
    assert (levels > 1e-3).mean() < 0.02
    # A size that needs no resampling is exact.
    np.testing.assert_allclose(theirs[2], ours[2], atol=1e-6)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_encode_images_matches_processor_and_model(kind, checkpoints, loaded) -> None:
    path, model = checkpoints[kind]
    scorer = loaded[kind]
    images = random_images(5)
    theirs, ours = processor_and_pixels(kind, path, images)

    embeds = scorer.encode_images(images)
    assert embeds.shape == (6, scorer.dim) and embeds.dtype == np.float32
    # On our own pixels the model is transformers' to float32 rounding.
    np.testing.assert_allclose(embeds, normalized(torch_features(model, ours)), atol=1e-5)
    # Through transformers' processor the inputs differ by <= 2 uint8 levels on < 2% of the
    # pixels (the preprocessing test above is the strict check of resize, crop and
    # normalization); with these models that moves the unit-norm embeddings by 1e-4 to 1.3e-3
    # (measured over seeds), so 5e-3 leaves a margin of about 4.
    np.testing.assert_allclose(embeds, normalized(torch_features(model, theirs)), atol=5e-3)
    # An array of equal-size images is a batch like a list.
    np.testing.assert_allclose(
        scorer.encode_images(np.stack([images[2]] * 5)), np.stack([embeds[2]] * 5), atol=1e-5
    )


def test_batches_compile_once(loaded) -> None:
    scorer = loaded["clip"]
    rng = np.random.default_rng(6)
    pixels = rng.normal(size=(9, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    full = scorer.image_features(pixels)
    compiled = scorer._image_fn._cache_size()
    for n in (1, 4, 5, 9):
        np.testing.assert_allclose(scorer.image_features(pixels[:n]), full[:n], atol=1e-5)
    images = random_images(6)
    np.testing.assert_allclose(
        scorer.encode_images(images),
        normalized(scorer.image_features(np.stack([scorer.preprocess(image) for image in images]))),
        atol=1e-6,
    )
    # Batches of 4 (the last padded) for every count, features and embeddings alike: all on the
    # one compiled shape.
    assert scorer._image_fn._cache_size() == compiled
    # A per-call batch size is one more shape (other GEMM blocking: float32 rounding differs).
    np.testing.assert_allclose(scorer.image_features(pixels, batch_size=2), full, atol=1e-5)
    assert scorer._image_fn._cache_size() == compiled + 1
    assert scorer.encode_images([]).shape == (0, scorer.dim)


def test_bfloat16_compute(checkpoints, loaded) -> None:
    path, _ = checkpoints["clip"]
    scorer = scorers.from_hf(path, dtype=jnp.bfloat16, batch_size=4)
    assert {x.dtype for x in jax.tree.leaves(scorer.variables)} == {jnp.dtype(jnp.float32)}
    images = random_images(7)
    low, high = scorer.encode_images(images), loaded["clip"].encode_images(images)
    assert low.dtype == np.float32
    assert np.min(np.sum(low * high, axis=-1)) > 0.99  # cosine to the float32 embeddings
    assert scorer.identity["dtype"] == "bfloat16" != loaded["clip"].identity["dtype"]


_MESH_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from ood_jax import scorers
    from ood_jax.sharding import make_mesh

    path, vocab = sys.argv[1], int(sys.argv[2])
    assert jax.device_count() == 4
    sharded = scorers.from_hf(path, mesh=make_mesh([("data", -1)]), batch_size=6)
    assert sharded.batch_size == 8  # rounded up to a multiple of the 4 devices
    batch = sharded._put(np.zeros((8, *sharded.image_size, 3), np.float32))
    assert len(batch.sharding.device_set) == 4 and batch.addressable_shards[0].data.shape[0] == 2
    plain = scorers.from_hf(path, batch_size=8)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(40 + i, 36, 3), dtype=np.uint8) for i in range(11)]
    got, expected = sharded.encode_images(images), plain.encode_images(images)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    ids = rng.integers(3, vocab, size=(5, sharded.text_length))
    np.testing.assert_allclose(sharded.text_features(ids), plain.text_features(ids), atol=1e-5)
    print("ok")
    """
)


def check_sharded_over_a_mesh(path, vocab_size: int) -> None:
    """A scorer from `path` on a 4-device data mesh embeds as the unsharded one does. In a child
    process, so that XLA_FLAGS gives it 4 CPU devices before jax starts."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
    }
    result = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, str(path), str(vocab_size)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.slow
def test_batch_sharded_over_a_mesh(checkpoints) -> None:
    check_sharded_over_a_mesh(checkpoints["clip"][0], vocab_size=100)


# --------------------------------------------------------------------------- open_clip


def open_clip_state_dict(model: transformers.CLIPModel) -> dict[str, torch.Tensor]:
    """The open_clip layout of a transformers CLIPModel's weights (the inverse mapping)."""
    sd = model.state_dict()
    out = {"logit_scale": sd["logit_scale"], "attn_mask": torch.ones(TEXT_LEN, TEXT_LEN)}

    def blocks(dst: str, src: str, depth: int) -> None:
        for i in range(depth):
            s, d = f"{src}.encoder.layers.{i}.", f"{dst}.resblocks.{i}."
            for n in ("weight", "bias"):
                out[f"{d}ln_1.{n}"] = sd[f"{s}layer_norm1.{n}"]
                out[f"{d}ln_2.{n}"] = sd[f"{s}layer_norm2.{n}"]
                out[f"{d}attn.in_proj_{n}"] = torch.cat(
                    [sd[f"{s}self_attn.{p}_proj.{n}"] for p in "qkv"]
                )
                out[f"{d}attn.out_proj.{n}"] = sd[f"{s}self_attn.out_proj.{n}"]
                out[f"{d}mlp.c_fc.{n}"] = sd[f"{s}mlp.fc1.{n}"]
                out[f"{d}mlp.c_proj.{n}"] = sd[f"{s}mlp.fc2.{n}"]

    v = "vision_model"
    out["visual.conv1.weight"] = sd[f"{v}.embeddings.patch_embedding.weight"]
    out["visual.class_embedding"] = sd[f"{v}.embeddings.class_embedding"]
    out["visual.positional_embedding"] = sd[f"{v}.embeddings.position_embedding.weight"]
    for n in ("weight", "bias"):
        out[f"visual.ln_pre.{n}"] = sd[f"{v}.pre_layrnorm.{n}"]
        out[f"visual.ln_post.{n}"] = sd[f"{v}.post_layernorm.{n}"]
        out[f"ln_final.{n}"] = sd[f"text_model.final_layer_norm.{n}"]
    blocks("visual.transformer", v, model.config.vision_config.num_hidden_layers)
    out["visual.proj"] = sd["visual_projection.weight"].T
    out["token_embedding.weight"] = sd["text_model.embeddings.token_embedding.weight"]
    out["positional_embedding"] = sd["text_model.embeddings.position_embedding.weight"]
    blocks("transformer", "text_model", model.config.text_config.num_hidden_layers)
    out["text_projection"] = sd["text_projection.weight"].T
    return out


def test_open_clip_converter_matches_transformers(tmp_path) -> None:
    # open_clip's laion models: exact GELU, 64-wide heads, text pooled at the largest id (what
    # transformers does for eos_token_id 2).
    config = transformers.CLIPConfig(
        text_config=dict(
            tower(vocab_size=100, max_position_embeddings=TEXT_LEN, eos_token_id=2),
            hidden_size=128,
            hidden_act="gelu",
        ),
        vision_config=dict(
            tower(image_size=IMAGE_SIZE, patch_size=8), hidden_size=128, hidden_act="gelu"
        ),
        projection_dim=48,
    )
    model = perturbed(transformers.CLIPModel(config), seed=8)
    sd = open_clip_state_dict(model)
    module, variables = convert.clip_from_open_clip(sd, activation="gelu")
    assert module.text.pool == "argmax" and module.image.encoder.num_heads == 2

    rng = np.random.default_rng(8)
    pixels = rng.normal(size=(3, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    ids = rng.integers(3, 98, size=(3, TEXT_LEN))
    ids[np.arange(3), [5, 15, 0]] = 99
    np.testing.assert_allclose(variables["params"]["t"], model.logit_scale.item(), rtol=1e-6)

    # Through a checkpoint file, as a Scorer.
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "open_clip_model.safetensors")
    scorer = scorers.from_open_clip(tmp_path / "open_clip_model.safetensors")
    assert scorer.kind == "clip" and scorer.preprocessing.crop == (IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(
        scorer.image_features(pixels), torch_features(model, pixels), atol=1e-4, rtol=0
    )
    np.testing.assert_allclose(
        scorer.text_features(ids), torch_features(model, ids=ids), atol=1e-4, rtol=0
    )

    with pytest.raises(ValueError, match=r"unused source key 'visual\.attn_pool\.probe'"):
        convert.clip_from_open_clip({**sd, "visual.attn_pool.probe": torch.zeros(1, 128)})
    missing = {k: v for k, v in sd.items() if k != "transformer.resblocks.1.ln_2.bias"}
    with pytest.raises(ValueError, match=r"unfilled target param 'text/block_1/norm2/bias'"):
        convert.clip_from_open_clip(missing)


# --------------------------------------------------------------------------- bad inputs


def test_bad_checkpoints_raise_naming_the_file_or_field(tmp_path, checkpoints) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        scorers.from_hf(tmp_path)

    def with_config(name: str, **changes) -> Path:
        src = checkpoints["clip"][0]
        dst = tmp_path / name
        dst.mkdir()
        config = json.loads((src / "config.json").read_text())
        for key, value in changes.items():
            section, _, field = key.rpartition("__")
            (config[section] if section else config)[field] = value
        (dst / "config.json").write_text(json.dumps(config))
        (dst / "model.safetensors").symlink_to(src / "model.safetensors")
        return dst

    with pytest.raises(ValueError, match=r"config.json: unknown model_type 'blip_2'"):
        scorers.from_hf(with_config("blip", model_type="blip_2"))
    with pytest.raises(ValueError, match=r"text_config.hidden_act='relu'"):
        scorers.from_hf(with_config("relu", text_config__hidden_act="relu"))
    with pytest.raises(ValueError, match=r"'text/proj/kernel' from 'text_projection.weight'"):
        scorers.from_hf(with_config("proj", projection_dim=40))

    # Weights without a tokenizer: features work, encode_texts names the missing files.
    bare = with_config("bare")
    scorer = scorers.from_hf(bare)
    assert scorer.text_features(np.ones((2, TEXT_LEN), np.int32)).shape == (2, 48)
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json / tokenizer_config.json"):
        scorer.encode_texts(["a cat"])
    # No preprocessor_config.json: CLIP's processor defaults at the model's image size.
    assert scorer.preprocessing == preprocess.ImagePreprocessing(
        shortest_edge=IMAGE_SIZE,
        crop=(IMAGE_SIZE, IMAGE_SIZE),
        mean=preprocess.OPENAI_CLIP_MEAN,
        std=preprocess.OPENAI_CLIP_STD,
    )
    (bare / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        scorers.from_hf(bare)

    with pytest.raises(ValueError, match="preprocessor_config.json: size="):
        preprocess.preprocessing_from_config({"size": {"longest_edge": 3}}, "clip", 32)
    with pytest.raises(ValueError, match="image 1: expected a uint8 image"):
        scorer.encode_images([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.float32)])
    with pytest.raises(ValueError, match="pixels are 16x16; the model takes 32x32"):
        scorer.image_features(np.zeros((1, 16, 16, 3), np.float32))
    with pytest.raises(TypeError, match="sequence of strings"):
        loaded_clip = scorers.from_hf(checkpoints["clip"][0])
        loaded_clip.encode_texts("a cat")
    with pytest.raises(ValueError, match="has no '{}'"):
        loaded_clip.encode_texts(["cat"], templates=["a photo"])
