"""MLLM evaluation: clients, the tasks (tasks/), the resumable run (runner.py on session.py), the
judge, the CLIP baseline, rescoring, shards and their merge, compare, and the job the
`ood-jax eval-mllm` command (ood_jax.cli.mllm) runs (job.py)."""
