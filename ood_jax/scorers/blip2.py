"""BLIP-2 (Li et al. 2023) image-text scoring in Flax: transformers' `Blip2ForImageTextRetrieval`.

BLIP-2 bridges a frozen image encoder (`vit.ViT`; EVA ViT-g in the released models) and text
through the Q-Former, a small BERT whose input starts with learned query tokens. `BLIP2` scores
an (image, text) pair by image-text contrast (ITC, `__call__`) or by its matching head (ITM,
`itm_logits`). Architecture: docs/guide/scorer-models.md.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ood_jax.models import vit
from ood_jax.scorers import clip

# LAVIS' max_txt_len: the text length BLIP-2 trained ITC with.
TEXT_LENGTH = 32


class QFormerLayer(nn.Module):
    """One post-norm Q-Former layer over [B, Q + L, W]: the first `num_queries` positions are the
    query tokens, the rest text.

    Attributes:
      num_heads, mlp_dim, ln_eps, activation: the transformer (a `vit.ACTIVATIONS` key).
      cross_attention: whether the query positions attend to the image states here.
      dtype: computation dtype.
    """

    num_heads: int
    mlp_dim: int
    cross_attention: bool
    ln_eps: float = 1e-12
    activation: str = "gelu"
    dtype: Any = jnp.float32

    def _attention(self, name: str) -> nn.MultiHeadDotProductAttention:
        return nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dtype=self.dtype, attention_fn=vit.attention, name=name
        )

    def _norm(self, name: str) -> nn.LayerNorm:
        return nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name=name)

    def _feed_forward(self, x: jax.Array, name: str) -> jax.Array:
        mlp = vit.MlpBlock(self.mlp_dim, dtype=self.dtype, activation=self.activation, name=name)
        return self._norm(f"{name}_norm")(x + mlp(x))

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        num_queries: int,
        image_states: jax.Array | None,
    ) -> jax.Array:
        x = self._norm("attention_norm")(x + self._attention("attention")(x, mask=mask))
        queries, text = x[:, :num_queries], x[:, num_queries:]
        out = []
        if num_queries:
            if self.cross_attention:
                if image_states is None:
                    raise ValueError("the query tokens need image states to cross-attend to")
                y = self._attention("cross_attention")(queries, image_states)
                queries = self._norm("cross_attention_norm")(queries + y)
            out.append(self._feed_forward(queries, "query_ffn"))
        if text.shape[1]:
            out.append(self._feed_forward(text, "text_ffn"))
        return jnp.concatenate(out, axis=1)


class QFormer(nn.Module):
    """Query tokens and/or text ids -> [B, Q + L, width] Q-Former states.

    BERT-style post-norm layers after a LayerNorm on the embedded input. Queries and text are one
    sequence for self-attention, but only the query positions cross-attend to the image states,
    and each kind of position has its own feed-forward ("query_ffn" / "text_ffn": transformers'
    `intermediate_query` / `output_query` and `intermediate` / `output`). Text is embedded with
    word plus absolute position embeddings, positions counting from 0 at the first text token.

    Attributes:
      vocab_size, max_len: word and position table sizes; text length must be <= max_len.
      width, depth, num_heads, mlp_dim, ln_eps, activation: the BERT layers.
      cross_attention_frequency: layers 0, f, 2f, ... cross-attend to the image.
      dtype: computation dtype.
    """

    vocab_size: int
    max_len: int
    width: int
    depth: int
    num_heads: int
    mlp_dim: int
    cross_attention_frequency: int = 2
    ln_eps: float = 1e-12
    activation: str = "gelu"
    dtype: Any = jnp.float32

    def _embed_text(self, input_ids: jax.Array) -> jax.Array:
        length = input_ids.shape[-1]
        if length > self.max_len:
            raise ValueError(f"text length {length} exceeds the {self.max_len} position embeddings")
        words = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, name="word_embeddings")
        positions = nn.Embed(self.max_len, self.width, dtype=self.dtype, name="position_embeddings")
        return words(input_ids) + positions(jnp.arange(length))[None]

    @nn.compact
    def __call__(
        self,
        queries: jax.Array | None,
        input_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        image_states: jax.Array | None = None,
    ) -> jax.Array:
        """queries [B, Q, width] and/or input_ids [B, L] (attention_mask [B, L], nonzero = a
        token) with image_states [B, S, encoder width] for the queries -> [B, Q + L, width]."""
        parts, valid = [], []
        if queries is not None:
            parts.append(queries.astype(self.dtype))
            valid.append(jnp.ones(queries.shape[:2], bool))
        if input_ids is not None:
            parts.append(self._embed_text(input_ids))
            text_valid = (
                jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask
            )
            valid.append(text_valid != 0)
        x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="embed_norm")(
            jnp.concatenate(parts, axis=1)
        )
        mask = jnp.concatenate(valid, axis=1)[:, None, None, :]  # padding hides keys only
        if image_states is not None:
            image_states = image_states.astype(self.dtype)
        num_queries = 0 if queries is None else queries.shape[1]
        for i in range(self.depth):
            x = QFormerLayer(
                self.num_heads,
                self.mlp_dim,
                cross_attention=i % self.cross_attention_frequency == 0,
                ln_eps=self.ln_eps,
                activation=self.activation,
                dtype=self.dtype,
                name=f"layer_{i}",
            )(x, mask, num_queries, image_states)
        return x


class BLIP2(nn.Module):
    """The ITC and ITM scores of BLIP-2.

    ITC (`__call__`): the queries alone, with the image, each projected into [B, Q, D]; the text
    alone, its first ([CLS]) state projected; a pair's score is the largest cosine over the
    queries. transformers applies no temperature; BLIP-2's learned one is not in its checkpoints
    (`convert_blip2.blip2_from_lavis` returns it). ITM (`itm_logits`): queries and text together,
    the queries attending to the image; softmax(itm_logits)[:, 1] is the match probability. Text
    ids are plain tokenizer output ([CLS] text [SEP], BERT's uncased vocabulary).

    Attributes:
      vision: the image encoder, a `vit.ViT` with a class token and pool_type "tok" (its pooled
        class token and feature map together are the 1 + P states); parameters under "vision".
      qformer: the `QFormer`; parameters under "qformer".
      num_query_tokens: Q, the learned "query_tokens" [1, Q, qformer.width].
      proj_dim: width of the shared ITC space ("vision_projection", "text_projection").
      text_length: the length tokenizers should pad and truncate to: BLIP-2 trained ITC with 32
        tokens (`TEXT_LENGTH`, LAVIS' max_txt_len), not the Q-Former's 512 positions; any length
        up to `qformer.max_len` runs.

    `init` through `__call__` creates every parameter but the ITM head's, which `itm_logits`
    creates.
    """

    vision: vit.ViT
    qformer: QFormer
    num_query_tokens: int
    proj_dim: int
    text_length: int = TEXT_LENGTH

    def setup(self) -> None:
        self.query_tokens = self.param(
            "query_tokens",
            nn.initializers.normal(stddev=0.02),
            (1, self.num_query_tokens, self.qformer.width),
        )
        dtype = self.qformer.dtype
        self.vision_projection = nn.Dense(self.proj_dim, dtype=dtype)
        self.text_projection = nn.Dense(self.proj_dim, dtype=dtype)
        self.itm_head = nn.Dense(2, dtype=dtype)

    @property
    def dtype(self) -> Any:
        """The image encoder's computation dtype (the Q-Former has its own)."""
        return self.vision.dtype

    @property
    def image_size(self) -> tuple[int, int]:
        """(h, w) the position embeddings were learned at; inputs must have this size."""
        return tuple(g * self.vision.patch_size for g in self.vision.pos_grid)

    def _queries(self, batch: int) -> jax.Array:
        return jnp.broadcast_to(self.query_tokens, (batch, *self.query_tokens.shape[1:]))

    def vision_states(self, images: jax.Array) -> jax.Array:
        """[B, H, W, 3] normalized pixels -> [B, 1 + P, vision width] float32 encoder states."""
        p = self.vision.patch_size
        grid = (images.shape[1] // p, images.shape[2] // p)
        if grid != tuple(self.vision.pos_grid):
            # vit.ViT would resample the position embeddings, which transformers does not do.
            raise ValueError(
                f"images of {images.shape[1]}x{images.shape[2]} give a {grid[0]}x{grid[1]} patch "
                f"grid; the position embeddings are learned for "
                f"{self.vision.pos_grid[0]}x{self.vision.pos_grid[1]} ({self.image_size} pixels)"
            )
        out = self.vision(images, train=False)
        b, _, _, d = out["features"].shape
        tokens = [out["pooled"][:, None], out["features"].reshape(b, -1, d)]
        # The Q-Former computes in its own dtype, float32 as transformers keeps it
        # (`_keep_in_fp32_modules`), so the states are handed over in float32.
        return jnp.concatenate(tokens, axis=1).astype(jnp.float32)

    def image_features(self, images: jax.Array) -> jax.Array:
        """[B, H, W, 3] normalized pixels -> [B, Q, D] projected query outputs, not normalized."""
        states = self.vision_states(images)
        queries = self.qformer(self._queries(states.shape[0]), image_states=states)
        return self.vision_projection(queries).astype(jnp.float32)

    def text_features(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None
    ) -> jax.Array:
        """[B, L] token ids -> [B, D]: the [CLS] state of the text alone, projected, not
        normalized."""
        x = self.qformer(None, input_ids, attention_mask)[:, 0]
        return self.text_projection(x).astype(jnp.float32)

    def itm_logits(
        self,
        vision_states: jax.Array,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
    ) -> jax.Array:
        """`vision_states` [B, S, W] and the paired texts [B, L] -> [B, 2] (no match, match)
        logits, averaged over the query positions. It takes `vision_states`, so that one
        image's encoder pass serves every text paired with it."""
        queries = self._queries(vision_states.shape[0])
        x = self.qformer(queries, input_ids, attention_mask, vision_states)
        return self.itm_head(x[:, : self.num_query_tokens]).mean(axis=1).astype(jnp.float32)

    @staticmethod
    def logits(image_embeds: jax.Array, text_embeds: jax.Array) -> jax.Array:
        """Normalized [N, Q, D] query and [M, D] text embeddings -> [N, M]: the largest cosine
        over the queries."""
        return jnp.einsum("nqd,md->nqm", image_embeds, text_embeds).max(axis=1)

    def __call__(
        self, images: jax.Array, input_ids: jax.Array, attention_mask: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """ITC, as transformers' retrieval model without the ITM head: "logits_per_image"
        [N, M], "image_embeds" [N, Q, D] and "text_embeds" [M, D], normalized."""
        image_embeds = clip.l2_normalize(self.image_features(images))
        text_embeds = clip.l2_normalize(self.text_features(input_ids, attention_mask))
        return {
            "logits_per_image": self.logits(image_embeds, text_embeds),
            "image_embeds": image_embeds,
            "text_embeds": text_embeds,
        }
