"""MLLM evaluation: prompts from ood_jax.prompts, reply parsing (parsing.py), clients (clients.py),
the resumable run (runner.py, on session.py: the run directory's files in store.py, request
scheduling in scheduling.py, cost and limits in accounting.py, records and results in
results.py, the manifest's fields in run_manifest.py), the CLIP baseline (clip_baseline.py), the
tasks (tasks/: the Item and Benchmark interface in base.py, then foci.py, counts_oodg.py and
oodbench.py, by name in tasks/__init__.py) and the `ood-jax eval-mllm` command (cli.py).
"""
