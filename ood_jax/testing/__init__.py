"""Helpers shared by tests and benches: random COCO cases (`coco_cases`), tiny random-weight VLMs
(`tiny_vlms`), random variables of any Flax module (`random_variables`), detections equal up to
ties (`detections`), and a reader of built datasets in a process without ood_jax (`plain_tfds`)."""
