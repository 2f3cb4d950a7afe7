"""A detector as an ONNX graph, for onnxruntime and the other ONNX runtimes.

`ood-jax export --format onnx` writes `model.onnx` (prepared images and mask -> boxes, scores,
labels, as `ExportedModel.predict_canvas` gives them; parameters folded in as initializers; the
batch dimension symbolic unless a batch size is given) and `contract.json` (inputs,
preprocessing, outputs, class names, provenance, as the stablehlo export's). jax2onnx converts
the jaxpr of `predict_canvas`; running the graph needs an ONNX runtime alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from ood_jax import files
from ood_jax.models import exported, portable

ONNX_FILE = "model.onnx"
CONTRACT_FILE = portable.CONTRACT_FILE
INPUT_NAMES = ("images", "mask")
OUTPUT_NAMES = ("boxes", "scores", "labels")
# The three families need nothing newer, and runtimes from onnxruntime 1.13 on read it.
OPSET = 17
# pyproject's `onnx` extra says why jax2onnx goes in without its declared dependencies.
INSTALL = "pip install 'ood-jax[onnx]' && pip install --no-deps jax2onnx==0.17.1"


def _converter() -> Any:
    try:
        import jax2onnx
    except ImportError as e:
        raise ImportError(f"ONNX export needs jax2onnx and onnx: {INSTALL}") from e
    return jax2onnx


def _max_pool(x: jax.Array, **params: Any) -> jax.Array:
    """reduce_window_max with the pooled axes last and the others merged into one.

    jax2onnx lowers reduce_window_max to one MaxPool that treats every operand axis as spatial,
    and onnxruntime pools over at most 3: a ResNet stem's NHWC pool fails when the graph runs
    ("Unsupported pooling size"). The same maxima come from a 3-axis pool.
    """
    axes = ("window_dimensions", "window_strides", "padding", "base_dilation", "window_dilation")
    trivial = (1, 1, (0, 0), 1, 1)
    pooled = [
        i
        for i in range(x.ndim)
        if tuple(tuple(params[a][i]) if a == "padding" else params[a][i] for a in axes) != trivial
    ]
    if x.ndim <= 3 or len(pooled) > 2:
        return lax.reduce_window_max_p.bind(x, **params)
    order = [i for i in range(x.ndim) if i not in pooled] + pooled
    y = jnp.transpose(x, order)
    kept = y.shape[: x.ndim - len(pooled)]
    y = y.reshape((-1, *y.shape[len(kept) :]))
    y = lax.reduce_window_max_p.bind(
        y, **{a: (trivial[k], *(params[a][i] for i in pooled)) for k, a in enumerate(axes)}
    )
    return jnp.transpose(y.reshape((*kept, *y.shape[1:])), np.argsort(order))


def _rem(x: jax.Array, y: jax.Array) -> jax.Array:
    """Integer remainder as x - div(x, y) * y: jax2onnx 0.17.1's lowering of rem fails on a
    symbolic batch dimension, and lax.rem and lax.div both truncate, so this is exact."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x - lax.div(x, y) * y
    return lax.rem_p.bind(x, y)


# Float sums of more elements than this are split in two (`_reduce_sum`).
_SPLIT_SUM = 4096


def _reduce_sum(x: jax.Array, *, axes: tuple[int, ...], **params: Any) -> jax.Array:
    """reduce_sum over several axes as the sums over all but the first, then over the first.

    onnxruntime's CPU ReduceSum over non-contiguous axes adds one element at a time: over the
    32768 elements of a GroupNorm group of DINO's first level at 512x512 it is off by 1.3e-5
    relative (XLA's tree: 2e-8), which GroupNorm's E[x^2] - E[x]^2 variance amplifies until
    DINO-R50's scores are 1.5e-4 off ours. The same sum in two stages is off by 2e-7.
    """
    axes = tuple(sorted(axes))
    sizes = [x.shape[a] for a in axes]
    if (
        len(axes) < 2
        or not jnp.issubdtype(x.dtype, jnp.floating)
        or not all(isinstance(n, int) for n in sizes)
        or math.prod(sizes) <= _SPLIT_SUM
    ):
        return lax.reduce_sum_p.bind(x, axes=axes, **params)
    partial = lax.reduce_sum_p.bind(x, axes=axes[1:], **params)
    return lax.reduce_sum_p.bind(partial, axes=axes[:1], **params)


# Primitives replaced in the traced predict function by equivalents that convert and run alike
# (`_reduce_sum`: the same sum, added in another order).
_REWRITES = {"reduce_window_max": _max_pool, "rem": _rem, "reduce_sum": _reduce_sum}
# Calls whose bodies are inlined so the rewrites reach them (custom derivatives and remat only
# matter for gradients), with the parameter holding the body.
_INLINED = {
    "jit": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
}


def _replay(jaxpr: jex.core.Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    """`jaxpr` evaluated (under the caller's trace) with calls inlined and `_REWRITES` applied."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _INLINED:
            body = eqn.params[_INLINED[name]]
            if isinstance(body, jex.core.ClosedJaxpr):
                out = _replay(body.jaxpr, body.consts, *inputs)
            else:
                out = _replay(body, (), *inputs)
        elif name in _REWRITES:
            out = _REWRITES[name](*inputs, **eqn.params)
        else:
            out = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    return [read(v) for v in jaxpr.outvars]


@contextlib.contextmanager
def _quiet_converter_logs() -> Iterator[None]:
    # jax2onnx imports all its plugin trees and logs a traceback for each one whose library is
    # missing (equinox, dm_pix), which these models never reach; onnx_ir warns of every shape
    # value the converter left untyped, which only leaves its type out of the graph's value_info.
    loggers = [logging.getLogger(n) for n in ("jax2onnx.plugins.plugin_system", "onnx_ir.serde")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _connected_by_producer() -> Iterator[None]:
    # After each equation jax2onnx 0.17.1 checks that its outputs are in the graph by comparing
    # them with every node's outputs (`_value_is_graph_connected`): quadratic in the graph's
    # size (DINO-R50's conversion took 257 s with it, 92 s without). A value whose producer is
    # a node of the builder's graph is in it; anything else still gets the converter's own
    # scan, so its answers do not change.
    from jax2onnx.converter import output_binding

    scan = getattr(output_binding, "_value_is_graph_connected", None)
    if scan is None:  # another jax2onnx: its own check, however long it takes
        yield
        return

    def connected(ctx: Any, value: Any) -> bool:
        producer = value.producer() if hasattr(value, "producer") else None
        graph = getattr(getattr(ctx, "builder", None), "graph", None)
        if producer is not None and graph is not None and producer.graph is graph:
            return True
        return scan(ctx, value)

    output_binding._value_is_graph_connected = connected
    try:
        yield
    finally:
        output_binding._value_is_graph_connected = scan


def convert(model: exported.ExportedModel, batch_size: int | None = None) -> Any:
    """The model's predict on prepared batches as an `onnx.ModelProto`: inputs `INPUT_NAMES`,
    outputs `OUTPUT_NAMES`, a symbolic batch dimension "batch" unless `batch_size` is given."""
    jax2onnx = _converter()
    module = model.module
    # Remat changes no value, and its chunked sampling loop would reach the graph as a scan.
    if getattr(module, "remat", False):
        module = module.clone(remat=False)
    plain = dataclasses.replace(model, module=module)

    def predict(images: jax.Array, mask: jax.Array) -> tuple[jax.Array, ...]:
        out = plain.predict_canvas(images, mask)
        return tuple(out[name] for name in OUTPUT_NAMES)

    # Traced here, outside jax2onnx: its tracing patches flax (nn.max_pool, Dense, LayerNorm,
    # ...) with plugins of its own, and the max_pool patch rejects linen's positional window.
    # Replaying the plain jaxpr gives jax2onnx lax primitives alone, parameters as constants.
    specs = list(portable.input_specs(model.input_config["image_size"], batch_size))
    traced = jax.make_jaxpr(predict)(*specs)
    with _quiet_converter_logs(), _connected_by_producer():
        return jax2onnx.to_onnx(
            lambda images, mask: _replay(traced.jaxpr, traced.consts, images, mask),
            specs,
            model_name=model.model_name or type(model.module).__name__,
            opset=OPSET,
            input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES,
        )


def _tensor_info(value: Any) -> dict[str, Any]:
    import onnx

    tensor = value.type.tensor_type
    return {
        "name": value.name,
        "shape": [d.dim_param or str(d.dim_value) for d in tensor.shape.dim],
        "dtype": str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))),
    }


def contract(model: exported.ExportedModel, graph: Any) -> dict[str, Any]:
    """What a user of the graph (an `onnx.ModelProto` of `convert`) needs to know."""
    feed = ", ".join(f"'{name}': {name}" for name in INPUT_NAMES)
    return {
        "contract_version": portable.CONTRACT_VERSION,
        "artifact": ONNX_FILE,
        "load": f"onnxruntime.InferenceSession('{ONNX_FILE}').run(None, {{{feed}}}) -> "
        f"[{', '.join(OUTPUT_NAMES)}]",
        "opset": OPSET,
        "converter": f"jax2onnx {importlib.metadata.version('jax2onnx')}",
        "jax_version": jax.__version__,
        "inputs": [_tensor_info(v) for v in graph.graph.input],
        **portable.model_contract(model),
    }


def write_onnx(
    model: exported.ExportedModel,
    out_dir: str | pathlib.Path,
    batch_size: int | None = None,
    extra_files: Mapping[str, str] | None = None,
) -> pathlib.Path:
    """Writes `ONNX_FILE`, `CONTRACT_FILE` and `extra_files` (name -> text) into `out_dir` and
    returns it.

    As `portable.write_stablehlo`: all are written into a staging directory beside `out_dir`
    that then takes its place, and an `out_dir` that holds anything but a previous ONNX export
    is refused. `batch_size` None gives a graph for any batch. A model computing in bfloat16
    gives a bfloat16 graph, which onnxruntime's CPU provider cannot run (it has no bfloat16
    Conv).
    """
    out_dir = files.export_directory(out_dir, "onnx export", [ONNX_FILE, CONTRACT_FILE])
    graph = convert(model, batch_size)
    with files.replaced_directory(out_dir) as staging:
        (staging / ONNX_FILE).write_bytes(graph.SerializeToString())
        (staging / CONTRACT_FILE).write_text(json.dumps(contract(model, graph), indent=2))
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
    return out_dir
