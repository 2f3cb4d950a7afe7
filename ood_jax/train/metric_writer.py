"""The scalars a training run writes for TensorBoard (WORKDIR/tensorboard).

Written with `tf.summary` itself: clu's metric writers import TensorBoard's hparams plugin,
whose Keras callback imports Keras, 5 s of each training process's start on 2 cores.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import tensorflow as tf


class MetricWriter:
    """Scalars into TensorBoard event files under `logdir`; with `enabled=False` (the processes
    other than the primary one) it writes nothing and makes no directory."""

    def __init__(self, logdir: str | pathlib.Path, enabled: bool = True):
        self._writer = tf.summary.create_file_writer(str(logdir)) if enabled else None

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(name, value)

    def close(self) -> None:
        """Flushes what is written and closes the event file."""
        if self._writer is not None:
            self._writer.close()
