"""bfloat16 mixed precision, one switch for every detector (`config.model.dtype`).

* With "bfloat16", DETR, Deformable DETR and DINO compute in it (the output of each of their
  submodules and every convolution of the train step, gradients included, is bfloat16) while the state
  (parameters, optimizer state, EMA) is float32, and the losses, the outputs they read, the
  Hungarian matching costs and the detections are float32. Checked on the trainer's own steps
  (`train.build_layout`, `train.jit_train_step`, `train.jit_predict_step`), traced, not run.
* A bfloat16 smoke run's loss follows the float32 run's from the same initialization on the
  same batches (`RTOL`, justified there).
* A dtype that is none is refused in one line naming the field; a changed dtype resumes, said.
* An exported model computes in the dtype it was trained and evaluated in.

The steps lower for GPU and TPU in bfloat16 too: tests/training/test_lowering.py, parametrized by dtype.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lowering import FAMILIES, small_config

from ood_jax import cli, datasets, sharding
from ood_jax.data import pipeline
from ood_jax.models import exported, focal_set_loss, load_exported, registry, set_loss
from ood_jax.train import config_checks, resume, train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = 6
# Relative difference allowed between the two runs' losses at each step. bfloat16 keeps 8
# significant bits (a rounding error of up to 2^-9 = 0.2% per operation); through the backbone,
# 3 transformer layers and the heads the outputs differ by about 1%, and the loss with them
# (measured on this smoke model: 0.1% to 1.6% per step over 10 steps with its backbone trained).
# In a few steps of Adam at lr 2e-4 the two runs' parameters barely part, so the gap does not
# grow; a near tie in the matching may go the other way in one run and move a step's loss by a
# few percent more. 5% leaves room for that; a non-finite or diverging bfloat16 step is outside.
RTOL = 0.05


def dtype_config(family: str, dtype: str, **overrides):
    config = small_config(family, dtype)
    for name, value in overrides.items():
        *parents, leaf = name.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def floating_dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


# ------------------------------------------------------------------------------------------------
# What computes in bfloat16 and what stays float32.
# ------------------------------------------------------------------------------------------------


def trace_train_step(config, monkeypatch):
    """(the layout, the train step's jaxpr text, its output shapes, the dtypes of what the
    losses and the matcher were given), from tracing the trainer's step on `config`'s layout."""
    layout = train.build_layout(config, sharding.make_mesh(config.mesh), steps_per_epoch=10.0)
    seen = {"outputs": set(), "costs": set()}

    def recording(module, name, key, dtypes):
        original = getattr(module, name)

        def wrapper(first, *args, **kwargs):
            seen[key] |= dtypes(first)
            return original(first, *args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    recording(set_loss, "set_loss", "outputs", floating_dtypes)
    recording(focal_set_loss, "focal_set_loss", "outputs", floating_dtypes)
    # Both losses match through set_loss.match_batch, which looks the matcher up when called.
    recording(set_loss, "hungarian_match", "costs", lambda cost: {str(cost.dtype)})
    step = train.jit_train_step(config, layout)
    args = (layout.abstract_state, pipeline.batch_spec(config.input), jax.random.key(0))
    jaxpr, shapes = jax.make_jaxpr(step, return_shape=True)(*args)
    return layout, str(jaxpr), shapes, seen


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_computes_in_bf16_and_keeps_state_losses_and_matching_in_float32(family, monkeypatch):
    config = dtype_config(family, "bfloat16")
    layout, jaxpr, (state, metrics), seen = trace_train_step(config, monkeypatch)
    assert layout.model.dtype == jnp.bfloat16

    # The state, before and after the step: parameters, optimizer state, EMA, BatchNorm
    # statistics.
    assert isinstance(layout.abstract_state, train.EmaTrainState)
    assert floating_dtypes(layout.abstract_state) == {"float32"}
    assert floating_dtypes(state) == {"float32"}

    # The forward pass: every submodule of the detector returns bfloat16 activations (the
    # backbone's stages, projections, encoder and decoder layers, the heads before the cast).
    st = layout.abstract_state
    batch = pipeline.batch_spec(config.input)
    _, captured = jax.eval_shape(
        lambda params, model_state, images, mask: layout.model.apply(
            {"params": params, **model_state},
            images,
            mask,
            train=False,
            capture_intermediates=True,
            mutable=["intermediates"],
        ),
        st.params,
        st.model_state,
        batch["image"],
        batch["image_mask"],
    )
    # (Inside them, Deformable DETR's and DINO's sampling offsets and attention weights are
    # float32 by design: bfloat16 sampling locations would be off by up to a pixel.)
    outputs = {
        name: calls.get("__call__", ())
        for name, calls in captured["intermediates"].items()
        if name != "__call__"
    }
    assert outputs["backbone"]
    for name, output in outputs.items():
        assert floating_dtypes(output) <= {"bfloat16"}, name
    # Every convolution of the train step, forward and backward, is a bfloat16 one.
    convolutions = re.findall(r":(\w+)\[[\d,]*\] = conv_general_dilated", jaxpr)
    assert convolutions and set(convolutions) == {"bf16"}

    # The loss boundary: the outputs the loss reads, the matching costs, the loss and metrics.
    assert seen["outputs"] == {"float32"}
    assert seen["costs"] == {"float32"}
    assert floating_dtypes(metrics) == {"float32"} and "loss" in metrics

    # Evaluation computes in bfloat16 too; the detections are float32.
    detections = jax.eval_shape(train.jit_predict_step(layout), st, batch)
    assert floating_dtypes(detections) == {"float32"}


def test_float32_is_the_default_and_computes_in_float32(monkeypatch):
    """The check above can fail: the same inspection of the default config sees no bfloat16."""
    config = dtype_config("detr", "float32")
    del config.model.dtype  # as configs and config.json files from before the switch
    layout, jaxpr, (state, metrics), seen = trace_train_step(config, monkeypatch)
    assert layout.model.dtype == jnp.float32
    assert "bf16" not in jaxpr
    assert seen == {"outputs": {"float32"}, "costs": {"float32"}}


# ------------------------------------------------------------------------------------------------
# A bfloat16 run follows the float32 one.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


def test_a_bf16_smoke_runs_loss_follows_the_float32_runs(data_dir, tmp_path):
    """DETR's smoke config at 64x64, batch 2, its backbone frozen as in the demo (the step
    compiles faster): STEPS steps in each dtype from one initial state, on the same batches."""
    configs = {
        dtype: dtype_config(
            "detr",
            dtype,
            dataset__data_dir=str(data_dir),
            ema_decay=0.0,
            model__args__freeze_backbone=True,
            optim__frozen_pattern=r"backbone/.*",
            optim__backbone_lr=0.0,
        )
        for dtype in ("float32", "bfloat16")
    }
    experiment = train.setup(configs["float32"], tmp_path)
    layouts = {
        "float32": experiment,
        "bfloat16": train.build_layout(
            configs["bfloat16"], experiment.mesh, experiment.steps_per_epoch
        ),
    }
    # One state for both: parameters and optimizer state are float32 in either dtype.
    assert layouts["bfloat16"].abstract_state == experiment.abstract_state
    initial = jax.device_get(train.initial_state(configs["float32"], experiment))
    host = pipeline.train_iterator(
        experiment.builder, experiment.splits["train"], configs["float32"].input
    )
    batches = sharding.start_global(host, experiment.data_sharding, pipeline.HOST_ONLY_KEYS)
    batches = [next(batches)[0] for _ in range(STEPS)]
    experiment.checkpointer.close()

    losses = {}
    for dtype, layout in layouts.items():
        state = jax.device_put(initial, layout.state_sharding)
        step = train.jit_train_step(configs[dtype], layout)
        losses[dtype] = []
        for batch in batches:
            state, metrics = step(state, batch, experiment.train_rng)
            losses[dtype].append(float(metrics["loss"]))
        assert floating_dtypes(state) == {"float32"}
    assert np.isfinite(losses["bfloat16"]).all()
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=RTOL)
    assert losses["bfloat16"] != losses["float32"]  # the bfloat16 run did compute in bfloat16


# ------------------------------------------------------------------------------------------------
# The config check, resume and export.
# ------------------------------------------------------------------------------------------------


def test_a_dtype_that_is_none_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError) as error:
        config_checks.check_numbers(dtype_config("detr", "float16"))
    assert str(error.value) == (
        "config.model.dtype: 'float16' is not a compute dtype; use one of 'float32', 'bfloat16'"
    )
    # ...before anything is built, in one line from the command line.
    argv = [
        "train",
        f"--config={REPO / 'configs' / 'synthetic_detr.py'}:smoke",
        f"--workdir={tmp_path / 'w'}",
        f"--config.dataset.data_dir={tmp_path / 'nothing'}",
        "--config.model.dtype=bf16",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    message = str(exit_info.value.code)
    assert message.startswith("error: config.model.dtype: 'bf16' is not a compute dtype")
    assert "\n" not in message
    assert not (tmp_path / "nothing").exists()
    # One switch: the model's own field is not a second one.
    config = dtype_config("detr", "float32")
    config.model.args.dtype = "bfloat16"
    with pytest.raises(ValueError, match=r"^config.model.args.dtype: set the compute dtype as "):
        registry.build_model(config.model)


def test_a_changed_dtype_resumes_and_says_so(tmp_path, capsys):
    stored = json.loads(dtype_config("detr", "float32").to_json_best_effort())
    config = dtype_config("detr", "bfloat16")
    assert config_checks.check_resume(stored, config, "w") == []  # no allow_config_change
    note = (
        'config.model.dtype "float32" -> "bfloat16": '
        + config_checks.NOTED_ON_RESUME["model.dtype"]
    )
    assert config_checks.resume_notes(stored, config) == [note]

    class WithCheckpoints:  # all the trainer's check asks of a workdir's checkpointer
        def latest_step(self) -> int:
            return 2

    (tmp_path / resume.CONFIG_FILE).write_text(json.dumps(stored))
    resume.check_workdir_config(config, tmp_path, WithCheckpoints())
    assert capsys.readouterr().out == f"Using {tmp_path}'s checkpoints with {note}\n"
    # A config.json from before the switch was float32.
    del stored["model"]["dtype"]
    assert config_checks.resume_notes(stored, dtype_config("detr", "float32")) == []
    assert len(config_checks.resume_notes(stored, config)) == 1


def test_an_exported_model_computes_in_its_runs_dtype(tmp_path):
    config = dtype_config("detr", "bfloat16")
    layout = train.build_layout(config, sharding.make_mesh(config.mesh), steps_per_epoch=10.0)
    variables = {"params": layout.abstract_state.params, **layout.abstract_state.model_state}
    variables = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), variables)
    payload = exported.make_payload(
        model_config=config.model.to_dict(),
        input_config=config.input.to_dict(),
        mean=pipeline.IMAGENET_MEAN,
        std=pipeline.IMAGENET_STD,
        class_names=None,
        variables=variables,
        step=0,
        model_name=None,
    )
    model = load_exported(exported.write_exported(tmp_path / "model.msgpack", payload))
    assert model.module.dtype == jnp.bfloat16
    assert floating_dtypes(model.variables) == {"float32"}
