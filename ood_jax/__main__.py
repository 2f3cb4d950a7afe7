"""`ood-jax` and `python -m ood_jax`: set up the process, then run the command line.

Kept apart from `ood_jax.cli` so that importing the CLI (as tests do) neither replaces the
process nor changes its environment.
"""

import os
import sys

from ood_jax import malloc

# The commands whose time goes into large compiled steps, whose per-step XLA:CPU buffers glibc's
# default malloc would fault in again on every call (`ood_jax.malloc`). The others (build, mine,
# eval-mllm, ...) run no such steps (build and mine measured no faster with it, under the
# earlier one-arena setting). `launch` starts its processes as `python -m ood_jax COMMAND`, each
# deciding for itself.
RESTARTS = frozenset({"pretrain", "train", "evaluate", "sweep", "demo"})


def command(argv: list[str]) -> str | None:
    """The subcommand `argv` (sys.argv) runs, as `ood_jax.cli` reads it (`--debug` anywhere)."""
    return next((a for a in argv[1:] if a != "--debug"), None)


def main() -> None:
    if command(sys.argv) in RESTARTS:
        malloc.restart_keeping_freed_memory()
    # TensorFlow (the data pipeline's) prints its oneDNN and CPU-feature notices at import,
    # before any flag could silence them. The oneDNN kernels only change TF's own float ops,
    # which here decode images. A user's own settings win.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    # TensorFlow imports Keras at its own import (for SavedModel registrations), 5 of the 15 s a
    # training process took to import on 2 cores; nothing here uses tf.keras. Told to use the
    # legacy tf_keras package, which is not installed, it skips that import.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    from ood_jax import cli

    cli.main()


if __name__ == "__main__":
    main()
