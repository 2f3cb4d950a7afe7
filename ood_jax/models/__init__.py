"""Detector backbones, detector families and checkpoint converters (Flax linen, NHWC).

`registry` maps a config's model name to its family module (`detr`, `deformable_detr`, `dino`);
`exported` holds the file format of an exported detector. `load_exported(path)` reads one and
runs it without the training stack: nothing here imports optax, orbax or TensorFlow.

    model = load_exported("detr.msgpack")
    detections = model.predict(image_uint8)  # [H, W, 3] -> boxes (absolute xywh), scores, labels
"""

from ood_jax.models.exported import EXPORT_FORMAT_VERSION, ExportedModel, load_exported

__all__ = ["EXPORT_FORMAT_VERSION", "ExportedModel", "load_exported"]
