"""SigLIP (Zhai et al. 2023) as a two-tower Flax module, shaped after big_vision's two_towers.

CLIP's towers and temperature plus a learned logit bias "b": pairs are scored independently,
`logits_per_image = exp(t) * cos(image, text) + b`, and read through a sigmoid rather than a
softmax over texts. The image tower pools with an attention head and has no projection; the text
tower attends bidirectionally and pools its last position (`towers.pooled_positions`).
"""

import flax.linen as nn
import jax

from ood_jax.scorers import clip

# big_vision's initial temperature log(10) and bias -10.
LOGIT_SCALE_INIT = 2.302585092994046
LOGIT_BIAS_INIT = -10.0


class SigLIP(clip.CLIP):
    """`clip.CLIP` with the logit bias "b".

    Attributes:
      logit_bias_init: initial value of "b".
    """

    logit_scale_init: float = LOGIT_SCALE_INIT
    logit_bias_init: float = LOGIT_BIAS_INIT

    def setup(self) -> None:
        super().setup()
        self.b = self.param("b", nn.initializers.constant(self.logit_bias_init), ())

    def logits(self, image_embeds: jax.Array, text_embeds: jax.Array) -> jax.Array:
        return super().logits(image_embeds, text_embeds) + self.b
