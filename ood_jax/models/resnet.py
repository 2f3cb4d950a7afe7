"""ResNet / ResNeXt backbones in torchvision's "v1.5" layout, NHWC.

`ResNet` returns every stage's feature map, so a detector takes the levels it needs, with
trainable or frozen BatchNorm (`norm`), DETR-DC5's dilated last stage (`dilation`), no
gradient into the first stages (`frozen_stages`) and a trunk that ends early (`last_stage`: a
C4 backbone). As in torchvision and timm, a downsampling bottleneck strides in its 3x3
convolution, and the projection shortcut exists where the channel count or the stride changes.
"""

from typing import Any, Callable, ClassVar, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from ood_jax.models import conv, pooling

Norm = Literal["batch", "frozen"]

BN_EPS = 1e-5

# torchvision's `kaiming_normal_(mode="fan_out", nonlinearity="relu")`.
_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")

ARCHS: dict[str, dict[str, Any]] = {
    "resnet18": dict(stage_sizes=(2, 2, 2, 2), block="basic"),
    "resnet34": dict(stage_sizes=(3, 4, 6, 3), block="basic"),
    "resnet50": dict(stage_sizes=(3, 4, 6, 3), block="bottleneck"),
    "resnet101": dict(stage_sizes=(3, 4, 23, 3), block="bottleneck"),
    "resnext101_32x4d": dict(
        stage_sizes=(3, 4, 23, 3), block="bottleneck", groups=32, width_per_group=4
    ),
}


class FrozenBatchNorm(nn.Module):
    """y = x * scale / sqrt(var + eps) + (bias - mean * scale / sqrt(var + eps)), all fixed."""

    epsilon: float = BN_EPS
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (x.shape[-1],)

        # All four tensors live in "batch_stats", not "params": an optimizer built on params never
        # sees them, a train loop that already threads "batch_stats" needs no special case, and
        # nothing writes them back, so they stay as loaded.
        def stat(name: str, init: Callable[..., jax.Array]) -> jax.Array:
            return self.variable("batch_stats", name, init, shape, jnp.float32).value

        scale = stat("scale", jnp.ones) * jax.lax.rsqrt(stat("var", jnp.ones) + self.epsilon)
        # Folded into one multiply-add in float32, the order torchvision's and transformers'
        # FrozenBatchNorm2d use, so converted checkpoints reproduce them to rounding.
        shift = stat("bias", jnp.zeros) - stat("mean", jnp.zeros) * scale
        return x * scale.astype(self.dtype) + shift.astype(self.dtype)


def _norm(kind: Norm, train: bool, dtype: Any, name: str) -> nn.Module:
    if kind == "frozen":
        return FrozenBatchNorm(dtype=dtype, name=name)
    # torch's momentum 0.1 is flax's 0.9 (flax weights the old value). The variance is taken in
    # two passes, as torch does: flax's default E[x^2] - E[x]^2 cancels catastrophically in
    # float32 on post-ReLU activations, and the backbone's gradients then differ by percents
    # between two summation orders of the same batch (one device or four).
    return nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        epsilon=BN_EPS,
        use_fast_variance=False,
        dtype=dtype,
        name=name,
    )


def _conv(
    features: int,
    kernel: int,
    dtype: Any,
    name: str,
    stride: int = 1,
    dilation: int = 1,
    groups: int = 1,
) -> nn.Conv:
    pad = dilation * (kernel // 2)
    return nn.Conv(
        features,
        (kernel, kernel),
        strides=stride,
        padding=((pad, pad), (pad, pad)),
        kernel_dilation=dilation,
        feature_group_count=groups,
        use_bias=False,
        dtype=dtype,
        kernel_init=_conv_init,
        conv_general_dilated=conv.conv_general_dilated,
        name=name,
    )


class _Block(nn.Module):
    """Shared fields of the two residual blocks."""

    planes: int
    stride: int = 1
    first_dilation: int = 1
    dilation: int = 1
    groups: int = 1
    width_per_group: int = 64
    norm: Norm = "batch"
    dtype: Any = jnp.float32

    expansion: ClassVar[int] = 1

    def shortcut(self, x: jax.Array, train: bool) -> jax.Array:
        out = self.planes * self.expansion
        if x.shape[-1] == out and self.stride == 1:
            return x
        x = _conv(out, 1, self.dtype, "proj_conv", stride=self.stride)(x)
        return _norm(self.norm, train, self.dtype, "proj_norm")(x)


class BasicBlock(_Block):
    """Two 3x3 convolutions (ResNet-18/34)."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        if self.groups != 1 or self.width_per_group != 64:
            raise ValueError("BasicBlock supports neither groups nor width_per_group")
        y = _conv(self.planes, 3, self.dtype, "conv1", self.stride, self.first_dilation)(x)
        y = nn.relu(_norm(self.norm, train, self.dtype, "norm1")(y))
        y = _conv(self.planes, 3, self.dtype, "conv2", dilation=self.dilation)(y)
        y = _norm(self.norm, train, self.dtype, "norm2")(y)
        return nn.relu(y + self.shortcut(x, train))


class Bottleneck(_Block):
    """1x1 reduce, 3x3 (strided, grouped for ResNeXt), 1x1 expand by 4."""

    expansion: ClassVar[int] = 4

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        width = self.planes * self.width_per_group // 64 * self.groups
        y = _conv(width, 1, self.dtype, "conv1")(x)
        y = nn.relu(_norm(self.norm, train, self.dtype, "norm1")(y))
        y = _conv(
            width, 3, self.dtype, "conv2", self.stride, self.first_dilation, groups=self.groups
        )(y)
        y = nn.relu(_norm(self.norm, train, self.dtype, "norm2")(y))
        y = _conv(self.planes * self.expansion, 1, self.dtype, "conv3")(y)
        y = _norm(self.norm, train, self.dtype, "norm3")(y)
        return nn.relu(y + self.shortcut(x, train))


BLOCKS: dict[str, type[_Block]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    """ResNet trunk without classifier.

    `__call__(images [B, H, W, 3], train=False)` returns {"stage1": stride 4, "stage2": 8,
    "stage3": 16, "stage4": 32} (stage4 at stride 16 with `dilation`), up to `last_stage`.

    Attributes:
      stage_sizes: blocks per stage.
      block: "basic" or "bottleneck".
      planes: per-stage base width; a stage outputs planes * expansion channels.
      stem_width: channels of the 7x7 stem convolution.
      groups, width_per_group: ResNeXt cardinality and width (64 and 1 for plain ResNets).
      norm: "batch" (trainable BatchNorm; running statistics in "batch_stats", updated when
        `train=True` with that collection mutable) or "frozen" (`FrozenBatchNorm`: fixed
        statistics and affine, as detectors fine-tune ImageNet backbones).
      dilation: dilate the last stage instead of striding (DC5).
      last_stage: the trunk ends after this stage (None: after the last). 3 is the C4
        backbone of Faster R-CNN-C4: features at stride 16 as DC5 gives them, without the
        last stage's compute (DC5 ResNet-18 at 128x128: 13.0 GFLOP per 8 images; C4: 6.8).
      frozen_stages: no gradient flows into the stem and the first this many stages (DETR keeps
        the ImageNet stem and first stage fixed), so the backward pass skips them; the optimizer
        should leave their parameters alone too (`optim.make_optimizer`'s `frozen_pattern`).
      remat: each block of the other stages keeps only its input for the backward pass and
        runs again there (`nn.remat`): DINO's train step at 800x1333 batch 2 needs 4.4 GB
        instead of 6.8 GB, for one more forward pass of those stages.
      dtype: compute dtype; parameters stay float32.
    """

    stage_sizes: tuple[int, ...]
    block: str = "bottleneck"
    planes: tuple[int, ...] = (64, 128, 256, 512)
    stem_width: int = 64
    groups: int = 1
    width_per_group: int = 64
    norm: Norm = "batch"
    dilation: bool = False
    last_stage: int | None = None
    frozen_stages: int = 0
    remat: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> dict[str, jax.Array]:
        if self.norm not in ("batch", "frozen"):
            raise ValueError(f"norm must be 'batch' or 'frozen', got {self.norm!r}")
        if self.block not in BLOCKS:
            raise ValueError(f"block must be one of {sorted(BLOCKS)}, got {self.block!r}")
        if not 0 <= self.frozen_stages <= len(self.stage_sizes):
            raise ValueError(
                f"frozen_stages must be in [0, {len(self.stage_sizes)}], got {self.frozen_stages}"
            )
        if len(self.planes) != len(self.stage_sizes):
            raise ValueError(f"planes {self.planes} and stage_sizes {self.stage_sizes} differ")
        num_stages = len(self.stage_sizes)
        if self.last_stage is not None and not 1 <= self.last_stage <= num_stages:
            raise ValueError(f"last_stage must be in [1, {num_stages}], got {self.last_stage}")
        stages = num_stages if self.last_stage is None else self.last_stage
        if self.dilation and stages < num_stages:
            raise ValueError(
                f"dilation dilates stage {num_stages}, which last_stage={self.last_stage} leaves out"
            )
        if self.frozen_stages > stages:
            raise ValueError(
                f"frozen_stages={self.frozen_stages} freezes stages after last_stage={stages}"
            )
        block_cls = BLOCKS[self.block]

        x = images.astype(self.dtype)
        x = nn.Conv(
            self.stem_width,
            (7, 7),
            strides=2,
            padding=((3, 3), (3, 3)),
            use_bias=False,
            dtype=self.dtype,
            kernel_init=_conv_init,
            conv_general_dilated=conv.conv_general_dilated,
            name="stem_conv",
        )(x)
        x = nn.relu(_norm(self.norm, train, self.dtype, "stem_norm")(x))
        x = pooling.max_pool(x, window=3, stride=2, pad=1)
        if self.frozen_stages > 0:
            x = jax.lax.stop_gradient(x)

        features = {}
        dilation = 1
        last = num_stages - 1
        for i, (num_blocks, planes) in enumerate(zip(self.stage_sizes[:stages], self.planes)):
            stride = 1 if i == 0 else 2
            # The dilated stage's first block keeps the previous dilation in the convolution that
            # used to stride, as torchvision and timm do.
            first_dilation = dilation
            if self.dilation and i == last:
                dilation, stride = dilation * stride, 1
            # Blocks behind a stop_gradient store nothing for the backward pass anyway.
            trained = self.remat and i + 1 > self.frozen_stages
            stage_block = nn.remat(block_cls, static_argnums=(2,)) if trained else block_cls
            for j in range(num_blocks):
                x = stage_block(
                    planes=planes,
                    stride=stride if j == 0 else 1,
                    first_dilation=first_dilation if j == 0 else dilation,
                    dilation=dilation,
                    groups=self.groups,
                    width_per_group=self.width_per_group,
                    norm=self.norm,
                    dtype=self.dtype,
                    name=f"stage{i + 1}_block{j}",
                )(x, train)
            if i + 1 <= self.frozen_stages:
                x = jax.lax.stop_gradient(x)
            features[f"stage{i + 1}"] = x
        return features


def build(arch: str, **overrides: Any) -> ResNet:
    """A named architecture (a key of `ARCHS`) with field overrides, e.g. norm="frozen"."""
    if arch not in ARCHS:
        raise ValueError(f"unknown ResNet {arch!r}; known: {sorted(ARCHS)}")
    return ResNet(**{**ARCHS[arch], **overrides})
