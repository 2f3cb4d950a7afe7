"""Checks of a training config before anything runs; errors name the field.

`check_numbers` refuses values that would train nothing (or fail deep inside XLA) and still exit
0 with results of the untrained model. `check_resume` holds a workdir with checkpoints to the
config that trained them (its config.json): resuming with another model, data, input, optimizer,
loss or seed would fail inside orbax or, worse, continue a different experiment under the old
one's name. Only `FREE_ON_RESUME` may change; every other field is checked, including any a
config adds later.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import ml_collections

from ood_jax.models import registry

# field path -> (kind, lower bound, whether the bound itself is allowed)
_RULES: dict[str, tuple[type, float, bool]] = {
    "total_steps": (int, 1, True),
    "log_every": (int, 1, True),
    "checkpoint_every": (int, 1, True),
    "keep_checkpoints": (int, 1, True),
    "eval_every": (int, 0, True),
    "eval_batch_size": (int, 1, True),
    "seed": (int, 0, True),
    "input.batch_size": (int, 1, True),
    "input.image_size": (int, 1, True),
    "input.max_size": (int, 1, True),
    "input.eval_size": (int, 1, True),
    "input.max_boxes": (int, 1, True),
    "input.orientation_window": (int, 0, True),
    "optim.lr": (float, 0.0, True),
    "optim.backbone_lr": (float, 0.0, True),
    "optim.weight_decay": (float, 0.0, True),
    "optim.clip_norm": (float, 0.0, False),
    "optim.warmup_steps": (int, 0, True),
    "pretrain.steps": (int, 0, True),
    "pretrain.batch_size": (int, 1, True),
    "pretrain.lr": (float, 0.0, False),
    "ema_decay": (float, 0.0, True),
}


def _lookup(config: ml_collections.ConfigDict, path: str) -> tuple[bool, Any]:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_numbers(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first field of `_RULES` whose value is out of range, an
    ema_decay of 1 or more, a config.model.dtype that is no compute dtype, or a model-selection
    fraction (config.selection) that is no share of a split."""
    for path, (kind, low, inclusive) in _RULES.items():
        present, value = _lookup(config, path)
        if not present:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int and not (number and float(value).is_integer()):
            raise ValueError(f"config.{path}: expected an integer, got {value!r}")
        if not number or not math.isfinite(value):
            raise ValueError(f"config.{path}: expected a finite number, got {value!r}")
        if value < low or (value == low and not inclusive):
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ValueError(f"config.{path}: must be {bound}, got {value!r}")
    if config.get("ema_decay", 0.0) >= 1:  # an average that never moves from the initialization
        raise ValueError(
            f"config.ema_decay: must be < 1 (0 turns EMA off), got {config.ema_decay!r}"
        )
    if "model" in config:
        registry.compute_dtype(config.model)
    fractions = {"val_fraction": (0.0, True), "oracle_fraction": (0.0, False)}
    for field, (low, inclusive) in fractions.items():
        present, value = _lookup(config, f"selection.{field}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if present and not (number and (low <= value if inclusive else low < value) and value < 1):
            bound = "[0, 1)" if inclusive else "(0, 1)"
            raise ValueError(
                f"config.selection.{field}: must be a fraction in {bound}, got {value!r}"
            )


def ema_enabled(config: ml_collections.ConfigDict | dict) -> bool:
    """Whether a config (or the JSON of one) keeps an EMA of the parameters."""
    return (config.get("ema_decay") or 0.0) > 0


# Fields (and the fields under them) a resumed run may change: how long and how often (steps,
# intervals, checkpoints kept, eval batch size), where files are (data_dir; backbone_weights is
# read on a fresh start only), on which devices (mesh, partition rules, multi-host) and in which
# compute dtype (parameters and optimizer state are float32 in either, so the checkpoints restore
# as they are, as onto another mesh; `resume_notes` says so, and the saved config records it).
# Model selection's fields are not free: the validation slice and a left-out domain change what
# the run trains on, the oracle's fraction what its evaluations record.
FREE_ON_RESUME = (
    "total_steps",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_batch_size",
    "model_name",
    "distributed",
    "mesh",
    "partition_rules",
    "dataset.data_dir",
    "dataset.build_if_missing",
    "model.backbone_weights",
    "model.dtype",
    "allow_config_change",
)

_ABSENT = object()

# Fields added after workdirs were trained without them -> the value an older config.json that
# lacks one stands for (what the trainer did before), so resuming those is no change.
ADDED_FIELDS = {
    "ema_decay": 0.0,
    "ema_warmup": True,
    "input.orientation_window": 0,
    "model.dtype": "float32",
    "selection.val_fraction": 0.0,
    "selection.oracle_fraction": 0.2,
    "selection.leave_out": "",
}

# Free fields whose change still changes what the resumed steps compute -> what resuming says.
NOTED_ON_RESUME = {
    "model.dtype": (
        "parameters and optimizer state are float32 in either dtype, so the checkpoints "
        "resume as they are; the steps from here compute in the new one"
    ),
}


def config_values(config: ml_collections.ConfigDict | dict) -> dict[str, Any]:
    """{dotted field path: value} of a config as JSON holds it (tuples become lists)."""
    if isinstance(config, ml_collections.ConfigDict):
        config = json.loads(config.to_json_best_effort())
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(config, "")
    return flat


def _is_free(path: str) -> bool:
    return any(path == free or path.startswith(free + ".") for free in FREE_ON_RESUME)


def changed_fields(stored: dict, config: ml_collections.ConfigDict) -> list[tuple[str, Any, Any]]:
    """(field, stored value, new value) for each field that differs, free ones included."""
    old = {**ADDED_FIELDS, **config_values(stored)}
    new = {**ADDED_FIELDS, **config_values(config)}
    return [
        (path, old.get(path, _ABSENT), new.get(path, _ABSENT))
        for path in sorted(old.keys() | new.keys())
        if old.get(path, _ABSENT) != new.get(path, _ABSENT)
    ]


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """`model.args.hidden_dim 32 -> 64, input.image_size 96 -> 128`."""

    def value(v: Any) -> str:
        return "(absent)" if v is _ABSENT else json.dumps(v)

    return ", ".join(f"{path} {value(old)} -> {value(new)}" for path, old, new in changes)


def resume_notes(stored: dict, config: ml_collections.ConfigDict) -> list[str]:
    """One line per `NOTED_ON_RESUME` field that differs from the stored config."""
    return [
        f"config.{describe_changes([change])}: {NOTED_ON_RESUME[change[0]]}"
        for change in changed_fields(stored, config)
        if change[0] in NOTED_ON_RESUME
    ]


def check_resume(
    stored: dict, config: ml_collections.ConfigDict, workdir: str | pathlib.Path
) -> list[tuple[str, Any, Any]]:
    """Raises ValueError naming each field outside `FREE_ON_RESUME` that differs from the
    config the workdir's checkpoints were trained with, unless `config.allow_config_change`.
    A field added after workdirs were trained without it (`ADDED_FIELDS`) is compared as the
    value it then had.

    Returns the changed fields that are not free (empty unless allow_config_change let them
    through), for the caller to report. Turning EMA on or off is refused in any case.
    """
    if ema_enabled(stored) != ema_enabled(config):
        stored_decay = stored.get("ema_decay") or 0.0
        was = f"ema_decay {stored_decay}" if ema_enabled(stored) else "no EMA"
        raise ValueError(
            f"config.ema_decay: --workdir {workdir} holds checkpoints trained with {was}, and "
            f"this config has ema_decay {config.get('ema_decay', 0.0)}: an EMA cannot be "
            "started or dropped on resume (the checkpoints hold the average or they do not); "
            f"resume with --config.ema_decay={stored_decay}, or use a fresh --workdir"
        )
    guarded = [change for change in changed_fields(stored, config) if not _is_free(change[0])]
    if guarded and not config.get("allow_config_change", False):
        raise ValueError(
            f"--workdir {workdir} holds checkpoints of another config "
            f"({describe_changes(guarded)}): they would not fit or would continue a different "
            "experiment; use a fresh --workdir, or --config.allow_config_change=True to resume "
            "anyway"
        )
    return guarded
