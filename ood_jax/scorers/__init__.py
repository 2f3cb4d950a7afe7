"""CLIP, SigLIP and GroupViT scorers in Flax: two-tower models, checkpoint conversion,
preprocessing, tokenization and an embedding cache for mining.

    scorer = ood_jax.scorers.from_hf(path)        # a CLIPModel / SiglipModel / GroupViTModel dir
    scorer.encode_images(images)                  # uint8 [H, W, 3] each -> L2-normalized [N, D]
    scorer.encode_texts(texts, templates=("a photo of a {}.",))
    scorer.image_features(pixels), scorer.text_features(input_ids)  # transformers' get_*_features
    scorer.logit_scale, scorer.logit_bias

Modules: `towers` (image and text encoders), `clip` / `siglip` / `groupvit` (two-tower models),
`convert` / `convert_groupvit` (transformers and open_clip checkpoints), `preprocess` (the image
processor), `scorer` (batched, jitted, sharded inference), `cache` (resumable embedding shards).
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
