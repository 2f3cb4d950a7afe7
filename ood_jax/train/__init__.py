"""Training: the loop, sharding, checkpoints, export and the detector losses."""
