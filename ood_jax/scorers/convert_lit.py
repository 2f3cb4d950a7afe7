"""LiT (Zhai et al. 2022, "LiT: Zero-Shot Transfer with Locked-image text Tuning") checkpoints ->
`clip.CLIP` modules and Flax variables, with LiT's tokenizer and image preprocessing.

LiT is a two-tower model scored as CLIP is: both towers' outputs are L2-normalized and an image's
logits over texts are `exp(t) * cos(image, text)`, read through a softmax over the texts
(vision_transformer's lit.ipynb: `softmax(out["t"] * ztxt @ zimg.T)`, with `out["t"] = exp(t)`).
So a LiT checkpoint converts to the project's `clip.CLIP`: no new module is needed.

Published checkpoints (google-research/vision_transformer vit_jax/configs/models.py and
model_cards/lit.md; big_vision configs/proj/image_text/README_lit.md). Each `.npz` has its
vocabulary next to it, `<name>.model` (sentencepiece) or `<name>.txt` (BERT WordPiece):

  | name      | weights                               | image       | text              | vocab  |
  |-----------|---------------------------------------|-------------|-------------------|--------|
  | LiT-B16B  | gs://vit_models/lit/LiT-B16B.npz      | B/16 + head | BERT-Base         | .txt   |
  | LiT-B16B_2| gs://vit_models/lit/LiT-B16B_2.npz    | B/16        | BERT-Base         | .txt   |
  | LiT-L16L  | gs://vit_models/lit/LiT-L16L.npz      | L/16        | BERT-Large        | .txt   |
  | LiT-L16S  | gs://vit_models/lit/LiT-L16S.npz      | L/16        | transformer S     | .model |
  | LiT-L16Ti | gs://vit_models/lit/LiT-L16Ti.npz     | L/16        | transformer Ti    | .model |

All take 224px images and 16 text tokens; the embeddings are 768 wide (B16B*) or 1024 (L16*).
This module converts the sentencepiece ones (L16S: width 384, 6 heads; L16Ti: width 192, 3 heads;
both 12 layers and a 16,000-piece vocabulary). The BERT ones are refused with an explanation:
their text tower (flaxformer's post-norm `BertEncoder`, with segment embeddings, an embedding
LayerNorm and a padding mask) is not the pre-norm `towers.TextTower`.

A LiT directory is one `.npz` and one sentencepiece `.model` file, as published side by side
(e.g. LiT-L16S.npz and LiT-L16S.model); `lit_from_dir(path)` loads it.

The `.npz` is a flattened Flax parameter tree, keys joined with "/". vit_jax's `checkpoint.load`
and big_vision's `utils.load_params` both read it; this module accepts what they accept:
  * the tree at the root (the published files), under "params/" (big_vision with optax) or under
    "opt/target/" (flax.optim). Next to a "params/" or "opt/target/" tree the other entries are
    optimizer state, the only tensors dropped on purpose;
  * submodule names numbered pre-Linen (one counter per parent, e.g.
    `MultiHeadDotProductAttention_1`, `MlpBlock_3`) or Linen (one per class), reconciled by flax's
    `convert_pre_linen` as both loaders do;
  * bfloat16 arrays stored as 2-byte void, as big_vision's `recover_dtype` reads them.

In Linen names the tree is
  img/embedding/{kernel [p, p, 3, D], bias}      patch convolution
  img/cls [1, 1, D]                              class token, the pooled output
  img/Transformer/posembed_input/pos_embedding   [1, 1 + N, D], the class token's row first
    (vit_jax); or img/Transformer/pos_embedding, or img/pos_embedding [1, N, D] (big_vision,
    which adds it before prepending the class token: the class token gets no position)
  img/Transformer/encoderblock_{i}/              pre-norm blocks, or one `encoderblock/` with a
    leading depth axis (big_vision's scan=True):
      LayerNorm_0, MultiHeadDotProductAttention_0/{query,key,value}/{kernel [D, H, d], bias [H, d]}
      and out/{kernel [H, d, D], bias}, LayerNorm_1, MlpBlock_0/Dense_{0,1}/{kernel, bias}
  img/Transformer/encoder_norm/{scale, bias}
  img/head/{kernel, bias}                        only LiT-B16B: a linear head with bias
  txt/Embed_0/embedding [V, D], txt/pos_embedding [1, L, D]
  txt/Encoder_0/encoderblock_{i}/... (as above), txt/Encoder_0/encoder_norm
  txt/head/{kernel [D, E], bias}                 into the shared embedding space
  t [1]                                          log temperature
(vit_jax/models_lit.py, vit_jax/models_vit.py; big_vision/models/vit.py,
models/proj/image_text/two_towers.py and text_transformer.py.) Both codebases use flax's
defaults: LayerNorm epsilon 1e-6 and the tanh approximation of GELU. The text tower attends
bidirectionally without a padding mask and pools the last position, which the sticky tokenizer
guarantees is "</s>". As `convert` does, the conversion fails, listing them, on a tensor it did
not use, a parameter it did not fill (naming the npz key it looked for) or a shape mismatch.
"""

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.traverse_util
import jax.numpy as jnp
import numpy as np
import sentencepiece
from flax.training import checkpoints

from ood_jax.models import vit
from ood_jax.scorers import clip, convert, preprocess, towers

KIND = "lit"
WEIGHTS_SUFFIX = ".npz"
TOKENIZER_SUFFIX = ".model"
PARAM_ROOTS = ("params/", "opt/target/")  # big_vision's `load_params`, in its order
LN_EPS = 1e-6  # flax.linen.LayerNorm's default
ACTIVATION = "gelu_tanh"  # flax.linen.gelu's default (approximate=True)
EOS_PIECE = "</s>"

# big_vision's eval `resize(224)|value_range(-1, 1)` and vit_jax's `PreprocessImages`: a squash
# to the square input size, bilinear, then 2 x / 255 - 1 ((x - 127.5) / 127.5). An approximation
# of TF's resize: `tf.image.resize` does not antialias and its result is truncated to uint8, while
# Pillow's bilinear filter rounds and antialiases when downsampling (when upsampling both are the
# same triangle filter, within a uint8 level).
PREPROCESSOR = {
    "do_resize": True,
    "resample": 2,  # PIL bilinear
    "do_center_crop": False,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": 0.5,
    "image_std": 0.5,
}

# `vit.EncoderBlock` parameter -> the LiT (Linen-named) encoderblock's.
_LEAVES = {"norm": ("scale", "bias"), "dense": ("kernel", "bias")}
BLOCK = {
    **{f"norm{j + 1}/{x}": f"LayerNorm_{j}/{x}" for j in (0, 1) for x in _LEAVES["norm"]},
    **{
        f"attn/{p}/{x}": f"MultiHeadDotProductAttention_0/{p}/{x}"
        for p in ("query", "key", "value", "out")
        for x in _LEAVES["dense"]
    },
    **{f"mlp/fc{j + 1}/{x}": f"MlpBlock_0/Dense_{j}/{x}" for j in (0, 1) for x in _LEAVES["dense"]},
}
# Where the image position embedding may be stored, oldest layout first (big_vision's
# `vit.fix_old_checkpoints`).
IMAGE_POS = (
    "img/Transformer/posembed_input/pos_embedding",
    "img/Transformer/pos_embedding",
    "img/pos_embedding",
)


# --------------------------------------------------------------------------- tokenizer


@dataclasses.dataclass(frozen=True)
class LiTTokenizer:
    """LiT's sentencepiece tokenization with a "sticky" end token.

    vit_jax's `SentencepieceTokenizer`: the pieces plus "</s>", cut to `max_len - 1`, padded with
    "</s>" to `max_len`, so the last position, the one the text tower pools, is always "</s>".
    That is big_vision's `tokenize(eos="sticky", pad_value=<id of "</s>">)`. vit_jax does not
    lowercase (big_vision's op does by default: `lower=True` follows it).

    Attributes:
      model_file: the sentencepiece model.
      max_len: tokens per text (the text tower's position embeddings).
      lower: lowercase texts first.
    """

    model_file: Path
    max_len: int
    lower: bool = False
    processor: sentencepiece.SentencePieceProcessor = dataclasses.field(init=False, repr=False)
    eos_id: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(self.model_file))
        eos_id = processor.piece_to_id(EOS_PIECE)
        if eos_id == processor.unk_id():
            raise ValueError(f"{self.model_file}: the sentencepiece model has no {EOS_PIECE!r}")
        object.__setattr__(self, "processor", processor)
        object.__setattr__(self, "eos_id", eos_id)

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        """Texts -> int32 [M, max_len] token ids. The text tower takes no mask."""
        out = np.full((len(texts), self.max_len), self.eos_id, np.int32)
        for row, text in zip(out, texts):
            ids = self.processor.encode(text.lower() if self.lower else text)
            ids = [*ids, self.eos_id][: self.max_len - 1]
            row[: len(ids)] = ids
        return out


# --------------------------------------------------------------------------- reading


def _recover_dtype(a: np.ndarray) -> np.ndarray:
    """float32; 2-byte void arrays are bfloat16 (big_vision's `recover_dtype`)."""
    if a.dtype.kind == "V" and a.itemsize == 2:
        a = a.view(jnp.bfloat16)
    return np.asarray(a, np.float32)


def read_npz(file: str | Path) -> dict[str, np.ndarray]:
    """The parameter tensors of a LiT `.npz`, keyed as stored, float32."""
    with np.load(file, allow_pickle=False) as npz:
        arrays = dict(npz.items())
    for root in PARAM_ROOTS:
        if any(k.startswith(root) for k in arrays):
            arrays = {k: v for k, v in arrays.items() if k.startswith(root)}
            break
    return {k: _recover_dtype(v) for k, v in arrays.items()}


def _param_key(key: str) -> str:
    return next((key[len(r) :] for r in PARAM_ROOTS if key.startswith(r)), key)


def linen_names(keys: Sequence[str]) -> dict[str, str]:
    """Linen-named parameter path -> the npz key it is stored under."""
    tree = flax.traverse_util.unflatten_dict({tuple(_param_key(k).split("/")): k for k in keys})
    renamed = checkpoints.convert_pre_linen(tree)
    return {"/".join(p): k for p, k in flax.traverse_util.flatten_dict(renamed).items()}


class Source:
    """The npz tensors by Linen name, remembering every key looked up and not found.

    Missing keys are named as Linen numbers them (`MultiHeadDotProductAttention_0`, ...) and
    without a "params/" root; the others as stored.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays
        self.names = linen_names(list(arrays))
        self.missing: dict[str, str] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.names:
            raise ValueError(f"missing npz key {name!r}")
        return self.arrays[self.names[name]].shape

    def put(self, m: convert.TensorMapping, target: str, name: str, fn: Callable = np.asarray):
        if name in self.names:
            m.put(target, self.names[name], fn)
        else:
            self.missing[target] = name

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.names)


# --------------------------------------------------------------------------- architecture


def _blocks(src: Source, encoder: str) -> tuple[str, int, bool]:
    """(first block's prefix, depth, scanned) of `encoder` ("img/Transformer", "txt/Encoder_0")."""
    if src.has_prefix(f"{encoder}/encoderblock/"):
        return (
            f"{encoder}/encoderblock",
            src.shape(f"{encoder}/encoderblock/LayerNorm_0/bias")[0],
            True,
        )
    pattern = re.compile(rf"{re.escape(encoder)}/encoderblock_(\d+)/")
    ids = {int(m.group(1)) for n in src.names if (m := pattern.match(n))}
    if not ids or ids != set(range(len(ids))):
        raise ValueError(f"{encoder}/encoderblock_i are not numbered 0..N-1 (found {sorted(ids)})")
    return f"{encoder}/encoderblock_0", len(ids), False


def _block_dims(src: Source, first: str) -> tuple[int, int]:
    """(heads, mlp_dim) from a block's [..., D, heads, head_dim] query and first MLP kernels."""
    heads = src.shape(f"{first}/MultiHeadDotProductAttention_0/query/kernel")[-2]
    return heads, src.shape(f"{first}/MlpBlock_0/Dense_0/kernel")[-1]


def _grid(rows: int) -> tuple[int, bool]:
    """(grid side, whether the first row is the class token's) of an image pos embedding."""
    for extra in (1, 0):
        side = math.isqrt(rows - extra)
        if side * side == rows - extra:
            return side, bool(extra)
    raise ValueError(f"image position embedding has {rows} rows: not a square grid (+1)")


def _image_pos(src: Source) -> str:
    return next((n for n in IMAGE_POS if n in src), IMAGE_POS[-1])


def lit_module(src: Source, dtype: Any = jnp.float32) -> clip.CLIP:
    """The `CLIP` module whose shapes the npz tensors have (see the module docstring)."""
    if src.has_prefix("txt/BertEncoder_0/"):
        raise ValueError(
            "a BERT text tower (txt/BertEncoder_0: LiT-B16B, LiT-B16B_2, LiT-L16L) is not "
            "supported: flaxformer's post-norm BertEncoder is not towers.TextTower"
        )
    if "img/cls" not in src:
        raise ValueError(
            "missing npz key 'img/cls': LiT image towers pool their class token; others "
            "(global average or attention pooling) are not supported"
        )
    patch, patch_w, _, width = src.shape("img/embedding/kernel")
    if patch != patch_w:
        raise ValueError(f"img/embedding/kernel: non-square patches {patch}x{patch_w}")
    side, _ = _grid(src.shape(_image_pos(src))[1])
    first, depth, _ = _blocks(src, "img/Transformer")
    heads, mlp = _block_dims(src, first)
    encoder = vit.ViT(
        width=width,
        depth=depth,
        num_heads=heads,
        mlp_dim=mlp,
        patch_size=patch,
        pos_grid=(side, side),
        ln_eps=LN_EPS,
        activation=ACTIVATION,
        pool_type="tok",
        dtype=dtype,
    )
    image_head = "img/head/kernel" in src
    image_dim = src.shape("img/head/kernel")[1] if image_head else width

    vocab, text_width = src.shape("txt/Embed_0/embedding")
    first, text_depth, _ = _blocks(src, "txt/Encoder_0")
    text_heads, text_mlp = _block_dims(src, first)
    text_dim = src.shape("txt/head/kernel")[1]
    if text_dim != image_dim:
        raise ValueError(f"image embeddings are {image_dim} wide, text embeddings {text_dim}")
    text = towers.TextTower(
        vocab_size=vocab,
        max_len=src.shape("txt/pos_embedding")[1],
        width=text_width,
        depth=text_depth,
        num_heads=text_heads,
        mlp_dim=text_mlp,
        ln_eps=LN_EPS,
        activation=ACTIVATION,
        mask="bidirectional",
        pool="last",
        proj_dim=text_dim,
        proj_bias=True,
        dtype=dtype,
    )
    image = towers.ImageTower(encoder, proj_dim=image_dim if image_head else None, proj_bias=True)
    return clip.CLIP(image=image, text=text)


# --------------------------------------------------------------------------- weights


def _with_cls_row(a: np.ndarray) -> np.ndarray:
    """big_vision's [1, N, D] grid -> [1, 1 + N, D] with a zero row: its class token has none."""
    if _grid(a.shape[1])[1]:
        return a
    return np.concatenate([np.zeros_like(a[:, :1]), a], axis=1)


def _encoder_params(
    m: convert.TensorMapping, src: Source, target: str, encoder: str, depth: int
) -> None:
    """Every parameter of the `depth` blocks and final norm of an encoder, from the npz's."""
    first, _, scanned = _blocks(src, encoder)
    for i in range(depth):
        block = first if scanned else f"{encoder}/encoderblock_{i}"
        take = (lambda a, i=i: a[i]) if scanned else np.asarray
        for ours, theirs in BLOCK.items():
            src.put(m, f"{target}/block_{i}/{ours}", f"{block}/{theirs}", take)
    for leaf in ("scale", "bias"):
        src.put(m, f"{target}/norm/{leaf}", f"{encoder}/encoder_norm/{leaf}")


def lit_params(src: Source, module: clip.CLIP) -> dict[str, Any]:
    """{"params": ...} for `module` from the npz tensors; a ValueError lists every mismatch."""
    m = convert.TensorMapping(src.arrays)
    img, txt = "image/encoder", "text"
    for leaf in ("kernel", "bias"):
        src.put(m, f"{img}/embedding/{leaf}", f"img/embedding/{leaf}")
    src.put(m, f"{img}/cls", "img/cls")
    src.put(m, f"{img}/pos_embedding", _image_pos(src), _with_cls_row)
    _encoder_params(m, src, img, "img/Transformer", module.image.encoder.depth)
    if module.image.proj_dim is not None:
        for leaf in ("kernel", "bias"):
            src.put(m, f"image/proj/{leaf}", f"img/head/{leaf}")

    src.put(m, f"{txt}/token_embedding/embedding", "txt/Embed_0/embedding")
    src.put(m, f"{txt}/pos_embedding", "txt/pos_embedding", lambda a: a[0])
    _encoder_params(m, src, txt, "txt/Encoder_0", module.text.depth)
    for leaf in ("kernel", "bias"):
        src.put(m, f"{txt}/proj/{leaf}", f"txt/head/{leaf}")
    src.put(m, "t", "t", convert.scalar)
    try:
        return convert.assemble(module, m, "LiT")
    except ValueError as e:
        missing = [f"missing npz key {n!r} (for {t!r})" for t, n in sorted(src.missing.items())]
        raise ValueError("\n  ".join([str(e), *missing])) from None


# --------------------------------------------------------------------------- directories


def _files(path: Path, suffix: str) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(suffix))


def is_lit_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding a LiT `.npz` (the layout `lit_from_dir` reads)."""
    path = Path(path)
    return path.is_dir() and bool(_files(path, WEIGHTS_SUFFIX))


def _one(path: Path, suffix: str, what: str) -> Path:
    files = _files(path, suffix)
    if len(files) != 1:
        found = ", ".join(p.name for p in files) or "none"
        raise ValueError(
            f"{path}: a LiT directory holds exactly one {suffix} file ({what}); found {found}"
        )
    return files[0]


def lit_from_dir(path: str | Path, dtype: Any = jnp.float32) -> tuple[str, clip.CLIP, dict, dict]:
    """(KIND, module, variables, info) of a LiT directory (one `.npz` and its `.model`).

    `info`: "tokenizer" (a `LiTTokenizer`), "preprocessing" (`preprocess.ImagePreprocessing`),
    "weights" and "tokenizer_file" (paths), and the checkpoint's facts read off its shapes:
    "image_size", "patch_size", "image_head", "text_len", "vocab_size", "embed_dim".
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    weights = _one(path, WEIGHTS_SUFFIX, "the LiT weights")
    vocab = weights.with_suffix(".txt")
    if not _files(path, TOKENIZER_SUFFIX) and vocab.is_file():
        raise ValueError(
            f"{path}: no sentencepiece {TOKENIZER_SUFFIX} file, but the WordPiece vocabulary "
            f"{vocab.name} of a BERT LiT checkpoint (LiT-B16B, LiT-B16B_2, LiT-L16L): those are "
            "not supported"
        )
    spm = _one(path, TOKENIZER_SUFFIX, "the sentencepiece model")
    try:
        src = Source(read_npz(weights))
        module = lit_module(src, dtype)
        variables = lit_params(src, module)
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from e
    tokenizer = LiTTokenizer(spm, module.text.max_len)
    if tokenizer.vocab_size > module.text.vocab_size:
        raise ValueError(
            f"{spm}: {tokenizer.vocab_size} pieces, but {weights.name} embeds only "
            f"{module.text.vocab_size} tokens"
        )
    encoder = module.image.encoder
    image_size = encoder.pos_grid[0] * encoder.patch_size
    # Every field is set, so the kind whose class defaults `preprocess` starts from is moot.
    config = {**PREPROCESSOR, "size": {"height": image_size, "width": image_size}}
    info = {
        "tokenizer": tokenizer,
        "preprocessing": preprocess.preprocessing_from_config(config, "siglip", image_size),
        "weights": weights,
        "tokenizer_file": spm,
        "image_size": image_size,
        "patch_size": encoder.patch_size,
        "image_head": module.image.proj_dim is not None,
        "text_len": module.text.max_len,
        "vocab_size": module.text.vocab_size,
        "embed_dim": module.text.proj_dim,
    }
    return KIND, module, variables, info
