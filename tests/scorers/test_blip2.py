"""BLIP-2 against transformers' PyTorch Blip2ForImageTextRetrieval.

Two small random-weight models (32px images; Q-Formers cross-attending in every layer and in
every other one, other activations and epsilons, one with `image_token_index` set) are saved with
save_pretrained and loaded back through `convert_blip2.blip2_from_hf`, then compared in float32 on
random pixels and padded token ids: ITC logits and embeddings, the unnormalized features, and the
ITM logits.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_scorers import perturbed, random_ids

from ood_jax.scorers import convert_blip2, preprocess

IMAGE_SIZE = 32
ATOL = 1e-4
IMAGE_TOKEN = 99


def every_layer() -> transformers.Blip2Config:
    return transformers.Blip2Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=8,
        ),
        qformer_config=dict(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=24,
            cross_attention_frequency=1,
            use_qformer_text_input=True,
        ),
        num_query_tokens=4,
        image_text_hidden_size=16,
    )


def every_other_layer() -> transformers.Blip2Config:
    # Another activation in each tower, other epsilons, and image tokens that transformers strips
    # from the front of the text.
    return transformers.Blip2Config(
        vision_config=dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=IMAGE_SIZE,
            patch_size=4,
            hidden_act="quick_gelu",
            layer_norm_eps=1e-5,
        ),
        qformer_config=dict(
            vocab_size=100,
            hidden_size=40,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=56,
            max_position_embeddings=40,
            cross_attention_frequency=2,
            hidden_act="gelu_new",
            layer_norm_eps=1e-7,
            use_qformer_text_input=True,
        ),
        num_query_tokens=8,
        image_text_hidden_size=24,
        image_token_index=IMAGE_TOKEN,
    )


CONFIGS = {"every_layer": every_layer, "every_other_layer": every_other_layer}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("blip2")
    out = {}
    for seed, (name, make) in enumerate(CONFIGS.items()):
        model = perturbed(transformers.Blip2ForImageTextRetrieval(make()), seed)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


@pytest.fixture(scope="module")
def converted(checkpoints) -> dict:
    return {name: convert_blip2.blip2_from_hf(path) for name, (path, _) in checkpoints.items()}


def inputs(n_images: int, ends: list[int], seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    pixels = rng.normal(size=(n_images, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    ids, mask = random_ids(rng, ends, eos=0)
    return pixels, ids, mask


def torch_text(model, ids: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' processor would give the model: with `image_token_index` set, the
    query tokens' placeholders in front of the text."""
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    if model.config.image_token_index is None:
        return ids, mask
    q = model.config.num_query_tokens
    ids = torch.cat([torch.full((len(ids), q), IMAGE_TOKEN), ids], dim=1)
    return ids, torch.cat([torch.ones((len(mask), q), dtype=mask.dtype), mask], dim=1)


def reference(model, pixels: np.ndarray, ids: np.ndarray, mask: np.ndarray, itm: bool) -> dict:
    images = torch.from_numpy(pixels.transpose(0, 3, 1, 2))
    text_ids, text_mask = torch_text(model, ids, mask)
    with torch.no_grad():
        out = model(images, text_ids, text_mask, use_image_text_matching_head=itm)
        if itm:
            return {"itm_logits": out.logits_per_image.numpy()}
        # The unnormalized features, as the ITC branch computes them before normalizing.
        states = model.vision_model(images).last_hidden_state
        queries = model.query_tokens.expand(len(states), -1, -1)
        image = model.qformer(query_embeds=queries, encoder_hidden_states=states)
        ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
        text = model.qformer(
            query_embeds=model.embeddings(input_ids=ids), query_length=0, attention_mask=mask
        )
    return {
        "logits_per_image": out.logits_per_image.numpy(),
        "image_embeds": out.image_embeds.numpy(),
        "text_embeds": out.text_embeds.numpy(),
        "image_features": model.vision_projection(image.last_hidden_state).detach().numpy(),
        "text_features": model.text_projection(text.last_hidden_state[:, 0]).detach().numpy(),
    }


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def method(module, name: str):
    return jax.jit(functools.partial(module.apply, method=getattr(module, name)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_itc_matches_transformers(name, checkpoints, converted) -> None:
    _, model = checkpoints[name]
    kind, module, variables, config = converted[name]
    assert kind == "blip2" and config["model_type"] == "blip-2"
    assert module.image_size == (IMAGE_SIZE, IMAGE_SIZE)
    assert module.text_length == min(32, model.config.qformer_config.max_position_embeddings)
    # Three images against five texts, four of them padded.
    pixels, ids, mask = inputs(3, [3, 15, 7, 1, 10], seed=7)
    expected = reference(model, pixels, ids, mask, itm=False)

    out = jax.jit(module.apply)(variables, pixels, ids, mask)
    for key in ("logits_per_image", "image_embeds", "text_embeds"):
        assert out[key].shape == expected[key].shape, key
        assert max_diff(out[key], expected[key]) < ATOL, key
    image = method(module, "image_features")(variables, pixels)
    text = method(module, "text_features")(variables, ids, mask)
    assert image.shape == (3, module.num_query_tokens, module.proj_dim)
    assert max_diff(image, expected["image_features"]) < ATOL
    assert max_diff(text, expected["text_features"]) < ATOL
    # Padding is masked: a padded row scores as its unpadded text.
    alone = method(module, "text_features")(variables, ids[2:3, :8], mask[2:3, :8])
    assert max_diff(alone[0], text[2]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_itm_matches_transformers(name, checkpoints, converted) -> None:
    _, model = checkpoints[name]
    _, module, variables, _ = converted[name]
    pixels, ids, mask = inputs(4, [15, 2, 9, 5], seed=8)
    expected = reference(model, pixels, ids, mask, itm=True)

    states = method(module, "vision_states")(variables, pixels)
    grid = IMAGE_SIZE // module.vision.patch_size
    assert states.shape == (4, 1 + grid * grid, module.vision.width)
    logits = method(module, "itm_logits")(variables, states, ids, mask)
    assert logits.shape == (4, 2) and logits.dtype == jnp.float32
    assert max_diff(logits, expected["itm_logits"]) < ATOL


@pytest.mark.slow
def test_bfloat16_image_encoder(checkpoints, converted) -> None:
    path, _ = checkpoints["every_other_layer"]
    _, module, variables, _ = converted["every_other_layer"]
    _, low, _, _ = convert_blip2.blip2_from_hf(path, jnp.bfloat16)
    assert low.dtype == jnp.bfloat16 and low.qformer.dtype == jnp.float32
    pixels, ids, mask = inputs(2, [5, 12], seed=9)
    full = jax.jit(module.apply)(variables, pixels, ids, mask)
    half = jax.jit(low.apply)(variables, pixels, ids, mask)
    for key in ("image_embeds", "text_embeds", "logits_per_image"):
        assert half[key].dtype == jnp.float32
        assert max_diff(full[key], half[key]) < 5e-2, key
    states = method(low, "vision_states")(variables, pixels)
    itm = method(low, "itm_logits")(variables, states, ids, mask)
    assert np.isfinite(np.asarray(itm)).all()


def test_images_must_have_the_trained_size(converted) -> None:
    _, module, variables, _ = converted["every_layer"]
    pixels = np.zeros((1, 48, 48, 3), np.float32)
    with pytest.raises(ValueError, match="learned for 4x4"):
        module.apply(variables, pixels, method=module.image_features)


def state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_bad_checkpoints_raise_naming_the_field_or_tensor(checkpoints, converted) -> None:
    _, model = checkpoints["every_layer"]
    _, module, _, _ = converted["every_layer"]
    state = state_dict(model)
    missing = "qformer.encoder.layer.1.crossattention.output.LayerNorm.weight"
    broken = {k: v for k, v in state.items() if k != missing}
    with pytest.raises(
        ValueError, match="unfilled target param 'qformer/layer_1/cross_attention_norm/scale'"
    ):
        convert_blip2.blip2_params_from_hf(broken, module)
    extra = {**state, "qformer.encoder.layer.0.extra.weight": np.zeros(3, np.float32)}
    with pytest.raises(
        ValueError, match="unused source key 'qformer.encoder.layer.0.extra.weight'"
    ):
        convert_blip2.blip2_params_from_hf(extra, module)
    wrong = {**state, "query_tokens": np.zeros((1, 5, 32), np.float32)}
    with pytest.raises(ValueError, match=r"'query_tokens' from 'query_tokens': shape \(1, 5, 32\)"):
        convert_blip2.blip2_params_from_hf(wrong, module)

    config = every_layer().to_dict()
    with pytest.raises(ValueError, match="use_qformer_text_input=False"):
        convert_blip2.blip2_module({**config, "qformer_config": {"hidden_size": 32}})
    with pytest.raises(ValueError, match="model_type='clip': expected 'blip-2'"):
        convert_blip2.blip2_module({"model_type": "clip"})
    no_bias = {**config, "vision_config": {**config["vision_config"], "qkv_bias": False}}
    with pytest.raises(ValueError, match="vision_config.qkv_bias=False"):
        convert_blip2.blip2_module(no_bias)


def test_a_captioning_checkpoint_is_refused(tmp_path) -> None:
    config = every_layer()
    config.text_config = transformers.OPTConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=1,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
    )
    transformers.Blip2ForConditionalGeneration(config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "blip-2"
    with pytest.raises(
        ValueError,
        match=r"config.json: architectures=\['Blip2ForConditionalGeneration'\]: only "
        "Blip2ForImageTextRetrieval",
    ):
        convert_blip2.blip2_from_hf(tmp_path)


def lavis_state_dict(model) -> dict[str, np.ndarray]:
    """The model's tensors under LAVIS' names (the inverse of `convert_blip2.LAVIS_RENAMES`),
    with EVA's separate q / v biases, the ITC temperature and the captioning head LAVIS has."""
    out = {"temp": np.float32(0.07), "Qformer.cls.predictions.bias": np.zeros(100, np.float32)}
    vision = {
        "layer_norm1": "norm1",
        "layer_norm2": "norm2",
        "self_attn.projection": "attn.proj",
        "self_attn.qkv": "attn.qkv",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
    }
    renames = {
        "vision_model.embeddings.class_embedding": "visual_encoder.cls_token",
        "vision_model.embeddings.position_embedding": "visual_encoder.pos_embed",
        "vision_model.embeddings.patch_embedding.": "visual_encoder.patch_embed.proj.",
        "vision_model.post_layernorm.": "ln_vision.",
        "qformer.layernorm.": "Qformer.bert.embeddings.LayerNorm.",
        "embeddings.": "Qformer.bert.embeddings.",
        "vision_projection.": "vision_proj.",
        "text_projection.": "text_proj.",
    }
    for key, value in state_dict(model).items():
        if key.startswith("vision_model.encoder.layers."):
            i, rest = key.removeprefix("vision_model.encoder.layers.").split(".", 1)
            module, tensor = rest.rsplit(".", 1)
            key = f"visual_encoder.blocks.{i}.{vision[module]}.{tensor}"
            if key.endswith("attn.qkv.bias"):
                q, _, v = np.split(value, 3)
                out[key.replace("qkv.bias", "q_bias")] = q
                out[key.replace("qkv.bias", "v_bias")] = v
                continue
        elif key.startswith("qformer.encoder."):
            key = "Qformer.bert.encoder." + key.removeprefix("qformer.encoder.")
            key = key.replace("attention.attention.", "attention.self.")
        else:
            for hf, lavis in renames.items():
                if key.startswith(hf):
                    key = lavis + key.removeprefix(hf)
                    break
        out[key] = value
    return out


@pytest.mark.slow
def test_lavis_checkpoints_load_as_transformers_does(checkpoints, converted) -> None:
    _, model = checkpoints["every_other_layer"]
    _, module, _, _ = converted["every_other_layer"]
    state = state_dict(model)
    for key in [k for k in state if k.endswith("self_attn.qkv.bias")]:
        third = len(state[key]) // 3  # LAVIS has no key bias: transformers' zero
        state[key] = np.concatenate(
            [state[key][:third], 0 * state[key][third:-third], state[key][-third:]]
        )
    expected = convert_blip2.blip2_params_from_hf(state, module)

    lavis = lavis_state_dict(model)
    renamed, temp = convert_blip2.hf_state_dict_from_lavis(lavis)
    assert temp == pytest.approx(0.07)
    assert sorted(renamed) == sorted(state)
    _, variables, temp = convert_blip2.blip2_from_lavis(lavis, model.config.to_dict())
    assert temp == pytest.approx(0.07)
    flat = jax.tree_util.tree_leaves_with_path(expected)
    ours = dict(jax.tree_util.tree_leaves_with_path(variables))
    for path, value in flat:
        np.testing.assert_array_equal(ours[path], value, err_msg=jax.tree_util.keystr(path))

    unknown = {**lavis, "visual_encoder.blocks.0.gamma_1": np.ones(48, np.float32)}
    with pytest.raises(ValueError, match="unused source key 'visual_encoder.blocks.0.gamma_1'"):
        convert_blip2.blip2_from_lavis(unknown, model.config.to_dict())


def test_preprocessing_is_blip_image_processor(tmp_path) -> None:
    processor = transformers.BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(tmp_path)
    ours = preprocess.load_preprocessing(tmp_path, "blip2", IMAGE_SIZE)
    assert ours == preprocess.preprocessing_from_config({}, "blip2", IMAGE_SIZE)
    assert ours.crop is None and ours.output_size == (IMAGE_SIZE, IMAGE_SIZE)
    assert ours.mean == preprocess.OPENAI_CLIP_MEAN
    # An image of the model's size is not resampled: the two agree exactly.
    image = np.random.default_rng(10).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    theirs = processor(images=image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    np.testing.assert_allclose(ours(image), theirs, atol=1e-6)


# --------------------------------------------------------------------------- the scorer

WORDS = "a photo of the cat dog bus person kite pizza bench on in red two".split()


def save_bert_tokenizer(path) -> None:
    """A tiny WordPiece tokenizer (BLIP-2's is bert-base-uncased) in the checkpoint directory."""
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "."]))
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(path)


@pytest.fixture(scope="module")
def blip2_scorer(checkpoints):
    from ood_jax import scorers

    path, model = checkpoints["every_layer"]
    save_bert_tokenizer(path)
    transformers.BlipImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(path)
    return scorers.from_hf(path, batch_size=2), model


@pytest.mark.slow
def test_scorer_embeds_and_matches_as_transformers(blip2_scorer) -> None:
    scorer, model = blip2_scorer
    assert scorer.kind == "blip2" and scorer.logit_scale is None  # transformers drops the temp
    assert scorer.image_embedding_shape == (model.config.num_query_tokens, 16)
    rng = np.random.default_rng(11)
    images = [rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8) for _ in range(5)]
    texts = ["a photo of a cat.", "two red bus on the bench", "kite", "a dog in a pizza"]
    pixels = np.stack([scorer.preprocess(image) for image in images])
    tokens = scorer.tokenizer(
        texts, padding="max_length", max_length=scorer.text_length, return_tensors="np"
    )
    expected = reference(
        model, pixels, tokens["input_ids"], tokens["attention_mask"], itm=False
    )  # fmt: skip
    # Five images in batches of two: the last one padded.
    assert max_diff(scorer.encode_images(images), expected["image_embeds"]) < ATOL
    assert max_diff(scorer.encode_texts(texts), expected["text_embeds"]) < ATOL

    image_rows, text_rows = np.array([4, 0, 2, 0, 3, 4, 1]), np.array([0, 1, 3, 3, 2, 2, 0])
    got = scorer.match_probabilities(images, texts, image_rows, text_rows)
    ids, mask = tokens["input_ids"][text_rows], tokens["attention_mask"][text_rows]
    logits = reference(model, pixels[image_rows], ids, mask, itm=True)["itm_logits"]
    want = torch.softmax(torch.from_numpy(logits), dim=-1)[:, 1].numpy()
    assert max_diff(got, want) < ATOL
    with pytest.raises(ValueError, match=r"text_rows\[1\] = 4 is outside \[0, 4\)"):
        scorer.match_probabilities(images, texts, [0, 1], [0, 4])


@pytest.mark.slow
def test_scorer_from_lavis_keeps_the_temperature(tmp_path, blip2_scorer) -> None:
    from ood_jax import scorers

    scorer, model = blip2_scorer
    lavis = {k: torch.as_tensor(v) for k, v in lavis_state_dict(model).items()}
    torch.save({"model": lavis}, tmp_path / "blip2_pretrained.pth")
    from_lavis = scorers.from_lavis(tmp_path / "blip2_pretrained.pth", scorer.tokenizer_dir)
    assert from_lavis.kind == "blip2"
    assert from_lavis.logit_scale == pytest.approx(1 / 0.07, rel=1e-6)
    assert from_lavis.identity["lavis_checkpoint"].endswith("blip2_pretrained.pth")
    texts = ["a cat", "a dog on a bench"]
    assert max_diff(from_lavis.encode_texts(texts), scorer.encode_texts(texts)) < 1e-6


@pytest.mark.slow
def test_scorer_batch_sharded_over_a_mesh(blip2_scorer) -> None:
    from test_scorers import check_sharded_over_a_mesh

    check_sharded_over_a_mesh(blip2_scorer[0].tokenizer_dir, vocab_size=100)
