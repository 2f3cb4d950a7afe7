"""Generators shared by tests and benches (random COCO cases)."""
