"""Trains a detector on some domains and evaluates it in-domain and on held-out ones (O(OD)^2).

One readable loop. The run lives in `workdir`: checkpoints, TensorBoard metrics, results. A run
started on a workdir with checkpoints resumes from the newest one, with the same data order, and
continues to `config.total_steps`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import time
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
from clu import metric_writers, periodic_actions
from flax import serialization

from ood_jax.data import building, counts, pipeline
from ood_jax.models import convert, convert_vit, detr, registry, vit
from ood_jax import sharding
from ood_jax.detection import evaluation as detection_eval
from ood_jax.train import checkpoint, objectives, optim, pretrain


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    model_state: Any  # non-trained collections, e.g. frozen BatchNorm statistics
    opt_state: Any


class NonFiniteLossError(RuntimeError):
    pass


def load_builder(config: ml_collections.ConfigDict) -> tfds.core.DatasetBuilder:
    """The prepared dataset; synthetic data is built on first use, real data must be built."""
    import tfds_builders  # noqa: F401  (registers our builders with TFDS)

    data_dir = os.path.expanduser(config.data_dir)
    builder = tfds.builder(config.name, data_dir=data_dir)
    if builder.is_prepared():
        return builder
    if not config.get("build_if_missing", False):
        raise FileNotFoundError(
            f"config.dataset: {config.name} is not prepared in {data_dir}; run "
            f"`ood-jax build {config.name.split('/')[0]} --source SRC --data-dir {data_dir}`"
        )
    name, _, builder_config = config.name.partition("/")
    return building.build(name, data_dir=data_dir, config=builder_config or None)


def experiment_splits(config: ml_collections.ConfigDict) -> dict[str, str]:
    """{"train", "iid", <each held-out domain>} -> TFDS split expressions."""
    return counts.held_out_split_expressions(
        config.target_domains, train_split=config.train_split, test_split=config.test_split
    )


def _is_primary() -> bool:
    return jax.process_index() == 0


def create_train_state(model, optimizer, rng, image_shape):
    """Initial state; jitted with out_shardings so it is born sharded."""
    images = jnp.zeros((1, *image_shape), jnp.float32)
    mask = jnp.ones((1, *image_shape[:2]), bool)
    variables = model.init({"params": rng, "dropout": rng}, images, mask, train=False)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=optimizer.init(params),
    )


def train_step(state: TrainState, batch, rng, *, loss_fn: objectives.LossFn, optimizer):
    """Forward, matching, loss, backward, update: one pure function."""
    rng = jax.random.fold_in(rng, state.step)

    def loss_of(params):
        variables = {"params": params, **state.model_state}
        return loss_fn(variables, batch, rng, mutable=list(state.model_state))

    (loss, (metrics, model_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
    state = state.replace(
        step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
    )
    return state, metrics


def jit_train_step(config: ml_collections.ConfigDict, env: dict[str, Any]):
    """`train_step` jitted on the run's shardings, the state's buffers donated."""
    return jax.jit(
        functools.partial(
            train_step,
            loss_fn=objectives.make_loss(config, env["model"]),
            optimizer=env["optimizer"],
        ),
        in_shardings=(env["state_sharding"], env["data_sharding"], None),
        out_shardings=(env["state_sharding"], None),
        donate_argnums=(0,),
    )


def predict_step(state: TrainState, batch, *, model):
    outputs = model.apply(
        {"params": state.params, **state.model_state},
        batch["image"],
        batch["image_mask"],
        train=False,
    )
    return registry.postprocess_for(model)(outputs)


def load_pretrained_backbone(
    state: TrainState, model_args, path: str | pathlib.Path, state_sharding
) -> TrainState:
    """Replaces the backbone with pretrained weights: torchvision/timm ResNet or timm ViT
    files, or the variables `pretrain.pretrain_backbone` writes (.msgpack)."""
    path = pathlib.Path(path)
    if path.suffix == ".msgpack":
        variables = serialization.msgpack_restore(path.read_bytes())
    elif model_args.backbone in vit.VARIANTS:
        _, variables = convert_vit.vit_from_timm(convert.load_state_dict(path))
    else:
        module = detr.build_backbone(
            model_args.backbone,
            model_args.get("backbone_norm", "frozen"),
            model_args.get("dilation", False),
        )
        variables = convert.resnet_from_torch(convert.load_state_dict(path), module)
    params = {**state.params, "backbone": variables["params"]}
    model_state = dict(state.model_state)
    if "batch_stats" in variables:
        model_state["batch_stats"] = {
            **model_state["batch_stats"],
            "backbone": variables["batch_stats"],
        }
    loaded = state.replace(params=params, model_state=model_state)
    expected = jax.tree.map(lambda x: x.shape, (state.params, state.model_state))
    got = jax.tree.map(lambda x: np.shape(x), (loaded.params, loaded.model_state))
    if expected != got:
        raise ValueError(
            f"config.model.backbone_weights: {path} does not fit backbone "
            f"{model_args.backbone!r} (shapes differ)"
        )
    return jax.device_put(loaded, state_sharding)


def setup(config: ml_collections.ConfigDict, workdir: pathlib.Path):
    """Everything train and evaluate share: mesh, data, model, sharded state, checkpoints."""
    if config.get("distributed", False):
        jax.distributed.initialize()
    # tf.data must not grab accelerators meant for JAX.
    tf.config.set_visible_devices([], "GPU")

    mesh = sharding.make_mesh(config.mesh)
    data_sharding = sharding.batch_sharding(mesh)

    builder = load_builder(config.dataset)
    splits = experiment_splits(config.dataset)
    num_train = builder.info.splits[splits["train"]].num_examples
    steps_per_epoch = num_train / config.input.batch_size

    model = registry.build_model(config.model)
    rng = jax.random.key(config.seed)
    init_rng, train_rng = jax.random.split(rng)
    image_shape = (config.input.image_size, config.input.image_size, 3)

    abstract_params = jax.eval_shape(
        lambda r: model.init(
            {"params": r, "dropout": r},
            jnp.zeros((1, *image_shape)),
            jnp.ones((1, *image_shape[:2]), bool),
            train=False,
        )["params"],
        init_rng,
    )
    optimizer, schedules = optim.make_optimizer(config.optim, abstract_params, steps_per_epoch)
    init = functools.partial(create_train_state, model, optimizer, image_shape=image_shape)
    abstract_state = jax.eval_shape(init, init_rng)
    state_sharding = sharding.tree_shardings(abstract_state, mesh, config.partition_rules)
    state = jax.jit(init, out_shardings=state_sharding)(init_rng)
    backbone_weights = config.model.get("backbone_weights")
    if not backbone_weights and config.get("pretrain") and config.pretrain.steps:
        backbone_weights = workdir / "backbone_pretrained.msgpack"
        if not backbone_weights.exists():
            pretrain.pretrain_backbone(config, builder, splits["train"], backbone_weights)
    if backbone_weights:
        state = load_pretrained_backbone(state, config.model.args, backbone_weights, state_sharding)

    ckpt = checkpoint.Checkpointer(
        workdir, every_steps=config.checkpoint_every, keep=config.keep_checkpoints
    )
    return {
        "mesh": mesh,
        "data_sharding": data_sharding,
        "builder": builder,
        "splits": splits,
        "steps_per_epoch": steps_per_epoch,
        "model": model,
        "optimizer": optimizer,
        "schedules": schedules,
        "state": state,
        "state_sharding": state_sharding,
        "train_rng": train_rng,
        "checkpointer": ckpt,
        # Jitted once, so periodic evaluations reuse one compilation.
        "predict": jax.jit(
            functools.partial(predict_step, model=model),
            in_shardings=(state_sharding, data_sharding),
        ),
    }


def evaluate_all(config, env, state) -> dict[str, Any]:
    """COCO numbers on the in-domain test split and on each held-out domain."""
    predict = env["predict"]
    eval_input = ml_collections.ConfigDict(config.input.to_dict())
    eval_input.batch_size = config.eval_batch_size
    run = functools.partial(
        detection_eval.evaluate_split,
        lambda batch: predict(state, batch),
        env["builder"],
        input_config=eval_input,
        data_sharding=env["data_sharding"],
    )
    iid = run(env["splits"]["iid"])
    per_domain = {
        domain: run(env["splits"][domain])
        for domain in (counts.canonical_domain(d) for d in config.dataset.target_domains)
    }
    return detection_eval.summarize(int(state.step), iid, per_domain)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = setup(config, workdir)
    state, ckpt = env["state"], env["checkpointer"]

    # ----------------------------------------------------------------------------------------
    # Resume.
    # ----------------------------------------------------------------------------------------
    start_step = 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, state)
        start_step = int(state.step)
        logging.info("Resumed from the checkpoint at step %d (workdir %s).", start_step, workdir)
        print(f"Resumed from step {start_step} of {workdir}; continuing to {config.total_steps}.")
    if _is_primary():
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))

    writer = metric_writers.create_default_writer(
        str(workdir / "tensorboard"), just_logging=not _is_primary()
    )
    train_input = ml_collections.ConfigDict(config.input.to_dict())
    train_input.seed = config.seed
    batches = pipeline.train_iterator(
        env["builder"], env["splits"]["train"], train_input, start_step=start_step
    )

    step_fn = jit_train_step(config, env)
    report = periodic_actions.ReportProgress(
        num_train_steps=config.total_steps, writer=writer, every_steps=config.log_every
    )

    # ----------------------------------------------------------------------------------------
    # Train.
    # ----------------------------------------------------------------------------------------
    meta = {"config": json.loads(config.to_json_best_effort())}
    pending: list[dict[str, jax.Array]] = []
    started = time.perf_counter()
    for step in range(start_step + 1, config.total_steps + 1):
        host_batch = next(batches)
        batch = pipeline.to_global_array(
            {k: v for k, v in host_batch.items() if k != "image_id"}, env["data_sharding"]
        )
        state, metrics = step_fn(state, batch, env["train_rng"])
        pending.append(metrics)
        report(step)

        # A checkpoint must never hold a diverged state, so every step since the last log is
        # checked before each save as well as at each log step; the error names the first one.
        log_due = step % config.log_every == 0 or step == config.total_steps
        if log_due or ckpt.should_save(step):
            first = step - len(pending) + 1
            for offset, m in enumerate(pending):
                loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    ckpt.wait()
                    raise NonFiniteLossError(
                        f"loss became {loss} (gradient norm {grad_norm}) at step "
                        f"{first + offset}; the last good checkpoint (step "
                        f"{ckpt.latest_step()}) is kept in {ckpt.directory}"
                    )
        if log_due:
            summary = {k: float(np.mean([m[k] for m in pending])) for k in pending[0]}
            pending = []
            summary["learning_rate"] = float(env["schedules"]["transformer"](step))
            writer.write_scalars(step, summary)
            if _is_primary():
                elapsed = time.perf_counter() - started
                rate = (step - start_step) / elapsed
                eta = (config.total_steps - step) / rate
                print(
                    f"step {step}/{config.total_steps}  loss {summary['loss']:.3f}  "
                    f"{rate:.2f} steps/s  ETA {eta / 60:.1f} min",
                    flush=True,
                )

        ckpt.save(step, state, meta, force=step == config.total_steps)

        if config.eval_every and step % config.eval_every == 0 and step != config.total_steps:
            results = evaluate_all(config, env, state)
            writer.write_scalars(step, {"eval/iid_AP": results["iid"]["AP"]})
    ckpt.wait()
    # Released before the final evaluation: torn down at function exit instead, the input
    # pipeline stalled the end of the run (12 s on a 20-step demo run, 30-50 s on full ones).
    del batches

    # ----------------------------------------------------------------------------------------
    # Final evaluation.
    # ----------------------------------------------------------------------------------------
    results = evaluate_all(config, env, state)
    if _is_primary():
        detection_eval.write_results(workdir, results, config.model_name)
        writer.write_scalars(
            int(state.step),
            {"eval/iid_AP": results["iid"]["AP"], "eval/ood_AP": results["ood_average"]["AP"]},
        )
    writer.flush()
    ckpt.close()
    return results


def evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Evaluates the newest checkpoint in `workdir` and writes the results there."""
    workdir = pathlib.Path(workdir)
    env = setup(config, workdir)
    ckpt = env["checkpointer"]
    latest = ckpt.latest_step()
    if latest is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
    state, _ = ckpt.restore(latest, env["state"])
    results = evaluate_all(config, env, state)
    if _is_primary():
        detection_eval.write_results(workdir, results, config.model_name)
    ckpt.close()
    return results
