"""LiT checkpoints (a big_vision / vit_jax `.npz` and its vocabulary) -> `clip.CLIP` modules and
Flax variables, with LiT's sentencepiece and BERT WordPiece tokenizers and image preprocessing.
The layouts read, the published checkpoints and the towers' conventions: docs/guide/lit.md.
"""

import dataclasses
import math
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.traverse_util
import jax.numpy as jnp
import numpy as np
import sentencepiece
import tokenizers

from ood_jax.models import vit
from ood_jax.scorers import bert, clip, convert, preprocess, towers

KIND = "lit"
WEIGHTS_SUFFIX = ".npz"
TOKENIZER_SUFFIX = ".model"  # sentencepiece
VOCAB_SUFFIX = ".txt"  # BERT WordPiece
PARAM_ROOTS = ("params/", "opt/target/")  # big_vision's `load_params`, in its order
LN_EPS = 1e-6  # flax.linen.LayerNorm's default
ACTIVATION = "gelu_tanh"  # flax.linen.gelu's default (approximate=True)
EOS_PIECE = "</s>"
# vit_jax configs/models.py: `pp.max_len` of every LiT model. The sentencepiece towers' position
# embeddings have as many rows; BERT's have 512, so the BERT towers take it from here.
TEXT_LEN = 16
CLS_TOKEN, UNK_TOKEN = "[CLS]", "[UNK]"
BERT = "txt/BertEncoder_0"
BERT_LAYERS = f"{BERT}/encoder_block/layer_sequence/layers_"
BERT_HEAD_DIM = 64  # every BERT size's (docs/guide/lit.md)

# big_vision's eval `resize(224)|value_range(-1, 1)` and vit_jax's `PreprocessImages`: a squash
# to the square input size with TensorFlow's bilinear resize (no antialiasing, truncated to
# uint8: `preprocess.TF_BILINEAR`), then 2 x / 255 - 1 ((x - 127.5) / 127.5).
PREPROCESSOR = {
    "do_resize": True,
    "resample": preprocess.TF_BILINEAR,
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


def read_vocab(file: str | Path) -> dict[str, int]:
    """A WordPiece vocabulary: one token a line, its id the line's number (tensorflow_text's
    lookup table, vit_jax's `vocab.index`); a repeated token keeps its first id."""
    lines = Path(file).read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    vocab: dict[str, int] = {}
    for i, token in enumerate(lines):
        vocab.setdefault(token, i)
    return vocab


def tf_text_case_fold(text: str) -> str:
    """tensorflow_text's `lower_case` and control-character steps before its word split.

    `case_fold_utf8` is ICU's NFKC_Casefold (tensorflow_text core/kernels/normalize_kernels.cc):
    compatibility forms folded ("ﬁ" -> "fi", full-width "Ａ" -> "a") and full case folding
    ("ß" -> "ss"). NFKC, `str.casefold`, NFKC again computes it, but for its deleting the
    default-ignorable characters (zero-width spaces and joiners, soft hyphens, ...), nearly all
    of them format characters (Cf), which `tokenizers` deletes in turn. Then control characters
    (Cc) become spaces: word breaks.
    """
    text = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    return "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)


@dataclasses.dataclass(frozen=True)
class LiTBertTokenizer:
    """LiT's WordPiece tokenization: "[CLS]", then the text's word pieces, zero-padded.

    vit_jax's `BertTokenizer` (preprocess.py) and big_vision's `bert_tokenize` op
    (pp/proj/flaxformer/bert_ops.py) are the same rule: tensorflow_text's
    `BertTokenizer(vocab, lower_case=True)` word pieces of the text, cut to `max_len - 1` and
    padded with 0 by `pad_model_inputs`, after the id of "[CLS]". No "[SEP]". The text tower
    recovers its padding mask from the zeros ("[PAD]" is id 0 in BERT's vocabularies), so the
    tokenizer returns ids only, as `LiTTokenizer` does.

    tensorflow_text lowercases (`tf_text_case_fold`), strips accents (NFD, then no Mn), splits
    at spaces, punctuation (ASCII and \\p{P}) and around CJK ideographs, and word-pieces each
    word greedily, longest match first, a word it cannot cover being "[UNK]". The same BERT
    pipeline of Hugging Face `tokenizers` (transformers' `BertTokenizer` / `BertTokenizerFast`
    backend: BertNormalizer, BertPreTokenizer, WordPiece), after `tf_text_case_fold` in place of
    its lowercasing, computes it here. It is built directly rather than through transformers:
    that would match special tokens in the text, which tensorflow_text does not (a "[CLS]" in a
    text is "[", the pieces of "cls", "]"), and transformers 5 ignores a `vocab_file` argument.
    What still differs, on inputs no prompt has (checked against tensorflow_text 2.21.1):
    `tokenizers` deletes U+FFFD and the format characters (Cf) that are not default-ignorable
    (e.g. the Arabic number signs), where tensorflow_text keeps the first and breaks words at
    the others; it breaks words at U+1680, U+2028 and U+2029, which RE2's ASCII `\\s` does not;
    its word limit is 100 characters, tensorflow_text's 100 bytes (longer words are "[UNK]").

    Attributes:
      vocab_file: the WordPiece vocabulary (.txt), one token a line.
      max_len: tokens per text, "[CLS]" included.
    """

    vocab_file: Path
    max_len: int
    vocab: dict[str, int] = dataclasses.field(init=False, repr=False)
    tokenizer: tokenizers.Tokenizer = dataclasses.field(init=False, repr=False)
    cls_id: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        vocab = read_vocab(self.vocab_file)
        for token in (CLS_TOKEN, UNK_TOKEN):
            if token not in vocab:
                raise ValueError(f"{self.vocab_file}: the WordPiece vocabulary has no {token!r}")
        tokenizer = tokenizers.Tokenizer(
            tokenizers.models.WordPiece(vocab, unk_token=UNK_TOKEN, max_input_chars_per_word=100)
        )
        tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=False
        )
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
        object.__setattr__(self, "vocab", vocab)
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "cls_id", vocab[CLS_TOKEN])

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (the embedding rows the vocabulary needs)."""
        return max(self.vocab.values()) + 1

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        """Texts -> int32 [M, max_len] token ids; 0 is padding, which the tower masks."""
        out = np.zeros((len(texts), self.max_len), np.int32)
        out[:, 0] = self.cls_id
        folded = [tf_text_case_fold(t) for t in texts]
        encodings = self.tokenizer.encode_batch(folded, add_special_tokens=False)
        for row, encoding in zip(out, encodings):
            ids = encoding.ids[: self.max_len - 1]
            row[1 : 1 + len(ids)] = ids
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
    # Here, not at the top: flax.training imports TensorFlow (through flax.io), which every
    # command that imports the scorers (all of `ood-jax`'s parser) would otherwise load.
    from flax.training import checkpoints

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


def _count(src: Source, prefix: str) -> int:
    """N where the npz has exactly `{prefix}0/` .. `{prefix}{N - 1}/` (0 where it has none)."""
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)/")
    ids = {int(m.group(1)) for n in src.names if (m := pattern.match(n))}
    if ids != set(range(len(ids))):
        raise ValueError(f"{prefix}i are not numbered 0..N-1 (found {sorted(ids)})")
    return len(ids)


def _blocks(src: Source, encoder: str) -> tuple[str, int, bool]:
    """(first block's prefix, depth, scanned) of `encoder` ("img/Transformer", "txt/Encoder_0")."""
    if src.has_prefix(f"{encoder}/encoderblock/"):
        return (
            f"{encoder}/encoderblock",
            src.shape(f"{encoder}/encoderblock/LayerNorm_0/bias")[0],
            True,
        )
    depth = _count(src, f"{encoder}/encoderblock_")
    if not depth:
        raise ValueError(f"missing npz keys {encoder}/encoderblock_0/...: no encoder blocks")
    return f"{encoder}/encoderblock_0", depth, False


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


def is_bert(src: Source) -> bool:
    """Whether the text tower is BERT (LiT-B16B, B16B_2, L16L) rather than sentencepiece's."""
    return src.has_prefix(f"{BERT}/")


def _image_tower(src: Source, dtype: Any) -> towers.ImageTower:
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
    proj_dim = src.shape("img/head/kernel")[1] if "img/head/kernel" in src else None
    return towers.ImageTower(encoder, proj_dim=proj_dim, proj_bias=True)


def _sentencepiece_tower(src: Source, dtype: Any) -> towers.TextTower:
    vocab, width = src.shape("txt/Embed_0/embedding")
    first, depth, _ = _blocks(src, "txt/Encoder_0")
    heads, mlp = _block_dims(src, first)
    return towers.TextTower(
        vocab_size=vocab,
        max_len=src.shape("txt/pos_embedding")[1],
        width=width,
        depth=depth,
        num_heads=heads,
        mlp_dim=mlp,
        ln_eps=LN_EPS,
        activation=ACTIVATION,
        mask="bidirectional",
        pool="last",
        proj_dim=src.shape("txt/head/kernel")[1],
        proj_bias=True,
        dtype=dtype,
    )


def _bert_tower(src: Source, dtype: Any) -> bert.BertTextTower:
    vocab, width = src.shape(f"{BERT}/embedder/embedders_token_ids/embedding")
    if width % BERT_HEAD_DIM:
        raise ValueError(
            f"{BERT}: width {width} is not a multiple of BERT's {BERT_HEAD_DIM}-wide heads"
        )
    depth = _count(src, BERT_LAYERS)
    if not depth:
        raise ValueError(f"missing npz keys {BERT_LAYERS}0/...: no BERT layers")
    encoder = bert.BertEncoder(
        vocab_size=vocab,
        num_positions=src.shape(f"{BERT}/embedder/embedders_position_ids/embedding")[0],
        num_segments=src.shape(f"{BERT}/embedder/embedders_segment_ids/embedding")[0],
        width=width,
        depth=depth,
        num_heads=width // BERT_HEAD_DIM,
        mlp_dim=src.shape(f"{BERT_LAYERS}0/mlp_block/mlp/dense_layer/kernel")[1],
        dtype=dtype,
    )
    proj_dim = src.shape("txt/head/kernel")[1]
    return bert.BertTextTower(encoder, max_len=TEXT_LEN, proj_dim=proj_dim, proj_bias=True)


def lit_module(src: Source, dtype: Any = jnp.float32) -> clip.CLIP:
    """The `CLIP` module whose shapes the npz tensors have (docs/guide/lit.md)."""
    image = _image_tower(src, dtype)
    text = _bert_tower(src, dtype) if is_bert(src) else _sentencepiece_tower(src, dtype)
    image_dim = image.proj_dim or image.encoder.width
    if text.proj_dim != image_dim:
        raise ValueError(f"image embeddings are {image_dim} wide, text embeddings {text.proj_dim}")
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


def _reshaped(stored: tuple[int, ...], shape: tuple[int, ...]) -> Callable:
    """Reshapes a tensor stored `stored` to `shape`; another shape is passed on as it is, for
    `convert.assemble` to report."""
    return lambda a: a.reshape(shape) if a.shape == stored else a


def _bert_layer_params(
    m: convert.TensorMapping, src: Source, target: str, layer: str, enc: bert.BertEncoder
) -> None:
    """A flaxformer BERT layer -> `bert.BertLayer`: flax's attention keeps heads apart."""
    d, h = enc.width, enc.num_heads
    attention = f"{layer}/attention_block"
    for p in ("query", "key", "value"):
        ours, theirs = f"{target}/attention/{p}", f"{attention}/attention_layer/{p}"
        src.put(m, f"{ours}/kernel", f"{theirs}/kernel", _reshaped((d, d), (d, h, -1)))
        src.put(m, f"{ours}/bias", f"{theirs}/bias", _reshaped((d,), (h, -1)))
    out = f"{attention}/dense_layer"
    src.put(m, f"{target}/attention/out/kernel", f"{out}/kernel", _reshaped((d, d), (h, -1, d)))
    src.put(m, f"{target}/attention/out/bias", f"{out}/bias")
    parts = {
        "attention_norm": f"{attention}/layer_norm",
        "ffn/fc1": f"{layer}/mlp_block/mlp/dense_layer",
        "ffn/fc2": f"{layer}/mlp_block/dense_layer",
        "ffn_norm": f"{layer}/mlp_block/layer_norm",
    }
    for ours, theirs in parts.items():
        leaves = _LEAVES["norm" if ours.endswith("norm") else "dense"]
        for leaf in leaves:
            src.put(m, f"{target}/{ours}/{leaf}", f"{theirs}/{leaf}")


def _bert_params(m: convert.TensorMapping, src: Source, enc: bert.BertEncoder) -> None:
    target = "text/encoder"
    for ours, theirs in (("word", "token"), ("position", "position"), ("segment", "segment")):
        embedding = f"{BERT}/embedder/embedders_{theirs}_ids/embedding"
        src.put(m, f"{target}/{ours}_embeddings/embedding", embedding)
    for leaf in _LEAVES["norm"]:
        src.put(m, f"{target}/embed_norm/{leaf}", f"{BERT}/layer_norm/{leaf}")
    for i in range(enc.depth):
        _bert_layer_params(m, src, f"{target}/layer_{i}", f"{BERT_LAYERS}{i}", enc)


def _sentencepiece_params(m: convert.TensorMapping, src: Source, text: towers.TextTower) -> None:
    src.put(m, "text/token_embedding/embedding", "txt/Embed_0/embedding")
    src.put(m, "text/pos_embedding", "txt/pos_embedding", lambda a: a[0])
    _encoder_params(m, src, "text", "txt/Encoder_0", text.depth)


def lit_params(src: Source, module: clip.CLIP) -> dict[str, Any]:
    """{"params": ...} for `module` from the npz tensors; a ValueError lists every mismatch."""
    m = convert.TensorMapping(src.arrays)
    img = "image/encoder"
    for leaf in _LEAVES["dense"]:
        src.put(m, f"{img}/embedding/{leaf}", f"img/embedding/{leaf}")
    src.put(m, f"{img}/cls", "img/cls")
    src.put(m, f"{img}/pos_embedding", _image_pos(src), _with_cls_row)
    _encoder_params(m, src, img, "img/Transformer", module.image.encoder.depth)
    if module.image.proj_dim is not None:
        for leaf in _LEAVES["dense"]:
            src.put(m, f"image/proj/{leaf}", f"img/head/{leaf}")

    if isinstance(module.text, bert.BertTextTower):
        _bert_params(m, src, module.text.encoder)
    else:
        _sentencepiece_params(m, src, module.text)
    for leaf in _LEAVES["dense"]:
        src.put(m, f"text/proj/{leaf}", f"txt/head/{leaf}")
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


def _vocabulary(path: Path, weights: Path) -> Path:
    """The tokenizer file beside `weights`: the WordPiece vocabulary of a BERT text tower, else
    the sentencepiece model; which one is read off the npz's key names, before its tensors."""
    with np.load(weights, allow_pickle=False) as npz:
        bert_text = any(_param_key(k).startswith(f"{BERT}/") for k in npz.files)
    if bert_text:
        return _one(path, VOCAB_SUFFIX, "the WordPiece vocabulary of its BERT text tower")
    return _one(path, TOKENIZER_SUFFIX, "the sentencepiece model")


def lit_from_dir(path: str | Path, dtype: Any = jnp.float32) -> tuple[str, clip.CLIP, dict, dict]:
    """(KIND, module, variables, info) of a LiT directory: one `.npz` and its vocabulary, a
    sentencepiece `.model` or, for a BERT text tower, a WordPiece `.txt`.

    `info`: "tokenizer" (a `LiTTokenizer` or `LiTBertTokenizer`: `tokenize(texts)` gives the
    ids, the only text input either tower needs), "preprocessing"
    (`preprocess.ImagePreprocessing`), "weights" and "tokenizer_file" (paths), and the
    checkpoint's facts read off its shapes: "image_size", "patch_size", "image_head",
    "text_len", "vocab_size", "embed_dim".
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    weights = _one(path, WEIGHTS_SUFFIX, "the LiT weights")
    vocab = _vocabulary(path, weights)
    try:
        src = Source(read_npz(weights))
        module = lit_module(src, dtype)
        variables = lit_params(src, module)
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from e
    tokenizer_class = LiTBertTokenizer if is_bert(src) else LiTTokenizer
    tokenizer = tokenizer_class(vocab, module.text.max_len)
    if tokenizer.vocab_size > module.text.vocab_size:
        raise ValueError(
            f"{vocab}: {tokenizer.vocab_size} tokens, but {weights.name} embeds only "
            f"{module.text.vocab_size}"
        )
    encoder = module.image.encoder
    image_size = encoder.pos_grid[0] * encoder.patch_size
    # Every field is set, so the kind whose class defaults `preprocess` starts from is moot.
    config = {**PREPROCESSOR, "size": {"height": image_size, "width": image_size}}
    info = {
        "tokenizer": tokenizer,
        "preprocessing": preprocess.preprocessing_from_config(config, "siglip", image_size),
        "weights": weights,
        "tokenizer_file": vocab,
        "image_size": image_size,
        "patch_size": encoder.patch_size,
        "image_head": module.image.proj_dim is not None,
        "text_len": module.text.max_len,
        "vocab_size": module.text.vocab_size,
        "embed_dim": module.text.proj_dim,
    }
    return KIND, module, variables, info
