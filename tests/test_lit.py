"""LiT `.npz` checkpoints through `convert_lit`, against a numpy forward of the published model.

Two tiny random-weight models are written in the published key layouts (`convert_lit` docstring):
  * "l16s": vit_jax's, as the LiT-L16S / L16Ti files: the tree at the root, pre-Linen submodule
    numbering, the image position embedding in `Transformer/posembed_input` with the class
    token's row first, no image head;
  * "b16b": big_vision's: the tree under "params/" next to optimizer state, Linen numbering,
    scanned (depth-stacked) encoder blocks, an image position embedding without a class-token row,
    an image head and a bfloat16 tensor stored as 2-byte void.
The reference forward (`lit_reference`) follows big_vision's vit.py, text_transformer.py and
two_towers.py step by step in float64 numpy, on the parameter tree as each codebase defines it.
The tokenizer is checked on a sentencepiece model trained here against big_vision's
`tokenize(eos="sticky", pad_value=eos)` rule.
"""

import functools
import math

import jax
import numpy as np
import pytest
import sentencepiece

from ood_jax.scorers import convert_lit

ATOL = 1e-5
TEXT_LEN = 16
SPM_VOCAB = 40

ARCHS = {
    "l16s": {
        "image": dict(width=32, depth=2, heads=2, mlp=64, patch=8, size=32, head=None),
        "text": dict(vocab=64, width=24, depth=2, heads=3, mlp=48, out=32),
        "layout": "vit_jax",
    },
    "b16b": {
        "image": dict(width=32, depth=1, heads=4, mlp=48, patch=16, size=32, head=20),
        "text": dict(vocab=64, width=40, depth=3, heads=2, mlp=80, out=20),
        "layout": "big_vision",
    },
}

# --------------------------------------------------------------------------- checkpoints


def _dense(rng, shape, out_dims=1) -> dict:
    """kernel `shape`, bias over its last `out_dims` axes (flax DenseGeneral)."""
    bias = rng.normal(0, 0.1, shape[-out_dims:])
    return {"kernel": rng.normal(0, 0.2, shape), "bias": bias}


def _norm(rng, d) -> dict:
    return {"scale": 1 + rng.normal(0, 0.1, d), "bias": rng.normal(0, 0.1, d)}


def _block(rng, d, heads, mlp) -> dict:
    """One Linen-named encoderblock: attention kernels are [D, heads, head_dim]."""
    hd = d // heads
    attn = {n: _dense(rng, (d, heads, hd), 2) for n in ("query", "key", "value")}
    attn["out"] = {"kernel": rng.normal(0, 0.2, (heads, hd, d)), "bias": rng.normal(0, 0.1, d)}
    return {
        "LayerNorm_0": _norm(rng, d),
        "MultiHeadDotProductAttention_0": attn,
        "LayerNorm_1": _norm(rng, d),
        "MlpBlock_0": {"Dense_0": _dense(rng, (d, mlp)), "Dense_1": _dense(rng, (mlp, d))},
    }


def lit_tree(arch: dict, seed: int) -> dict:
    """Random LiT parameters, Linen-named, unstacked; the image pos embedding as `arch`'s
    codebase defines it (vit_jax: [1, 1 + N, D], big_vision: [1, N, D])."""
    rng = np.random.default_rng(seed)
    im, tx = arch["image"], arch["text"]
    d, p, n = im["width"], im["patch"], (im["size"] // im["patch"]) ** 2
    rows = n + (arch["layout"] == "vit_jax")
    img = {
        "embedding": _dense(rng, (p, p, 3, d)),
        "cls": rng.normal(0, 0.5, (1, 1, d)),
        "pos_embedding": rng.normal(0, 0.5, (1, rows, d)),
        "blocks": [_block(rng, d, im["heads"], im["mlp"]) for _ in range(im["depth"])],
        "encoder_norm": _norm(rng, d),
    }
    if im["head"]:
        img["head"] = _dense(rng, (d, im["head"]))
    w = tx["width"]
    txt = {
        "Embed_0": {"embedding": rng.normal(0, 0.5, (tx["vocab"], w))},
        "pos_embedding": rng.normal(0, 0.5, (1, TEXT_LEN, w)),
        "blocks": [_block(rng, w, tx["heads"], tx["mlp"]) for _ in range(tx["depth"])],
        "encoder_norm": _norm(rng, w),
        "head": _dense(rng, (w, tx["out"])),
    }
    return {"img": img, "txt": txt, "t": np.array([rng.normal(1.5, 0.3)])}


PRE_LINEN = {  # Linen name -> vit_jax's pre-Linen one (one counter per parent module)
    "LayerNorm_0": "LayerNorm_0",
    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
    "LayerNorm_1": "LayerNorm_2",
    "MlpBlock_0": "MlpBlock_3",
}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v, np.float32)
    return out


def _blocks(blocks: list, layout: str) -> dict:
    if layout == "vit_jax":
        return {
            f"encoderblock_{i}": {PRE_LINEN[k]: v for k, v in b.items()}
            for i, b in enumerate(blocks)
        }
    return {"encoderblock": jax.tree.map(lambda *a: np.stack(a), *blocks)}


def published(tree: dict, layout: str) -> dict[str, np.ndarray]:
    """`lit_tree` as the npz keys and arrays of a checkpoint in `layout`."""
    img, txt = tree["img"], tree["txt"]
    transformer = {**_blocks(img["blocks"], layout), "encoder_norm": img["encoder_norm"]}
    image = {k: img[k] for k in ("embedding", "cls") if k in img}
    image |= {"head": img["head"]} if "head" in img else {}
    if layout == "vit_jax":
        transformer["posembed_input"] = {"pos_embedding": img["pos_embedding"]}
    else:
        image["pos_embedding"] = img["pos_embedding"]
    encoder = {**_blocks(txt["blocks"], layout), "encoder_norm": txt["encoder_norm"]}
    text = {"Embed_0": txt["Embed_0"], "pos_embedding": txt["pos_embedding"], "head": txt["head"]}
    params = {"img": {**image, "Transformer": transformer}, "txt": {**text, "Encoder_0": encoder}}
    flat = _flatten({**params, "t": tree["t"]})
    if layout == "vit_jax":
        return flat
    flat = {f"params/{k}": v for k, v in flat.items()}
    # big_vision stores bfloat16 as 2-byte void; the optimizer state is not part of the model.
    cls = flat["params/img/cls"].astype(jax.numpy.bfloat16)
    flat["params/img/cls"] = cls.view(np.dtype("V2"))
    flat["opt/state/mu/img/cls"] = np.zeros((1, 1, 32), np.float32)
    return flat


def bf16_rounded(tree: dict, layout: str) -> dict:
    if layout == "big_vision":
        tree["img"]["cls"] = np.asarray(
            tree["img"]["cls"].astype(np.float32).astype(jax.numpy.bfloat16), np.float64
        )
    return tree


# --------------------------------------------------------------------------- reference


def layer_norm(x, p, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def gelu(x):  # flax.linen.gelu's default, the tanh approximation
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def dense(x, p):
    return x @ p["kernel"] + p["bias"]


def self_attention(x, p):
    q, k, v = (
        np.einsum("bld,dhk->blhk", x, p[n]["kernel"]) + p[n]["bias"]
        for n in ("query", "key", "value")
    )
    logits = np.einsum("bqhk,bshk->bhqs", q / math.sqrt(q.shape[-1]), k)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhqs,bshk->bqhk", w, v)
    return np.einsum("bqhk,hkd->bqd", o, p["out"]["kernel"]) + p["out"]["bias"]


def encoder(x, blocks, norm):
    """big_vision's vit.Encoder: pre-norm blocks, then encoder_norm."""
    for b in blocks:
        x = x + self_attention(layer_norm(x, b["LayerNorm_0"]), b["MultiHeadDotProductAttention_0"])
        mlp = b["MlpBlock_0"]
        y = layer_norm(x, b["LayerNorm_1"])
        x = x + dense(gelu(dense(y, mlp["Dense_0"])), mlp["Dense_1"])
    return layer_norm(x, norm)


def image_reference(img, images, patch, layout):
    b, h, w, c = images.shape
    gh, gw = h // patch, w // patch
    patches = images.reshape(b, gh, patch, gw, patch, c).transpose(0, 1, 3, 2, 4, 5)
    x = np.einsum("bijpqc,pqcd->bijd", patches, img["embedding"]["kernel"])
    x = (x + img["embedding"]["bias"]).reshape(b, gh * gw, -1)
    cls = np.broadcast_to(img["cls"], (b, 1, x.shape[-1]))
    if layout == "vit_jax":  # concatenate the class token, then add [1, 1 + N, D]
        x = np.concatenate([cls, x], axis=1) + img["pos_embedding"]
    else:  # add [1, N, D], then concatenate the class token
        x = np.concatenate([cls, x + img["pos_embedding"]], axis=1)
    x = encoder(x, img["blocks"], img["encoder_norm"])[:, 0]
    return dense(x, img["head"]) if "head" in img else x


def text_reference(txt, ids):
    x = txt["Embed_0"]["embedding"][ids] + txt["pos_embedding"]
    x = encoder(x, txt["blocks"], txt["encoder_norm"])[:, -1]  # "last" pooling
    return dense(x, txt["head"])


def lit_reference(tree, images, ids, arch) -> dict:
    """two_towers.Model: the towers' outputs, normalized as big_vision does, and the logits."""
    zimg = image_reference(tree["img"], images, arch["image"]["patch"], arch["layout"])
    ztxt = text_reference(tree["txt"], ids)
    nimg = zimg / (np.linalg.norm(zimg, axis=1, keepdims=True) + 1e-8)
    ntxt = ztxt / (np.linalg.norm(ztxt, axis=1, keepdims=True) + 1e-8)
    return {
        "image_features": zimg,
        "text_features": ztxt,
        "image_embeds": nimg,
        "text_embeds": ntxt,
        "logits_per_image": np.exp(tree["t"][0]) * nimg @ ntxt.T,
    }


# --------------------------------------------------------------------------- fixtures


TEXTS = [
    "a photo of a cat",
    "a photo of a dog",
    "the quick brown fox jumps over the lazy dog",
    "gas station",
    "a bad photo of colorful houses",
    "itap of a cd player",
    "a drawing of a small red car",
    "an origami crane on a table",
]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 4) + "\n")
    # T5's conventions, as LiT's sentencepiece models: pad 0, "</s>" 1, unknown 2, no bos.
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "lit"),
        vocab_size=SPM_VOCAB,
        hard_vocab_limit=False,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    return root / "lit.model"


def write_dir(path, arrays: dict, spm_model=None, name="LiT-tiny"):
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / f"{name}.npz", **arrays)
    if spm_model is not None:
        (path / f"{name}.model").write_bytes(spm_model.read_bytes())
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, spm_model) -> dict:
    root = tmp_path_factory.mktemp("lit")
    out = {}
    for seed, (name, arch) in enumerate(ARCHS.items()):
        tree = lit_tree(arch, seed)
        path = write_dir(root / name, published(tree, arch["layout"]), spm_model)
        out[name] = (path, bf16_rounded(tree, arch["layout"]))
    return out


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(ARCHS))
def test_matches_the_reference_forward(name, checkpoints) -> None:
    path, tree = checkpoints[name]
    arch = ARCHS[name]
    kind, module, variables, info = convert_lit.lit_from_dir(path)
    assert kind == convert_lit.KIND == "lit"
    assert convert_lit.is_lit_dir(path)
    im, tx = arch["image"], arch["text"]
    enc, text = module.image.encoder, module.text
    assert (enc.width, enc.depth, enc.num_heads, enc.mlp_dim) == (
        im["width"],
        im["depth"],
        im["heads"],
        im["mlp"],
    )
    assert (text.width, text.depth, text.num_heads, text.mlp_dim, text.vocab_size) == (
        tx["width"],
        tx["depth"],
        tx["heads"],
        tx["mlp"],
        tx["vocab"],
    )
    assert (text.mask, text.pool, text.max_len) == ("bidirectional", "last", TEXT_LEN)
    assert info["image_head"] == bool(im["head"]) and info["embed_dim"] == tx["out"]
    assert info["image_size"] == im["size"] and info["text_len"] == TEXT_LEN

    rng = np.random.default_rng(3)
    pixels = rng.uniform(-1, 1, size=(3, im["size"], im["size"], 3)).astype(np.float32)
    ids = info["tokenizer"].tokenize(TEXTS[:5])
    expected = lit_reference(tree, pixels.astype(np.float64), ids, arch)

    out = jax.jit(module.apply)(variables, pixels, ids)
    image = jax.jit(functools.partial(module.apply, method=module.image_features))(
        variables, pixels
    )
    text = jax.jit(functools.partial(module.apply, method=module.text_features))(variables, ids)
    got = {**out, "image_features": image, "text_features": text}
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        assert max_diff(got[key], value) < ATOL, (key, max_diff(got[key], value))


def test_preprocessing_is_resize_and_value_range(checkpoints) -> None:
    _, _, _, info = convert_lit.lit_from_dir(checkpoints["l16s"][0])
    pre = info["preprocessing"]
    assert pre.resize_to == (32, 32) and pre.crop is None and pre.resample == 2
    image = np.full((20, 50, 3), 51, np.uint8)
    np.testing.assert_allclose(pre(image), np.full((32, 32, 3), 2 * 51 / 255 - 1), atol=1e-6)


def sticky_reference(sp, text: str, max_len: int, lower: bool) -> list[int]:
    """big_vision's `tokenize(..., eos="sticky", pad_value=id("</s>"))` (pp/ops_text.py)."""
    eos = sp.piece_to_id("</s>")
    tokens = sp.encode(text.lower() if lower else text, add_eos=True)
    if len(tokens) >= max_len:
        return tokens[: max_len - 1] + tokens[-1:]
    return tokens + [eos] * (max_len - len(tokens))


@pytest.mark.parametrize("lower", [False, True])
def test_tokenizer_is_big_vision_sticky_eos(spm_model, lower) -> None:
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    tok = convert_lit.LiTTokenizer(spm_model, max_len=8, lower=lower)
    assert tok.eos_id == 1
    # Every length from empty to past max_len, so some texts fill exactly max_len - 1 and
    # max_len positions with their end token.
    texts = [" ".join(["a"] * k) for k in range(10)] + ["A Photo of a CAT", *TEXTS]
    lengths = {len(sp.encode(t, add_eos=True)) for t in texts}
    assert {7, 8} <= lengths and max(lengths) > 8
    ids = tok.tokenize(texts)
    assert ids.dtype == np.int32 and ids.shape == (len(texts), 8)
    assert (ids[:, -1] == tok.eos_id).all()
    expected = [sticky_reference(sp, t, 8, lower) for t in texts]
    np.testing.assert_array_equal(ids, np.array(expected, np.int32))


# --------------------------------------------------------------------------- errors


def _arrays(name: str) -> dict:
    arch = ARCHS[name]
    return published(lit_tree(arch, 0), arch["layout"])


def _load_error(path) -> str:
    with pytest.raises(ValueError) as e:
        convert_lit.lit_from_dir(path)
    return str(e.value)


def test_missing_key(tmp_path, spm_model) -> None:
    arrays = _arrays("l16s")
    del arrays["txt/Encoder_0/encoder_norm/bias"]
    msg = _load_error(write_dir(tmp_path, arrays, spm_model))
    assert "LiT-tiny.npz" in msg
    assert "missing npz key 'txt/Encoder_0/encoder_norm/bias'" in msg


def test_extra_key(tmp_path, spm_model) -> None:
    arrays = {**_arrays("b16b"), "params/txt/extra/kernel": np.zeros((2, 2), np.float32)}
    msg = _load_error(write_dir(tmp_path, arrays, spm_model))
    assert "LiT-tiny.npz" in msg and "unused source key 'params/txt/extra/kernel'" in msg


def test_wrong_shape(tmp_path, spm_model) -> None:
    arrays = _arrays("l16s")
    arrays["txt/head/bias"] = np.zeros(7, np.float32)
    msg = _load_error(write_dir(tmp_path, arrays, spm_model))
    assert "LiT-tiny.npz" in msg and "from 'txt/head/bias': shape (7,) != (32,)" in msg


def test_directory_without_a_sentencepiece_model(tmp_path) -> None:
    path = write_dir(tmp_path, _arrays("l16s"))
    assert convert_lit.is_lit_dir(path)
    msg = _load_error(path)
    assert str(path) in msg and "exactly one .model file" in msg


def test_bert_text_towers_are_refused(tmp_path, spm_model) -> None:
    arrays = {
        **_arrays("l16s"),
        "txt/BertEncoder_0/embedder/embedders_token_ids/embedding": np.zeros((4, 2), np.float32),
    }
    msg = _load_error(write_dir(tmp_path / "spm", arrays, spm_model))
    assert "LiT-tiny.npz" in msg and "BERT text tower" in msg
    path = write_dir(tmp_path / "bert", arrays)
    (path / "LiT-tiny.txt").write_text("[PAD]\n[CLS]\n")
    assert "WordPiece vocabulary LiT-tiny.txt" in _load_error(path)
    assert not convert_lit.is_lit_dir(tmp_path / "nowhere")
