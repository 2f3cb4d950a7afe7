"""The CLIP multiple-choice baseline (FOCI Sec. 4.2, Fig. 3-4): a scorer (`encode_images`,
`encode_texts`, as ood_jax.scorers' have) picks the option whose text is most like the image,
written as an LVLM's run is; `conditional_accuracy` is Fig. 4's LVLM accuracy where CLIP is right
and where it is wrong."""

from __future__ import annotations

import pathlib
import string
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ood_jax.eval import runner, store
from ood_jax.eval.tasks.base import Benchmark, Item, ItemsError

# CLIP's standard single zero-shot prompt; FOCI's exact template is not printed in the paper.
DEFAULT_TEMPLATES = ("a photo of a {}.",)


class Scorer(Protocol):
    def encode_images(self, images: list[np.ndarray]) -> np.ndarray: ...

    def encode_texts(self, texts: list[str], templates: Sequence[str]) -> np.ndarray: ...


def _check_item(item: Item) -> None:
    options, answer = item.meta.get("options"), item.meta.get("answer")
    if not isinstance(options, list) or not isinstance(answer, int) or isinstance(answer, bool):
        raise ItemsError(
            f"item {item.id!r}: the CLIP baseline answers multiple-choice items (options and an "
            "option index as answer)"
        )
    if len(item.request.images) != 1:
        raise ItemsError(
            f"item {item.id!r} has {len(item.request.images)} images; the CLIP baseline scores "
            "one image against the options (use zero-shot items)"
        )


class ClipAnswerer:
    """Answers batches of items with a scorer; option embeddings are computed once per text."""

    def __init__(self, scorer: Scorer, templates: Sequence[str] = DEFAULT_TEMPLATES):
        if not templates:
            raise ValueError("need at least one text template")
        self.scorer, self.templates = scorer, tuple(templates)
        self._text_cache: dict[str, np.ndarray] = {}

    def _text_embeddings(self, texts: Sequence[str]) -> np.ndarray:
        missing = sorted({t for t in texts if t not in self._text_cache})
        if missing:
            encoded = np.asarray(self.scorer.encode_texts(missing, self.templates), np.float32)
            if encoded.shape[0] != len(missing):
                raise ValueError(
                    f"encode_texts returned {encoded.shape[0]} rows for {len(missing)} texts"
                )
            self._text_cache.update(zip(missing, encoded))
        return np.stack([self._text_cache[t] for t in texts])

    def __call__(self, items: list[Item]) -> list[str]:
        for item in items:
            _check_item(item)
        pixels = [np.asarray(item.request.images[0].to_pil(), np.uint8) for item in items]
        image_embeddings = np.asarray(self.scorer.encode_images(pixels), np.float32)
        if image_embeddings.shape[0] != len(items):
            raise ValueError(
                f"encode_images returned {image_embeddings.shape[0]} rows for {len(items)} images"
            )
        replies = []
        for item, image in zip(items, image_embeddings):
            similarities = self._text_embeddings(item.meta["options"]) @ image
            # argmax takes the first of equal similarities: the lower option letter.
            replies.append(string.ascii_uppercase[int(np.argmax(similarities))])
        return replies


def scorer_identity(name: str, templates: Sequence[str]) -> dict:
    return {"client": "clip", "model": name, "templates": list(templates)}


def run_clip_baseline(
    benchmark: Benchmark,
    scorer: Scorer,
    output: str | pathlib.Path,
    scorer_name: str,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    batch_size: int = 64,
    options: runner.RunOptions = runner.RunOptions(),
) -> dict:
    """Runs the baseline over `benchmark` into `output` (resumable, as `runner.run`)."""
    answerer = ClipAnswerer(scorer, templates)
    identity = scorer_identity(scorer_name, templates)
    return runner.run_batched(benchmark, identity, answerer, output, batch_size, options)


def _load_predictions(directory: str | pathlib.Path) -> dict[str, dict]:
    path = pathlib.Path(directory) / store.PREDICTIONS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no predictions")
    return store.PredictionStore(path, repair=False).records


def conditional_accuracy(
    lvlm_dir: str | pathlib.Path, clip_dir: str | pathlib.Path
) -> dict[str, Any]:
    """FOCI Fig. 4: LVLM accuracy on the items CLIP gets right and on those it gets wrong.

    Only items present, with the same digest, in both directories count; failed LVLM requests
    count as wrong.
    """
    lvlm, clip = _load_predictions(lvlm_dir), _load_predictions(clip_dir)
    shared = [i for i in lvlm if i in clip]
    if not shared:
        raise ValueError(f"{lvlm_dir} and {clip_dir} share no item ids")
    mismatched = [i for i in shared if lvlm[i]["digest"] != clip[i]["digest"]]
    if mismatched:
        raise ValueError(
            f"item {mismatched[0]!r} was asked differently in {lvlm_dir} and {clip_dir}"
        )
    out: dict[str, Any] = {"num_items": len(shared)}
    for name, clip_correct in (("clip_correct", True), ("clip_wrong", False)):
        ids = [i for i in shared if bool(clip[i]["correct"]) == clip_correct]
        hits = [bool(lvlm[i]["correct"]) for i in ids]
        out[name] = {
            "lvlm_accuracy": float(np.mean(hits)) if hits else float("nan"),
            "count": len(ids),
        }
    out["clip_accuracy"] = float(np.mean([bool(clip[i]["correct"]) for i in shared]))
    out["lvlm_accuracy"] = float(np.mean([bool(lvlm[i]["correct"]) for i in shared]))
    return out
