"""`Scorer`: a converted CLIP / SigLIP model with its preprocessing and tokenizer, jitted.

    scorer = from_hf("checkpoints/clip-vit-large-patch14")   # config.json + model.safetensors
    image_embeds = scorer.encode_images(images)             # uint8 [H, W, 3] each -> [N, D]
    text_embeds = scorer.encode_texts(["cat", "dog"], templates=("a photo of a {}.",))
    logits = scorer.logit_scale * image_embeds @ text_embeds.T (+ scorer.logit_bias for SigLIP)

Every device call runs on a fixed batch (`batch_size` rows; the last batch is padded and the
padding sliced off), so each input shape compiles once. With a mesh the batch is split over its
devices (`ood_jax.sharding.batch_sharding`) and the parameters are replicated. `dtype` is the
computation dtype (bfloat16 on accelerators); parameters stay float32 and outputs are float32.

`encode_images` overlaps the host and the device: JAX dispatches a batch asynchronously, and the
next batch is resized in a thread pool (Pillow releases the GIL) while the device computes.

Text: the tokenizer (transformers' `AutoTokenizer`, from the checkpoint directory, never a hub)
pads and truncates to the text tower's length (the config's max_position_embeddings), as each
model was trained: 77 for CLIP, with the padding mask passed as transformers does (the causal
mask already hides padding from the end token); 64 for SigLIP, without a padding mask, as SigLIP
was trained (big_vision and open_clip attend to the pad tokens, and the pooled last position is a
pad token for short texts).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ood_jax.models import convert as model_convert
from ood_jax.scorers import clip, convert, convert_groupvit, preprocess
from ood_jax import sharding

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _sha256(file: Path) -> str | None:
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None


# Scorer kinds whose image-text probability is a softmax over the texts and whose text tower
# (CLIP's) takes the tokenizer's padding mask; SigLIP's is a sigmoid of each pair's logit.
SOFTMAX_KINDS = ("clip", convert_groupvit.KIND)
KINDS = (*convert.KINDS.values(), convert_groupvit.KIND)


class Scorer:
    """A CLIP, SigLIP or GroupViT model ready to embed images and texts; build it with
    `from_hf`.

    Attributes:
      kind: "clip", "siglip" or "groupvit".
      module, variables: the Flax two-tower model and its float32 parameters.
      preprocessing: the image processor (`preprocess.ImagePreprocessing`).
      logit_scale: exp of the learned log scale, a float (as transformers applies it).
      logit_bias: SigLIP's logit bias, None for CLIP.
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
        mesh: Mesh | None = None,
        batch_size: int = 32,
        num_workers: int | None = None,
    ):
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
        self.logit_scale = float(np.exp(params["t"]))
        self.logit_bias = float(params["b"]) if "b" in params else None
        if mesh is not None:
            variables = jax.device_put(variables, sharding.replicated(mesh))
        self.variables = variables
        self._batch_sharding = None if mesh is None else sharding.batch_sharding(mesh)
        self._tokenizer = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

        # Embeddings are normalized on the host, so that features and embeddings share one
        # compiled function per input shape.
        self._image_fn = jax.jit(functools.partial(_image_features, module))
        self._text_fn = jax.jit(functools.partial(_text_features, module))

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
        return self._run(self._image_fn, _batches([pixels], self._rows(batch_size)))

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
        return self._run(self._text_fn, _batches(arrays, self._rows(batch_size)))

    # ------------------------------------------------------------------ embeddings

    def preprocess(self, image: Any) -> np.ndarray:
        """One uint8 [H, W, 3] image -> the model's input, float32 [h, w, 3]."""
        return self.preprocessing(image)

    def encode_images(
        self, images: Sequence[Any] | np.ndarray, batch_size: int | None = None
    ) -> np.ndarray:
        """uint8 images of any sizes (a list, or one [N, H, W, 3] array) -> L2-normalized
        float32 [N, D], preprocessed as the checkpoint's image processor does."""
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
        if isinstance(images, np.ndarray) and images.ndim != 4:
            raise ValueError(f"an image array must be [N, H, W, 3], got shape {images.shape}")
        if len(images) == 0:
            return np.zeros((0, self.dim), np.float32)
        batches = self._image_batches(images, self._rows(batch_size))
        return _l2_normalize(self._run(self._image_fn, batches))

    def tokenize(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Texts -> {"input_ids"[, "attention_mask"]} int32 [M, text_length], as the model
        expects them."""
        encoded = self.tokenizer(
            list(texts),
            padding="max_length",
            max_length=self.text_length,
            truncation=True,
            return_tensors="np",
        )
        out = {"input_ids": np.asarray(encoded["input_ids"], np.int32)}
        if self.kind in SOFTMAX_KINDS and "attention_mask" in encoded:
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
        embeds = _l2_normalize(self._run(self._text_fn, _batches(arrays, self._rows(batch_size))))
        return _l2_normalize(embeds.reshape(len(templates), len(texts), -1).mean(axis=0))

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
        self, images: Sequence[Any], rows: int
    ) -> Iterator[tuple[int, list[np.ndarray]]]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.num_workers)
        h, w = self.preprocessing.output_size
        for start in range(0, len(images), rows):
            chunk = [images[i] for i in range(start, min(start + rows, len(images)))]
            pixels = np.zeros((rows, h, w, 3), np.float32)
            for i, image in enumerate(
                self._pool.map(self._preprocess_nth, chunk, itertools.count(start))
            ):
                pixels[i] = image
            yield len(chunk), [pixels]

    def _preprocess_nth(self, image: Any, index: int) -> np.ndarray:
        try:
            return self.preprocessing(image)
        except ValueError as e:
            raise ValueError(f"image {index}: {e}") from None

    def _put(self, x: np.ndarray) -> jax.Array:
        if self._batch_sharding is None:
            return jnp.asarray(x)
        return jax.device_put(x, self._batch_sharding)

    def _run(
        self, fn: Callable[..., jax.Array], batches: Iterator[tuple[int, list[np.ndarray]]]
    ) -> np.ndarray:
        """Runs `fn(variables, *batch)` over full batches, one in flight while the next is made."""
        done: list[np.ndarray] = []
        pending: collections.deque[tuple[int, jax.Array]] = collections.deque()
        for valid, arrays in batches:
            pending.append((valid, fn(self.variables, *map(self._put, arrays))))
            if len(pending) > 1:
                valid_before, out = pending.popleft()
                done.append(np.asarray(out)[:valid_before])
        done.extend(np.asarray(out)[:valid] for valid, out in pending)
        if not done:
            return np.zeros((0, self.dim), np.float32)
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


def from_hf(
    path: str | Path,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    *,
    batch_size: int = 32,
    num_workers: int | None = None,
) -> Scorer:
    """A `Scorer` from a transformers CLIPModel / SiglipModel / GroupViTModel directory on disk.

    The directory needs config.json and the weights (model.safetensors, its sharded index, or
    pytorch_model.bin); preprocessor_config.json and the tokenizer files are optional (without
    them the processor class's defaults apply and `encode_texts` raises, naming the files).
    """
    path = Path(path)
    load = (
        convert_groupvit.groupvit_from_hf
        if convert.read_config(path).get("model_type") == convert_groupvit.MODEL_TYPE
        else convert.load_hf
    )
    kind, module, variables, _ = load(path, dtype)
    size = module.image.encoder.pos_grid[0] * module.image.encoder.patch_size
    return Scorer(
        kind,
        module,
        variables,
        preprocess.load_preprocessing(path, kind, size),
        tokenizer_dir=path,
        identity=_identity(
            path,
            dtype,
            _sha256(path / convert.CONFIG_FILE),
            preprocessor_sha256=_sha256(path / preprocess.PREPROCESSOR_FILE),
        ),
        mesh=mesh,
        batch_size=batch_size,
        num_workers=num_workers,
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
    size = module.image.encoder.pos_grid[0] * module.image.encoder.patch_size
    return Scorer(
        "clip",
        module,
        variables,
        preprocess.preprocessing_from_config({}, "clip", size),
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
