"""A training workdir that recovers, or says in one line why it cannot (issue 17).

Each problem is reproduced on copies of one short smoke run (4 steps; checkpoints at 1, the
first step orbax always saves, 2 and 4):

* a changed model field on an existing workdir used to end in 200 lines of orbax traceback
  advising `strict=False`: it is refused naming the field, old -> new, and the fix;
* a truncated file in the newest checkpoint used to end in 262 lines of traceback: that
  checkpoint is reported by step, moved aside, and the next older one used; if none restores,
  one error line lists them and nothing is moved;
* Ctrl-C in the train loop saves the step it stopped at and says how to continue;
* compiling and evaluating print what they are doing;
* per_domain_ap.png labels its bars and has no offset or multiplier on its y axis.

The processes here share a persistent XLA compilation cache, so only the first run compiles.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import pathlib
import re
import shutil

import jax
import ml_collections
import numpy as np
import pytest

from ood_jax import cli, datasets, multihost
from ood_jax.detection import evaluation
from ood_jax.models import exported
from ood_jax.train import checkpoint, config_checks, resume, train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "configs" / "synthetic_detr.py"
STEPS = 4
CHECKPOINTS = [1, 2, STEPS]
LOSS_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss (\S+)", re.MULTILINE)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


def smoke_config(data_dir: pathlib.Path, **overrides) -> ml_collections.ConfigDict:
    """get_config("smoke") with `field__sub=value` overrides, as --config.field.sub=value."""
    spec = importlib.util.spec_from_file_location("synthetic_detr_config", CONFIG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.dataset.data_dir = str(data_dir)
    config.total_steps, config.checkpoint_every, config.log_every = STEPS, 2, 1
    for name, value in overrides.items():
        *parents, leaf = name.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def argv(command: str, workdir: pathlib.Path, data_dir: pathlib.Path, *extra: str) -> list[str]:
    return [
        command,
        f"--config={CONFIG_FILE}:smoke",
        f"--workdir={workdir}",
        f"--config.dataset.data_dir={data_dir}",
        f"--config.total_steps={STEPS}",
        "--config.checkpoint_every=2",
        "--config.log_every=1",
        *extra,
    ]


def error_line(args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    message = str(exit_info.value.code)
    assert message.startswith("error: "), message
    assert "\n" not in message and "Traceback" not in message, message
    return message


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    directory = workdir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir, compile_cache):
    """The one training of this module; each test works on a copy of its workdir."""
    workdir = tmp_path_factory.mktemp("run") / "workdir"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.train_and_evaluate(smoke_config(data_dir), str(workdir))
    assert checkpoint_steps(workdir) == CHECKPOINTS
    return {"workdir": workdir, "stdout": out.getvalue()}


@pytest.fixture
def workdir(run, tmp_path) -> pathlib.Path:
    copy = tmp_path / "workdir"
    shutil.copytree(run["workdir"], copy)
    return copy


def truncate_largest_array_file(workdir: pathlib.Path, step: int) -> pathlib.Path:
    """Halves the biggest data file of checkpoint `step`, as a full disk or a kill could."""
    files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = largest.read_bytes()
    largest.write_bytes(data[: len(data) // 2])
    return largest


# ------------------------------------------------------------------------------------------------
# The run's config is kept and compared.
# ------------------------------------------------------------------------------------------------


def test_the_config_is_stored_in_the_workdir(run, data_dir):
    stored = json.loads((run["workdir"] / resume.CONFIG_FILE).read_text())
    assert config_checks.changed_fields(stored, smoke_config(data_dir)) == []


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_a_changed_model_field_is_refused_by_name(workdir, data_dir, command):
    before = (workdir / resume.CONFIG_FILE).read_text()
    message = error_line(argv(command, workdir, data_dir, "--config.model.args.hidden_dim=64"))
    assert f"--workdir {workdir} holds checkpoints of another config" in message
    assert "(model.args.hidden_dim 32 -> 64)" in message
    assert "--config.allow_config_change=True" in message and "fresh --workdir" in message
    assert "strict" not in message
    assert checkpoint_steps(workdir) == CHECKPOINTS
    assert (workdir / resume.CONFIG_FILE).read_text() == before


def test_every_changed_field_is_named_with_old_and_new_values(workdir, data_dir):
    message = error_line(
        argv(
            "train",
            workdir,
            data_dir,
            "--config.input.image_size=64",
            "--config.optim.lr=0.001",
            "--config.total_steps=8",  # free: not named
        )
    )
    assert "input.image_size 96 -> 64" in message and "optim.lr 0.0002 -> 0.001" in message
    assert "total_steps" not in message.split("(")[1]


def test_allowed_change_of_shapes_is_still_refused_by_array(workdir, data_dir):
    message = error_line(
        argv(
            "evaluate",
            workdir,
            data_dir,
            "--config.model.args.hidden_dim=64",
            "--config.allow_config_change=True",
        )
    )
    assert (
        f"checkpoint {STEPS} in {workdir / 'checkpoints'} holds a train state of other shapes"
        in message
    )
    assert re.search(r"params\.\S+ \[32\] -> \[64\]", message), message
    assert "fresh --workdir" in message
    # Not damaged, so nothing is moved aside.
    assert checkpoint_steps(workdir) == CHECKPOINTS
    assert not (workdir / checkpoint.FAILED_DIR).exists()


def test_which_fields_may_change_on_resume(data_dir):
    stored = json.loads(smoke_config(data_dir).to_json_best_effort())
    free = smoke_config(
        data_dir / "moved",
        total_steps=100,
        eval_every=5,
        log_every=7,
        checkpoint_every=3,
        keep_checkpoints=1,
        eval_batch_size=2,
        mesh=[("data", 1), ("fsdp", -1)],
        partition_rules=[(".*", "fsdp")],
        model__backbone_weights="/elsewhere/r18.pth",
    )
    assert config_checks.check_resume(stored, free, "w") == []
    for field, value in [
        ("seed", 1),
        ("dataset__target_domains", ("sky",)),
        ("input__shuffle_buffer", 8),
        ("loss__eos_coef", 0.2),
        ("model__args__dropout", 0.1),
    ]:
        path = field.replace("__", ".")
        with pytest.raises(ValueError, match=rf"\({re.escape(path)} .+ -> "):
            config_checks.check_resume(stored, smoke_config(data_dir, **{field: value}), "w")
        allowed = smoke_config(data_dir, allow_config_change=True, **{field: value})
        assert [c[0] for c in config_checks.check_resume(stored, allowed, "w")] == [path]


# ------------------------------------------------------------------------------------------------
# A damaged checkpoint.
# ------------------------------------------------------------------------------------------------


def test_a_truncated_newest_checkpoint_is_moved_aside_and_the_older_one_used(
    workdir, data_dir, capfd
):
    truncate_largest_array_file(workdir, STEPS)
    cli.main(argv("train", workdir, data_dir))
    out, err = capfd.readouterr()

    moved = workdir / checkpoint.FAILED_DIR / str(STEPS)
    line = next(line for line in out.splitlines() if line.startswith(f"checkpoint {STEPS} "))
    assert re.fullmatch(
        rf"checkpoint {STEPS} could not be restored \(ValueError: array \S+: OUT_OF_RANGE: .+\); "
        rf"moved to {re.escape(str(moved))}; resuming from 2",
        line,
    ), line
    assert "Resumed from step 2" in out
    assert sorted(int(m[1]) for m in LOSS_LINE.finditer(out)) == [3, 4]
    assert moved.is_dir() and checkpoint_steps(workdir) == CHECKPOINTS  # trained to 4 again
    assert json.loads((workdir / "results.json").read_text())["step"] == STEPS
    # Nor does orbax's aborted parallel read print its hundreds of tracebacks.
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]


def test_when_no_checkpoint_restores_one_line_lists_them_and_nothing_moves(workdir, data_dir):
    for step in CHECKPOINTS:
        (workdir / "checkpoints" / str(step) / "state" / "_METADATA").write_text("{")
    message = error_line(argv("evaluate", workdir, data_dir))
    assert f"no checkpoint in {workdir / 'checkpoints'} could be restored" in message
    for step in CHECKPOINTS:
        assert f"step {step}: JSONDecodeError" in message
    assert "fresh --workdir" in message
    assert checkpoint_steps(workdir) == CHECKPOINTS
    assert not (workdir / checkpoint.FAILED_DIR).exists()


def test_export_takes_the_newest_checkpoint_that_restores(workdir, capfd, tmp_path):
    saved = exported_variables(workdir, 2, tmp_path / "step2.msgpack")
    truncate_largest_array_file(workdir, STEPS)
    out = tmp_path / "model.msgpack"
    cli.main(["export", "--workdir", str(workdir), "--out", str(out)])
    printed, err = capfd.readouterr()

    moved = workdir / checkpoint.FAILED_DIR / str(STEPS)
    assert re.search(
        rf"^checkpoint {STEPS} could not be restored \(ValueError: array \S+: OUT_OF_RANGE: .+\); "
        rf"moved to {re.escape(str(moved))}; exporting step 2$",
        printed,
        re.MULTILINE,
    ), printed
    model = exported.load_exported(out)
    assert model.step == 2 and moved.is_dir() and checkpoint_steps(workdir) == [1, 2]
    assert flat(model.variables) == flat(saved) and "Traceback" not in err, err[-3000:]

    # A damaged step asked for by --step is an error naming it; nothing moves.
    truncate_largest_array_file(workdir, 2)
    message = error_line(["export", "--workdir", str(workdir), "--out", str(out), "--step", "2"])
    assert message.startswith(f"error: checkpoint 2 in {workdir / 'checkpoints'} could not be "), (
        message
    )
    assert "without --step the newest that restores is exported" in message
    assert checkpoint_steps(workdir) == [1, 2]


def exported_variables(workdir: pathlib.Path, step: int, out: pathlib.Path) -> dict:
    cli.main(["export", "--workdir", str(workdir), "--out", str(out), "--step", str(step)])
    return exported.load_exported(out).variables


def flat(tree) -> dict[str, bytes]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf).tobytes() for path, leaf in leaves}


# ------------------------------------------------------------------------------------------------
# Ctrl-C.
# ------------------------------------------------------------------------------------------------


def test_ctrl_c_in_training_saves_the_step_and_a_rerun_continues(
    workdir, data_dir, monkeypatch, capsys
):
    preempted = multihost.preempted

    def ctrl_c_after_step_5(step: int) -> bool:  # asked once a step, after the step is taken
        if step == 5:
            raise KeyboardInterrupt
        return preempted(step)

    command = argv("train", workdir, data_dir, "--config.total_steps=6")
    monkeypatch.setattr(multihost, "preempted", ctrl_c_after_step_5)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(command)
    assert exit_info.value.code == cli.INTERRUPTED_EXIT_CODE
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"interrupted: checkpoint at step 5 kept in {workdir}; rerun the same command to continue"
    )
    assert "Traceback" not in err
    assert checkpoint_steps(workdir) == [2, 4, 5]  # 3 kept

    monkeypatch.setattr(multihost, "preempted", preempted)
    cli.main(command)
    out = capsys.readouterr().out
    assert "Resumed from step 5" in out
    assert sorted(int(m[1]) for m in LOSS_LINE.finditer(out)) == [6]
    assert json.loads((workdir / "results.json").read_text())["step"] == 6


def test_ctrl_c_before_the_first_checkpoint_says_none_was_kept(tmp_path):
    import jax.numpy as jnp

    ckpt = checkpoint.Checkpointer(tmp_path, every_steps=2)
    state = train.TrainState(
        step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(3)}, model_state={}, opt_state=()
    )
    message = resume.keep_on_interrupt(ckpt, state, {}, tmp_path)
    assert message == (
        f"no checkpoint saved in {tmp_path} yet; rerun the same command to start again"
    )
    assert ckpt.latest_step() is None  # the untrained state of step 0 is not worth a checkpoint
    ckpt.close()


# ------------------------------------------------------------------------------------------------
# Progress.
# ------------------------------------------------------------------------------------------------


def test_compiling_and_evaluating_say_what_they_do(run, data_dir):
    lines = run["stdout"].splitlines()

    def index(pattern: str) -> int:
        found = [i for i, line in enumerate(lines) if re.fullmatch(pattern, line)]
        assert found, f"no line {pattern!r} in:\n" + "\n".join(lines)
        return found[0]

    assert (
        index(r"New run in .*: initializing the parameters \.\.\.")
        < index(r"compiling the train step \.\.\.")
        < index(r"compiled the train step in \d+\.\d s")
        < index(r"step 1/4 .*")
        < index(r"compiling the predict step \.\.\.")
        < index(r"evaluated iid: 48 images in \d+\.\d s")  # 12 training domains' test images
    )
    for domain in smoke_config(data_dir).dataset.target_domains:
        index(rf"evaluated {domain}: \d+ images in \d+\.\d s")


def test_long_evaluations_report_how_far_they_are(capsys):
    ticks = iter(range(0, 1000, 4))  # 4 s per batch
    progress = evaluation.SplitProgress("sky", 40, every_s=10.0, clock=lambda: float(next(ticks)))
    for _ in range(5):
        progress.update(8)
    progress.close()
    assert capsys.readouterr().out.splitlines() == [
        "evaluating sky: 24/40 images",  # 12 s after the start
        "evaluated sky: 40 images in 24.0 s",
    ]


# ------------------------------------------------------------------------------------------------
# per_domain_ap.png.
# ------------------------------------------------------------------------------------------------


def test_the_bar_chart_labels_its_bars_from_zero_without_an_offset():
    from matplotlib import pyplot as plt

    results = {
        "step": 4,
        "iid": {"AP": 0.254},
        "per_domain": {"sky": {"AP": 3e-6}, "dim": {"AP": 0.0}, "water": {"AP": -1.0}},
    }
    fig = evaluation.bar_chart_figure(results)
    try:
        fig.canvas.draw()
        (ax,) = fig.axes
        assert [t.get_text() for t in ax.texts] == ["0.254", "3.0e-06", "0.000", "n/a"]
        assert ax.get_ylim()[0] == 0
        assert ax.yaxis.get_major_formatter().get_offset() == ""
    finally:
        plt.close(fig)
    # Tiny APs alone are what gave matplotlib's default axis its "1e-6" multiplier.
    tiny = {"step": 4, "iid": {"AP": 3e-6}, "per_domain": {"sky": {"AP": 1e-6}}}
    fig = evaluation.bar_chart_figure(tiny)
    try:
        fig.canvas.draw()
        assert fig.axes[0].yaxis.get_major_formatter().get_offset() == ""
    finally:
        plt.close(fig)
    assert evaluation._bar_chart(results).startswith(b"\x89PNG")
