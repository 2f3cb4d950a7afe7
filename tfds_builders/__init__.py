"""TFDS builders of ood-jax; importing this package registers them with TFDS."""

from tfds_builders.corrupted import corrupted_dataset_builder  # noqa: F401
from tfds_builders.counts import counts_dataset_builder  # noqa: F401
from tfds_builders.foci import foci_dataset_builder  # noqa: F401
from tfds_builders.oodbench import oodbench_dataset_builder  # noqa: F401
from tfds_builders.synthetic_shifts import synthetic_shifts_dataset_builder  # noqa: F401

NAMES = ("counts", "foci", "oodbench", "synthetic_shifts", "corrupted")
