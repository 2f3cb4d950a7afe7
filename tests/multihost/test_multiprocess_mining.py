"""Mining on several processes (`ood-jax launch`, JAX's CPU collectives over 127.0.0.1):

* 2 processes x 2 devices write the same FOCI options, OODBench splits (a contrastive scorer
  with its embedding cache, and BLIP-2's matching head) and OODG items as 1 process of 4
  devices, with real random-weight CLIP and BLIP-2 checkpoints;
* the embedding cache holds each image once, written by process 0 alone;
* an unreadable image only process 1 reads stops process 1 with the error naming it, and
  process 0 with a line naming process 1, instead of a wait in the next collective.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from test_mining_paper_scorers import _source as coco_source
from test_mining_paper_scorers import save_blip2
from test_multiprocess import HANG_GUARD_S, REPO, environ, launch_command, run
from test_scorers import IMAGE_SIZE, clip_config, save_clip

from ood_jax import datasets

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

BATCH = 8  # 2 rows per device; the FOCI source's 20 images make 3 batches, the last padded
FOLDERS = {"c0": "snow leopard", "c1": "lynx", "c2": "ocelot", "c3": "serval", "c4": "puma"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("scorers")
    save_clip(root / "clip", clip_config())
    save_blip2(root / "blip2")
    return {"clip": root / "clip", "blip2": root / "blip2"}


@pytest.fixture(scope="module")
def foci_source(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("foci")
    rng = np.random.default_rng(0)
    for k, folder in enumerate(sorted(FOLDERS) * 4):
        path = root / "images" / folder / f"{k:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (IMAGE_SIZE + k % 5, IMAGE_SIZE + 3, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
    (root / "class_names.json").write_text(json.dumps(FOLDERS))
    return root


def mine(args: list[str], processes: int) -> subprocess.CompletedProcess:
    """`ood-jax mine ...` as 2 processes x 2 devices, or as 1 process of 4 devices."""
    if processes == 2:
        return run(launch_command(["mine", *args]), environ())
    command = [sys.executable, "-m", "ood_jax", "mine", *args]
    return run(command, environ(devices=4))


def test_foci_options_and_the_cache_as_one_process_writes_them(
    checkpoints, foci_source, compile_cache, tmp_path
):
    common = ["foci", "--dataset", "custom", "--data-dir", str(foci_source), "--quiet"]
    common += ["--scorer", str(checkpoints["clip"]), "--batch-size", str(BATCH)]
    two, one = tmp_path / "two.json", tmp_path / "one.json"
    done = mine([*common, "--out", str(two), "--cache", str(tmp_path / "cache")], 2)
    mine([*common, "--out", str(one)], 1)

    assert two.read_bytes() == one.read_bytes()
    assert done.stdout.count("zero-shot accuracy of this scorer") == 1  # printed once
    manifest = json.loads((tmp_path / "two.manifest.json").read_text())
    assert manifest["status"] == "complete"

    # Each image once, in shards of a batch, written by one process.
    names = [p.name for p in sorted((tmp_path / "cache").iterdir())]
    assert names == ["manifest.json", *(f"shard-{k:06d}.npz" for k in range(3))], names
    ids = [i for k in range(3) for i in np.load(tmp_path / "cache" / f"shard-{k:06d}.npz")["ids"]]
    assert len(ids) == len(set(ids)) == 20


def test_oodbench_splits_as_one_process_writes_them(checkpoints, compile_cache, tmp_path):
    coco_source(tmp_path / "coco", num_images=10)
    common = ["oodbench", "--source", str(tmp_path / "coco"), "--quiet"]
    common += ["--scorer", str(checkpoints["clip"]), "--scorer", str(checkpoints["blip2"])]
    common += ["--match", "blip2", "--batch-size", str(BATCH), "--max-per-split", "0"]
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    mine([*common, "--out", str(two), "--cache", str(tmp_path / "cache")], 2)
    mine([*common, "--out", str(one)], 1)
    assert two.read_bytes() == one.read_bytes()
    records = [json.loads(line) for line in two.read_text().splitlines()]
    assert records and all(set(r["scores"]) == {"clip", "blip2"} for r in records)


def test_oodg_items_as_one_process_writes_them(compile_cache, tmp_path):
    datasets.build("synthetic_shifts", str(tmp_path / "tfds"), config="tiny")
    common = ["oodg", "--dataset", "synthetic_shifts/tiny", "--data-dir", str(tmp_path / "tfds")]
    common += ["--task", "grounding", "--setting", "covariate_shift", "--ice", "1"]
    common += ["--num-items", "4"]
    mine([*common, "--out", str(tmp_path / "two")], 2)
    mine([*common, "--out", str(tmp_path / "one")], 1)
    written = sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*"))
    assert written == sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*"))
    for path in written:
        if (tmp_path / "two" / path).is_file():
            one, two = (
                (tmp_path / "one" / path).read_bytes(),
                (tmp_path / "two" / path).read_bytes(),
            )
            assert one == two, path


def test_an_error_on_one_process_stops_both(checkpoints, foci_source, compile_cache, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(foci_source, source)
    # Sorted, the sixth image is row 5 of the first batch: process 1's (rows 4-7 of 8).
    broken = sorted((source / "images").rglob("*.png"))[5]
    broken.write_bytes(b"not an image")
    out = tmp_path / "options.json"
    args = ["mine", "foci", "--dataset", "custom", "--data-dir", str(source), "--quiet"]
    args += ["--scorer", str(checkpoints["clip"]), "--batch-size", str(BATCH), "--out", str(out)]
    done = subprocess.run(
        launch_command(args), env=environ(), cwd=REPO, capture_output=True,
        text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert f"[1] error: image 5: {broken}: corrupt or unreadable image" in output, output[-4000:]
    assert "error: process 1 of 2 failed (its error is above); process 0 stops too" in output
    assert not out.exists()
