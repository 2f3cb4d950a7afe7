"""Detector backbones, detectors and checkpoint converters (Flax linen, NHWC)."""
