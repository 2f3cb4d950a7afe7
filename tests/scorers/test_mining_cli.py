"""`ood-jax mine`'s flags -> the jobs' option records: every flag reaches its record under its own
name (so a manifest's options are the command's flags), the examples make the records they say,
and a job's ValueError is the command's one error line."""

from __future__ import annotations

import argparse
import shlex

import pytest

from ood_jax.cli import mine as mining_cli
from ood_jax.mining import DEFAULT_CHUNK_SIZE, foci, jobs, oodbench

OPTIONS = {
    "foci": (mining_cli.foci_options, mining_cli.FOCI_EXAMPLE),
    "foci-zero-shot": (mining_cli.foci_zero_shot_options, mining_cli.FOCI_ZERO_SHOT_EXAMPLE),
    "oodbench": (mining_cli.oodbench_options, mining_cli.OODBENCH_EXAMPLE),
    "oodbench-ablation": (mining_cli.oodbench_ablation_options, mining_cli.ABLATION_EXAMPLE),
    "oodg": (mining_cli.oodg_options, mining_cli.OODG_EXAMPLE),
}
NOT_OPTIONS = {"run", "command", "mine_command", "help"}
PARSED = {"series": ("clip", "blip2", "groupvit", "lit")}  # "A,B,..." is recorded as its names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ood-jax")
    mining_cli.add_parsers(parser.add_subparsers(dest="command"))
    return parser


def _parse(example: str) -> argparse.Namespace:
    return _parser().parse_args(shlex.split(example.replace("\\\n", " "))[1:])


def _subparser(name: str) -> argparse.ArgumentParser:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            mine = action.choices["mine"]
    for action in mine._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_flag_is_a_field_of_its_name(name):
    make, example = OPTIONS[name]
    args = _parse(example)
    assert args.mine_command == name
    recorded = jobs.options(make(args))
    flags = {a.dest for a in _subparser(name)._actions} - NOT_OPTIONS
    assert set(recorded) == flags
    # Scalars are recorded as given; lists as tuples, JSON lists again in the manifest.
    for flag in flags:
        value = PARSED.get(flag, getattr(args, flag))
        if isinstance(value, (str, int, float, bool, tuple)):
            assert recorded[flag] == value, flag


def test_examples_make_the_records_they_say():
    assert mining_cli.foci_options(_parse(mining_cli.FOCI_EXAMPLE)) == jobs.FociMining(
        dataset="food101",
        source="data/foci/food101",
        scorer="models/clip-vit-l14",
        cache="work/foci_cache",
    )
    assert mining_cli.oodbench_options(_parse(mining_cli.OODBENCH_EXAMPLE)) == jobs.OodbenchMining(
        source="data/coco",
        scorer=("models/clip-vit-l14", "models/blip2-itm-vit-g"),
        out="data/coco/splits.jsonl",
        scoring=jobs.PairScoring(lavis=(("blip2-itm-vit-g", "models/blip2_pretrained.pth"),)),
    )
    ablation = mining_cli.oodbench_ablation_options(_parse(mining_cli.ABLATION_EXAMPLE))
    assert ablation.scorer[0] == ("clip", "models/clip-vit-l14") and len(ablation.scorer) == 4
    assert ablation.group == (
        ("I", ("clip", "blip2")),
        ("II", ("blip2", "groupvit")),
        ("III", ("groupvit", "lit")),
    )
    assert ablation.series == ("clip", "blip2", "groupvit", "lit")
    assert ablation.scoring.lavis == (("blip2", "models/blip2_pretrained.pth"),)
    oodg = mining_cli.oodg_options(_parse(mining_cli.OODG_EXAMPLE))
    assert oodg == jobs.OodgMining(
        dataset="counts", data_dir="data/tfds", task="grounding", setting="covariate_shift",
        num_items=500, out="items/", domains=("sky",), ice=3,
    )  # fmt: skip


def test_defaults_are_the_records_defaults():
    args = _parse("ood-jax mine oodbench --source S --scorer A --quiet --match A")
    job = mining_cli.oodbench_options(args)
    assert job.max_per_split == oodbench.MAX_PER_SPLIT and job.seed == 0 and job.out is None
    assert job.scoring == jobs.PairScoring(match=("A",))
    assert job.encoding == jobs.Encoding(quiet=True)
    args = _parse("ood-jax mine foci --dataset custom --data-dir D --scorer S")
    job = mining_cli.foci_options(args)
    assert job.source == "D" and job.templates == foci.DEFAULT_TEMPLATES
    assert job.chunk_size == DEFAULT_CHUNK_SIZE and job.encoding == jobs.Encoding()


def test_a_job_error_is_one_line(tmp_path):
    args = _parse(f"ood-jax mine foci --dataset imagenet --source {tmp_path} --scorer S")
    with pytest.raises(SystemExit) as stop:
        args.run(args)
    assert stop.value.code.startswith("error: unknown FOCI config 'imagenet'")
    args = _parse(f"ood-jax mine oodg --dataset synthetic_shifts/tiny --data-dir {tmp_path} "
                  f"--task grounding --setting zero_shot --num-items 1 --out {tmp_path / 'x'}")  # fmt: skip
    with pytest.raises(SystemExit, match=r"^error: synthetic_shifts/tiny is not built"):
        args.run(args)


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--scorer clip", "expected NAME=VALUE"),
        ("--scorer clip=c --group I", "expected NAME=VALUE"),
        ("--scorer clip=c --logit-scale clip=-1", "must be a positive number"),
    ],
)
def test_malformed_named_values_are_argparse_errors(flag, message, capsys):
    with pytest.raises(SystemExit) as stop:
        _parse(f"ood-jax mine oodbench-ablation --source S --out O {flag}")
    assert stop.value.code == 2 and message in capsys.readouterr().err
