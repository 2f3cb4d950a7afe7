"""What `ood-jax stats` reads from files: points (.npy), vectors (.npy, a JSON list, a `stats
drops --out` file) and per-model drops from eval-mllm results.json files. A file that cannot be
read is a ValueError naming it."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np


def load_points(path: str) -> np.ndarray:
    """Points [N, D] (or [N]) from a .npy file."""
    if not path.endswith(".npy"):
        raise ValueError(f"{path}: expected a .npy array of points [N, D] (numpy.save)")
    try:
        array = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except ValueError as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from None
    if array.ndim not in (1, 2):
        raise ValueError(f"{path}: expected points [N, D], got shape {array.shape}")
    return array


def load_vector(path: str) -> np.ndarray:
    """A vector from a .npy file, a JSON list of numbers or a `stats drops --out` file."""
    if path.endswith(".npy"):
        values = load_points(path)
    else:
        data = _read_json(path)
        if isinstance(data, dict):
            if "drops" not in data:
                raise ValueError(f"{path}: a JSON object needs a 'drops' list")
            data = data["drops"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of numbers")
        for i, value in enumerate(data):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{path}: entry {i} is {value!r}, expected a number")
        values = np.asarray(data, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"{path}: expected a vector, got shape {values.shape}")
    return values.astype(np.float64)


def _read_json(path: str) -> object:
    try:
        return json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None


def _split_metric(path: str, data: object, split: str, metric: str) -> float:
    splits = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(splits, dict):
        raise ValueError(
            f"{path}: no 'splits' (an eval-mllm oodbench or oodbench-bap results.json)"
        )
    if split not in splits:
        raise ValueError(f"{path}: no split {split!r} (has {', '.join(splits)})")
    value = splits[split].get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{path}: split {split!r} has no number {metric!r}")
    return float(value)


def drops(results: Sequence[str], metric: str, reference: str, shifted: str) -> dict:
    """Each model's `metric` on split `reference` minus on split `shifted`, from one eval-mllm
    results.json per model: {models, metric, reference, shifted, drops}."""
    models, values = [], []
    for path in results:
        data = _read_json(path)
        base = _split_metric(path, data, reference, metric)
        values.append(base - _split_metric(path, data, shifted, metric))
        models.append(data.get("model", path))
    return {
        "models": models,
        "metric": metric,
        "reference": reference,
        "shifted": shifted,
        "drops": values,
    }
