"""Image-text scorers in Flax (CLIP, SigLIP, GroupViT, BLIP-2, LiT): the models, checkpoint
conversion, preprocessing, tokenization and an embedding cache for mining.

    scorer = ood_jax.scorers.from_hf(path)        # a transformers or LiT checkpoint directory
    scorer.encode_images(images)                  # uint8 [H, W, 3] each -> L2-normalized [N, D]
                                                  # (BLIP-2: [N, Q, D], one per query)
    scorer.encode_texts(texts, templates=("a photo of a {}.",))
    scorer.image_features(pixels), scorer.text_features(input_ids)  # transformers' get_*_features
    scorer.logit_scale, scorer.logit_bias
    scorer.match_probabilities(images, texts, image_rows, text_rows)  # BLIP-2's ITM head

Modules: `towers` (image and text encoders), `bert` (LiT's BERT text tower), `clip` / `siglip` /
`groupvit` / `blip2` (the models), `convert` / `convert_groupvit` / `convert_blip2` /
`convert_lit` (transformers, open_clip, LAVIS and big_vision checkpoints), `preprocess` (the
image processors), `scorer` (batched, jitted, sharded inference), `cache` (resumable embedding
shards).
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
