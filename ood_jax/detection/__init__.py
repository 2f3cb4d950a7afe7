"""Detector evaluation: COCO numbers per domain (O(OD)^2), tables and charts."""
