"""Several processes on this machine (`ood-jax launch`, JAX's CPU collectives over 127.0.0.1),
as a SLURM or TPU-pod job runs them:

* 2 processes x 2 devices pretrain the backbone, train DETR's smoke config, checkpoint and
  evaluate; a 1-process `ood-jax evaluate` of the same checkpoint writes the same results.json
  and matches.npz, and a 1-process `ood-jax export` reads the checkpoint they wrote together;
  `evaluate --corrupted` writes the same summaries from 2 processes as from 1 (DINO:
  test_multiprocess_dino.py);
* 1 process x 4 devices trains on the same examples at each step: the same first losses;
* a process killed with SIGKILL is named by the other, which stops; SIGTERM to every process
  (a preemption) saves the same step on each; the reruns resume and end where the
  uninterrupted run ends, loss for loss and parameter for parameter.

The runs share one dataset and one compilation cache, and compare with one uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_train import tensorboard_scalars

from ood_jax import datasets, multihost
from ood_jax.detection import compare
from ood_jax.train import selection, train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = f"--config={REPO / 'configs' / 'synthetic_detr.py'}:smoke"
STEPS = 4
LOSS_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss (\S+)", re.MULTILINE)
SHARED_COMPILES = pathlib.Path(__file__).parent / "shared_compiles"
HANG_GUARD_S = 600  # a wedged job fails the test instead of stalling the suite


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


def environ(devices: int | None = None) -> dict[str, str]:
    """This process's environment (the compile_cache fixture's cache included) for a job's
    processes, which compile each program once, in process 0 (shared_compiles/)."""
    env = dict(os.environ)
    paths = [str(REPO), str(SHARED_COMPILES), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env["JAX_SHARE_BINARY_BETWEEN_HOSTS"] = "true"
    for name in (multihost.NUM_PROCESSES_ENV, multihost.PROCESS_ID_ENV):
        env.pop(name, None)
    if devices is not None:
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


def train_args(workdir: pathlib.Path, data_dir: pathlib.Path) -> list[str]:
    return [
        "train",
        CONFIG,
        f"--workdir={workdir}",
        f"--config.dataset.data_dir={data_dir}",
        f"--config.total_steps={STEPS}",
        "--config.checkpoint_every=2",
        "--config.log_every=1",
        # Smaller images than the smoke config's: the runs here check agreement, not learning.
        "--config.input.image_size=64",
        "--config.input.scales=(48, 64)",
        # The backbone's own stage first (the runs below start from this run's backbone).
        "--config.pretrain.steps=2",
        "--config.pretrain.batch_size=8",
    ]


def launch_command(args: list[str], lost_after: float | None = None) -> list[str]:
    command = [sys.executable, "-m", "ood_jax", "launch", "--processes", "2", "--cpu-devices", "2"]
    if lost_after is not None:
        command += ["--lost-after", str(lost_after)]
    return command + args


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def logged_losses(workdir: pathlib.Path) -> dict[int, float]:
    """The float32 losses of every logged step, from the run's TensorBoard events."""
    return tensorboard_scalars(workdir).get("loss", {})


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def read_state(workdir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
    """A checkpoint's train state as host arrays, whatever devices wrote it."""
    path = workdir / "checkpoints" / str(step) / "state"
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return flat(checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy)))


# The per-detection fields of `coco.Matches`, reordered together.
DETECTION_FIELDS = ("image", "category", "score", "rank", "out_of_range")


def matches_by_detection(workdir: pathlib.Path) -> dict[str, dict[str, np.ndarray]]:
    """Each split's saved matches (matches.npz) with its detections in (category, image, rank)
    order instead of accumulate order (category, descending score, ...): two executables whose
    scores differ in the last bits may put near-tied detections of two images either way."""
    out = {}
    for split, m in compare.read_matches(workdir).items():
        order = np.lexsort((m.rank, m.image, m.category))
        new_position = np.empty_like(order)
        new_position[order] = np.arange(order.size)
        candidate = new_position[m.candidate]
        by_candidate = np.argsort(candidate)
        out[split] = {
            "image_ids": m.image_ids,
            "category_ids": m.category_ids,
            "num_positive": m.num_positive,
            "ground_truth": np.asarray(m.ground_truth),
            **{name: getattr(m, name)[order] for name in DETECTION_FIELDS},
            "candidate": candidate[by_candidate],
            "tp": m.tp[by_candidate],
            "fp": m.fp[by_candidate],
        }
    return out


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory, data_dir, compile_cache):
    """An uninterrupted run of 2 processes x 2 devices: backbone pretraining, then training
    with a periodic evaluation."""
    workdir = tmp_path_factory.mktemp("two_by_two")
    pretraining = ["--config.pretrain.steps=2", "--config.pretrain.batch_size=8"]
    command = launch_command(
        [*train_args(workdir, data_dir), *pretraining, "--config.eval_every=2"]
    )
    started = time.perf_counter()
    done = run(command, environ())
    print(f"\n2 x 2 run: {time.perf_counter() - started:.0f} s\n{done.stdout}")
    return {"workdir": workdir, "stdout": done.stdout, "losses": logged_losses(workdir)}


# ------------------------------------------------------------------------------------------------
# Training, checkpoints and evaluation agree with one process.
# ------------------------------------------------------------------------------------------------


def test_one_process_evaluates_the_checkpoint_as_two_did(
    two_by_two, data_dir, compile_cache, tmp_path
):
    trained = two_by_two["workdir"]
    assert sorted(two_by_two["losses"]) == list(range(1, STEPS + 1))
    assert checkpoint_steps(trained) == [1, 2, 4]  # orbax saves the first step too
    assert [r["step"] for r in selection.read_evaluations(trained)] == [2, STEPS]
    # Only process 0 writes the results and prints them.
    assert two_by_two["stdout"].count("Results at step") == 1

    workdir = tmp_path / "evaluated"
    shutil.copytree(trained, workdir)
    (workdir / "results.json").unlink()
    (workdir / "matches.npz").unlink()
    evaluate = [sys.executable, "-m", "ood_jax", "evaluate", *train_args(workdir, data_dir)[1:]]
    run(evaluate, environ(devices=4))

    one = json.loads((workdir / "results.json").read_text())
    two = json.loads((trained / "results.json").read_text())
    assert one == two
    ones, twos = matches_by_detection(workdir), matches_by_detection(trained)
    assert ones.keys() == twos.keys()
    assert any(split["score"].size for split in twos.values())
    for split in twos:
        for name in twos[split]:
            np.testing.assert_array_equal(ones[split][name], twos[split][name], err_msg=name)


def test_one_process_exports_what_two_processes_saved(two_by_two, compile_cache, tmp_path):
    from ood_jax.models import exported

    out = tmp_path / "exported.msgpack"
    export = [sys.executable, "-m", "ood_jax", "export", "--workdir", str(two_by_two["workdir"])]
    run([*export, "--out", str(out)], environ(devices=1))
    written = flat(exported.load_exported(out).variables["params"])
    saved = read_state(two_by_two["workdir"], STEPS)
    assert written
    for name, value in written.items():
        np.testing.assert_array_equal(value, saved["['params']" + name], err_msg=name)


def test_corrupted_evaluation_as_one_process(two_by_two, data_dir, compile_cache, tmp_path):
    request = {"dataset": "synthetic_shifts/tiny", "corruptions": "contrast", "severities": "3"}
    built = datasets.build("corrupted", str(data_dir), corruption=request)
    corrupted = f"--corrupted=corrupted/{built.builder_config.name}"
    summaries = {}
    for processes in (2, 1):
        workdir = tmp_path / str(processes)
        shutil.copytree(two_by_two["workdir"], workdir)
        args = ["evaluate", *train_args(workdir, data_dir)[1:], corrupted]
        if processes == 2:
            run(launch_command(args), environ())
        else:
            run([sys.executable, "-m", "ood_jax", *args], environ(devices=4))
        written = sorted((workdir / "corruptions").glob("*.json"))
        summaries[processes] = {p.name: json.loads(p.read_text()) for p in written}
    assert summaries[2] and summaries[2] == summaries[1]


# ------------------------------------------------------------------------------------------------
# The examples of a step do not depend on the process count.
# ------------------------------------------------------------------------------------------------


def test_one_process_of_four_devices_trains_on_the_same_examples(
    two_by_two, data_dir, compile_cache, tmp_path
):
    workdir = tmp_path / "one_by_four"
    workdir.mkdir()
    shutil.copy(two_by_two["workdir"] / train.PRETRAINED_BACKBONE, workdir)
    command = [sys.executable, "-m", "ood_jax", *train_args(workdir, data_dir)]
    run([*command, "--config.total_steps=3"], environ(devices=4))
    one, two = logged_losses(workdir), two_by_two["losses"]
    assert sorted(one) == [1, 2, 3]
    # The same examples give the same first loss but for the float32 rounding of cross-device
    # sums (in-process vs. collectives between processes). Adam's first updates amplify that
    # rounding where gradients are near zero (5e-6 by step 2 and 3e-5 by step 3 measured, 1e-3
    # by step 6, 1e-2 by step 20); data of other examples would change a loss in the second
    # digit.
    np.testing.assert_allclose(one[1], two[1], rtol=2e-6, err_msg="step 1")
    for step in (2, 3):
        np.testing.assert_allclose(one[step], two[step], rtol=5e-4, err_msg=f"step {step}")


# ------------------------------------------------------------------------------------------------
# Faults: preemption (SIGTERM to every process) and a lost process (SIGKILL to one).
# ------------------------------------------------------------------------------------------------


def wait_for_line(child: subprocess.Popen, pattern: str, log: list[str]) -> None:
    for line in child.stdout:
        log.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"the job ended before {pattern!r}:\n{''.join(log)[-4000:]}")


def interrupted(command: list[str], env: dict[str, str], after: str, interrupt) -> tuple[int, str]:
    """Runs `command` until a line matches `after`, then calls `interrupt(launcher)`; returns
    the launcher's exit code and output once the job has ended."""
    log: list[str] = []
    child = subprocess.Popen(
        command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for_line(child, after, log)
        interrupt(child)
        rest, _ = child.communicate(timeout=HANG_GUARD_S)
    finally:
        child.kill()
    return child.returncode, "".join(log) + rest


def kill_process_1(launcher: subprocess.Popen) -> None:
    children = pathlib.Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
    processes = [int(pid) for pid in children.split()]
    assert len(processes) == 2
    os.kill(processes[1], signal.SIGKILL)


def test_lost_process_then_preemption_then_the_same_end(
    two_by_two, data_dir, compile_cache, tmp_path
):
    """SIGKILL to process 1: process 0 names it and stops; the rerun resumes. SIGTERM to every
    process: both save the same step and stop; the rerun resumes and ends, loss for loss and
    parameter for parameter, where the uninterrupted run ends."""
    workdir = tmp_path / "faults"
    workdir.mkdir()
    shutil.copy(two_by_two["workdir"] / train.PRETRAINED_BACKBONE, workdir)
    command = launch_command(train_args(workdir, data_dir), lost_after=10)
    env = environ()

    def once_a_checkpoint_is_finished(launcher: subprocess.Popen) -> None:
        while not checkpoint_steps(workdir):  # orbax finishes a step once every process has
            assert launcher.poll() is None
            time.sleep(0.1)
        kill_process_1(launcher)

    code, output = interrupted(command, env, r"^step 2/", once_a_checkpoint_is_finished)
    assert code == multihost.LOST_EXIT_CODE, output[-4000:]
    assert "error: process 1 of 2 is lost" in output, output[-4000:]
    assert "launch: process 0 exited with 75, process 1 was killed by SIGKILL" in output
    assert not (workdir / "results.json").exists()
    kept = checkpoint_steps(workdir)[-1]

    # The launcher passes SIGTERM on to every process.
    code, output = interrupted(command, env, r"^step \d+/", lambda c: c.send_signal(signal.SIGTERM))
    assert f"Resumed from step {kept}" in output
    assert code == multihost.PREEMPTED_EXIT_CODE, output[-4000:]
    saved = re.findall(r"preempted: SIGTERM received; step (\d+) is saved", output)
    assert len(saved) == 2 and len(set(saved)) == 1, output[-4000:]
    step = int(saved[0])
    assert kept < step <= STEPS and checkpoint_steps(workdir)[-1] == step

    resumed = run(command, env)
    assert f"Resumed from step {step}" in resumed.stdout
    losses, uninterrupted = logged_losses(workdir), two_by_two["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == uninterrupted
    final, expected = read_state(workdir, STEPS), read_state(two_by_two["workdir"], STEPS)
    assert final.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(final[name], expected[name], err_msg=name)
