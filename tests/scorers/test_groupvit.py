"""GroupViT against transformers' PyTorch GroupViTModel.

Two small random-weight models (32px images; three stages with a group projector, and two stages
ending without group tokens) are saved with save_pretrained and loaded back through
`convert_groupvit.groupvit_from_hf`, then compared in float32 on random pixels and token ids.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_scorers import check_sharded_over_a_mesh, perturbed, random_ids
from transformers.models.groupvit import modeling_groupvit

from ood_jax.scorers import convert_groupvit, groupvit, preprocess, scorer

IMAGE_SIZE = 32
TEXT_LEN = 16
ATOL = 1e-4


def three_stages() -> transformers.GroupViTConfig:
    return transformers.GroupViTConfig(
        text_config=dict(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TEXT_LEN,
            eos_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            depths=[1, 1, 1],
            num_hidden_layers=3,
            num_group_tokens=[8, 4, 0],
            num_output_groups=[8, 4, 4],
            image_size=IMAGE_SIZE,
            patch_size=4,
        ),
        projection_dim=24,
        projection_intermediate_dim=48,
    )


def two_stages() -> transformers.GroupViTConfig:
    # Another activation, assign_mlp_ratio and assign_eps, and the legacy eos_token_id 2 that
    # pools text at the largest token id.
    return transformers.GroupViTConfig(
        text_config=dict(
            vocab_size=100,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=TEXT_LEN,
            eos_token_id=2,
        ),
        vision_config=dict(
            hidden_size=48,
            intermediate_size=80,
            num_attention_heads=4,
            depths=[2, 1],
            num_hidden_layers=3,
            num_group_tokens=[6, 0],
            num_output_groups=[3, 3],
            image_size=IMAGE_SIZE,
            patch_size=8,
            hidden_act="quick_gelu",
            assign_mlp_ratio=[1, 2],
            assign_eps=0.5,
        ),
        projection_dim=16,
        projection_intermediate_dim=32,
    )


CONFIGS = {"three_stages": three_stages, "two_stages": two_stages}


def save(path, config: transformers.GroupViTConfig, seed: int) -> torch.nn.Module:
    model = perturbed(transformers.GroupViTModel(config), seed)
    # Buffers are not parameters: give the heads' BatchNorms statistics of their own too.
    with torch.no_grad():
        for bn in (model.visual_projection[1], model.text_projection[1]):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    model.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=[0.485, 0.456, 0.406],  # GroupViT's checkpoints use ImageNet statistics
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("groupvit")
    return {
        name: (root / name, save(root / name, make(), seed))
        for seed, (name, make) in enumerate(CONFIGS.items())
    }


def token_ids(name: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = random_ids(rng, [3, 15, 7, 1, 10], eos=1)
    if name == "two_stages":  # legacy pooling: one largest id per row, at its end token
        ids = np.where(ids == 99, 98, ids)
        ids[np.arange(len(ids)), mask.sum(-1) - 1] = 99
    return ids, mask


def reference(model, pixels: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> dict:
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            pixel_values=torch.from_numpy(pixels.transpose(0, 3, 1, 2)),
        )
        image = model.get_image_features(torch.from_numpy(pixels.transpose(0, 3, 1, 2)))
        text = model.get_text_features(torch.from_numpy(ids), torch.from_numpy(mask))
    return {
        "image_embeds": out.image_embeds.numpy(),
        "text_embeds": out.text_embeds.numpy(),
        "logits_per_image": out.logits_per_image.numpy(),
        "image_features": image.pooler_output.numpy(),
        "text_features": text.pooler_output.numpy(),
    }


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(name, checkpoints) -> None:
    path, model = checkpoints[name]
    kind, module, variables, config = convert_groupvit.groupvit_from_hf(path)
    assert kind == "groupvit" and config["model_type"] == "groupvit"
    assert module.text.pool == ("argmax" if name == "two_stages" else "eos")
    rng = np.random.default_rng(7)
    pixels = rng.normal(size=(3, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    ids, mask = token_ids(name, rng)
    expected = reference(model, pixels, ids, mask)

    out = jax.jit(module.apply)(variables, pixels, ids, mask)
    for key in ("image_embeds", "text_embeds", "logits_per_image"):
        assert out[key].shape == expected[key].shape
        assert max_diff(out[key], expected[key]) < ATOL, key
    image = jax.jit(functools.partial(module.apply, method=module.image_features))(
        variables, pixels
    )
    text = jax.jit(functools.partial(module.apply, method=module.text_features))(
        variables, ids, mask
    )
    assert max_diff(image, expected["image_features"]) < ATOL
    assert max_diff(text, expected["text_features"]) < ATOL


def test_hard_assignment_is_transformers_hard_softmax() -> None:
    logits = np.random.default_rng(0).normal(size=(2, 5, 7)).astype(np.float32)
    cotangent = np.random.default_rng(1).normal(size=logits.shape).astype(np.float32)
    theirs = torch.from_numpy(logits).requires_grad_()
    value = modeling_groupvit.hard_softmax(theirs, dim=-2)
    (value * torch.from_numpy(cotangent)).sum().backward()

    ours, vjp = jax.vjp(lambda x: groupvit.hard_softmax(x, axis=-2), jnp.asarray(logits))
    # One group per token (a one-hot over axis -2), with the softmax's gradient.
    np.testing.assert_array_equal(np.asarray(ours).round(), value.detach().numpy().round())
    np.testing.assert_allclose(np.asarray(ours).sum(-2), 1.0, atol=1e-6)
    assert set(np.unique(np.asarray(ours).round())) == {0.0, 1.0}
    assert max_diff(vjp(jnp.asarray(cotangent))[0], theirs.grad.numpy()) < 1e-6


@pytest.mark.slow
def test_a_scorer_over_the_module(checkpoints) -> None:
    path, model = checkpoints["three_stages"]
    _, module, variables, _ = convert_groupvit.groupvit_from_hf(path)
    s = scorer.from_hf(path, batch_size=2)
    assert s.kind == "groupvit"
    assert s.image_size == (IMAGE_SIZE, IMAGE_SIZE) and s.text_length == TEXT_LEN
    np.testing.assert_allclose(s.logit_scale, model.logit_scale.exp().item(), rtol=1e-6)
    rng = np.random.default_rng(8)
    images = [rng.integers(0, 256, size=(40, 50, 3), dtype=np.uint8) for _ in range(5)]
    pixels = np.stack([s.preprocess(image) for image in images])
    ids, mask = token_ids("three_stages", rng)
    expected = reference(model, pixels, ids, mask)
    # Five rows in batches of two: the last one padded.
    assert max_diff(s.image_features(pixels), expected["image_features"]) < ATOL
    assert max_diff(s.text_features(ids, mask), expected["text_features"]) < ATOL
    assert max_diff(s.encode_images(images), expected["image_embeds"]) < ATOL


@pytest.mark.slow
def test_batch_sharded_over_a_mesh(checkpoints) -> None:
    # The grouping stages' token mixing and hard assignment stay per image under a data mesh.
    check_sharded_over_a_mesh(checkpoints["three_stages"][0], vocab_size=99)


def test_preprocessing_is_the_saved_clip_image_processor(checkpoints) -> None:
    path, _ = checkpoints["two_stages"]
    processor = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
    ours = preprocess.load_preprocessing(path, "groupvit", IMAGE_SIZE)
    assert ours.mean == (0.485, 0.456, 0.406) and ours.output_size == (IMAGE_SIZE, IMAGE_SIZE)
    # An image of the model's size is neither resampled nor cropped: the two agree exactly.
    image = np.random.default_rng(10).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    theirs = processor(images=image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    np.testing.assert_allclose(ours(image), theirs, atol=1e-6)
    # Without the file, CLIPImageProcessor's defaults.
    defaults = preprocess.preprocessing_from_config({}, "groupvit", IMAGE_SIZE)
    assert defaults == preprocess.preprocessing_from_config({}, "clip", IMAGE_SIZE)


@pytest.mark.slow
def test_bfloat16_compute(checkpoints) -> None:
    path, _ = checkpoints["three_stages"]
    _, module, variables, _ = convert_groupvit.groupvit_from_hf(path)
    _, low, _, _ = convert_groupvit.groupvit_from_hf(path, jnp.bfloat16)
    rng = np.random.default_rng(9)
    pixels = rng.normal(size=(4, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    ids, mask = token_ids("three_stages", rng)
    full = jax.jit(module.apply)(variables, pixels, ids, mask)
    half = jax.jit(low.apply)(variables, pixels, ids, mask)
    for key in ("image_embeds", "text_embeds"):
        assert half[key].dtype == jnp.float32
        cosine = np.sum(np.asarray(full[key]) * np.asarray(half[key]), axis=-1)
        assert cosine.min() > 0.999, key


@pytest.mark.slow
def test_bad_checkpoints_raise_naming_the_field_or_tensor(tmp_path, checkpoints) -> None:
    config = three_stages().to_dict()
    config["vision_config"]["num_output_groups"] = [6, 4, 4]
    with pytest.raises(ValueError, match=r"num_group_tokens\[0\]=8 must equal num_output_groups"):
        convert_groupvit.groupvit_module(config)
    with pytest.raises(ValueError, match="model_type 'clip'"):
        convert_groupvit.groupvit_module({"model_type": "clip"})

    path, model = checkpoints["three_stages"]
    _, module, _, _ = convert_groupvit.groupvit_from_hf(path)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    missing = {
        "vision_model.encoder.stages.1.group_projector.1.fc1.weight": (
            "unfilled target param 'image/encoder/stage_1/group_projector/fc1/kernel'"
        ),
        "text_projection.1.running_var": r"unfilled \['text_head/bn/var'\]",
    }
    for key, message in missing.items():
        broken = {k: v for k, v in state.items() if k != key}
        with pytest.raises(ValueError, match=message):
            convert_groupvit.groupvit_params_from_hf(broken, module)
    extra = {**state, "vision_model.encoder.stages.0.extra.weight": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="unused source key 'vision_model.encoder.stages.0.extra"):
        convert_groupvit.groupvit_params_from_hf(extra, module)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "groupvit"}))
    with pytest.raises(FileNotFoundError):
        convert_groupvit.groupvit_from_hf(tmp_path)
