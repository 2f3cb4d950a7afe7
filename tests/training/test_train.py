"""The training loop end to end on the smoke config (`configs/synthetic_detr.py:smoke`).

* a run writes results.json / results.md / per_domain_ap.png with the promised fields;
* one device and four simulated devices (data x fsdp, 2 x 2) take the same step;
* a run killed with SIGKILL after a checkpoint, then restarted, ends where an uninterrupted run
  ends, and raising total_steps continues a finished run;
* a non-finite loss stops the run naming the step and keeps the last good checkpoint.

Every process here compiles the same few programs, so they share a persistent XLA compilation
cache (a temporary directory): the first run compiles, the others load. That changes how long
the tests take, not what they compute.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow as tf

from ood_jax import cli
from ood_jax import datasets
from ood_jax.data import counts, pipeline
from ood_jax.metrics import coco
from ood_jax.train import train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "configs" / "synthetic_detr.py"
CONFIG_FLAG = f"--config={CONFIG_FILE}:smoke"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOSS_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss (\S+)", re.MULTILINE)


# ------------------------------------------------------------------------------------------------
# Shared fixtures: one dataset, one compilation cache, one uninterrupted run.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


def child_env(devices: int | None = None) -> dict[str, str]:
    """This process's environment (the compile_cache fixture's cache included) for a child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if devices is not None:  # simulated CPU devices
        env["JAX_PLATFORMS"] = "cpu"
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def smoke_config(data_dir: pathlib.Path, **overrides) -> ml_collections.ConfigDict:
    """get_config("smoke") with `field__sub=value` overrides, as --config.field.sub=value."""
    spec = importlib.util.spec_from_file_location("synthetic_detr_config", CONFIG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.dataset.data_dir = str(data_dir)
    for name, value in overrides.items():
        *parents, leaf = name.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def train_argv(workdir: pathlib.Path, data_dir: pathlib.Path, **overrides) -> list[str]:
    args = [
        "train",
        CONFIG_FLAG,
        f"--workdir={workdir}",
        f"--config.dataset.data_dir={data_dir}",
    ]
    return args + [f"--config.{k.replace('__', '.')}={v}" for k, v in overrides.items()]


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    """Steps of finished checkpoints: orbax writes to a temporary name and renames at the end."""
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def load_state(workdir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
    """The saved train state of `step` as {path: numpy array}, read with plain orbax."""
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(workdir / "checkpoints" / str(step) / "state")
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def assert_states_equal(actual: dict, expected: dict, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    assert any("params" in name for name in actual)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=0, atol=atol, err_msg=name)


def losses(stdout: str) -> dict[int, float]:
    return {int(m[1]): float(m[3]) for m in LOSS_LINE.finditer(stdout)}


def tensorboard_scalars(workdir: pathlib.Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's TensorBoard events (tag -> step -> float32 value)."""
    found: dict[str, dict[int, float]] = {}
    for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                scalar = float(tf.make_ndarray(value.tensor))
                found.setdefault(value.tag, {})[event.step] = scalar
    return found


RUN_A_STEPS = 6


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, data_dir, compile_cache):
    """An uninterrupted smoke run, through the CLI entry point: 6 steps, checkpoints every 2."""
    workdir = tmp_path_factory.mktemp("run_a")
    argv = train_argv(workdir, data_dir, total_steps=RUN_A_STEPS, checkpoint_every=2, log_every=1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(argv)
    # A later test moves this workdir on to step 8; keep what the others check as it is now.
    return {
        "workdir": workdir,
        "stdout": out.getvalue(),
        "results": json.loads((workdir / "results.json").read_text()),
        "results_md": (workdir / "results.md").read_text(),
        "png": (workdir / "per_domain_ap.png").read_bytes(),
        "checkpoints": checkpoint_steps(workdir),
        "final_state": load_state(workdir, RUN_A_STEPS),
        "scalars": tensorboard_scalars(workdir),
    }


# ------------------------------------------------------------------------------------------------
# 1. A smoke run writes its results.
# ------------------------------------------------------------------------------------------------


def test_smoke_run_writes_results(run_a, data_dir):
    results, stdout = run_a["results"], run_a["stdout"]
    targets = smoke_config(data_dir).dataset.target_domains
    assert set(targets) < set(counts.PAPER_TARGET_DOMAINS)
    stat_names = set(coco.STAT_NAMES)
    assert len(stat_names) == 12

    assert results["step"] == RUN_A_STEPS
    assert set(results["iid"]) == stat_names
    assert set(results["per_domain"]) == set(targets)
    for domain, stats in results["per_domain"].items():
        assert set(stats) == stat_names, domain
    assert set(results["ood_average"]) == stat_names
    for stats in [results["iid"], results["ood_average"], *results["per_domain"].values()]:
        assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values()), stats
    for name in coco.STAT_NAMES:
        mean = np.mean([results["per_domain"][d][name] for d in targets])
        assert results["ood_average"][name] == pytest.approx(mean)

    markdown = run_a["results_md"]
    assert f"Results at step {RUN_A_STEPS}" in markdown
    for domain in targets:
        assert domain.capitalize() in markdown
    assert markdown.strip() in stdout  # the CLI prints the table at the end
    assert run_a["png"].startswith(PNG_MAGIC)

    logged = losses(stdout)
    assert sorted(logged) == list(range(1, RUN_A_STEPS + 1))
    assert all(math.isfinite(v) and v > 0 for v in logged.values()), logged
    assert run_a["checkpoints"][-1] == RUN_A_STEPS

    # TensorBoard: each logged step's printed loss, its rate and learning rate; the final AP.
    scalars = run_a["scalars"]
    for tag in ("loss", "learning_rate", "steps_per_sec"):
        assert sorted(scalars[tag]) == list(range(1, RUN_A_STEPS + 1)), tag
    for step, loss in logged.items():
        assert scalars["loss"][step] == pytest.approx(loss, abs=5e-4)
    assert all(v > 0 for v in scalars["steps_per_sec"].values())
    assert scalars["eval/iid_AP"][RUN_A_STEPS] == pytest.approx(results["iid"]["AP"])
    assert scalars["eval/ood_AP"][RUN_A_STEPS] == pytest.approx(results["ood_average"]["AP"])


def test_cli_main_applies_config_overrides_from_its_argv(tmp_path, data_dir, monkeypatch):
    """`cli.main(argv)` honours --config.x=v in `argv`, whatever sys.argv holds (ml_collections
    looks for overrides in sys.argv unless told otherwise)."""
    seen = {}

    def fake_train(config, workdir):
        seen["config"] = config
        (pathlib.Path(workdir) / "results.md").write_text("table\n")

    monkeypatch.setattr(train, "train_and_evaluate", fake_train)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    cli.main(train_argv(tmp_path, data_dir, total_steps=7))
    assert seen["config"].total_steps == 7
    assert seen["config"].dataset.data_dir == str(data_dir)


# ------------------------------------------------------------------------------------------------
# 2. One device and four simulated devices take the same step.
# ------------------------------------------------------------------------------------------------

# Run in a child process whose device count XLA_FLAGS fixed before jax started: builds the smoke
# state with train.setup for each mesh given, takes one train_step (jitted as train.py does) on
# the first global batch of the pipeline, and saves the loss, metrics and state before and after.
ONE_STEP = textwrap.dedent(
    """
    import importlib.util, json, pathlib, re, sys

    import jax, ml_collections, numpy as np

    from ood_jax import sharding
    from ood_jax.data import pipeline
    from ood_jax.train import train

    config_file, data_dir, workdir, meshes = sys.argv[1:]
    spec = importlib.util.spec_from_file_location("config", config_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def flat(tree):
        return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
                jax.tree_util.tree_leaves_with_path(tree)}

    for name, (mesh, rules, devices) in json.loads(meshes).items():
        assert jax.device_count() == devices, (jax.device_count(), devices)
        config = module.get_config("smoke")
        config.dataset.data_dir = data_dir
        config.mesh = [tuple(axis) for axis in mesh]
        config.partition_rules = [tuple(rule) for rule in rules]
        experiment = train.setup(config, pathlib.Path(workdir) / name)
        initial = train.initial_state(config, experiment)
        train_input = ml_collections.ConfigDict(config.input.to_dict())
        train_input.seed = config.seed
        host = pipeline.train_iterator(experiment.builder, experiment.splits["train"], train_input)
        batches = sharding.start_global(host, experiment.data_sharding, pipeline.HOST_ONLY_KEYS)
        batch, _ = next(batches)
        assert len(batch["image"].sharding.device_set) == devices
        step = train.jit_train_step(config, experiment).lower(
            initial, batch, experiment.train_rng
        ).compile()
        before = flat({"params": initial.params, "model_state": initial.model_state})
        state, metrics = step(initial, batch, experiment.train_rng)
        # Collectives that XLA put inside a while loop (the matching's, were its loops run on
        # the global batch): one round trip among all devices per iteration.
        in_loops = re.findall(
            r' (?:all-reduce|all-gather|collective-permute|all-to-all)(?:-start)?\(.*'
            r'op_name="[^"]*/while/', step.as_text()
        )
        after = flat({"params": state.params, "model_state": state.model_state})
        arrays = {**{"before" + k: v for k, v in before.items()}, **after}
        arrays.update({"metric/" + k: np.asarray(v) for k, v in metrics.items()})
        arrays["collectives_in_loops"] = np.asarray(len(in_loops))
        np.savez(pathlib.Path(workdir) / name / f"{name}.npz", **arrays)
    """
)

# Data parallelism alone over four devices is tests/multihost/test_multiprocess.py's 1 x 4 run,
# whose losses match the 2 x 2 job's.
MESHES = {
    "one_device": ([("data", -1)], [(".*", "replicate")], 1),
    "data2_fsdp2": ([("data", 2), ("fsdp", 2)], [(".*", "fsdp")], 4),
}


def test_one_and_four_devices_take_the_same_step(tmp_path, data_dir, compile_cache):
    # One child per mesh, side by side: a child's device count is fixed when its jax starts.
    children = {}
    for name, spec in MESHES.items():
        (tmp_path / name).mkdir()
        args = [str(CONFIG_FILE), str(data_dir), str(tmp_path), json.dumps({name: spec})]
        children[name] = subprocess.Popen(
            [sys.executable, "-c", ONE_STEP, *args],
            env=child_env(devices=spec[2]),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        outputs = {name: child.communicate(timeout=400)[0] for name, child in children.items()}
    finally:
        for child in children.values():
            child.kill()
    for name, child in children.items():
        assert child.returncode == 0, f"{name}:\n{outputs[name][-4000:]}"
    runs = {name: dict(np.load(tmp_path / name / f"{name}.npz")) for name in MESHES}

    # Each device matches its own images (set_loss.match_batch): no loop waits on the others.
    assert {name: int(run.pop("collectives_in_loops")) for name, run in runs.items()} == {
        name: 0 for name in MESHES
    }
    reference = runs.pop("one_device")
    # A BatchNorm that normalized each device's share of the batch on its own would change the
    # loss in the first digits, not the sixth.
    assert reference["metric/loss"] > 0
    for name, run in runs.items():
        assert run.keys() == reference.keys(), name
        for key in reference:
            if key.startswith("metric/"):
                np.testing.assert_allclose(run[key], reference[key], rtol=1e-5, err_msg=name + key)
        for key in reference:
            if key.startswith("['params']"):
                # The same initial parameters, whatever their layout...
                np.testing.assert_array_equal(run["before" + key], reference["before" + key])
                # ...and the same update. Adam's first update is about +-lr (2e-5 here), so a
                # tolerance on the parameters themselves would hide a wrong update.
                update = run[key] - run["before" + key]
                expected = reference[key] - reference["before" + key]
                np.testing.assert_allclose(update, expected, rtol=0, atol=1e-6, err_msg=name + key)
            elif key.startswith("['model_state']"):  # the BatchNorm running statistics
                moved = reference[key] - reference["before" + key]
                assert np.abs(moved).max() > 0, key
                np.testing.assert_allclose(
                    run[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=name + key
                )


# ------------------------------------------------------------------------------------------------
# 3. SIGKILL, restart, same end; raising total_steps continues.
# ------------------------------------------------------------------------------------------------


def test_killed_and_restarted_run_ends_like_an_uninterrupted_one(
    tmp_path, data_dir, compile_cache, run_a
):
    workdir = tmp_path / "run_b"
    argv = train_argv(workdir, data_dir, total_steps=RUN_A_STEPS, checkpoint_every=2, log_every=1)
    command = [sys.executable, "-m", "ood_jax", *argv]
    env = child_env()
    log = tmp_path / "first_attempt.log"
    with open(log, "w") as out:
        child = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not {2, 4} & set(checkpoint_steps(workdir)):
                assert child.poll() is None, f"exited before checkpointing:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no checkpoint:\n{log.read_text()}"
                time.sleep(0.05)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (workdir / "results.json").exists()
    resume_step = checkpoint_steps(workdir)[-1]
    assert resume_step in (2, 4), checkpoint_steps(workdir)

    # The rerun in this process, as run_a ran: a process of its own would only add its startup.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(argv)
    second = out.getvalue()
    assert f"Resumed from step {resume_step}" in second, second
    resumed_losses = losses(second)
    assert sorted(resumed_losses) == list(range(resume_step + 1, RUN_A_STEPS + 1))
    uninterrupted = losses(run_a["stdout"])
    assert resumed_losses == {s: uninterrupted[s] for s in resumed_losses}
    assert json.loads((workdir / "results.json").read_text())["step"] == RUN_A_STEPS

    assert_states_equal(load_state(workdir, RUN_A_STEPS), run_a["final_state"])


def test_sigterm_saves_the_step_it_reached_and_says_so(tmp_path, data_dir, compile_cache):
    """A preemption of a single-process run (SLURM and TPU maintenance send SIGTERM)."""
    from ood_jax import multihost

    workdir = tmp_path / "preempted"
    command = [sys.executable, "-m", "ood_jax", *train_argv(workdir, data_dir, log_every=1)]
    child = subprocess.Popen(
        command,
        env=child_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in child.stdout:
            seen.append(line)
            if line.startswith("step 1/"):
                child.send_signal(signal.SIGTERM)
                break
        output = "".join(seen) + child.communicate(timeout=400)[0]
    finally:
        child.kill()
    assert child.returncode == multihost.PREEMPTED_EXIT_CODE, output[-3000:]
    saved = re.findall(r"preempted: SIGTERM received; step (\d+) is saved", output)
    assert len(saved) == 1, output[-3000:]
    assert checkpoint_steps(workdir)[-1] == int(saved[0])
    assert not (workdir / "results.json").exists()


def test_raising_total_steps_continues_a_finished_run(run_a, data_dir):
    """Moves run A on from step 6 to step 8 (the run_a fixture kept what other tests need)."""
    workdir, total = run_a["workdir"], RUN_A_STEPS + 2
    config = smoke_config(data_dir, total_steps=total, checkpoint_every=2, log_every=1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = train.train_and_evaluate(config, str(workdir))
    assert f"Resumed from step {RUN_A_STEPS}" in out.getvalue()
    assert sorted(losses(out.getvalue())) == list(range(RUN_A_STEPS + 1, total + 1))
    assert results["step"] == total
    assert json.loads((workdir / "results.json").read_text())["step"] == total
    assert checkpoint_steps(workdir)[-1] == total
    state = load_state(workdir, total)
    assert int(state["['step']"]) == total
    assert all(np.isfinite(v).all() for v in state.values())


def test_total_steps_below_the_saved_step_is_refused(run_a, data_dir):
    """A workdir past config.total_steps is neither trained nor silently re-evaluated."""
    config = smoke_config(data_dir, total_steps=2)
    with pytest.raises(ValueError, match=r"config.total_steps: 2, but .* already holds step \d+"):
        train.train_and_evaluate(config, str(run_a["workdir"]))


# ------------------------------------------------------------------------------------------------
# 4. A non-finite loss stops the run.
# ------------------------------------------------------------------------------------------------


def poison_from(first_bad_step: int):
    """A train_iterator whose batches from global step `first_bad_step` on hold NaN images."""
    real = pipeline.train_iterator

    def train_iterator(builder, split, config=None, *, start_step=0, **kwargs):
        batches = real(builder, split, config, start_step=start_step, **kwargs)
        for step, batch in enumerate(batches, start=start_step + 1):
            if step >= first_bad_step:
                batch = {**batch, "image": np.full_like(batch["image"], np.nan)}
            yield batch

    return train_iterator


def assert_finite_checkpoint(workdir: pathlib.Path, step: int) -> None:
    state = load_state(workdir, step)
    assert int(state["['step']"]) == step
    bad = [name for name, value in state.items() if not np.isfinite(value).all()]
    assert not bad, f"checkpoint {step} holds non-finite values: {bad[:5]}"


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path, data_dir, monkeypatch):
    monkeypatch.setattr(pipeline, "train_iterator", poison_from(3))
    config = smoke_config(data_dir, total_steps=6, checkpoint_every=2, log_every=1)
    with pytest.raises(train.NonFiniteLossError, match=r"\bstep 3\b") as error:
        train.train_and_evaluate(config, str(tmp_path))
    assert checkpoint_steps(tmp_path)[-1] == 2
    assert re.search(r"\bstep 2\b", str(error.value)), "names the last good checkpoint"
    assert_finite_checkpoint(tmp_path, 2)
    assert not (tmp_path / "results.json").exists()


def test_non_finite_loss_between_log_steps_is_not_checkpointed(tmp_path, data_dir, monkeypatch):
    monkeypatch.setattr(pipeline, "train_iterator", poison_from(3))
    config = smoke_config(data_dir, total_steps=4, checkpoint_every=3, log_every=4)
    with pytest.raises(train.NonFiniteLossError) as error:
        train.train_and_evaluate(config, str(tmp_path))
    last = checkpoint_steps(tmp_path)[-1]
    assert_finite_checkpoint(tmp_path, last)
    assert re.search(rf"\bstep {last}\b", str(error.value))
    assert re.search(r"\bstep 3\b", str(error.value)), "names the first non-finite step"


def test_pretrained_backbone_enters_the_detector(tmp_path, data_dir):
    """Classification pretraining writes backbone variables that the trainer loads as they are."""
    import tensorflow_datasets as tfds
    from flax import serialization

    from ood_jax.train import pretrain

    config = smoke_config(data_dir, pretrain__steps=3, pretrain__batch_size=4, log_every=1)
    experiment = train.setup(smoke_config(data_dir), tmp_path / "fresh")
    builder = tfds.builder(config.dataset.name, data_dir=str(data_dir))
    path = pretrain.pretrain_backbone(
        config, builder, experiment.splits["train"], tmp_path / "backbone.msgpack"
    )
    written = serialization.msgpack_restore(path.read_bytes())
    fresh = train.initial_state(smoke_config(data_dir), experiment)
    # The pretraining moved the weights away from the detector's own initialization.
    kernel = np.asarray(written["params"]["stem_conv"]["kernel"])
    assert not np.allclose(kernel, np.asarray(fresh.params["backbone"]["stem_conv"]["kernel"]))

    loaded = train.load_pretrained_backbone(
        fresh, config.model.args, path, experiment.state_sharding
    )
    np.testing.assert_array_equal(loaded.params["backbone"]["stem_conv"]["kernel"], kernel)
    np.testing.assert_array_equal(
        loaded.model_state["batch_stats"]["backbone"]["stem_norm"]["mean"],
        written["batch_stats"]["stem_norm"]["mean"],
    )
    np.testing.assert_array_equal(
        loaded.params["input_projection"]["kernel"], fresh.params["input_projection"]["kernel"]
    )


def test_pretraining_is_a_stage_of_its_own(tmp_path, data_dir):
    """`ood-jax pretrain` writes the backbone once; `evaluate` never pretrains. Its batches
    here are on an 80x96 or 96x80 rectangle (input.orientation_window)."""
    workdir = tmp_path / "run"
    overrides = {"pretrain__steps": 2, "pretrain__batch_size": 4, "log_every": 1}
    overrides.update(input__orientation_window=1, input__scales=(64, 80), input__crop_prob=1.0)
    argv = ["pretrain", *train_argv(workdir, data_dir, **overrides)[1:]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(argv)
    path = workdir / train.PRETRAINED_BACKBONE
    assert path.is_file() and "backbone pretraining 2/2" in out.getvalue()
    written = path.read_bytes()

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(argv)
    assert "exists, kept" in out.getvalue() and path.read_bytes() == written

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train.evaluate(smoke_config(data_dir, **overrides), str(tmp_path / "other"))
    assert not (tmp_path / "other" / train.PRETRAINED_BACKBONE).exists()

    with pytest.raises(SystemExit, match="config.pretrain.steps"):
        cli.main(["pretrain", *train_argv(tmp_path / "none", data_dir)[1:]])
