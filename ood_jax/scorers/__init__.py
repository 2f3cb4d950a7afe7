"""Image-text scorers in Flax (CLIP, SigLIP, GroupViT, BLIP-2, LiT): the models, checkpoint
conversion, preprocessing, tokenization and an embedding cache for mining.

Modules: `towers`, `bert`, `clip`, `siglip`, `groupvit`, `blip2` (the models); `convert`,
`convert_groupvit`, `convert_blip2`, `convert_lit` (transformers, open_clip, LAVIS and big_vision
checkpoints); `preprocess` (image processors); `scorer` (batched, jitted, sharded inference);
`cache` (resumable embedding shards).
"""

from ood_jax.scorers.cache import EmbeddingCache
from ood_jax.scorers.scorer import (
    KINDS,
    SOFTMAX_KINDS,
    Scorer,
    from_hf,
    from_lavis,
    from_open_clip,
)

__all__ = [
    "KINDS",
    "SOFTMAX_KINDS",
    "EmbeddingCache",
    "Scorer",
    "from_hf",
    "from_lavis",
    "from_open_clip",
]
