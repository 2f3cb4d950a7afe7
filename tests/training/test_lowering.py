"""Every detector's train and predict step lowers for GPU and TPU, checked on this CPU.

The steps are the trainer's own (`train.build_layout`, `train.jit_train_step`,
`train.jit_predict_step`), for DETR, Deformable DETR (two-stage, box refinement) and DINO at a
small size, in float32 and in bfloat16 compute (`config.model.dtype`), exported with
`jax.export` for ("cuda", "tpu") in one module: lowering only, nothing compiles. An op without
a lowering there, or a host callback (which `jax.export` refuses to serialize), fails the
export; a custom call that exists only on the host (LAPACK, the CPU FFT) fails the test.

`ood_jax.models.conv` takes its convolution gradients by im2col matrix products on CPU only
(`lax.platform_dependent`); on GPU and TPU they must stay XLA's convolutions. Its two einsums
name their ops in the exported module's locations ("pk,po->ko" for the kernel gradient,
"po,ko->pk" for the 1x1 input gradient): the accelerator modules must not hold them, and a
CPU export of the same steps must, or the check could not fail.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from jax import export

from ood_jax import config_files, sharding
from ood_jax.data import pipeline
from ood_jax.train import train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
ACCELERATORS = ("cuda", "tpu")
FAMILIES = ("detr", "deformable_detr", "dino")
DTYPES = ("float32", "bfloat16")  # config.model.dtype
ELEMENT_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # -> StableHLO's name
IMAGE_SIZE, BATCH = 64, 2
# Op names of conv.py's CPU-only gradient rules (`kernel_gradient`, `pointwise_input_gradient`).
CPU_BRANCH = ("pk,po->ko", "po,ko->pk")
# Custom calls that exist only on the host: Python callbacks, LAPACK, the CPU FFT.
CPU_CUSTOM_CALL = re.compile(r"callback|cpu|lapack|ducc", re.IGNORECASE)


def small_config(family: str, dtype: str = "float32") -> ml_collections.ConfigDict:
    """The family's smoke config at 64x64, batch 2, with EMA (DETR trains its backbone, the
    others freeze it: between them every conv.py rule is in a train step), computing in
    `dtype`."""
    name = "synthetic_detr" if family == "detr" else "synthetic_dino"
    config = config_files.load(REPO / "configs" / f"{name}.py", "smoke")
    config.input.image_size = IMAGE_SIZE  # eval_size and max_size follow it
    config.input.batch_size = BATCH
    config.ema_decay = 0.9998  # the step with its EMA update: the one without is a part of it
    config.model.dtype = dtype
    if family == "deformable_detr":  # DINO's smoke model, as Deformable DETR's two-stage variant
        config.model.name = family
        config.model.args.two_stage = True
        config.model.args.with_box_refine = True
    return config


def custom_call_targets(module_text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w.$-]+)", module_text)) | set(
        re.findall(r'call_target_name = "([^"]+)"', module_text)
    )


@pytest.fixture(scope="module")
def modules() -> dict[tuple[str, str, tuple[str, ...], str], str]:
    """(family, "train" | "predict", platforms, compute dtype) -> the exported module's text."""
    texts = {}
    for family in FAMILIES:
        for dtype in DTYPES:
            config = small_config(family, dtype)
            mesh = sharding.make_mesh(config.mesh)
            layout = train.build_layout(config, mesh, steps_per_epoch=10.0)
            batch = pipeline.batch_spec(config.input)
            steps = {
                "train": (train.jit_train_step(config, layout), (batch, jax.random.key(0))),
                "predict": (train.jit_predict_step(layout), (batch,)),
            }
            for kind, (step, args) in steps.items():
                cpu_too = kind == "train" and dtype == "float32"  # for the CPU branch's check
                for platforms in (ACCELERATORS, ("cpu",)) if cpu_too else (ACCELERATORS,):
                    exported = export.export(step, platforms=platforms)(
                        layout.abstract_state, *args
                    )
                    assert exported.platforms == platforms
                    texts[family, kind, platforms, dtype] = exported.mlir_module()
    return texts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["train", "predict"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_step_lowers_for_gpu_and_tpu_without_cpu_paths(modules, family, kind, dtype):
    text = modules[family, kind, ACCELERATORS, dtype]
    # The backbone is in it, every convolution (and, training, its gradients) in the dtype.
    convolutions = re.findall(r"stablehlo\.convolution.*-> tensor<[\dx]+(\w+)>", text)
    assert convolutions and set(convolutions) == {ELEMENT_TYPES[dtype]}
    leaked = [name for name in CPU_BRANCH if name in text]
    assert not leaked, f"conv.py's CPU-only gradients {leaked} in the {ACCELERATORS} module"
    host = sorted(t for t in custom_call_targets(text) if CPU_CUSTOM_CALL.search(t))
    assert not host, f"host-only custom calls in the {ACCELERATORS} module: {host}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cpu_export_of_the_train_step_holds_the_cpu_branch(modules, family):
    """What the previous test looks for is there when it should be."""
    text = modules[family, "train", ("cpu",), "float32"]
    assert CPU_BRANCH[0] in text
    if family == "detr":  # the only one whose backbone, with its 1x1 convolutions, trains
        assert CPU_BRANCH[1] in text


def test_host_callbacks_and_cpu_custom_calls_are_caught():
    """What the checks above rely on: `jax.export` refuses a host callback outright, and a
    CPU-only custom call (LAPACK's, for a Cholesky factorization) is recognized by name."""
    spec = jax.ShapeDtypeStruct((3, 3), jnp.float32)

    def with_callback(x):
        return jax.pure_callback(lambda v: v, spec, x)

    with pytest.raises(NotImplementedError, match="callback"):
        export.export(jax.jit(with_callback), platforms=ACCELERATORS)(spec)

    def targets(platforms: tuple[str, ...]) -> set[str]:
        exported = export.export(jax.jit(jnp.linalg.cholesky), platforms=platforms)(spec)
        return custom_call_targets(exported.mlir_module())

    assert any(CPU_CUSTOM_CALL.search(t) for t in targets(("cpu",)))
    assert not any(CPU_CUSTOM_CALL.search(t) for t in targets(ACCELERATORS))
