"""LiT `.npz` checkpoints through `convert_lit`, against a numpy forward of the published model.

Three tiny random-weight models are written in the published key layouts (`convert_lit`
docstring):
  * "l16s": vit_jax's, as the LiT-L16S / L16Ti files: the tree at the root, pre-Linen submodule
    numbering, the image position embedding in `Transformer/posembed_input` with the class
    token's row first, no image head;
  * "b16b": big_vision's: the tree under "params/" next to optimizer state, Linen numbering,
    scanned (depth-stacked) encoder blocks, an image position embedding without a class-token row,
    an image head and a bfloat16 tensor stored as 2-byte void;
  * "b16b_bert": vit_jax's, as the LiT-B16B file: "l16s"'s image layout plus an image head, and
    a BERT text tower in flaxformer's layout (2-D kernels, heads flattened), with a WordPiece
    vocabulary.
The reference forward (`lit_reference`) follows big_vision's vit.py, text_transformer.py and
two_towers.py, and flaxformer's bert.py for BERT, step by step in float64 numpy, on the parameter
tree as each codebase defines it. The BERT tower is also checked against transformers'
`BertModel`, its weights copied into flaxformer's layout. The sentencepiece tokenizer is checked
on a model trained here against big_vision's `tokenize(eos="sticky", pad_value=eos)` rule, the
WordPiece one against tensorflow_text's `BertTokenizer` rule written out here.
"""

import functools
import math
import re
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece

from ood_jax.scorers import bert, convert_lit, preprocess

ATOL = 1e-5
TEXT_LEN = 16
SPM_VOCAB = 40
BERT_EPS = 1e-12  # flaxformer's BertBaseConfig / BertLargeConfig
# A WordPiece vocabulary covering most of TEXTS; BERT's special tokens first, "[PAD]" id 0.
WORDPIECES = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "the", "cat", "dog",
    "quick", "brown", "fox", "jump", "##s", "over", "la", "##zy", "gas", "station", "bad",
    "color", "##ful", "house", "it", "##ap", "cd", "play", "##er", "draw", "##ing", "small",
    "red", "car", "an", "or", "##iga", "##mi", "crane", "on", "table", ".", ",", "!", "[", "]",
    "cl", "cafe", "fish", "strasse",
]  # fmt: skip

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
    "b16b_bert": {
        "image": dict(width=32, depth=1, heads=4, mlp=48, patch=16, size=32, head=20),
        # BERT's heads are 64 wide; 24 position embeddings, more than the 16 tokens (as 512).
        "text": dict(vocab=64, width=128, depth=2, heads=2, mlp=96, positions=24, out=20),
        "layout": "vit_jax",
        "bert": True,
    },
}
SPM_ARCHS = [name for name, arch in ARCHS.items() if not arch.get("bert")]

# --------------------------------------------------------------------------- checkpoints


def _dense(rng, shape, out_dims=1, std=0.2) -> dict:
    """kernel `shape`, bias over its last `out_dims` axes (flax DenseGeneral)."""
    bias = rng.normal(0, 0.1, shape[-out_dims:])
    return {"kernel": rng.normal(0, std, shape), "bias": bias}


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


def bert_tree(rng, tx: dict) -> dict:
    """Random flaxformer `BertEncoder` parameters as stored: 2-D kernels, heads flattened."""
    w, f = tx["width"], tx["mlp"]
    dense = functools.partial(_dense, rng, std=0.1)

    def layer() -> dict:
        attention = {n: dense((w, w)) for n in ("query", "key", "value")}
        return {
            "attention_block": {
                "attention_layer": attention,
                "dense_layer": dense((w, w)),
                "layer_norm": _norm(rng, w),
            },
            "mlp_block": {
                "mlp": {"dense_layer": dense((w, f))},
                "dense_layer": dense((f, w)),
                "layer_norm": _norm(rng, w),
            },
        }

    tables = {"token_ids": tx["vocab"], "position_ids": tx["positions"], "segment_ids": 2}
    return {
        "embedder": {
            f"embedders_{k}": {"embedding": rng.normal(0, 0.5, (n, w))} for k, n in tables.items()
        },
        "layer_norm": _norm(rng, w),
        "encoder_block": {"layer_sequence": {f"layers_{i}": layer() for i in range(tx["depth"])}},
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
    if arch.get("bert"):
        txt = {"BertEncoder_0": bert_tree(rng, tx), "head": _dense(rng, (w, tx["out"]), std=0.1)}
    else:
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


def _published_text(txt: dict, layout: str) -> dict:
    if "BertEncoder_0" in txt:  # stored as flaxformer defines it
        return txt
    encoder = {**_blocks(txt["blocks"], layout), "encoder_norm": txt["encoder_norm"]}
    text = {"Embed_0": txt["Embed_0"], "pos_embedding": txt["pos_embedding"], "head": txt["head"]}
    return {**text, "Encoder_0": encoder}


def published(tree: dict, layout: str) -> dict[str, np.ndarray]:
    """`lit_tree` as the npz keys and arrays of a checkpoint in `layout`."""
    img = tree["img"]
    transformer = {**_blocks(img["blocks"], layout), "encoder_norm": img["encoder_norm"]}
    image = {k: img[k] for k in ("embedding", "cls") if k in img}
    image |= {"head": img["head"]} if "head" in img else {}
    if layout == "vit_jax":
        transformer["posembed_input"] = {"pos_embedding": img["pos_embedding"]}
    else:
        image["pos_embedding"] = img["pos_embedding"]
    params = {
        "img": {**image, "Transformer": transformer},
        "txt": _published_text(tree["txt"], layout),
    }
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


def layer_norm(x, p, eps=1e-6):  # flax's default epsilon
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def gelu(x):  # flax.linen.gelu's default, the tanh approximation
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def dense(x, p):
    return x @ p["kernel"] + p["bias"]


def attend(q, k, v, bias=0.0):
    """[B, L, H, d] queries, keys and values (+ a [B, 1, L, L] logit bias) -> [B, L, H, d]."""
    logits = np.einsum("bqhk,bshk->bhqs", q / math.sqrt(q.shape[-1]), k) + bias
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqs,bshk->bqhk", w, v)


def self_attention(x, p):
    q, k, v = (
        np.einsum("bld,dhk->blhk", x, p[n]["kernel"]) + p[n]["bias"]
        for n in ("query", "key", "value")
    )
    o = attend(q, k, v)
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


def bert_reference(bert_params, ids, heads):
    """flaxformer's BertEncoder at inference: [B, L, D] last-layer states."""
    e = bert_params["embedder"]
    b, length = ids.shape
    x = e["embedders_token_ids"]["embedding"][ids]
    x = x + e["embedders_position_ids"]["embedding"][:length]
    x = x + e["embedders_segment_ids"]["embedding"][0]  # segment_ids = zeros
    x = layer_norm(x, bert_params["layer_norm"], BERT_EPS)
    # input_mask = tokens != 0; make_attention_mask(input_mask, input_mask); masked: -1e10.
    valid = ids != 0
    bias = np.where(valid[:, None, :, None] & valid[:, None, None, :], 0.0, -1e10)
    layers = bert_params["encoder_block"]["layer_sequence"]
    for i in range(len(layers)):
        a, m = layers[f"layers_{i}"]["attention_block"], layers[f"layers_{i}"]["mlp_block"]
        q, k, v = (
            dense(x, a["attention_layer"][n]).reshape(b, length, heads, -1)
            for n in ("query", "key", "value")
        )
        o = attend(q, k, v, bias).reshape(b, length, -1)
        x = layer_norm(x + dense(o, a["dense_layer"]), a["layer_norm"], BERT_EPS)
        y = dense(gelu(dense(x, m["mlp"]["dense_layer"])), m["dense_layer"])
        x = layer_norm(x + y, m["layer_norm"], BERT_EPS)
    return x


def text_reference(txt, ids, arch):
    if arch.get("bert"):  # vit_jax's models_lit.BertModel: the [CLS] state, then the head
        x = bert_reference(txt["BertEncoder_0"], ids, arch["text"]["heads"])[:, 0]
    else:
        x = txt["Embed_0"]["embedding"][ids] + txt["pos_embedding"]
        x = encoder(x, txt["blocks"], txt["encoder_norm"])[:, -1]  # "last" pooling
    return dense(x, txt["head"])


def lit_reference(tree, images, ids, arch) -> dict:
    """two_towers.Model: the towers' outputs, normalized as big_vision does, and the logits."""
    zimg = image_reference(tree["img"], images, arch["image"]["patch"], arch["layout"])
    ztxt = text_reference(tree["txt"], ids, arch)
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


# Texts for the WordPiece tokenizer: cased, accented, unknown words, punctuation, an empty one,
# one cut at TEXT_LEN - 1 pieces and a special token's name, which is plain text to it.
BERT_TEXTS = [
    *TEXTS,
    "A Photo of a CAT!",
    "Café, a photo of a dog.",
    "a photo of a zebra",
    "",
    "a photo of a cat, a photo of a dog, a photo of a fox",
    "a [CLS] cat",
]


def write_dir(path, arrays: dict, spm_model=None, name="LiT-tiny", vocab=None):
    """A LiT directory: the npz, and a sentencepiece model and/or WordPiece vocabulary."""
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / f"{name}.npz", **arrays)
    if spm_model is not None:
        (path / f"{name}.model").write_bytes(spm_model.read_bytes())
    if vocab is not None:
        (path / f"{name}.txt").write_text("\n".join(vocab) + "\n")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, spm_model) -> dict:
    root = tmp_path_factory.mktemp("lit")
    out = {}
    for seed, (name, arch) in enumerate(ARCHS.items()):
        tree = lit_tree(arch, seed)
        vocabulary = {"vocab": WORDPIECES} if arch.get("bert") else {"spm_model": spm_model}
        path = write_dir(root / name, published(tree, arch["layout"]), **vocabulary)
        out[name] = (path, bf16_rounded(tree, arch["layout"]))
    return out


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def _image_tower_matches(module, arch) -> None:
    enc, im = module.image.encoder, arch["image"]
    assert (enc.width, enc.depth, enc.num_heads, enc.mlp_dim) == (
        im["width"],
        im["depth"],
        im["heads"],
        im["mlp"],
    )


def _forward_matches(module, variables, tree, arch, ids) -> None:
    """The converted model against `lit_reference` on random pixels and `ids`."""
    size = arch["image"]["size"]
    pixels = np.random.default_rng(3).uniform(-1, 1, size=(3, size, size, 3)).astype(np.float32)
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


# --------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.parametrize("name", SPM_ARCHS)
def test_matches_the_reference_forward(name, checkpoints) -> None:
    path, tree = checkpoints[name]
    arch = ARCHS[name]
    kind, module, variables, info = convert_lit.lit_from_dir(path)
    assert kind == convert_lit.KIND == "lit"
    assert convert_lit.is_lit_dir(path)
    im, tx = arch["image"], arch["text"]
    _image_tower_matches(module, arch)
    text = module.text
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
    assert isinstance(info["tokenizer"], convert_lit.LiTTokenizer)
    _forward_matches(module, variables, tree, arch, info["tokenizer"].tokenize(TEXTS[:5]))


def test_bert_matches_the_reference_forward(checkpoints) -> None:
    path, tree = checkpoints["b16b_bert"]
    arch = ARCHS["b16b_bert"]
    kind, module, variables, info = convert_lit.lit_from_dir(path)
    assert kind == "lit" and convert_lit.is_lit_dir(path)
    im, tx = arch["image"], arch["text"]
    _image_tower_matches(module, arch)
    assert isinstance(module.text, bert.BertTextTower)
    enc = module.text.encoder
    assert (enc.width, enc.depth, enc.num_heads, enc.mlp_dim) == (
        tx["width"],
        tx["depth"],
        tx["heads"],
        tx["mlp"],
    )
    assert (enc.vocab_size, enc.num_positions, enc.num_segments) == (
        tx["vocab"],
        tx["positions"],
        2,
    )
    assert (enc.ln_eps, enc.activation) == (BERT_EPS, "gelu_tanh")
    assert module.text_length == info["text_len"] == TEXT_LEN
    assert info["image_head"] and info["embed_dim"] == tx["out"] == im["head"]
    assert info["tokenizer_file"].name == "LiT-tiny.txt"
    tokenizer = info["tokenizer"]
    assert isinstance(tokenizer, convert_lit.LiTBertTokenizer)
    ids = tokenizer.tokenize(BERT_TEXTS)
    assert (ids == 0).any() and (ids != 0).all(axis=1).any()  # padded rows and a full one
    _forward_matches(module, variables, tree, arch, ids)


def test_bert_tower_matches_transformers(tmp_path) -> None:
    """The BERT text tower against transformers' BertModel, weights copied into flaxformer's
    layout (what flaxformer's bert_checkpoint_converter reads off a TF BERT checkpoint)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    arch = ARCHS["b16b_bert"]
    tx = arch["text"]
    config = transformers.BertConfig(
        vocab_size=tx["vocab"],
        hidden_size=tx["width"],
        num_hidden_layers=tx["depth"],
        num_attention_heads=tx["heads"],
        intermediate_size=tx["mlp"],
        max_position_embeddings=tx["positions"],
        type_vocab_size=2,
        hidden_act="gelu_new",  # the tanh approximation, flax's nn.gelu default
        layer_norm_eps=BERT_EPS,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # random norms and biases too, not their ones and zeros
        for name, p in model.named_parameters():
            p.copy_((name.endswith("LayerNorm.weight")) + 0.1 * torch.randn_like(p))
    sd = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}

    def linear(key) -> dict:
        return {"kernel": sd[f"{key}.weight"].T, "bias": sd[f"{key}.bias"]}

    def norm(key) -> dict:
        return {"scale": sd[f"{key}.weight"], "bias": sd[f"{key}.bias"]}

    def layer(i) -> dict:
        hf = f"encoder.layer.{i}"
        return {
            "attention_block": {
                "attention_layer": {
                    n: linear(f"{hf}.attention.self.{n}") for n in ("query", "key", "value")
                },
                "dense_layer": linear(f"{hf}.attention.output.dense"),
                "layer_norm": norm(f"{hf}.attention.output.LayerNorm"),
            },
            "mlp_block": {
                "mlp": {"dense_layer": linear(f"{hf}.intermediate.dense")},
                "dense_layer": linear(f"{hf}.output.dense"),
                "layer_norm": norm(f"{hf}.output.LayerNorm"),
            },
        }

    embeddings = {"token_ids": "word", "position_ids": "position", "segment_ids": "token_type"}
    bert_params = {
        "embedder": {
            f"embedders_{ours}": {"embedding": sd[f"embeddings.{theirs}_embeddings.weight"]}
            for ours, theirs in embeddings.items()
        },
        "layer_norm": norm("embeddings.LayerNorm"),
        "encoder_block": {"layer_sequence": {f"layers_{i}": layer(i) for i in range(tx["depth"])}},
    }
    tree = lit_tree(arch, seed=7)
    tree["txt"]["BertEncoder_0"] = bert_params
    path = write_dir(tmp_path, published(tree, arch["layout"]), vocab=WORDPIECES)
    _, module, variables, _ = convert_lit.lit_from_dir(path)

    # [CLS] first, then zero padding after 16, 9, 3 and 1 tokens.
    rng = np.random.default_rng(5)
    ids = rng.integers(5, tx["vocab"], (4, TEXT_LEN)).astype(np.int32)
    ids[:, 0] = WORDPIECES.index("[CLS]")
    ids[np.arange(TEXT_LEN) >= np.array([16, 9, 3, 1])[:, None]] = 0
    mask = (ids != 0).astype(np.int32)
    with torch.no_grad():
        hidden = model(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    expected = hidden.last_hidden_state.numpy().astype(np.float64)

    def states(m, input_ids, attention_mask=None):
        return m.text.encoder(input_ids, attention_mask)

    run = jax.jit(functools.partial(module.apply, method=states))
    # The mask given, or recovered from the zeros as LiT does: every state is transformers'.
    for got in (run(variables, ids, mask), run(variables, ids)):
        assert max_diff(got, expected) < ATOL, max_diff(got, expected)
    # The pooled output is the [CLS] state, projected by the head (no BERT pooler).
    head = tree["txt"]["head"]
    text = jax.jit(functools.partial(module.apply, method=module.text_features))(variables, ids)
    pooled = expected[:, 0] @ head["kernel"] + head["bias"]
    assert max_diff(text, pooled) < ATOL, max_diff(text, pooled)


def test_preprocessing_is_resize_and_value_range(checkpoints) -> None:
    _, _, _, info = convert_lit.lit_from_dir(checkpoints["l16s"][0])
    pre = info["preprocessing"]
    assert pre.resize_to == (32, 32) and pre.crop is None
    assert pre.resample == preprocess.TF_BILINEAR  # equal to tf.image.resize: test_tf_resize.py
    image = np.random.default_rng(3).integers(0, 256, (20, 50, 3), dtype=np.uint8)
    squashed = preprocess.tf_bilinear_resize(image, 32, 32)
    np.testing.assert_allclose(pre(image), squashed / 127.5 - 1, atol=1e-6)


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


def wordpiece_reference(text: str, max_len: int) -> list[int]:
    """vit_jax's `BertTokenizer` on `WORDPIECES`, for texts without the characters where
    lowercasing and tensorflow_text's case folding differ: lowercase, strip accents, split at
    whitespace and punctuation, word pieces longest first ("[UNK]" for a word they do not
    cover), cut to max_len - 1, "[CLS]" first, zero padding."""
    vocab = {t: i for i, t in enumerate(WORDPIECES)}
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    pieces = []
    for word in re.findall(r"\w+|[^\w\s]", text):
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start and ("##" * bool(start) + word[start:end]) not in vocab:
                end -= 1
            if end == start:
                ids = [vocab["[UNK]"]]
                break
            ids.append(vocab["##" * bool(start) + word[start:end]])
            start = end
        pieces += ids
    ids = [vocab["[CLS]"], *pieces[: max_len - 1]]
    return ids + [0] * (max_len - len(ids))


def test_bert_tokenizer_is_vit_jax_wordpiece(tmp_path) -> None:
    (tmp_path / "vocab.txt").write_text("\n".join(WORDPIECES) + "\n")
    tok = convert_lit.LiTBertTokenizer(tmp_path / "vocab.txt", max_len=TEXT_LEN)
    assert tok.cls_id == 2 and tok.vocab_size == len(WORDPIECES)
    ids = tok.tokenize(BERT_TEXTS)
    assert ids.dtype == np.int32 and ids.shape == (len(BERT_TEXTS), TEXT_LEN)
    expected = np.array([wordpiece_reference(t, TEXT_LEN) for t in BERT_TEXTS], np.int32)
    np.testing.assert_array_equal(ids, expected)
    assert (ids[:, 0] == tok.cls_id).all() and not (ids == WORDPIECES.index("[SEP]")).any()
    # tensorflow_text case-folds with NFKC: the ligature and "ß" fold to ASCII letters.
    folded = tok.tokenize(["STRAßE", "ﬁsh", "ＣＡＴ"])[:, 1]
    np.testing.assert_array_equal(folded, [WORDPIECES.index(w) for w in ("strasse", "fish", "cat")])


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


LAYER = "txt/BertEncoder_0/encoder_block/layer_sequence/layers_1"


def test_bert_missing_key(tmp_path) -> None:
    arrays = _arrays("b16b_bert")
    del arrays[f"{LAYER}/mlp_block/layer_norm/bias"]
    msg = _load_error(write_dir(tmp_path, arrays, vocab=WORDPIECES))
    assert f"missing npz key '{LAYER}/mlp_block/layer_norm/bias'" in msg


def test_bert_extra_key(tmp_path) -> None:
    # A BERT pooler, which LiT does not use, is not silently dropped.
    pooler = "txt/BertEncoder_0/pooler/dense/kernel"
    arrays = {**_arrays("b16b_bert"), pooler: np.zeros((128, 128), np.float32)}
    msg = _load_error(write_dir(tmp_path, arrays, vocab=WORDPIECES))
    assert f"unused source key '{pooler}'" in msg


def test_bert_wrong_shape(tmp_path) -> None:
    arrays = _arrays("b16b_bert")
    key = f"{LAYER}/attention_block/attention_layer/query/bias"
    arrays[key] = np.zeros(7, np.float32)
    msg = _load_error(write_dir(tmp_path, arrays, vocab=WORDPIECES))
    assert f"from '{key}': shape (7,) != (2, 64)" in msg


def test_bert_directory_without_a_vocabulary(tmp_path, spm_model) -> None:
    # A sentencepiece model does not stand in for the WordPiece vocabulary.
    path = write_dir(tmp_path, _arrays("b16b_bert"), spm_model)
    msg = _load_error(path)
    assert str(path) in msg and "exactly one .txt file (the WordPiece vocabulary" in msg


def test_bert_vocabulary_without_cls(tmp_path) -> None:
    path = write_dir(tmp_path, _arrays("b16b_bert"), vocab=[w for w in WORDPIECES if w != "[CLS]"])
    assert "the WordPiece vocabulary has no '[CLS]'" in _load_error(path)


# --------------------------------------------------------------------------- the scorer


@pytest.mark.slow
@pytest.mark.parametrize("name", ["l16s", "b16b_bert"])
def test_a_scorer_over_a_lit_directory(name, checkpoints) -> None:
    from ood_jax import scorers

    path, tree = checkpoints[name]
    arch = ARCHS[name]
    scorer = scorers.from_hf(path, batch_size=2)
    assert scorer.kind == "lit" and scorer.text_length == TEXT_LEN
    assert scorer.logit_scale == pytest.approx(float(np.exp(tree["t"][0])), rel=1e-6)
    assert scorer.identity["tokenizer_sha256"] and scorer.identity["path"].endswith(".npz")
    rng = np.random.default_rng(12)
    size = arch["image"]["size"]
    images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(3)]
    pixels = np.stack(images).astype(np.float64) / 127.5 - 1  # an image of the model's size
    ids = scorer.tokenize(TEXTS)["input_ids"]
    expected = lit_reference(tree, pixels, ids, arch)
    assert max_diff(scorer.encode_images(images), expected["image_embeds"]) < ATOL
    assert max_diff(scorer.encode_texts(TEXTS), expected["text_embeds"]) < ATOL
    low = scorers.from_hf(path, dtype=jnp.bfloat16, batch_size=2)
    cosine = np.sum(low.encode_texts(TEXTS) * scorer.encode_texts(TEXTS), axis=-1)
    assert cosine.min() > 0.99


@pytest.mark.slow
def test_a_lit_scorer_batch_sharded_over_a_mesh(checkpoints) -> None:
    from test_scorers import check_sharded_over_a_mesh

    check_sharded_over_a_mesh(
        checkpoints["b16b_bert"][0], vocab_size=ARCHS["b16b_bert"]["text"]["vocab"]
    )
