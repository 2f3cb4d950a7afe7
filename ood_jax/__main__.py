"""`ood-jax` and `python -m ood_jax`: restart under a malloc that keeps freed memory, then run
the CLI.

Kept apart from `ood_jax.cli` so the restart comes before the CLI's imports, and so importing
the CLI (as tests do) never replaces the process.
"""

from ood_jax import malloc


def main() -> None:
    malloc.restart_keeping_freed_memory()
    from ood_jax import cli

    cli.main()


if __name__ == "__main__":
    main()
