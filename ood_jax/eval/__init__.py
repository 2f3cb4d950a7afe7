"""MLLM evaluation: the papers' prompt texts, reply parsing, clients and the evaluation runner."""
