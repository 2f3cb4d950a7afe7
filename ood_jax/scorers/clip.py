"""CLIP (Radford et al. 2021) as a two-tower Flax module, shaped after big_vision's two_towers.

The towers return projected, unnormalized features (transformers' `get_image_features` /
`get_text_features`); `__call__` normalizes both and scales their cosine by the learned
temperature, stored as its logarithm "t" as in transformers' `logit_scale`, and exponentiated
here: `logits_per_image = exp(t) * cos(image, text)`, compared with a softmax over texts.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from ood_jax.scorers import towers

# log(1 / 0.07): CLIP's initial temperature (transformers' `logit_scale_init_value`).
LOGIT_SCALE_INIT = 2.6592


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / ||x|| over the last axis, in float32 (as transformers, no epsilon)."""
    x = x.astype(jnp.float32)
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


class CLIP(nn.Module):
    """Image and text towers plus the log temperature "t".

    Attributes:
      image: the image tower; its parameters live under "image".
      text: the text tower; its parameters live under "text".
      logit_scale_init: initial value of "t" (the log of the logit scale).
    """

    image: towers.ImageTower
    text: towers.TextTower
    logit_scale_init: float = LOGIT_SCALE_INIT

    def setup(self) -> None:
        self.t = self.param("t", nn.initializers.constant(self.logit_scale_init), ())

    @property
    def image_size(self) -> tuple[int, int]:
        """(h, w) the image tower's position embeddings were learned for."""
        encoder = self.image.encoder
        return tuple(g * encoder.patch_size for g in encoder.pos_grid)

    @property
    def text_length(self) -> int:
        """Tokens per text: the text tower's position embeddings."""
        return self.text.max_len

    def image_features(self, images: jax.Array) -> jax.Array:
        """[B, H, W, 3] normalized pixels -> [B, D] projected features, not normalized."""
        return self.image(images).astype(jnp.float32)

    def text_features(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None
    ) -> jax.Array:
        """[B, L] token ids -> [B, D] projected features, not normalized."""
        return self.text(input_ids, attention_mask).astype(jnp.float32)

    def logits(self, image_embeds: jax.Array, text_embeds: jax.Array) -> jax.Array:
        """Normalized [N, D] and [M, D] embeddings -> [N, M] logits."""
        return jnp.exp(self.t) * image_embeds @ text_embeds.T

    def __call__(
        self, images: jax.Array, input_ids: jax.Array, attention_mask: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        image_embeds = l2_normalize(self.image_features(images))
        text_embeds = l2_normalize(self.text_features(input_ids, attention_mask))
        return {
            "logits_per_image": self.logits(image_embeds, text_embeds),
            "image_embeds": image_embeds,
            "text_embeds": text_embeds,
        }
