"""`preprocess.tf_bilinear_resize` (LiT's big_vision resize) against TensorFlow itself."""

import numpy as np
import pytest
import tensorflow as tf

from ood_jax.scorers import preprocess


@pytest.mark.parametrize(
    "size, out",
    [((375, 500), (224, 224)), ((96, 80), (224, 224)), ((33, 517), (224, 224)), ((7, 9), (5, 12))],
)
def test_equals_tf_image_resize_cast_to_uint8(size, out) -> None:
    image = np.random.default_rng(sum(size)).integers(0, 256, (*size, 3), dtype=np.uint8)
    resized = tf.image.resize(image, out, method="bilinear", antialias=False)
    want = tf.cast(tf.clip_by_value(resized, 0, 255), tf.uint8).numpy()
    np.testing.assert_array_equal(preprocess.tf_bilinear_resize(image, *out), want)


def test_a_preprocessing_with_tf_bilinear() -> None:
    config = {"size": {"height": 20, "width": 20}, "resample": preprocess.TF_BILINEAR}
    ours = preprocess.preprocessing_from_config(
        {**config, "image_mean": 0.5, "image_std": 0.5}, "siglip", 20
    )
    image = np.random.default_rng(0).integers(0, 256, (31, 45, 3), dtype=np.uint8)
    want = tf.cast(tf.image.resize(image, (20, 20)), tf.uint8).numpy() / 127.5 - 1
    np.testing.assert_allclose(ours(image), want, atol=1e-6)
    with pytest.raises(ValueError, match="resample='lanczos'; expected a Pillow filter code"):
        preprocess.preprocessing_from_config({"resample": "lanczos"}, "siglip", 20)
