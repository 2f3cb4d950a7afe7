"""`Scorer`: a converted CLIP / SigLIP / GroupViT / BLIP-2 / LiT model with its preprocessing
and tokenizer, jitted.

Every device call runs on a fixed batch (the last one padded), so each input shape compiles
once; with a mesh the batch is split over its devices, possibly across processes, and every
process gets every output row. Parameters stay float32, outputs are float32, and `dtype` is the
computation dtype. Usage: docs/guide/scorer-models.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ood_jax.models import convert as model_convert
from ood_jax.scorers import clip, convert, convert_blip2, convert_groupvit, convert_lit, preprocess
from ood_jax import sharding

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _sha256(file: Path) -> str | None:
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None


# Scorer kinds whose image-text probability is a softmax over the texts (all trained with CLIP's
# contrastive loss); SigLIP's is a sigmoid of each pair's logit.
SOFTMAX_KINDS = ("clip", convert_groupvit.KIND, convert_blip2.KIND, convert_lit.KIND)
KINDS = (*convert.KINDS.values(), convert_groupvit.KIND, convert_blip2.KIND, convert_lit.KIND)
# Text towers that take the tokenizer's padding mask, as each model was trained: CLIP's as
# transformers passes it (its causal mask already hides padding from the end token). SigLIP's
# attends to its pad tokens (big_vision and open_clip do), and its pooled last position is a pad
# token for short texts.
MASKED_TEXT_KINDS = ("clip", convert_groupvit.KIND, convert_blip2.KIND)


class Scorer:
    """A contrastive image-text model ready to embed images and texts; build it with `from_hf`.

    Attributes:
      kind: one of `KINDS`.
      module, variables: the Flax model and its float32 parameters; the module has
        `image_features` and `text_features` methods and `image_size`, `text_length` properties.
      preprocessing: the image processor (`preprocess.ImagePreprocessing`).
      logit_scale: exp of the learned log scale, a float (as transformers applies it); the
        `logit_scale` argument where the checkpoint has none (BLIP-2 from transformers), else None.
      logit_bias: SigLIP's logit bias, None for the others.
      identity: what makes embeddings reproducible (checkpoint path, hashes of its config and
        preprocessor files, dtype); `EmbeddingCache` refuses a cache written under another.
      batch_size: rows per device call (a multiple of the mesh's device count); each method
        also takes its own `batch_size`.
    """

    def __init__(
        self,
        kind: str,
        module: clip.CLIP,
        variables: dict[str, Any],
        preprocessing: preprocess.ImagePreprocessing,
        *,
        tokenizer_dir: str | Path | None,
        identity: dict[str, Any],
        tokenize_fn: Callable[[list[str]], dict[str, np.ndarray]] | None = None,
        logit_scale: float | None = None,
        mesh: Mesh | None = None,
        batch_size: int = 32,
        num_workers: int | None = None,
    ):
        """`tokenize_fn` (texts -> {"input_ids"[, "attention_mask"]}, int [M, text_length])
        replaces transformers' tokenizer from `tokenizer_dir` (LiT's sentencepiece and WordPiece
        rules); `logit_scale` supplies one to a checkpoint without a learned "t"."""
        if kind not in KINDS:
            raise ValueError(f"unknown scorer kind {kind!r}; scorers are {', '.join(KINDS)}")
        self.kind = kind
        self.module = module
        self.preprocessing = preprocessing
        self.identity = dict(identity)
        self.tokenizer_dir = None if tokenizer_dir is None else Path(tokenizer_dir)
        self.mesh = mesh
        self.batch_size = self._rows(batch_size)
        self.num_workers = num_workers or min(8, os.cpu_count() or 1)

        params = variables["params"]
        self.logit_scale = float(np.exp(params["t"])) if "t" in params else logit_scale
        self.logit_bias = float(params["b"]) if "b" in params else None
        if mesh is not None:
            variables = sharding.tree_from_host_copy(
                variables, sharding.replicated(mesh), source=self.identity.get("path", kind)
            )
        self.variables = variables
        self._batch_sharding = None if mesh is None else sharding.batch_sharding(mesh)
        self._tokenizer = None
        self._tokenize_fn = tokenize_fn
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

        # Embeddings are normalized on the host, so that features and embeddings share one
        # compiled function per input shape.
        self._image_fn = jax.jit(functools.partial(_image_features, module))
        self._text_fn = jax.jit(functools.partial(_text_features, module))
        if hasattr(module, "itm_logits"):
            self._states_fn = jax.jit(functools.partial(_vision_states, module))
            self._match_fn = jax.jit(functools.partial(_match_probability, module))

    # ------------------------------------------------------------------ shapes

    @property
    def image_size(self) -> tuple[int, int]:
        """(h, w) the image tower was trained at."""
        return tuple(self.module.image_size)

    @property
    def text_length(self) -> int:
        return self.module.text_length

    @functools.cached_property
    def image_embedding_shape(self) -> tuple[int, ...]:
        """Shape of one image's embedding: (D,), or (Q, D) for BLIP-2's query embeddings."""
        pixels = jax.ShapeDtypeStruct((1, *self.image_size, 3), jnp.float32)
        return tuple(jax.eval_shape(self._image_fn, self.variables, pixels).shape[1:])

    @property
    def dim(self) -> int:
        """Embedding width (shared by images and texts)."""
        return self.image_embedding_shape[-1]

    def compiled_image_features(self, batch: int) -> jax.stages.Compiled:
        """The compiled image tower for `batch` images, as `image_features` runs it: for what
        XLA says of it (cost and memory analysis)."""
        pixels = jax.ShapeDtypeStruct((batch, *self.image_size, 3), jnp.float32)
        return self._image_fn.lower(self.variables, pixels).compile()

    # ------------------------------------------------------------------ features

    def _rows(self, batch_size: int | None) -> int:
        """Rows per device call: `batch_size` (default the scorer's) rounded up to a multiple of
        the mesh's devices. Each distinct value compiles once."""
        if batch_size is None:
            return self.batch_size
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        devices = 1 if self.mesh is None else self.mesh.size
        return -(-int(batch_size) // devices) * devices

    def image_features(self, pixels: Any, batch_size: int | None = None) -> np.ndarray:
        """Preprocessed float [N, H, W, 3] -> projected features [N, D], not normalized
        (transformers' `get_image_features`). [H, W] must be the model's `image_size`."""
        pixels = np.asarray(pixels, np.float32)
        if pixels.ndim != 4 or pixels.shape[-1] != 3:
            raise ValueError(f"pixels must be [N, H, W, 3], got shape {pixels.shape}")
        if pixels.shape[1:3] != self.image_size:
            # As transformers (without interpolate_pos_encoding): the position embeddings are
            # learned for one grid.
            raise ValueError(
                f"pixels are {pixels.shape[1]}x{pixels.shape[2]}; the model takes "
                f"{self.image_size[0]}x{self.image_size[1]}"
            )
        return self._run(
            self._image_fn, _batches([pixels], self._rows(batch_size)), self.image_embedding_shape
        )

    def text_features(
        self, input_ids: Any, attention_mask: Any | None = None, batch_size: int | None = None
    ) -> np.ndarray:
        """Token ids int [M, L] (and optionally the [M, L] attention mask) -> projected features
        [M, D], not normalized (transformers' `get_text_features`)."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be integer [M, L], got {ids.dtype} {ids.shape}")
        arrays = [ids.astype(np.int32)]
        if attention_mask is not None:
            mask = np.asarray(attention_mask)
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask shape {mask.shape} != input_ids {ids.shape}")
            arrays.append(mask.astype(np.int32))
        return self._run(self._text_fn, _batches(arrays, self._rows(batch_size)), (self.dim,))

    # ------------------------------------------------------------------ embeddings

    def _check_preprocessing(self) -> None:
        size = self.preprocessing.output_size
        if size is None:
            raise ValueError(
                f"{preprocess.PREPROCESSOR_FILE}: neither a center crop nor a fixed-size resize, "
                "so preprocessed images keep different sizes and cannot be batched"
            )
        if size != self.image_size:
            raise ValueError(
                f"{preprocess.PREPROCESSOR_FILE}: images come out {size[0]}x{size[1]}, the model "
                f"takes {self.image_size[0]}x{self.image_size[1]}"
            )

    def preprocess(self, image: Any) -> np.ndarray:
        """One uint8 [H, W, 3] image -> the model's input, float32 [h, w, 3]."""
        return self.preprocessing(image)

    def encode_images(
        self, images: Sequence[Any] | np.ndarray, batch_size: int | None = None
    ) -> np.ndarray:
        """uint8 images of any sizes (a list, or one [N, H, W, 3] array) -> L2-normalized
        float32 [N, D], preprocessed as the checkpoint's image processor does."""
        self._check_preprocessing()
        if isinstance(images, np.ndarray) and images.ndim != 4:
            raise ValueError(f"an image array must be [N, H, W, 3], got shape {images.shape}")
        if len(images) == 0:
            return np.zeros((0, *self.image_embedding_shape), np.float32)
        batches = self._image_batches(images, self._rows(batch_size))
        return _l2_normalize(self._run(self._image_fn, batches, self.image_embedding_shape))

    def tokenize(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Texts -> {"input_ids"[, "attention_mask"]} int32 [M, text_length], as the model
        expects them: padded and truncated to the text tower's length, as each model was trained
        (77 for CLIP, 64 for SigLIP). transformers' tokenizer comes from the checkpoint
        directory, never a hub."""
        if self._tokenize_fn is not None:
            return {k: np.asarray(v, np.int32) for k, v in self._tokenize_fn(list(texts)).items()}
        encoded = self.tokenizer(
            list(texts),
            padding="max_length",
            max_length=self.text_length,
            truncation=True,
            return_tensors="np",
        )
        out = {"input_ids": np.asarray(encoded["input_ids"], np.int32)}
        if self.kind in MASKED_TEXT_KINDS and "attention_mask" in encoded:
            out["attention_mask"] = np.asarray(encoded["attention_mask"], np.int32)
        return out

    def encode_texts(
        self,
        texts: Sequence[str],
        templates: Sequence[str] = ("{}",),
        batch_size: int | None = None,
    ) -> np.ndarray:
        """Texts -> float32 [M, D]: each template formatted with the text, the embeddings
        L2-normalized, averaged over the templates and normalized again."""
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not one string")
        templates = list(templates)
        if not templates:
            raise ValueError("templates must not be empty")
        for template in templates:
            if "{}" not in template:
                raise ValueError(f"template {template!r} has no '{{}}' for the text")
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        prompts = [template.format(text) for template in templates for text in texts]
        tokens = self.tokenize(prompts)
        arrays = [tokens["input_ids"]]
        if "attention_mask" in tokens:
            arrays.append(tokens["attention_mask"])
        batches = _batches(arrays, self._rows(batch_size))
        embeds = _l2_normalize(self._run(self._text_fn, batches, (self.dim,)))
        return _l2_normalize(embeds.reshape(len(templates), len(texts), -1).mean(axis=0))

    # ------------------------------------------------------------------ image-text matching

    @property
    def has_matching_head(self) -> bool:
        """Whether the model scores a pair jointly (BLIP-2's image-text matching head)."""
        return hasattr(self.module, "itm_logits")

    def match_probabilities(
        self,
        images: Sequence[Any],
        texts: Sequence[str],
        image_rows: Sequence[int],
        text_rows: Sequence[int],
        batch_size: int | None = None,
    ) -> np.ndarray:
        """float32 [P]: the matching head's probability that text `text_rows[p]` describes image
        `image_rows[p]` (softmax of its two logits, at "match").

        Unlike the contrastive score, each pair takes a Q-Former pass of its own; each image's
        encoder states are computed once, for a batch of images at a time, and every pair of
        those images is scored against them (in fixed-size batches of pairs) before the next.
        """
        if not self.has_matching_head:
            raise ValueError(f"a {self.kind} scorer has no image-text matching head")
        image_rows, text_rows = np.asarray(image_rows, np.int64), np.asarray(text_rows, np.int64)
        if image_rows.shape != text_rows.shape or image_rows.ndim != 1:
            raise ValueError(f"image_rows {image_rows.shape} and text_rows {text_rows.shape}")
        for name, rows, n in (
            ("image_rows", image_rows, len(images)),
            ("text_rows", text_rows, len(texts)),
        ):
            bad = (rows < 0) | (rows >= n)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"{name}[{i}] = {rows[i]} is outside [0, {n})")
        self._check_preprocessing()
        tokens = self.tokenize(list(texts))
        ids = tokens["input_ids"]
        mask = tokens.get("attention_mask", np.ones_like(ids))
        rows = self._rows(batch_size)
        out = np.zeros(len(image_rows), np.float32)
        order = np.argsort(image_rows, kind="stable")
        # Each batch's pairs are a run of the sorted rows: found by bisection, not by a scan.
        bounds = np.searchsorted(image_rows[order], np.arange(0, len(images) + rows, rows))
        for start, lo, hi in zip(range(0, len(images), rows), bounds, bounds[1:]):
            stop = min(start + rows, len(images))
            chosen = order[lo:hi]
            if not len(chosen):
                continue
            _, (pixels,) = next(self._image_batches(images[start:stop], rows, first=start))
            states = self._states_fn(self.variables, self._put(pixels))
            pairs = [(image_rows[chosen] - start).astype(np.int32), ids[text_rows[chosen]]]
            pairs.append(mask[text_rows[chosen]])
            for offset, (valid, arrays) in zip(range(0, len(chosen), rows), _batches(pairs, rows)):
                probs = self._match_fn(self.variables, states, *map(self._put, arrays))
                out[chosen[offset : offset + valid]] = sharding.to_host(probs)[:valid]
        return out

    # ------------------------------------------------------------------ plumbing

    @property
    def tokenizer(self) -> Any:
        """transformers' tokenizer from the checkpoint directory (loaded on first use)."""
        if self._tokenizer is None:
            where = self.tokenizer_dir
            if where is None or not any((where / f).is_file() for f in TOKENIZER_FILES):
                raise FileNotFoundError(
                    f"{where}: no tokenizer ({' / '.join(TOKENIZER_FILES)} missing); encode_texts "
                    "needs the checkpoint's tokenizer files, text_features works without them"
                )
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        return self._tokenizer

    def _image_batches(
        self, images: Sequence[Any], rows: int, first: int = 0
    ) -> Iterator[tuple[int, list[np.ndarray]]]:
        """(valid rows, [pixels]) per batch; `first` numbers the images in errors.

        Only the rows this process's devices take are read (`images[i]` may load a file) and
        preprocessed, in the thread pool; the others stay zero, never sent."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.num_workers)
        h, w = self.preprocessing.output_size
        mine = (0, rows) if self.mesh is None else sharding.process_rows(self._batch_sharding, rows)
        for start in range(0, len(images), rows):
            valid = min(rows, len(images) - start)
            indices = range(start + mine[0], start + min(mine[1], valid))
            pixels = np.zeros((rows, h, w, 3), np.float32)
            preprocess = functools.partial(self._preprocess_nth, images, first=first)
            for i, image in zip(indices, self._pool.map(preprocess, indices)):
                pixels[i - start] = image
            yield valid, [pixels]

    def _preprocess_nth(self, images: Sequence[Any], index: int, first: int = 0) -> np.ndarray:
        try:
            return self.preprocessing(images[index])
        except ValueError as e:
            raise ValueError(f"image {first + index}: {e}") from None

    def _put(self, x: np.ndarray) -> jax.Array:
        if self._batch_sharding is None:
            return jnp.asarray(x)
        return sharding.from_host_copy(x, self._batch_sharding)

    def _run(
        self,
        fn: Callable[..., jax.Array],
        batches: Iterator[tuple[int, list[np.ndarray]]],
        row_shape: tuple[int, ...],
    ) -> np.ndarray:
        """Runs `fn(variables, *batch)` over full batches, one in flight while the next is made;
        [0, *row_shape] when there are none."""
        # JAX dispatches a batch asynchronously: the next one is made (images resized in the
        # thread pool, Pillow releasing the GIL) while the device computes.
        done: list[np.ndarray] = []
        pending: collections.deque[tuple[int, jax.Array]] = collections.deque()
        for valid, arrays in batches:
            pending.append((valid, fn(self.variables, *map(self._put, arrays))))
            if len(pending) > 1:
                valid_before, out = pending.popleft()
                done.append(sharding.to_host(out)[:valid_before])
        done.extend(sharding.to_host(out)[:valid] for valid, out in pending)
        if not done:
            return np.zeros((0, *row_shape), np.float32)
        return np.concatenate(done).astype(np.float32, copy=False)


def _l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _image_features(module: clip.CLIP, variables: dict, pixels: jax.Array) -> jax.Array:
    return module.apply(variables, pixels, method=module.image_features)


def _text_features(
    module: clip.CLIP,
    variables: dict,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
) -> jax.Array:
    return module.apply(variables, input_ids, attention_mask, method=module.text_features)


def _vision_states(module: Any, variables: dict, pixels: jax.Array) -> jax.Array:
    return module.apply(variables, pixels, method=module.vision_states)


def _match_probability(
    module: Any,
    variables: dict,
    states: jax.Array,
    rows: jax.Array,
    input_ids: jax.Array,
    attention_mask: jax.Array,
) -> jax.Array:
    logits = module.apply(
        variables, states[rows], input_ids, attention_mask, method=module.itm_logits
    )
    return jax.nn.softmax(logits, axis=-1)[:, 1]


def _batches(arrays: list[np.ndarray], batch_size: int) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(valid rows, arrays padded to batch_size rows) per batch. Padding rows are zeros, and
    ones for an attention mask (the second array) so that padded text rows attend somewhere."""
    n = len(arrays[0])
    for start in range(0, n, batch_size):
        valid = min(batch_size, n - start)
        padded = []
        for k, a in enumerate(arrays):
            chunk = a[start : start + valid]
            if valid < batch_size:
                pad = np.full((batch_size - valid, *a.shape[1:]), int(k == 1), a.dtype)
                chunk = np.concatenate([chunk, pad])
            padded.append(chunk)
        yield valid, padded


def _identity(path: Path, dtype: Any, config_sha256: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "path": str(path.resolve()),
        "config_sha256": config_sha256,
        "dtype": jnp.dtype(dtype).name,
        **extra,
    }


# transformers model_type -> the loader of its directories (CLIP and SigLIP: `convert.load_hf`).
_HF_LOADERS = {
    convert_groupvit.MODEL_TYPE: convert_groupvit.groupvit_from_hf,
    convert_blip2.MODEL_TYPE: convert_blip2.blip2_from_hf,
}


def from_hf(
    path: str | Path,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    *,
    logit_scale: float | None = None,
    batch_size: int = 32,
    num_workers: int | None = None,
) -> Scorer:
    """A `Scorer` from a checkpoint directory on disk: transformers CLIPModel / SiglipModel /
    GroupViTModel / Blip2ForImageTextRetrieval, or a LiT directory (`convert_lit`).

    A transformers directory needs config.json and the weights (model.safetensors, its sharded
    index, or pytorch_model.bin); preprocessor_config.json and the tokenizer files are optional
    (without them the processor class's defaults apply and `encode_texts` raises, naming the
    files). `logit_scale` is used where the checkpoint has none: transformers' BLIP-2 retrieval
    checkpoints drop BLIP-2's learned temperature (`from_lavis` reads it from LAVIS's).
    """
    path = Path(path)
    if convert_lit.is_lit_dir(path):
        return _from_lit(path, dtype, mesh, batch_size=batch_size, num_workers=num_workers)
    load = _HF_LOADERS.get(convert.read_config(path).get("model_type"), convert.load_hf)
    kind, module, variables, _ = load(path, dtype)
    return _from_hf_parts(
        path, kind, module, variables, dtype, mesh,
        logit_scale=logit_scale, batch_size=batch_size, num_workers=num_workers,
    )  # fmt: skip


def _from_hf_parts(
    path: Path,
    kind: str,
    module: Any,
    variables: dict,
    dtype: Any,
    mesh: Mesh | None,
    extra_identity: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Scorer:
    return Scorer(
        kind,
        module,
        variables,
        preprocess.load_preprocessing(path, kind, module.image_size[0]),
        tokenizer_dir=path,
        identity=_identity(
            path,
            dtype,
            _sha256(path / convert.CONFIG_FILE),
            preprocessor_sha256=_sha256(path / preprocess.PREPROCESSOR_FILE),
            **(extra_identity or {}),
        ),
        mesh=mesh,
        **kwargs,
    )


def from_lavis(
    checkpoint: str | Path,
    config_dir: str | Path,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    *,
    batch_size: int = 32,
    num_workers: int | None = None,
) -> Scorer:
    """A BLIP-2 `Scorer` from a LAVIS checkpoint (e.g. blip2_pretrained.pth), which keeps the
    learned ITC temperature, with the architecture, tokenizer and image processor of a
    transformers directory of the same model (e.g. Salesforce/blip2-itm-vit-g)."""
    checkpoint, config_dir = Path(checkpoint), Path(config_dir)
    module, variables, temp = convert_blip2.blip2_from_lavis(
        checkpoint, convert.read_config(config_dir), dtype
    )
    return _from_hf_parts(
        config_dir, convert_blip2.KIND, module, variables, dtype, mesh,
        logit_scale=1.0 / temp, batch_size=batch_size, num_workers=num_workers,
        extra_identity={"lavis_checkpoint": str(checkpoint.resolve()),
                        "size_bytes": checkpoint.stat().st_size},
    )  # fmt: skip


def _from_lit(path: Path, dtype: Any, mesh: Mesh | None, **kwargs: Any) -> Scorer:
    kind, module, variables, info = convert_lit.lit_from_dir(path, dtype)
    tokenizer = info["tokenizer"]
    return Scorer(
        kind,
        module,
        variables,
        info["preprocessing"],
        tokenizer_dir=None,
        tokenize_fn=lambda texts: {"input_ids": tokenizer.tokenize(texts)},
        # As for open_clip files: the architecture read off the shapes and the file size stand in
        # for hashing a gigabyte of weights on every start; the vocabulary is small and hashed.
        identity=_identity(
            info["weights"],
            dtype,
            hashlib.sha256(repr(module).encode()).hexdigest(),
            size_bytes=info["weights"].stat().st_size,
            tokenizer_sha256=_sha256(info["tokenizer_file"]),
        ),
        mesh=mesh,
        **kwargs,
    )


def from_open_clip(
    checkpoint: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    activation: str = "gelu",
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    batch_size: int = 32,
    num_workers: int | None = None,
) -> Scorer:
    """A CLIP `Scorer` from an open_clip checkpoint file (open_clip_model.safetensors or
    open_clip_pytorch_model.bin, read with weights_only=True).

    open_clip's ViTs preprocess as OpenAI CLIP (bicubic shortest-side resize, center crop, the
    OpenAI statistics), which are the CLIP defaults used here. `tokenizer_dir` is a directory with
    a CLIP tokenizer (tokenizer.json) for `encode_texts`; `activation` as in
    `convert.clip_from_open_clip`.
    """
    checkpoint = Path(checkpoint)
    module, variables = convert.clip_from_open_clip(
        model_convert.load_state_dict(checkpoint), activation=activation, dtype=dtype
    )
    return Scorer(
        "clip",
        module,
        variables,
        preprocess.preprocessing_from_config({}, "clip", module.image_size[0]),
        tokenizer_dir=tokenizer_dir,
        # Without a config file, the architecture read off the shapes stands in for it (hashing
        # a multi-gigabyte checkpoint on every start would cost more than it protects).
        identity=_identity(
            checkpoint,
            dtype,
            hashlib.sha256(repr(module).encode()).hexdigest(),
            size_bytes=checkpoint.stat().st_size,
        ),
        mesh=mesh,
        batch_size=batch_size,
        num_workers=num_workers,
    )
