"""`ood-jax launch`: one job of N processes on this machine, joined as on a cluster.

Each process is `ood-jax COMMAND ...` with the variables `multihost.initialize` reads, so it
runs the same `jax.distributed` setup as a SLURM or TPU-pod job, with JAX's CPU collectives
between processes here. On CPU, `cpu_devices` gives each process that many simulated devices;
with GPUs, each process takes an equal share of them.

Process 0's output passes through as it is; the others' lines are prefixed "[i] ". SIGTERM and
SIGINT (Ctrl-C) to the launcher reach every process as SIGTERM: a preemption, as SLURM sends it. The launcher
waits for all of them (a lost process is named by the others, `multihost`), then exits with
the first nonzero code in process order, 0 when all succeeded.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from ood_jax import multihost


@dataclasses.dataclass(frozen=True)
class Job:
    processes: int
    cpu_devices: int | None = None  # simulated CPU devices per process; None: the platform's
    port: int | None = None  # the coordinator's; None: a free one
    lost_after_s: float | None = None  # None: multihost's default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def process_environ(
    job: Job, process: int, port: int, environ: Mapping[str, str] = os.environ, gpus: int = 0
) -> dict[str, str]:
    """The environment of process `process` of `job`."""
    env = dict(environ)
    env[multihost.COORDINATOR_ENV] = f"127.0.0.1:{port}"
    env[multihost.NUM_PROCESSES_ENV] = str(job.processes)
    env[multihost.PROCESS_ID_ENV] = str(process)
    if job.lost_after_s is not None:
        env[multihost.LOST_AFTER_ENV] = str(job.lost_after_s)
    if job.cpu_devices is not None:
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={job.cpu_devices}")
        env["XLA_FLAGS"] = " ".join(flags)
    elif gpus:
        if gpus % job.processes:
            raise ValueError(
                f"--processes {job.processes}: this machine's {gpus} GPUs do not divide evenly"
            )
        share = gpus // job.processes
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(
            str(i) for i in range(process * share, (process + 1) * share)
        )
    return env


def _relay(stream: IO[str], prefix: str) -> None:
    for line in stream:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def run(job: Job, command: Sequence[str]) -> int:
    """Runs `ood-jax COMMAND...` as the job's processes; returns the exit code."""
    if job.processes < 1:
        raise ValueError(f"--processes {job.processes}: expected at least 1")
    if job.cpu_devices is not None and job.cpu_devices < 1:
        raise ValueError(f"--cpu-devices {job.cpu_devices}: expected at least 1")
    if not command:
        raise ValueError("no command to launch: ood-jax launch --processes N COMMAND [ARGS...]")
    port = job.port or free_port()
    gpus = 0 if job.cpu_devices is not None else _gpu_count()
    argv = [sys.executable, "-m", "ood_jax", *command]
    children: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    for process in range(job.processes):
        child = subprocess.Popen(
            argv,
            env=process_environ(job, process, port, gpus=gpus),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            # Their own process group: a Ctrl-C at the terminal reaches the launcher alone.
            process_group=0,
        )
        children.append(child)
        relay = threading.Thread(
            target=_relay, args=(child.stdout, "" if process == 0 else f"[{process}] ")
        )
        relay.start()
        relays.append(relay)

    def forward(signum, frame):
        # SIGTERM either way: a preemption, at which every process saves the same step. A
        # Ctrl-C would stop each process at its own step, where no checkpoint can be saved.
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [child.wait() for child in children]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for relay in relays:
            relay.join()
    failed = [(i, code) for i, code in enumerate(codes) if code != 0]
    if not failed:
        return 0
    print(
        "launch: " + ", ".join(f"process {i} {_describe(code)}" for i, code in failed),
        file=sys.stderr,
        flush=True,
    )
    code = failed[0][1]
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"
