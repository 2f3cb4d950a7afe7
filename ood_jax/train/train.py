"""Trains a detector on some domains and evaluates it in-domain and on held-out ones (O(OD)^2).

One readable loop. The run lives in `workdir`: checkpoints, TensorBoard metrics, results. A run
started on a workdir with checkpoints resumes from the newest one, with the same data order, and
continues to `config.total_steps`.

`setup` builds what training and evaluation share (an `Experiment`: mesh, data, model, optimizer,
the state's layout) and creates no parameters. Its data-free part, a `StepLayout`
(`build_layout`), is all the jitted steps are built from (`jit_train_step`, `jit_predict_step`),
so they can be lowered for other platforms without a dataset or a run (tests/training/test_lowering.py).
A fresh run then has its stages in order: backbone pretraining when `config.pretrain.steps` asks
for it (also its own command, `ood-jax pretrain`), the initial state, the starting backbone
weights. Evaluation only restores a checkpoint.

With `config.ema_decay` > 0 the state also keeps an exponential moving average of the
parameters (`EmaTrainState`, `optim.update_ema`), updated in the train step, saved in the
checkpoints, and used by evaluation and export in place of the parameters.

`config.model.dtype` is the detectors' compute dtype ("bfloat16": mixed precision): the state
(parameters, optimizer state, EMA) is float32 whichever it is, and the losses and their
matching read the model's outputs in float32 (`set_loss.float32_outputs`). Evaluation computes
in it too; detections (`postprocess`) are float32.

A workdir keeps the config its checkpoints were trained with (config.json); `train` and
`evaluate` refuse another one by field, use the newest checkpoint that restores, and Ctrl-C in
training saves the step it stopped at (resume.py).

Training also keeps WORKDIR/evaluations.json: every `config.eval_every` steps and at its last
step, the COCO numbers of every evaluated split, including the ones model selection adds
(`config.selection`: a validation slice of the training images, a left-out training domain) and
the oracle's (selection.py). Model selection (`ood-jax sweep`, sweep.py) chooses among them.
An evaluation is recorded before the checkpoint of its step is saved, so a resumed run has the
records of every step up to the one it resumes from, and recomputes the ones after it.

Both write WORKDIR/manifest.json when they start and when they end, however they end
(run_manifest.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging
from flax import linen as nn

from ood_jax import datasets, files, manifest, multihost, sharding
from ood_jax.data import counts, pipeline
from ood_jax.detection import evaluation
from ood_jax.metrics import coco
from ood_jax.models import backbones, registry
from ood_jax.train import checkpoint, config_checks, optim, pretrain, resume, run_manifest
from ood_jax.train import selection
from ood_jax.train.compiled import CompiledOnFirstCall
from ood_jax.train.metric_writer import MetricWriter


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    model_state: Any  # non-trained collections, e.g. frozen BatchNorm statistics
    opt_state: Any


@flax.struct.dataclass
class EmaTrainState(TrainState):
    """A TrainState that also keeps an exponential moving average of the parameters
    (`config.ema_decay`, see `optim.update_ema`), which evaluation and export use.

    A subclass rather than an optional field, so that a run without EMA keeps the state, and
    the checkpoints, it always had: orbax restores a tree only into the same structure.
    """

    ema_params: Any  # float32, laid out as `params`


def evaluated_params(state: TrainState) -> Any:
    """The parameters evaluation uses (and export writes, see export.py): the EMA ones when
    the state keeps them."""
    return state.ema_params if isinstance(state, EmaTrainState) else state.params


class NonFiniteLossError(RuntimeError):
    pass


# What the pretraining stage writes into the workdir (see `pretrain.py`).
PRETRAINED_BACKBONE = "backbone_pretrained.msgpack"


def load_builder(config: ml_collections.ConfigDict) -> tfds.core.DatasetBuilder:
    """The prepared dataset; synthetic data is built on first use, real data must be built."""
    try:
        return datasets.load(
            config.name, config.data_dir, build_if_missing=config.get("build_if_missing", False)
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"config.dataset: {e}") from None


def experiment_splits(
    config: ml_collections.ConfigDict,
    builder: tfds.core.DatasetBuilder,
    model_selection: ml_collections.ConfigDict | None = None,
    seed: int = 0,
) -> dict[str, str]:
    """{"train", "iid", <each held-out domain>} -> TFDS split expressions over the build's
    splits (an image of several domains trains only if none is held out) of `config`
    (config.dataset); with `model_selection` (config.selection), "train" without the images
    it holds out and those as its own splits (`selection.selection_splits`, seeded by `seed`)."""
    splits = counts.held_out_split_expressions(
        builder.info.splits.keys(),
        config.target_domains,
        train_split=config.train_split,
        test_split=config.test_split,
    )
    if model_selection is None:
        return splits
    return selection.selection_splits(splits, builder, config, model_selection, seed)


def _is_primary() -> bool:
    return jax.process_index() == 0


def create_train_state(model, optimizer, rng, image_shape, *, ema: bool = False):
    """Initial state; jitted with out_shardings so it is born sharded. With `ema`, an
    EmaTrainState whose average starts at the initial parameters (as timm's and detrex's do)."""
    return state_from_variables(init_variables(model, rng, image_shape), optimizer, ema=ema)


def init_variables(model, rng, image_shape) -> dict[str, Any]:
    """The model's initial variables ("params", and "batch_stats" where it has them)."""
    images = jnp.zeros((1, *image_shape), jnp.float32)
    mask = jnp.ones((1, *image_shape[:2]), bool)
    return model.init({"params": rng, "dropout": rng}, images, mask, train=False)


def state_from_variables(variables: Mapping[str, Any], optimizer, *, ema: bool = False):
    """The train state that starts at `variables` (see `create_train_state`)."""
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=optimizer.init(params),
    )
    if not ema:
        return state
    return EmaTrainState(**_fields(state), ema_params=optim.init_ema(params))


def _fields(state: TrainState) -> dict[str, Any]:
    return {field.name: getattr(state, field.name) for field in dataclasses.fields(TrainState)}


def train_step(
    state: TrainState,
    batch,
    rng,
    *,
    loss_fn: registry.LossFn,
    optimizer,
    ema_decay: float = 0.0,
    ema_warmup: bool = True,
):
    """Forward, matching, loss, backward, update: one pure function. With `ema_decay` (an
    EmaTrainState), the parameters' moving average follows the update (`optim.update_ema`)."""
    rng = jax.random.fold_in(rng, state.step)

    def loss_of(params):
        variables = {"params": params, **state.model_state}
        return loss_fn(variables, batch, rng, mutable=list(state.model_state))

    (loss, (metrics, model_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
    if ema_decay:
        ema = optim.update_ema(
            state.ema_params, params, state.step, decay=ema_decay, warmup=ema_warmup
        )
        state = state.replace(ema_params=ema)
    state = state.replace(
        step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
    )
    return state, metrics


# XLA:CPU expands remat's optimization barriers into plain ops before CSE, which then merges the
# recomputation back into the forward pass: remat would save no memory. GPU and TPU keep the
# barriers, and a step without remat has none.
CSE_BARRIER_PASS = "cse_barrier_expander"


def step_compiler_options(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> dict[str, str] | None:
    """XLA options for the train step: on CPU with `config.model.args.remat`, the passes
    XLA_FLAGS disables plus the one that would undo remat."""
    if not config.model.get("args", {}).get("remat", False):
        return None
    if mesh.devices.flat[0].platform != "cpu":
        return None
    # A per-compile option replaces XLA_FLAGS' value of the same flag: keep the user's too.
    disabled = [
        value
        for flag in os.environ.get("XLA_FLAGS", "").split()
        for name, _, value in [flag.partition("=")]
        if name == "--xla_disable_hlo_passes" and value
    ]
    return {"xla_disable_hlo_passes": ",".join([*disabled, CSE_BARRIER_PASS])}


def jit_train_step(config: ml_collections.ConfigDict, layout: StepLayout):
    """`train_step` jitted on the run's shardings, the state's buffers donated, traced on the
    mesh (each device matches its own images: `set_loss.match_batch`); remat made effective on
    CPU (`step_compiler_options`)."""
    step = functools.partial(
        train_step,
        loss_fn=registry.family(config.model.name).make_loss(config, layout.model),
        optimizer=layout.optimizer,
        ema_decay=config.get("ema_decay", 0.0) or 0.0,
        ema_warmup=config.get("ema_warmup", True),
    )
    return jax.jit(
        sharding.traced_on(layout.mesh, step),
        in_shardings=(layout.state_sharding, layout.data_sharding, None),
        out_shardings=(layout.state_sharding, None),
        donate_argnums=(0,),
        compiler_options=step_compiler_options(config, layout.mesh),
    )


def predict_step(state: TrainState, batch, *, model):
    outputs = model.apply(
        {"params": evaluated_params(state), **state.model_state},
        batch["image"],
        batch["image_mask"],
        train=False,
    )
    return registry.family_of(model).postprocess(outputs)


def jit_predict_step(layout: StepLayout):
    """`predict_step` jitted on the run's shardings: (state, batch) -> detections."""
    return jax.jit(
        functools.partial(predict_step, model=layout.model),
        in_shardings=(layout.state_sharding, layout.data_sharding),
    )


def load_pretrained_backbone(
    state: TrainState,
    model_args,
    path: str | pathlib.Path,
    state_sharding,
    *,
    model_name: str | None = None,
) -> TrainState:
    """Replaces the backbone with pretrained weights: torchvision/timm ResNet or timm ViT
    files, or the variables `pretrain.pretrain_backbone` writes (.msgpack).

    The file is read by the `load_backbone` of the family `model_name` (config.model.name)
    names; without one, by `backbones.load_backbone`, which every family's is today. The
    state's other arrays are kept as they are (shared, not copied).
    """
    path = pathlib.Path(path)
    load = registry.family(model_name).load_backbone if model_name else backbones.load_backbone
    variables = load(model_args, path)
    expected = jax.tree.map(np.shape, (state.params, state.model_state))
    got = jax.tree.map(np.shape, _with_backbone(state, variables))
    if expected != got:
        raise ValueError(
            f"config.model.backbone_weights: {path} does not fit backbone "
            f"{model_args.backbone!r} (shapes differ)"
        )
    where = {"params": state_sharding.params["backbone"]}
    if "batch_stats" in variables:
        where["batch_stats"] = state_sharding.model_state["batch_stats"]["backbone"]
    read = {name: variables[name] for name in where}
    placed = sharding.tree_from_host_copy(read, where, source=str(path))
    params, model_state = _with_backbone(state, placed)
    loaded = state.replace(params=params, model_state=model_state)
    if isinstance(state, EmaTrainState):  # step 0: the average is the weights it starts from
        # Copies, never aliases: the train step donates params and ema_params, each buffer once.
        copy_of_average = jax.jit(
            lambda p: jax.tree.map(jnp.copy, optim.init_ema(p)),
            out_shardings=state_sharding.ema_params,
        )
        loaded = loaded.replace(ema_params=copy_of_average(params))
    return loaded


def _with_backbone(state: TrainState, variables: Mapping[str, Any]) -> tuple[Any, Any]:
    """`state`'s (params, model_state) with the backbone's parts taken from `variables`."""
    params = {**state.params, "backbone": variables["params"]}
    model_state = dict(state.model_state)
    if "batch_stats" in variables:
        model_state["batch_stats"] = {
            **model_state["batch_stats"],
            "backbone": variables["batch_stats"],
        }
    return params, model_state


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """What the jitted steps are built from: mesh, model, optimizer and the state's layout;
    no data and no parameters (`build_layout`)."""

    mesh: jax.sharding.Mesh
    data_sharding: jax.sharding.NamedSharding
    model: nn.Module
    optimizer: optax.GradientTransformation
    schedules: Mapping[str, optax.Schedule]  # optimizer group -> learning rate schedule
    abstract_state: TrainState  # shapes, dtypes and shardings, no buffers
    state_sharding: Any


def _image_shape(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
    return (config.input.image_size, config.input.image_size, 3)


def build_layout(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, steps_per_epoch: float
) -> StepLayout:
    """The model, optimizer and state layout `config` describes on `mesh`, shapes only.

    EMA parameters (`config.ema_decay`) are laid out as the parameters are, whatever the
    partition rules say of their names: the average is then an update without communication.
    """
    model = registry.build_model(config.model)
    image_shape = _image_shape(config)
    rng = jax.random.key(config.seed)  # shapes only: no value is drawn
    # The model is traced once, here; the state's shapes follow from its variables'.
    variables = jax.eval_shape(
        functools.partial(init_variables, model, image_shape=image_shape), rng
    )
    optimizer, schedules = optim.make_optimizer(config.optim, variables["params"], steps_per_epoch)
    ema = config_checks.ema_enabled(config)
    shapes = jax.eval_shape(
        functools.partial(state_from_variables, optimizer=optimizer, ema=ema), variables
    )
    rules = config.partition_rules
    state_sharding = sharding.tree_shardings(TrainState(**_fields(shapes)), mesh, rules)
    if ema:
        state_sharding = EmaTrainState(**_fields(state_sharding), ema_params=state_sharding.params)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, state_sharding
    )
    return StepLayout(
        mesh=mesh,
        data_sharding=sharding.batch_sharding(mesh),
        model=model,
        optimizer=optimizer,
        schedules=schedules,
        abstract_state=abstract_state,
        state_sharding=state_sharding,
    )


@dataclasses.dataclass(frozen=True)
class Experiment(StepLayout):
    """What training and evaluating one config share, built once by `setup`."""

    builder: tfds.core.DatasetBuilder
    splits: Mapping[str, str]  # "train", "iid" and each held-out domain -> TFDS split
    steps_per_epoch: float
    init_rng: jax.Array
    train_rng: jax.Array
    checkpointer: checkpoint.Checkpointer
    # Compiled once, so periodic evaluations reuse it: (state, batch) -> detections.
    predict: CompiledOnFirstCall


def setup(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> Experiment:
    """Mesh, data, model, optimizer and the state's layout; no parameters are created."""
    config_checks.check_numbers(config)
    multihost.initialize(cluster=config.get("distributed", False))
    # tf.data must not grab accelerators meant for JAX.
    tf.config.set_visible_devices([], "GPU")

    mesh = sharding.make_mesh(config.mesh)
    builder = load_builder(config.dataset)
    splits = experiment_splits(config.dataset, builder, config.get("selection"), config.seed)
    num_train = builder.info.splits[splits["train"]].num_examples
    steps_per_epoch = num_train / config.input.batch_size
    layout = build_layout(config, mesh, steps_per_epoch)
    init_rng, train_rng = jax.random.split(jax.random.key(config.seed))
    return Experiment(
        **{field.name: getattr(layout, field.name) for field in dataclasses.fields(layout)},
        builder=builder,
        splits=splits,
        steps_per_epoch=steps_per_epoch,
        init_rng=init_rng,
        train_rng=train_rng,
        checkpointer=checkpoint.Checkpointer(
            workdir, every_steps=config.checkpoint_every, keep=config.keep_checkpoints
        ),
        predict=CompiledOnFirstCall(jit_predict_step(layout), "predict step"),
    )


def initial_state(config: ml_collections.ConfigDict, experiment: Experiment) -> TrainState:
    """A fresh state, born sharded (`jax.jit` with out_shardings)."""
    init = functools.partial(
        create_train_state,
        experiment.model,
        experiment.optimizer,
        image_shape=_image_shape(config),
        ema=config_checks.ema_enabled(config),
    )
    return jax.jit(init, out_shardings=experiment.state_sharding)(experiment.init_rng)


def pretrained_backbone_path(
    config: ml_collections.ConfigDict, workdir: pathlib.Path
) -> pathlib.Path | None:
    """Where the backbone's starting weights are: `config.model.backbone_weights`, or what the
    pretraining stage writes into the workdir when `config.pretrain.steps` asks for one."""
    if config.model.get("backbone_weights"):
        return pathlib.Path(config.model.backbone_weights)
    if config.get("pretrain") and config.pretrain.steps:
        return workdir / PRETRAINED_BACKBONE
    return None


def pretrain_stage(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> pathlib.Path:
    """Backbone pretraining (`ood-jax pretrain`, and `train`'s first stage when configured):
    writes WORKDIR/backbone_pretrained.msgpack unless it is there already."""
    workdir = pathlib.Path(workdir)
    config_checks.check_numbers(config)
    if not (config.get("pretrain") and config.pretrain.steps):
        raise ValueError("config.pretrain.steps: 0, so there is no pretraining stage to run")
    if config.model.get("backbone_weights"):
        raise ValueError(
            f"config.model.backbone_weights is set ({config.model.backbone_weights}): train "
            "starts from those weights, so a pretraining stage would go unused"
        )
    out = workdir / PRETRAINED_BACKBONE
    if out.exists():
        print(f"Backbone pretraining: {out} exists, kept.")
        return out
    workdir.mkdir(parents=True, exist_ok=True)
    tf.config.set_visible_devices([], "GPU")
    builder = load_builder(config.dataset)
    splits = experiment_splits(config.dataset, builder, config.get("selection"), config.seed)
    return pretrain.pretrain_backbone(config, builder, splits["train"], out)


def eval_splits(
    config: ml_collections.ConfigDict, experiment: Experiment
) -> dict[str, evaluation.EvalSplit]:
    """Every evaluated split ("iid", each held-out domain and model selection's): its ground
    truth and batches, built once for all of a run's evaluations."""
    eval_input = ml_collections.ConfigDict(config.input.to_dict())
    eval_input.batch_size = config.eval_batch_size
    return {
        name: evaluation.load_split(experiment.builder, split, eval_input, experiment.data_sharding)
        for name, split in experiment.splits.items()
        if name != "train"
    }


def evaluate_all(
    experiment: Experiment, state, splits: Mapping[str, evaluation.EvalSplit]
) -> dict[str, coco.CocoEvalResult]:
    """COCO evaluation on each of `splits`."""
    return {
        name: evaluation.evaluate_split(
            lambda batch: experiment.predict(state, batch),
            split,
            experiment.data_sharding,
            name=name,
        )
        for name, split in splits.items()
    }


def summarize(step: int, evaluated: Mapping[str, coco.CocoEvalResult]) -> dict[str, Any]:
    """results.json's content (`evaluation.summarize`): in-domain and each held-out domain."""
    per_domain = {
        name: r for name, r in evaluated.items() if name != "iid" and name not in selection.SPLITS
    }
    return evaluation.summarize(step, evaluated["iid"], per_domain)


# ---------------------------------------------------------------------------------------------
# train and evaluate
# ---------------------------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains to config.total_steps (resuming the workdir's newest checkpoint), evaluates, and
    writes the results and manifest.json into the workdir."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    experiment = setup(config, workdir)
    started = run_manifest.start("train", config, experiment.builder, experiment.splits)
    with manifest.recording(workdir, started, enabled=_is_primary()) as record:
        results = _train_and_evaluate(config, workdir, experiment)
        if _is_primary():  # the others would only read the checkpoint's files again
            record.update(_end_manifest(config, workdir, experiment, results))
    return results


def _end_manifest(config, workdir: pathlib.Path, experiment: Experiment, results) -> dict:
    backbone = pretrained_backbone_path(config, workdir)
    return run_manifest.end(experiment.checkpointer, results, backbone)


def _resume_or_start(
    config: ml_collections.ConfigDict, workdir: pathlib.Path, experiment: Experiment
) -> TrainState:
    """The newest checkpoint's state; else a fresh one, after backbone pretraining (its own
    stage) when the config asks for it, with the backbone's starting weights."""
    ckpt = experiment.checkpointer
    latest = ckpt.latest_step()
    if latest is not None and latest > config.total_steps:
        raise ValueError(
            f"config.total_steps: {config.total_steps}, but {workdir} already holds step "
            f"{latest}; raise total_steps to continue, or use a fresh --workdir"
        )
    resume.check_workdir_config(config, workdir, ckpt)
    restored = resume.restore_newest(ckpt, experiment.abstract_state, "resuming from")
    if restored is not None:
        step = int(restored.state.step)
        logging.info("Resumed from the checkpoint at step %d (workdir %s).", step, workdir)
        print(f"Resumed from step {step} of {workdir}; continuing to {config.total_steps}.")
        return restored.state
    backbone_weights = pretrained_backbone_path(config, workdir)
    if backbone_weights == workdir / PRETRAINED_BACKBONE:
        pretrain_stage(config, workdir)
    if _is_primary():
        print(f"New run in {workdir}: initializing the parameters ...", flush=True)
    state = initial_state(config, experiment)
    if not backbone_weights:
        return state
    return load_pretrained_backbone(
        state,
        config.model.args,
        backbone_weights,
        experiment.state_sharding,
        model_name=config.model.name,
    )


def _check_finite(pending: list[dict[str, jax.Array]], last_step: int, ckpt) -> None:
    """NonFiniteLossError naming the first step of `pending` (the metrics of the steps up to
    `last_step`) whose loss or gradient norm is not finite."""
    first = last_step - len(pending) + 1
    for offset, m in enumerate(pending):
        loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            ckpt.wait()
            raise NonFiniteLossError(
                f"loss became {loss} (gradient norm {grad_norm}) at step {first + offset}; the "
                f"last good checkpoint (step {ckpt.latest_step()}) is kept in {ckpt.directory}"
            )


def _train_batches(config: ml_collections.ConfigDict, experiment: Experiment, start_step: int):
    """The global training batches from `start_step` on, in the same order as a run that never
    stopped."""
    train_input = ml_collections.ConfigDict(config.input.to_dict())
    train_input.seed = config.seed
    return sharding.start_global(
        pipeline.train_iterator(
            experiment.builder,
            experiment.splits["train"],
            train_input,
            start_step=start_step,
            rows=sharding.process_rows(experiment.data_sharding, train_input.batch_size),
        ),
        experiment.data_sharding,
        host_keys=pipeline.HOST_ONLY_KEYS,
    )


def _print_step(step: int, total: int, loss: float, rate: float) -> None:
    if _is_primary():
        print(
            f"step {step}/{total}  loss {loss:.3f}  {rate:.2f} steps/s  "
            f"ETA {(total - step) / rate / 60:.1f} min",
            flush=True,
        )


def _train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: pathlib.Path, experiment: Experiment
) -> dict[str, Any]:
    ckpt = experiment.checkpointer
    state = _resume_or_start(config, workdir, experiment)
    start_step = int(state.step)
    meta = {"config": json.loads(config.to_json_best_effort())}
    if _is_primary():
        files.write_json_atomic(workdir / resume.CONFIG_FILE, meta["config"])

    writer = MetricWriter(workdir / "tensorboard", enabled=_is_primary())
    batches = _train_batches(config, experiment, start_step)
    splits = eval_splits(config, experiment)
    validation_by_domain = (
        selection.validation_domains(experiment.builder, experiment.splits[selection.VALIDATION])
        if selection.VALIDATION in experiment.splits
        else None
    )
    # Records after the resumed step are recomputed below (a fresh run has none to keep); a
    # finished run resumed at its last step evaluates that step again, replacing its record.
    evaluations = {
        r["step"]: r for r in selection.read_evaluations(workdir) if r["step"] <= start_step
    }

    def record_evaluation(step: int, evaluated: Mapping[str, coco.CocoEvalResult]) -> None:
        evaluations[step] = selection.evaluation_record(
            step, evaluated, config.get("selection"), config.seed, validation_by_domain
        )
        if _is_primary():
            selection.write_evaluations(workdir, list(evaluations.values()))

    step_fn = CompiledOnFirstCall(jit_train_step(config, experiment), "train step")

    # ----------------------------------------------------------------------------------------
    # Train.
    # ----------------------------------------------------------------------------------------
    pending: list[dict[str, jax.Array]] = []
    started = time.perf_counter()
    with multihost.catching_preemption():
        try:
            for step in range(start_step + 1, config.total_steps + 1):
                batch, _ = next(batches)
                state, metrics = step_fn(state, batch, experiment.train_rng)
                pending.append(metrics)

                # A checkpoint must never hold a diverged state, so every step since the last log
                # is checked before each save as well as at each log step.
                log_due = step % config.log_every == 0 or step == config.total_steps
                if log_due or ckpt.should_save(step):
                    _check_finite(pending, step, ckpt)
                if log_due:
                    summary = {k: float(np.mean([m[k] for m in pending])) for k in pending[0]}
                    pending = []
                    summary["learning_rate"] = float(experiment.schedules["transformer"](step))
                    # The compilation in the first step is not the training's speed.
                    elapsed = time.perf_counter() - started - step_fn.compile_seconds
                    summary["steps_per_sec"] = (step - start_step) / elapsed
                    writer.write_scalars(step, summary)
                    _print_step(step, config.total_steps, summary["loss"], summary["steps_per_sec"])

                # Before the step's checkpoint: a run resumed from it has its evaluation.
                if (
                    config.eval_every
                    and step % config.eval_every == 0
                    and step != config.total_steps
                ):
                    evaluated = evaluate_all(experiment, state, splits)
                    record_evaluation(step, evaluated)
                    writer.write_scalars(step, {"eval/iid_AP": evaluated["iid"].stats["AP"]})

                # Asked at every step, as JAX's preemption sync point requires; every process
                # gets the same answer for the same step.
                preempted = multihost.preempted(step)
                ckpt.save(step, state, meta, force=step == config.total_steps or preempted)
                if preempted:
                    ckpt.wait()
                    del batches  # let go of the input pipeline now (see below)
                    raise multihost.Preempted(multihost.preempted_line(step, workdir))
        except KeyboardInterrupt:
            raise KeyboardInterrupt(resume.keep_on_interrupt(ckpt, state, meta, workdir)) from None
    ckpt.wait()
    # The input pipeline's threads stop before the final evaluation, not at function exit (its
    # teardown runs in the background: data/iteration.py).
    del batches

    # ----------------------------------------------------------------------------------------
    # Final evaluation.
    # ----------------------------------------------------------------------------------------
    try:
        evaluated = evaluate_all(experiment, state, splits)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"checkpoint at step {int(state.step)} kept in {workdir}, not yet evaluated; rerun "
            "the same command to evaluate it"
        ) from None
    record_evaluation(int(state.step), evaluated)
    results = summarize(int(state.step), evaluated)
    if _is_primary():
        evaluation.write_results(workdir, results, config.model_name)
        writer.write_scalars(
            int(state.step),
            {"eval/iid_AP": results["iid"]["AP"], "eval/ood_AP": results["ood_average"]["AP"]},
        )
    writer.close()
    ckpt.close()
    return results


def evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Evaluates the newest checkpoint in `workdir` that restores and writes the results there."""
    workdir = pathlib.Path(workdir)
    experiment = setup(config, workdir)
    ckpt = experiment.checkpointer
    resume.check_workdir_config(config, workdir, ckpt)
    restored = resume.restore_newest(ckpt, experiment.abstract_state, "evaluating step")
    if restored is None:
        raise FileNotFoundError(
            f"no checkpoint in {ckpt.directory}: train first (`ood-jax train` on this --workdir)"
        )
    started = run_manifest.start("evaluate", config, experiment.builder, experiment.splits)
    with manifest.recording(workdir, started, enabled=_is_primary()) as record:
        evaluated = evaluate_all(experiment, restored.state, eval_splits(config, experiment))
        results = summarize(restored.step, evaluated)
        if _is_primary():
            evaluation.write_results(workdir, results, config.model_name)
            record.update(_end_manifest(config, workdir, experiment, results))
    ckpt.close()
    return results
