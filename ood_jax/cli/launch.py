"""`ood-jax launch`: an ood-jax command as N processes of one jax.distributed job here."""

from __future__ import annotations

import argparse

from ood_jax import multihost
from ood_jax.cli import help_text


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="run an ood-jax command as N processes of one jax.distributed job on this machine",
        description=help_text.fill(
            "Starts COMMAND as N processes joined as on a cluster (multihost.py): the way to run "
            "or debug a multi-host job on one machine. Process 0's output passes through, the "
            "others' lines are prefixed [i]; SIGTERM and Ctrl-C reach every process."
        ),
        epilog=help_text.examples(
            "ood-jax launch --processes 2 --cpu-devices 2 train "
            "--config=configs/synthetic_detr.py:smoke --workdir=workdirs/smoke2x2",
            "ood-jax launch --processes 2 evaluate --config=configs/synthetic_detr.py:smoke "
            "--workdir=workdirs/smoke2x2",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--processes", type=int, required=True, metavar="N")
    p.add_argument(
        "--cpu-devices",
        type=int,
        metavar="D",
        help="simulate D CPU devices in each process (default: the machine's devices; GPUs "
        "are shared out equally)",
    )
    p.add_argument("--port", type=int, help="the coordinator's port (default: a free one)")
    p.add_argument(
        "--lost-after",
        type=float,
        metavar="SECONDS",
        help=f"a process silent this long is lost and the job stops (default "
        f"{multihost.DEFAULT_LOST_AFTER_S:.0f}; {multihost.LOST_AFTER_ENV})",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="an ood-jax command and its flags")
    p.set_defaults(run=_launch)


def _launch(args: argparse.Namespace) -> None:
    from ood_jax import launch

    job = launch.Job(
        processes=args.processes,
        cpu_devices=args.cpu_devices,
        port=args.port,
        lost_after_s=args.lost_after,
    )
    raise SystemExit(launch.run(job, args.command))
