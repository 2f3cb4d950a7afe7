"""MLLM evaluation: prompts from ood_jax.prompts, reply parsing (parsing.py), clients (clients.py),
the resumable runner (runner.py), the CLIP baseline (clip_baseline.py), the tasks (tasks/: the
Item and Benchmark interface in base.py, then foci.py, counts_oodg.py and oodbench.py, by name in
tasks/__init__.py) and the `ood-jax eval-mllm` command (cli.py).
"""
