"""`remat=True` (deformable sampling by the custom VJP, each encoder and decoder layer
recomputed from its inputs in the backward pass) changes memory, not numbers: DINO and
two-stage Deformable DETR give the same outputs as without it, and the same gradients to float32
rounding, on a batch with a padded image and denoising queries."""

import pathlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ood_jax.models import deformable_detr, denoising, dino, resnet

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]

# The programs here are compiled to be compared (with and without remat), not timed: LLVM at -O0
# compiles them in less time than the suite's -O1 (tests/conftest.py); memory is assigned before
# LLVM runs, so the compiled step's temp bytes are the same at either level (measured on the
# trainer's DINO step at 64 px with remat: 29,758,592 bytes at both).
COMPARED_NOT_TIMED = {"xla_backend_optimization_level": 0}

TINY_RESNET = resnet.ResNet(
    stage_sizes=(1, 1, 1, 1), block="basic", planes=(8, 16, 32, 64), stem_width=8, norm="frozen"
)
SMALL = dict(
    num_classes=5,
    num_queries=12,
    hidden_dim=32,
    num_heads=4,
    num_encoder_layers=1,
    num_decoder_layers=1,
    ffn_dim=64,
    dropout=0.0,
    backbone=TINY_RESNET,
)


def _inputs():
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.standard_normal((2, 32, 32, 3)), jnp.float32)
    pixel_mask = np.ones((2, 32, 32), bool)
    pixel_mask[1, 20:, :] = False
    pixel_mask[1, :, 18:] = False
    return images, jnp.asarray(pixel_mask)


def _denoise():
    labels = jnp.asarray([[1, 4, 0], [2, 2, 3]], jnp.int32)
    boxes = jnp.asarray(np.random.default_rng(1).uniform(0.2, 0.6, (2, 3, 4)), jnp.float32)
    mask = jnp.asarray([[True, True, False], [True, True, True]])
    return denoising.make_cdn_queries(
        jax.random.key(2), labels, boxes, mask, num_classes=5, num_queries=12, num_dn_queries=12
    )


@pytest.mark.parametrize("family", ["dino", "deformable_detr"])
def test_remat_changes_neither_outputs_nor_gradients(family: str) -> None:
    images, pixel_mask = _inputs()
    if family == "dino":
        model, kwargs = dino.DINO(**SMALL), {"denoise": _denoise()}
    else:
        model = deformable_detr.DeformableDetr(**SMALL, two_stage=True, with_box_refine=True)
        kwargs = {}
    variables = jax.jit(model.init, compiler_options=COMPARED_NOT_TIMED)(
        jax.random.key(0), images, pixel_mask
    )

    def run(remat: bool):
        module = model.clone(remat=remat)

        def loss(params):
            out = module.apply({**variables, "params": params}, images, pixel_mask, True, **kwargs)
            leaves = jax.tree.leaves(out)
            return sum(jnp.sum(x * (i + 1)) for i, x in enumerate(leaves)), out

        gradient = jax.grad(loss, has_aux=True)
        return jax.jit(gradient, compiler_options=COMPARED_NOT_TIMED)(variables["params"])

    (ref_grads, ref), (grads, out) = run(False), run(True)
    for ours, theirs in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6 * np.abs(theirs).max())
    # Rounding is relative to the largest gradient: a near-zero leaf is a sum that cancels.
    scale = max(np.abs(x).max() for x in jax.tree.leaves(ref_grads))
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, theirs), ours in zip(flat_ref, jax.tree.leaves(grads)):
        np.testing.assert_allclose(
            ours, theirs, rtol=0, atol=2e-6 * scale, err_msg=jax.tree_util.keystr(path)
        )


def test_recomputed_op_lowers_for_gpu_and_tpu() -> None:
    """The custom VJP's chunked gather and scatter export for both accelerators (the train
    steps of tests/training/test_lowering.py run without remat)."""
    from jax import export

    from ood_jax.models import deformable_attention as da

    shapes = ((6, 7), (3, 4))
    spec = jax.ShapeDtypeStruct
    args = (
        spec((2, 54, 4, 8), jnp.bfloat16),
        spec((2, 9, 4, 2, 3, 2), jnp.float32),
        spec((2, 9, 4, 2, 3), jnp.float32),
    )

    def loss(value, locations, weights):
        out = da.multi_scale_deformable_attention(
            value, shapes, locations, weights, remat=True, query_chunk=4
        )
        return jnp.sum(out.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    exported = export.export(step, platforms=("cuda", "tpu"))(*args)
    assert "callback" not in exported.mlir_module()


# ------------------------------------------------------------------------------------------------
# Through the trainer: remat saves memory on CPU too.
# ------------------------------------------------------------------------------------------------


def _trainer_step_temp_bytes(remat: bool) -> int:
    """Temp bytes of the compiled `train.jit_train_step` of a small DINO (the smoke config, three
    encoder layers) at 256x256, batch 2: compiled abstractly, nothing runs."""
    from ood_jax import config_files, sharding
    from ood_jax.data import pipeline
    from ood_jax.train import train

    config = config_files.load(REPO / "configs" / "synthetic_dino.py", "smoke")
    config.input.image_size = 256
    config.input.batch_size = 2
    config.model.args.num_encoder_layers = 3
    config.model.args.remat = remat
    layout = train.build_layout(config, sharding.make_mesh(config.mesh), steps_per_epoch=10.0)
    batch = pipeline.batch_spec(config.input)
    step = train.jit_train_step(config, layout)
    lowered = step.lower(layout.abstract_state, batch, jax.random.key(0))
    # Added to the step's own options (train.step_compiler_options), which stay in force.
    compiled = lowered.compile(COMPARED_NOT_TIMED)
    return compiled.memory_analysis().temp_size_in_bytes


def test_remat_saves_memory_in_the_trainers_cpu_step() -> None:
    # Measured: 119 MiB without remat; 120 MiB with it before the trainer kept XLA:CPU from
    # merging the recomputation back (train.step_compiler_options), 57 MiB after.
    without, with_remat = _trainer_step_temp_bytes(False), _trainer_step_temp_bytes(True)
    print(
        f"trainer's DINO step temp: {without / 2**20:.0f} MiB, remat {with_remat / 2**20:.0f} MiB"
    )
    assert with_remat < 0.7 * without


def test_the_users_disabled_passes_are_kept(monkeypatch) -> None:
    import ml_collections

    from ood_jax import sharding
    from ood_jax.train import train

    config = ml_collections.ConfigDict({"model": {"args": {"remat": True}}})
    mesh = sharding.make_mesh([("data", -1)])
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true --xla_disable_hlo_passes=a,b")
    assert train.step_compiler_options(config, mesh) == {
        "xla_disable_hlo_passes": "a,b,cse_barrier_expander"
    }
    config.model.args.remat = False
    assert train.step_compiler_options(config, mesh) is None
