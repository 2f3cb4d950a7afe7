"""A built dataset as plain TFDS reads it: in a fresh interpreter that never imports ood_jax."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

_SCRIPT = """
import json, sys
import tensorflow_datasets as tfds
builder = tfds.builder_from_directory(sys.argv[1])
labels = builder.info.features["objects"]["label"]
out = {}
for split in json.loads(sys.argv[2]) or list(builder.info.splits):
    for r in tfds.as_numpy(builder.as_dataset(split=split)):
        out[str(r["image/id"])] = {
            "split": split,
            "shape": list(r["image"].shape),
            "labels": [labels.int2str(i) for i in r["objects"]["label"]],
        }
assert not any(m.split(".")[0] in ("ood_jax", "tfds_builders") for m in sys.modules)
print(json.dumps(out))
"""


def detection_records(
    dataset_dir: str, splits: Sequence[str] = (), cwd: str | None = None
) -> dict[str, dict]:
    """Image id -> {"split", "shape", "labels"} of a detection dataset's records (of `splits`,
    default all), read by `tfds.builder_from_directory` in a process without ood_jax."""
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, dataset_dir, json.dumps(list(splits))],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise AssertionError(f"plain TFDS could not read {dataset_dir}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
