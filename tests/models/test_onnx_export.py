"""ONNX export (`ood_jax.models.onnx_export.write_onnx`): tiny random-weight DETR, two-stage
Deformable DETR and DINO, each written once and run in onnxruntime against
`ExportedModel.predict_canvas` on the same canvases (one full, two with padded masks).

Boxes and scores must agree within 1e-4 and labels exactly, except where two detections' scores
tie within the tolerance (DETR: a query's two best classes; top-k: neighbouring ranks), which
may come out in either order: there the graph's (label, box, score) must be one of the
reference's (query, class) pairs. The top-k post-processing really selects (more query-class
pairs than it keeps), and two-stage Deformable DETR and DINO select their queries from the
encoder's proposals with top-k as well. One graph runs a batch of 3 and each of its images
alone (symbolic batch); a graph exported for a fixed batch says so in its input shapes.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

pytest.importorskip("jax2onnx")
ort = pytest.importorskip("onnxruntime")

from ood_jax.models import exported, onnx_export, registry, resnet  # noqa: E402
from ood_jax.testing.detections import assert_same_detections  # noqa: E402
from ood_jax.testing.random_variables import random_variables  # noqa: E402

# Conversion takes seconds per model: left out of `make test-fast`.
pytestmark = pytest.mark.slow

TOL = 1e-4
SIDE = 64
COMMON = dict(
    num_classes=5,
    hidden_dim=32,
    num_heads=4,
    num_encoder_layers=1,
    num_decoder_layers=2,
    ffn_dim=64,
    dropout=0.0,
    # A ResNet-18 of one block per stage at an eighth of the width: every layer kind, and quick
    # to compile and convert.
    backbone=resnet.ResNet(
        stage_sizes=(1, 1, 1, 1), block="basic", planes=(8, 16, 32, 64), stem_width=8
    ),
)
# Three ResNet stages and one extra level: 8x8 + 4x4 + 2x2 + 1x1 = 85 encoder positions at 64.
MULTI_SCALE = dict(
    num_feature_levels=4,
    backbone_stages=("stage2", "stage3", "stage4"),
    encoder_points=2,
    decoder_points=2,
)
MODELS = {
    "detr": dict(COMMON, num_queries=8),
    # 24 queries x 5 classes = 120 pairs, of which post-processing keeps 100.
    "deformable_detr": dict(
        COMMON, **MULTI_SCALE, num_queries=24, two_stage=True, with_box_refine=True
    ),
    # 20 x 16 = 320 pairs, of which post-processing keeps 300.
    "dino": dict(COMMON, **MULTI_SCALE, num_queries=20, num_classes=16),
}


def build(name: str) -> exported.ExportedModel:
    config = ml_collections.ConfigDict({"name": name, "args": MODELS[name]})
    module = registry.build_model(config)
    images = jnp.zeros((1, SIDE, SIDE, 3), jnp.float32)
    variables = random_variables(module, images, jnp.ones((1, SIDE, SIDE), bool))
    input_config = {
        "image_size": SIDE,
        "eval_size": 48,
        "max_size": SIDE,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }
    return exported.ExportedModel(
        module,
        variables,
        [f"class{i}" for i in range(MODELS[name]["num_classes"])],
        input_config,
        step=7,
        model_name=f"tiny_{name}",
    )


def canvases(seed: int, sizes: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Random normalized images of (height, width) at the top-left of zero canvases, and their
    masks, as `ExportedModel.preprocess` lays them out."""
    rng = np.random.default_rng(seed)
    images = np.zeros((len(sizes), SIDE, SIDE, 3), np.float32)
    mask = np.zeros((len(sizes), SIDE, SIDE), bool)
    for i, (height, width) in enumerate(sizes):
        images[i, :height, :width] = rng.standard_normal((height, width, 3))
        mask[i, :height, :width] = True
    return images, mask


def compare(model: exported.ExportedModel, session, images, mask, ref) -> dict[str, float]:
    """Asserts the graph's detections on (images, mask) are `ref` (`predict_canvas`'s on them)
    up to ties (see the module docstring) and returns the max differences."""
    got = dict(zip(onnx_export.OUTPUT_NAMES, session.run(None, {"images": images, "mask": mask})))
    assert got["labels"].dtype == np.int32
    return assert_same_detections(model.module, model.variables, images, mask, got, ref, TOL)


# The whole canvas, an image of 48x36 and one of 40x64 on it: predict_canvas compiles once.
CANVASES = canvases(0, [(SIDE, SIDE), (48, 36), (40, SIDE)])


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """family -> (model, export directory, session, predict_canvas on CANVASES), each family
    built, written (with a readme) and run once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = build(name)
            out = tmp_path_factory.mktemp("onnx") / name
            onnx_export.write_onnx(model, out, extra_files={"README.txt": "tiny"})
            session = ort.InferenceSession(
                str(out / onnx_export.ONNX_FILE), providers=["CPUExecutionProvider"]
            )
            ref = jax.device_get(model.predict_canvas(*CANVASES))
            cache[name] = model, out, session, ref
        return cache[name]

    return get


@pytest.fixture(params=list(MODELS))
def export(request, exports):
    return request.param, *exports(request.param)


def test_onnx_matches_predict_canvas(export):
    name, model, _, session, ref = export
    images, mask = CANVASES
    diff = compare(model, session, images, mask, ref)
    print(f"\n{name}: max |onnxruntime - predict_canvas| {diff}")


def test_one_graph_any_batch(export):
    """The batch-3 graph on one image alone gives predict_canvas's batch-3 detections of it."""
    name, model, _, session, ref = export
    assert session.get_inputs()[0].shape[0] == "batch"
    images, mask = CANVASES
    for i in range(len(images)):
        one = {key: value[i : i + 1] for key, value in ref.items()}
        diff = compare(model, session, images[i : i + 1], mask[i : i + 1], one)
        print(f"\n{name} image {i} alone: max |onnxruntime - predict_canvas| {diff}")


def test_contract_and_extra_files(export):
    name, model, out, session, _ = export
    assert sorted(p.name for p in out.iterdir()) == ["README.txt", "contract.json", "model.onnx"]
    assert [o.name for o in session.get_outputs()] == ["boxes", "scores", "labels"]
    contract = json.loads((out / "contract.json").read_text())
    assert contract["inputs"] == [
        {"name": "images", "shape": ["batch", "64", "64", "3"], "dtype": "float32"},
        {"name": "mask", "shape": ["batch", "64", "64"], "dtype": "bool"},
    ]
    assert contract["artifact"] == "model.onnx" and contract["opset"] == onnx_export.OPSET
    assert contract["preprocessing"]["image_size"] == SIDE
    assert contract["preprocessing"]["std"] == model.input_config["std"]
    assert list(contract["outputs"]) == ["boxes", "scores", "labels"]
    assert contract["class_names"] == model.class_names
    assert contract["model"] == {
        "name": type(model.module).__name__,
        "model_name": f"tiny_{name}",
        "step": 7,
    }


def test_fixed_batch_replaces_previous_export(exports, tmp_path):
    model, previous, _, ref = exports("detr")
    out = tmp_path / "onnx"
    shutil.copytree(previous, out)
    onnx_export.write_onnx(model, out, batch_size=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx"]
    assert sorted(p.name for p in out.iterdir()) == ["contract.json", "model.onnx"]
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [3, SIDE, SIDE, 3]
    assert json.loads((out / "contract.json").read_text())["inputs"][1]["shape"][0] == "3"
    compare(model, session, *CANVASES, ref)


def test_the_converters_own_check_is_back_after_a_conversion(exports):
    """`convert` answers jax2onnx's per-equation connectivity check from the producer node
    during a conversion only (the graphs above are that path's test)."""
    from jax2onnx.converter import output_binding

    exports("detr")
    check = output_binding._value_is_graph_connected
    assert check.__module__ == output_binding.__name__, check


def test_refuses_a_directory_that_is_no_onnx_export(tmp_path):
    model = build("detr")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="other: exists and is no onnx export"):
        onnx_export.write_onnx(model, other)
    # A stablehlo export has a contract but no graph.
    stablehlo = tmp_path / "stablehlo"
    stablehlo.mkdir()
    (stablehlo / "contract.json").write_text("{}")
    with pytest.raises(FileExistsError, match="no onnx export"):
        onnx_export.write_onnx(model, stablehlo)
    assert (other / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "stablehlo"]
