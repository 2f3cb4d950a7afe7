"""Exported detectors (`ood_jax.train.export` -> `ood_jax.models.load_exported`).

One short smoke run (2 steps, a checkpoint at each) is exported; the file must rebuild the model
the run saved, prepare images as the evaluation pipeline does, load without the training stack,
name bad files, and never be left half written.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from flax import serialization

from ood_jax.data import pipeline
from ood_jax.models import EXPORT_FORMAT_VERSION, load_exported, registry, transformers_export
from ood_jax.testing.detections import assert_same_detections
from ood_jax.train import checkpoint, train
from ood_jax.train import export as export_lib

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "configs" / "synthetic_detr.py"
TRAINING_STACK = ("optax", "orbax", "tensorflow", "tensorflow_datasets", "keras")


def smoke_config(data_dir: pathlib.Path) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location("synthetic_detr_config", CONFIG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.dataset.data_dir = str(data_dir)
    config.total_steps = 2
    config.checkpoint_every = 1
    return config


@pytest.fixture(scope="module")
def run(tmp_path_factory, compile_cache) -> dict[str, Any]:
    """A 2-step smoke run, the variables it handed to each checkpoint save, and its export."""
    config = smoke_config(tmp_path_factory.mktemp("tfds"))
    workdir = tmp_path_factory.mktemp("run")
    saved = {}
    save = checkpoint.Checkpointer.save

    def recording_save(self, step: int, state: Any, meta: dict, **kwargs: Any) -> bool:
        # Copied before the save, as the next step donates the state's buffers.
        variables = jax.device_get({"params": state.params, **state.model_state})
        started = save(self, step, state, meta, **kwargs)
        if started:
            saved[step] = variables
        return started

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint.Checkpointer, "save", recording_save)
        train.train_and_evaluate(config, str(workdir))
    assert sorted(saved) == [1, 2]
    out = export_lib.export(workdir, tmp_path_factory.mktemp("export") / "detr.msgpack")
    return {"config": config, "workdir": workdir, "saved": saved, "exported": out}


@functools.partial(jax.jit, static_argnums=0)
def apply(module: nn.Module, variables: Any, images: Any, mask: Any) -> dict[str, Any]:
    return module.apply(variables, images, mask, train=False)


def assert_trees_equal(actual: Any, expected: Any) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), e, err_msg=jax.tree_util.keystr(path))


def test_exported_model_is_the_checkpointed_model(run):
    config = run["config"]
    model = load_exported(run["exported"])
    assert model.step == 2
    assert model.model_name == config.model_name
    assert model.input_config == {
        "image_size": 96,
        "eval_size": 96,
        "max_size": 96,
        "mean": list(pipeline.IMAGENET_MEAN),
        "std": list(pipeline.IMAGENET_STD),
    }
    builder = tfds.builder(config.dataset.name, data_dir=config.dataset.data_dir)
    assert model.class_names == builder.info.features["objects"]["label"].names
    assert len(model.class_names) == config.model.args.num_classes
    assert_trees_equal(model.variables, run["saved"][2])

    reference = registry.build_model(config.model)
    assert model.module == reference
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 96, 96, 3)).astype(np.float32)
    mask = np.ones((2, 96, 96), bool)
    mask[1, :, 70:] = False

    ours = apply(model.module, model.variables, images, mask)
    theirs = apply(reference, run["saved"][2], images, mask)
    for name in ("logits", "boxes"):
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6, err_msg=name)


def test_export_of_a_given_step(run, tmp_path):
    path = export_lib.export(
        run["workdir"], tmp_path / "step1.msgpack", step=1, class_names=list("abcdefgh")
    )
    model = load_exported(path)
    assert model.step == 1
    assert model.class_names == list("abcdefgh")
    assert_trees_equal(model.variables, run["saved"][1])
    first, last = run["saved"][1]["params"], run["saved"][2]["params"]
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(last))
    )


def test_predict_prepares_images_as_the_eval_pipeline(run):
    """Same canvas and mask as `pipeline.eval_dataset`, and detections in source pixels."""
    config = run["config"]
    model = load_exported(run["exported"])
    builder = tfds.builder(config.dataset.name, data_dir=config.dataset.data_dir)
    split = train.experiment_splits(config.dataset, builder)["sky"]
    eval_input = ml_collections.ConfigDict(config.input.to_dict())
    eval_input.batch_size = 4
    batch = next(pipeline.eval_dataset(builder, split, eval_input).as_numpy_iterator())
    sources = {
        int(ex["image/id"]): ex["image"]
        for ex in builder.as_dataset(split=split, shuffle_files=False).as_numpy_iterator()
    }
    images = [sources[int(i)] for i in batch["image_id"]]
    for image, canvas, mask in zip(images, batch["image"], batch["image_mask"]):
        ours, our_mask = model.preprocess(image)
        np.testing.assert_allclose(ours, canvas, rtol=0, atol=1e-4)
        np.testing.assert_array_equal(our_mask, mask)

    # Non-square images, upscaled and downscaled past max_size, through the pipeline's resize
    # (private, but it is the definition being matched).
    rng = np.random.default_rng(1)
    for shape in [(40, 70, 3), (300, 150, 3)]:
        image = rng.integers(0, 256, shape, np.uint8)
        resized, size = pipeline._resize(tf.constant(image), config.input.eval_size, 96, (96, 96))
        canvas, mask = pipeline._canvas(resized, size, (96, 96))
        ours, our_mask = model.preprocess(image)
        assert model.resized_size(*shape[:2]) == tuple(size.numpy())
        np.testing.assert_allclose(ours, canvas.numpy(), rtol=0, atol=1e-4)
        np.testing.assert_array_equal(our_mask, mask.numpy())

    detections = model.predict(images)
    outputs = apply(model.module, model.variables, batch["image"], batch["image_mask"])
    probs = np.asarray(jax.nn.softmax(outputs["logits"], axis=-1))[..., :-1]
    expected_boxes = pipeline.coco_boxes(np.asarray(outputs["boxes"]), batch["orig_size"])
    # The canvases agree to 1e-4 rather than bit for bit, hence the tolerances.
    for i, found in enumerate(detections):
        assert found["boxes"].shape == (config.model.args.num_queries, 4)
        np.testing.assert_allclose(found["boxes"], expected_boxes[i], rtol=0, atol=1e-2)
        np.testing.assert_allclose(found["scores"], probs[i].max(-1), rtol=0, atol=1e-4)


def test_inference_does_not_import_the_training_stack(run):
    code = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        from ood_jax.models import load_exported

        model = load_exported(sys.argv[1])
        found = model.predict(np.zeros((50, 70, 3), np.uint8))
        assert found["boxes"].shape == (model.module.num_queries, 4)
        print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & {set(TRAINING_STACK)!r})))
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(run["exported"])],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_bad_paths_are_named(run, tmp_path):
    missing = tmp_path / "missing.msgpack"
    with pytest.raises(FileNotFoundError, match="missing.msgpack"):
        load_exported(missing)
    garbage = tmp_path / "garbage.msgpack"
    garbage.write_bytes(b"\xc1 not msgpack")
    with pytest.raises(ValueError, match="garbage.msgpack"):
        load_exported(garbage)
    future = tmp_path / "future.msgpack"
    future.write_bytes(serialization.msgpack_serialize({"format_version": 99}))
    with pytest.raises(
        ValueError, match=f"future.msgpack: format_version 99.*{EXPORT_FORMAT_VERSION}"
    ):
        load_exported(future)

    with pytest.raises(FileNotFoundError, match="nowhere"):
        export_lib.export(tmp_path / "nowhere", tmp_path / "out.msgpack")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 7; there are \[1, 2\]"):
        export_lib.export(run["workdir"], tmp_path / "out.msgpack", step=7)
    with pytest.raises(ValueError, match="3 class names for config.model.args.num_classes=8"):
        export_lib.export(run["workdir"], tmp_path / "out.msgpack", class_names=["a", "b", "c"])
    for file_format in ("msgpack", "transformers", "pytorch"):
        with pytest.raises(ValueError, match=f"stablehlo or onnx, not {file_format}"):
            export_lib.export(
                run["workdir"], tmp_path / "out.msgpack", file_format=file_format, batch_size=2
            )
    assert not (tmp_path / "out.msgpack").exists()


@pytest.mark.parametrize("failing", ["serialization.msgpack_serialize", "os.fsync"])
def test_failed_export_leaves_the_old_file_and_no_partial_one(run, tmp_path, monkeypatch, failing):
    out = tmp_path / "detr.msgpack"
    out.write_bytes(b"previous export")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    module, _, name = failing.rpartition(".")
    monkeypatch.setattr({"serialization": serialization, "os": os}[module], name, fail)
    with pytest.raises(OSError, match="disk full"):
        export_lib.export(run["workdir"], out)
    assert out.read_bytes() == b"previous export"
    assert [p.name for p in tmp_path.iterdir()] == ["detr.msgpack"]


# Runs in a fresh interpreter that cannot import ood_jax: the artifact needs jax alone.
_PORTABLE_CHILD = """
import importlib.abc, json, pathlib, sys

class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ood_jax", "tfds_builders"):
            raise ImportError(f"{name} is hidden")

sys.meta_path.insert(0, Hidden())
import jax
import numpy as np

out = pathlib.Path(sys.argv[1])
contract = json.loads((out / "contract.json").read_text())
artifact = (out / contract["artifact"]).read_bytes()
exp = jax.export.deserialize(bytearray(artifact))
inputs = np.load(sys.argv[2])
found = exp.call(inputs["images"], inputs["mask"])
np.savez(sys.argv[3], **{k: np.asarray(v) for k, v in found.items()})
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"ood_jax", "tfds_builders"})))
"""


def test_stablehlo_export_runs_with_jax_alone(run, tmp_path):
    """`ood-jax export --format stablehlo`: an artifact for cpu, cuda and tpu whose predict,
    loaded without ood_jax, gives the exported model's detections on prepared images."""
    from ood_jax import cli

    out = tmp_path / "portable"
    cli.main(
        ["export", "--workdir", str(run["workdir"]), "--out", str(out), "--format", "stablehlo"]
    )
    model = load_exported(run["exported"])
    contract = json.loads((out / "contract.json").read_text())
    assert contract["platforms"] == ["cpu", "cuda", "tpu"]
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "contract.json",
        "predict.jax_export",
    ]
    assert [i["shape"] for i in contract["inputs"]] == [
        ["batch", "96", "96", "3"],
        ["batch", "96", "96"],
    ]
    assert contract["class_names"] == model.class_names and contract["model"]["step"] == 2
    assert contract["preprocessing"]["mean"] == list(pipeline.IMAGENET_MEAN)

    rng = np.random.default_rng(3)
    images = [
        rng.integers(0, 256, size, np.uint8) for size in ((50, 70, 3), (96, 40, 3), (120, 130, 3))
    ]
    prepared = [model.preprocess(image) for image in images]
    canvas = np.stack([np.asarray(c) for c, _ in prepared])
    mask = np.stack([np.asarray(m) for _, m in prepared])
    np.savez(tmp_path / "inputs.npz", images=canvas, mask=mask)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _PORTABLE_CHILD,
            str(out),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "found.npz"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    found = dict(np.load(tmp_path / "found.npz"))
    expected = jax.device_get(model.predict_canvas(canvas, mask))
    assert set(found) == set(expected) == {"boxes", "scores", "labels"}
    # The child compiles the artifact's StableHLO itself: another executable than this
    # process's, whose scores round apart in the last bits (1.1e-6 seen on 0.33).
    assert_same_detections(model.module, model.variables, canvas, mask, found, expected, tol=1e-5)


def test_stablehlo_export_fixed_batch_replaces_refuses(run, tmp_path):
    out = tmp_path / "portable"
    export_lib.export(run["workdir"], out, step=1, file_format="stablehlo", batch_size=2)
    contract = json.loads((out / "contract.json").read_text())
    assert (
        contract["inputs"][0]["shape"] == ["2", "96", "96", "3"] and contract["model"]["step"] == 1
    )
    export_lib.export(run["workdir"], out, file_format="stablehlo")  # replaces the previous one
    assert json.loads((out / "contract.json").read_text())["model"]["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["portable"]
    (tmp_path / "other").mkdir()
    with pytest.raises(FileExistsError, match="other: exists and is no stablehlo export"):
        export_lib.export(run["workdir"], tmp_path / "other", file_format="stablehlo")
    with pytest.raises(ValueError, match="unknown export format 'tflite'"):
        export_lib.export(run["workdir"], tmp_path / "x", file_format="tflite")


def test_onnx_export_runs_in_onnxruntime_as_ours(run, tmp_path):
    """`ood-jax export --format onnx` of the trained run: onnxruntime gives the exported
    model's detections (tests/models/test_onnx_export.py covers each family)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    from ood_jax import cli

    out = tmp_path / "onnx"
    cli.main(["export", "--workdir", str(run["workdir"]), "--out", str(out), "--format", "onnx"])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "contract.json", "model.onnx"]
    contract = json.loads((out / "contract.json").read_text())
    assert contract["inputs"][0]["shape"] == ["batch", "96", "96", "3"]
    model = load_exported(run["exported"])
    rng = np.random.default_rng(4)
    prepared = [
        model.preprocess(rng.integers(0, 256, size, np.uint8))
        for size in ((50, 70, 3), (96, 40, 3))
    ]
    canvas = np.stack([np.asarray(c) for c, _ in prepared])
    mask = np.stack([np.asarray(m) for _, m in prepared])
    session = onnxruntime.InferenceSession(str(out / "model.onnx"))
    got = dict(
        zip(("boxes", "scores", "labels"), session.run(None, {"images": canvas, "mask": mask}))
    )
    expected = jax.device_get(model.predict_canvas(canvas, mask))
    assert_same_detections(model.module, model.variables, canvas, mask, got, expected, tol=1e-4)
    with pytest.raises(FileExistsError, match="is no stablehlo export"):
        export_lib.export(run["workdir"], out, file_format="stablehlo")


# ------------------------------------------------------------------------------------------------
# --format transformers: loaded by transformers itself.
# ------------------------------------------------------------------------------------------------


def test_transformers_export_loads_in_transformers_and_predicts_as_ours(run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ood_jax.models import convert

    out = export_lib.export(run["workdir"], tmp_path / "detr_hf", file_format="transformers")
    model, info = transformers.DetrForObjectDetection.from_pretrained(out, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    model.eval()
    exported = load_exported(run["exported"])
    assert model.config.id2label == dict(enumerate(exported.class_names))
    processor = transformers.DetrImageProcessor.from_pretrained(out)
    assert processor.size == {"shortest_edge": 96, "longest_edge": 96}
    assert list(processor.image_mean) == list(pipeline.IMAGENET_MEAN)
    assert list(processor.image_std) == list(pipeline.IMAGENET_STD)

    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 96, 128, 3)).astype(np.float32)
    mask = np.ones((2, 96, 128), bool)
    mask[1, 60:, :] = False
    mask[1, :, 80:] = False
    ours = apply(exported.module, exported.variables, images, mask)
    with torch.no_grad():
        theirs = model(
            pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2).copy()),
            pixel_mask=torch.from_numpy(mask.astype(np.int64)),
        )
    for name, reference in (("logits", theirs.logits), ("boxes", theirs.pred_boxes)):
        difference = np.abs(np.asarray(ours[name]) - reference.numpy()).max()
        print(f"transformers' {name} against ours: max |difference| {difference:.2e}")
        assert difference <= 1e-5, (name, difference)

    # The model card says what the model is and where its numbers came from.
    card = (out / "README.md").read_text()
    trained = json.loads((run["workdir"] / "manifest.json").read_text())
    assert card.startswith(f"# {run['config'].model_name}\n")
    assert "Results at step 2" in card  # results.json is the exported step's
    assert trained["dataset"]["digest"]["sha256"] in card
    assert trained["checkpoint"]["digest"]["sha256"] in card

    # Read back by our importer: the variables inference uses, bit for bit.
    _, reread = convert.detr_from_hf(out)
    written = by_path(
        transformers_export.inference_variables(run["config"].model.args, exported.variables)
    )
    assert by_path(reread).keys() == written.keys()
    for path, value in written.items():
        np.testing.assert_array_equal(by_path(reread)[path], value, err_msg=path)


def by_path(variables) -> dict[str, np.ndarray]:
    """Leaves by module path, whichever collection holds them (a BatchNorm trained with batch
    statistics keeps scale and bias in params; transformers' frozen one, in batch_stats)."""
    flat = jax.tree_util.tree_leaves_with_path(variables)
    return {jax.tree_util.keystr(path[1:]): np.asarray(leaf) for path, leaf in flat}


def test_transformers_export_refuses_what_transformers_cannot_express():
    with pytest.raises(ValueError, match=r"backbone='vit_s16'.*cannot be exported"):
        transformers_export.detr_config({"backbone": "vit_s16", "num_classes": 3}, None)
