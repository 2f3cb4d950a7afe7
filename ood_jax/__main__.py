"""`ood-jax` and `python -m ood_jax`: set up the process, then run the command line.

Kept apart from `ood_jax.cli` so that importing the CLI (as tests do) neither replaces the
process nor changes its environment.
"""

import os

from ood_jax import malloc


def main() -> None:
    # TensorFlow (the data pipeline's) prints its oneDNN and CPU-feature notices at import,
    # before any flag could silence them. The oneDNN kernels only change TF's own float ops,
    # which here decode images. A user's own settings win.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    malloc.restart_keeping_freed_memory()
    from ood_jax import cli

    cli.main()


if __name__ == "__main__":
    main()
