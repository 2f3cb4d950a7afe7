"""The exponential moving average of the parameters (`config.ema_decay`, ood_jax/train/optim.py).

* the update rule, warmup or none, against a numpy reference over several steps, and inside
  the trainer's jitted step against the parameters each step made;
* a run whose newest checkpoint is lost (as a kill leaves it) and resumed ends with the EMA
  of the uninterrupted run, bit for bit;
* evaluation and export use the EMA parameters;
* off (the default), the train state is the one the trainer always had, and a workdir cannot
  turn EMA on or off on resume.

One smoke run (configs/synthetic_detr.py:smoke, 4 steps, EMA on) serves every test that needs
one; the resumed run loads its compiled step from the module's compilation cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_checkpoint_recovery as recovery

from ood_jax import cli, datasets, sharding
from ood_jax.data import pipeline
from ood_jax.models import load_exported
from ood_jax.train import config_checks, export, optim, resume, train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "configs" / "synthetic_detr.py"
STEPS = 4
# With the warmup (the default) the 4 steps' decays are its cap (1 + t) / (10 + t), 0.1 to
# 0.31; where the cap stops binding is checked on the rule alone.
DECAY = 0.5


def smoke_config(data_dir: pathlib.Path | None = None, **overrides) -> ml_collections.ConfigDict:
    return recovery.smoke_config(data_dir, total_steps=STEPS, **overrides)


def load_state(workdir: pathlib.Path, step: int) -> dict:
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(workdir / "checkpoints" / str(step) / "state")


def assert_trees_equal(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), jax.tree_util.keystr(path))


def reference_ema(steps: list, decay: float, warmup: bool) -> list:
    """EMA after each of `steps` (the parameters at step 0, 1, ...), float64 numpy."""
    ema = [np.asarray(steps[0], np.float64)]
    for t, params in enumerate(steps[1:]):
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        ema.append(d * ema[-1] + (1 - d) * np.asarray(params, np.float64))
    return ema


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir, compile_cache):
    """A 4-step EMA run (checkpoints at 1, 2 and 4), and the parameters each step made."""
    workdir = tmp_path_factory.mktemp("run") / "workdir"
    # The backbone frozen, as in the demo: the step compiles faster, and the average of the
    # backbone must stay the backbone itself.
    config = smoke_config(
        data_dir,
        ema_decay=DECAY,
        model__args__freeze_backbone=True,
        optim__frozen_pattern=r"backbone/.*",
        optim__backbone_lr=0.0,
    )
    params = []

    class Recording(train.CompiledOnFirstCall):
        def __call__(self, *args):
            if self.what != "train step":
                return super().__call__(*args)
            if not params:  # before the step donates them
                params.append(jax.device_get(args[0].params))
            state, metrics = super().__call__(*args)
            params.append(jax.device_get(state.params))
            return state, metrics

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        mp.setattr(train, "CompiledOnFirstCall", Recording)
        train.train_and_evaluate(config, str(workdir))
    return {"config": config, "workdir": workdir, "params": params}


# ------------------------------------------------------------------------------------------------
# The rule.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("warmup", [True, False])
def test_update_rule_matches_numpy(warmup):
    rng = np.random.default_rng(0)
    steps = [{"w": rng.normal(size=(3, 5)).astype(np.float32)}]
    for _ in range(6):
        steps.append({"w": steps[-1]["w"] + rng.normal(size=(3, 5)).astype(np.float32)})
    frozen = rng.normal(size=(7,)).astype(np.float32)
    update = jax.jit(optim.update_ema, static_argnames=("decay", "warmup"))

    ema = optim.init_ema({**steps[0], "frozen": frozen})
    for t, params in enumerate(steps[1:]):
        ema = update(ema, {**params, "frozen": frozen}, jnp.int32(t), decay=0.9, warmup=warmup)
    expected = reference_ema([s["w"] for s in steps], 0.9, warmup)[-1]
    assert ema["w"].dtype == jnp.float32
    np.testing.assert_allclose(ema["w"], expected, rtol=1e-6, atol=1e-6)
    # A parameter that never moves keeps an average equal to itself, not merely close.
    np.testing.assert_array_equal(ema["frozen"], frozen)
    # The warmup's cap binds in the first steps and not once (1 + t) / (10 + t) passes 0.9.
    decays = [float(optim.ema_decay_at(jnp.int32(t), 0.9, warmup)) for t in (0, 1, 100)]
    expected_decays = [0.1, 2 / 11, 0.9] if warmup else [0.9, 0.9, 0.9]
    np.testing.assert_allclose(decays, expected_decays, rtol=1e-6)


def test_the_train_step_averages_the_parameters_each_step_made(run):
    params = run["params"]
    assert len(params) == STEPS + 1
    ema = load_state(run["workdir"], STEPS)["ema_params"]
    path_leaves = jax.tree_util.tree_leaves_with_path(params[0])
    moved = 0
    for i, (path, _) in enumerate(path_leaves):
        history = [jax.tree.leaves(p)[i] for p in params]
        expected = reference_ema(history, DECAY, warmup=True)[-1]
        actual = jax.tree.leaves(ema)[i]
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7, err_msg=name)
        moved += not np.array_equal(history[-1], history[0])
        if name.startswith("['backbone']"):  # frozen: its average is itself, bit for bit
            np.testing.assert_array_equal(actual, history[0], err_msg=name)
    assert moved  # the smoke run trains: the average follows something


def test_the_average_starts_at_pretrained_backbone_weights(run, tmp_path):
    """And in buffers of its own: the train step donates the parameters and the average."""
    from flax import serialization

    config = run["config"]
    experiment = train.setup(config, tmp_path / "fresh")
    state = train.initial_state(config, experiment)
    variables = {
        "params": jax.tree.map(lambda x: np.asarray(x) + 1, state.params["backbone"]),
        "batch_stats": jax.device_get(state.model_state["batch_stats"]["backbone"]),
    }
    path = tmp_path / "backbone.msgpack"
    path.write_bytes(serialization.msgpack_serialize(variables))
    loaded = train.load_pretrained_backbone(
        state, config.model.args, path, experiment.state_sharding
    )
    assert_trees_equal(loaded.ema_params["backbone"], variables["params"])
    assert_trees_equal(loaded.ema_params["input_projection"], state.params["input_projection"])

    host = pipeline.train_iterator(experiment.builder, experiment.splits["train"], config.input)
    batch, _ = next(sharding.start_global(host, experiment.data_sharding, pipeline.HOST_ONLY_KEYS))
    stepped, _ = train.jit_train_step(config, experiment)(loaded, batch, experiment.train_rng)
    assert_trees_equal(stepped.ema_params["backbone"], variables["params"])  # frozen
    experiment.checkpointer.close()


# ------------------------------------------------------------------------------------------------
# Resume.
# ------------------------------------------------------------------------------------------------


def test_a_resumed_run_ends_with_the_uninterrupted_runs_average(run, data_dir, tmp_path):
    """Checkpoint 4 and the results removed, as a kill after checkpoint 2 leaves a workdir."""
    workdir = tmp_path / "resumed"
    shutil.copytree(run["workdir"], workdir)
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))
    (workdir / "results.json").unlink()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.train_and_evaluate(run["config"], str(workdir))
    assert "Resumed from step 2" in out.getvalue()

    resumed, uninterrupted = load_state(workdir, STEPS), load_state(run["workdir"], STEPS)
    assert_trees_equal(resumed, uninterrupted)
    # ...an average that is not the parameters.
    differ = [
        not np.array_equal(e, p)
        for e, p in zip(jax.tree.leaves(resumed["ema_params"]), jax.tree.leaves(resumed["params"]))
    ]
    assert any(differ)


# ------------------------------------------------------------------------------------------------
# Evaluation and export use the average.
# ------------------------------------------------------------------------------------------------


def test_evaluation_and_export_use_the_average(run, data_dir, tmp_path):
    config = run["config"]
    experiment = train.setup(config, run["workdir"])
    state = resume.restore_newest(
        experiment.checkpointer, experiment.abstract_state, "evaluating step"
    ).state
    assert isinstance(state, train.EmaTrainState) and int(state.step) == STEPS

    eval_input = ml_collections.ConfigDict(config.input.to_dict())
    eval_input.batch_size = config.eval_batch_size
    split = experiment.splits["iid"]
    host = next(pipeline.eval_dataset(experiment.builder, split, eval_input).as_numpy_iterator())
    batch = sharding.to_global_array(
        {k: v for k, v in host.items() if k not in pipeline.HOST_ONLY_KEYS},
        experiment.data_sharding,
    )

    def detections(params):
        plain = train.TrainState(
            step=state.step, params=params, model_state=state.model_state, opt_state=None
        )
        return jax.device_get(
            jax.jit(train.predict_step, static_argnames="model")(
                plain, batch, model=experiment.model
            )
        )

    evaluated = jax.device_get(experiment.predict(state, batch))
    assert_trees_equal(evaluated, detections(state.ema_params))
    raw = detections(state.params)
    assert any(not np.array_equal(evaluated[k], raw[k]) for k in evaluated)

    experiment.checkpointer.close()

    model = load_exported(export.export(run["workdir"], tmp_path / "model.msgpack"))
    assert model.step == STEPS
    saved = load_state(run["workdir"], STEPS)
    assert_trees_equal(model.variables["params"], saved["ema_params"])


# ------------------------------------------------------------------------------------------------
# Off by default; on or off for good.
# ------------------------------------------------------------------------------------------------


def test_off_by_default_the_state_is_what_it_was():
    config = smoke_config()
    assert config.ema_decay == 0.0 and not config_checks.ema_enabled(config)
    mesh = sharding.make_mesh(config.mesh)
    off = train.build_layout(config, mesh, steps_per_epoch=10.0).abstract_state
    assert type(off) is train.TrainState
    assert [f.name for f in dataclasses.fields(off)] == [
        "step",
        "params",
        "model_state",
        "opt_state",
    ]
    config.ema_decay = 0.999
    on = train.build_layout(config, mesh, steps_per_epoch=10.0)
    assert type(on.abstract_state) is train.EmaTrainState
    # The same state plus the average, shaped and laid out as the parameters.
    assert jax.tree.structure(on.abstract_state.ema_params) == jax.tree.structure(off.params)
    for ema, param, layout in zip(
        jax.tree.leaves(on.abstract_state.ema_params),
        jax.tree.leaves(off.params),
        jax.tree.leaves(on.state_sharding.params),
    ):
        assert (ema.shape, ema.dtype, ema.sharding) == (param.shape, jnp.float32, layout)


def test_a_config_json_from_before_ema_resumes_with_ema_off(data_dir):
    stored = json.loads(smoke_config(data_dir).to_json_best_effort())
    del stored["ema_decay"], stored["ema_warmup"]
    assert config_checks.check_resume(stored, smoke_config(data_dir), "w") == []


@pytest.mark.parametrize("allow_config_change", [False, True])
def test_turning_ema_on_or_off_on_resume_is_refused(data_dir, allow_config_change):
    without = json.loads(smoke_config(data_dir).to_json_best_effort())
    del without["ema_decay"]
    on = smoke_config(data_dir, ema_decay=0.999, allow_config_change=allow_config_change)
    with pytest.raises(ValueError) as error:
        config_checks.check_resume(without, on, "w")
    assert str(error.value).startswith(
        "config.ema_decay: --workdir w holds checkpoints trained with no EMA, and this config "
        "has ema_decay 0.999: an EMA cannot be started or dropped on resume"
    )
    assert str(error.value).endswith("resume with --config.ema_decay=0.0, or use a fresh --workdir")

    stored = json.loads(on.to_json_best_effort())
    off = smoke_config(data_dir, allow_config_change=allow_config_change)
    with pytest.raises(ValueError, match=r"trained with ema_decay 0\.999, and this config has "):
        config_checks.check_resume(stored, off, "w")
    # Another decay is a change like any other: allow_config_change lets it through.
    other = smoke_config(data_dir, ema_decay=0.99, allow_config_change=allow_config_change)
    if allow_config_change:
        assert config_checks.check_resume(stored, other, "w")[0][0] == "ema_decay"
    else:
        with pytest.raises(ValueError, match=r"\(ema_decay 0\.999 -> 0\.99\)"):
            config_checks.check_resume(stored, other, "w")


def test_the_cli_refuses_dropping_the_average_in_one_line(run, data_dir):
    argv = [
        "evaluate",
        f"--config={CONFIG_FILE}:smoke",
        f"--workdir={run['workdir']}",
        f"--config.dataset.data_dir={data_dir}",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    message = str(exit_info.value.code)
    assert message.startswith(
        f"error: config.ema_decay: --workdir {run['workdir']} holds checkpoints trained with "
        f"ema_decay {DECAY}, and this config has ema_decay 0.0"
    )
    assert "\n" not in message


def test_a_decay_of_one_is_refused(data_dir):
    with pytest.raises(ValueError, match=r"config.ema_decay: must be < 1 \(0 turns EMA off\)"):
        config_checks.check_numbers(smoke_config(data_dir, ema_decay=1.0))
    with pytest.raises(ValueError, match=r"config.ema_decay: must be >= 0"):
        config_checks.check_numbers(smoke_config(data_dir, ema_decay=-0.1))
