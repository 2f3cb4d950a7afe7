"""`--config=FILE[:arg]` and `--config.field=value` (ood_jax.cli.config_flags) against
ml_collections' absl config flags, the reference for how an override is read."""

from __future__ import annotations

import pathlib

import pytest
from absl import flags
from ml_collections import config_flags as absl_config_flags

from ood_jax import cli
from ood_jax.cli import config_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = f"{ROOT}/configs/synthetic_detr.py:smoke"

OVERRIDES = [
    ["--config.total_steps=7"],
    ["--config.optim.lr=0.001", "--config.optim.clip_norm=1"],  # an int's text for a float
    ["--config.model.args.dilation=false", "--config.ema_warmup=True"],
    ["--config.model.args.freeze_backbone=1", "--config.allow_config_change=0"],
    ["--config.model.dtype=bfloat16", "--config.model_name=a name with spaces"],
    ["--config.input.scales=(48, 64)"],
    ["--config.input.scales=48", "--config.input.scales=64"],  # a tuple field, repeated
    ["--config.input.image_size=64"],  # a FieldReference: max_size and eval_size follow
    ["--config.input.max_size=80"],  # ... and setting the reference sets it for all
    ["--config.dataset.target_domains=('sky', 'dim')"],
    ["--config.total_steps", "9", "--config.seed=3"],  # the value as the next argument
    ["--config.model.args.dilation"],  # a bare bool flag is true
]


def absl_config(argv: list[str], spec: str = SPEC):
    values = flags.FlagValues()
    absl_config_flags.DEFINE_config_file(
        "config", None, "", flag_values=values, lock_config=True, sys_argv=["prog", *argv]
    )
    values(["prog", f"--config={spec}", *argv])
    return values.config


@pytest.mark.parametrize("argv", OVERRIDES, ids=" ".join)
def test_overrides_read_as_absl_reads_them(argv):
    ours = config_flags.load(SPEC, config_flags.split_overrides(argv)[1])
    assert ours.to_dict() == absl_config(argv).to_dict()
    assert ours.is_locked


def test_a_field_named_as_one_of_its_parents_is_reached(tmp_path):
    # One-character names are one object in CPython: a path is walked by position, not identity.
    # The file's get_config takes no argument, as absl allows.
    spec = tmp_path / "nested.py"
    spec.write_text(
        "import ml_collections\n\n\ndef get_config():\n"
        "    return ml_collections.ConfigDict({'a': {'b': {'a': 1}, 'a': 2}, 'b': 3})\n"
    )
    argv = ["--config.a.b.a=5", "--config.a.a=6"]
    ours = config_flags.load(str(spec), config_flags.split_overrides(argv)[1])
    assert ours.to_dict() == absl_config(argv, str(spec)).to_dict()
    assert ours.to_dict() == {"a": {"b": {"a": 5}, "a": 6}, "b": 3}


def test_the_command_line_loads_the_config_with_its_overrides():
    args = cli.parse_args(
        ["train", f"--config={SPEC}", "--workdir=/tmp/x", "--config.input.image_size=64"]
    )
    assert args.config.input.max_size == 64 and args.workdir == "/tmp/x"
    assert args.run.__name__ == "_train"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--config.optim.lrr=1"],
            "--config.optim.lrr: config.optim has no field 'lrr'; did you mean lr?",
        ),
        (["--config.total_steps=many"], "--config.total_steps: 'many' is not an int"),
        (["--config.ema_warmup=maybe"], "--config.ema_warmup: 'maybe' is not a bool"),
        (["--config.total_steps.x=1"], "--config.total_steps.x: config.total_steps is a int"),
        (["--config.seed"], "--config.seed needs a value"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(argv, message):
    with pytest.raises(ValueError) as error:
        config_flags.load(SPEC, config_flags.split_overrides(argv)[1])
    assert str(error.value).startswith(message)


def test_overrides_without_a_config_are_refused():
    with pytest.raises(ValueError, match="--config.total_steps needs --config=FILE"):
        cli.parse_args(["sweep", "--workdir=/tmp/x", "--aggregate-only", "--config.total_steps=2"])


def test_a_launched_command_keeps_its_overrides():
    args = cli.parse_args(["launch", "--processes", "2", "train", "--config.total_steps=3"])
    assert args.command == ["train", "--config.total_steps=3"]
