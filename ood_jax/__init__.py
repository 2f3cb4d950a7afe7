"""ood-jax: COUNTS, FOCI and OODBench in JAX/Flax."""

__version__ = "0.1.0"
