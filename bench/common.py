"""What the benchmarks share: interleaved timing, the result line and random detection inputs.

Scripts in bench/ run as `python bench/X.py`, so this module is imported as `common`.

How every bench times: each side (ours, the peer) gets the same `--warmup` untimed calls and the
same number of timed calls, alternating (`time_alternating`), and is reported by the median;
imports, model building, compiling and other one-time setup happen before the timing (our
compile time is printed apart). A `--dtype bfloat16` run changes only our side unless the bench
says otherwise: the header and the result line name each side's dtype.

Every bench ends with one machine-readable line, the last line of its stdout (`result_line`):

    RESULT {"name": "coco_eval", "ours_s": 0.41, "peer": "faster-coco-eval", "peer_s": 3.1,
            "ratio": 7.6, "stat": "median of 3 after 1 warm-up", ...}

(on one line): "RESULT " and a JSON object with at least `name` (the bench), `ours_s` (our
seconds per unit of work, the bench's headline figure), `peer` (what we are compared with, null
if nothing), `peer_s` (its seconds for the same work, null if not run), `ratio` (peer_s / ours_s,
above 1 when ours is faster; null without a peer) and `stat` (how the seconds were taken); a
bench adds its own keys (dtypes, other rows, sizes). `parse_result_line` reads it back. Every
bench also takes `--smoke`: the tiniest sizes that run the same code, for the tests
(tests/cli/test_benches.py), whose timings mean nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def time_alternating(
    fns: dict[str, Callable[..., Any]],
    steps: int,
    warmup: int,
    setup: dict[str, Callable[[], tuple]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each of `steps` calls of every fn (each must block until done), after
    `warmup` calls. The calls alternate between the fns, so a change in the machine's load
    during the run weighs on all of them alike. `setup[name]`, if given, runs untimed before
    each call of fns[name] and its tuple is the call's arguments (fresh inputs for a peer that
    writes into its own)."""
    setup = setup or {}
    times = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            args = setup[name]() if name in setup else ()
            start = time.perf_counter()
            fn(*args)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


RESULT_PREFIX = "RESULT "
RESULT_KEYS = ("name", "ours_s", "peer", "peer_s", "ratio", "stat")


def result_line(
    name: str,
    ours_s: float | None,
    peer: str | None,
    peer_s: float | None,
    stat: str,
    **extra: Any,
) -> dict[str, Any]:
    """Prints the bench's machine-readable result line (see the module docstring) and returns
    its record. Call it last: the line must be the last of stdout. `ratio` is computed here,
    peer_s / ours_s, so that every bench means the same by it."""
    ratio = None if ours_s is None or peer_s is None else peer_s / ours_s
    record = {
        "name": name,
        "ours_s": ours_s,
        "peer": peer,
        "peer_s": peer_s,
        "ratio": None if ratio is None else round(ratio, 4),
        "stat": stat,
        **extra,
    }
    # NumPy scalars (a float64 median, a bool_ check) as the Python values they hold.
    line = json.dumps(record, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    print(RESULT_PREFIX + line, flush=True)
    return record


def parse_result_line(line: str) -> dict[str, Any]:
    """The record of a `result_line`; ValueError if `line` is not one."""
    if not line.startswith(RESULT_PREFIX):
        raise ValueError(f"not a result line: {line[:80]!r}")
    record = json.loads(line[len(RESULT_PREFIX) :])
    missing = [key for key in RESULT_KEYS if key not in record]
    if missing:
        raise ValueError(f"result line without {missing}: {line[:200]!r}")
    return record


def stat_text(steps: int, warmup: int) -> str:
    """How `time_alternating`'s seconds are summed up in the result line."""
    return f"median of {steps} after {warmup} warm-up, alternating"


def random_detection_input(seed: int, batch: int, size: int, max_boxes: int, num_classes: int):
    """Images [B, S, S, 3] float32, boxes [B, M, 4] normalized cxcywh, labels [B, M], and a
    mask [B, M] with 3 to 6 real boxes per image."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, size, size, 3), np.float32)
    box_size = rng.uniform(0.05, 0.5, (batch, max_boxes, 2))
    center = rng.uniform(box_size / 2, 1 - box_size / 2)
    boxes = np.concatenate([center, box_size], -1).astype(np.float32)
    labels = rng.integers(0, num_classes, (batch, max_boxes)).astype(np.int32)
    counts = rng.integers(3, 7, batch)
    mask = np.arange(max_boxes)[None, :] < counts[:, None]
    return images, boxes, labels, mask


def summary(times: list[float]) -> str:
    """Median [min-max] seconds."""
    return f"{statistics.median(times):8.3f} [{min(times):.3f}-{max(times):.3f}]"


def torch_detection_batch(inputs):
    """`random_detection_input`'s arrays as transformers' detectors take them: pixel values
    [B, 3, S, S], an all-ones pixel mask, and one {"class_labels", "boxes"} dict per image."""
    import torch

    images, boxes, labels, mask = inputs
    pixel_values = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    pixel_mask = torch.ones(images.shape[:3], dtype=torch.long)
    targets = [
        {
            "class_labels": torch.from_numpy(labels[i][mask[i]]).long(),
            "boxes": torch.from_numpy(boxes[i][mask[i]]),
        }
        for i in range(len(images))
    ]
    return pixel_values, pixel_mask, targets


def torch_adamw(model, lr: float, backbone_lr: float, weight_decay: float):
    """AdamW in DETR's two parameter groups (the backbone at `backbone_lr`) over the parameters
    that require grad, and those parameters (for gradient clipping)."""
    import torch

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    backbone = [p for n, p in trainable if n.startswith("model.backbone.")]
    rest = [p for n, p in trainable if not n.startswith("model.backbone.")]
    optimizer = torch.optim.AdamW(
        [{"params": backbone, "lr": backbone_lr}, {"params": rest, "lr": lr}],
        lr=lr,
        weight_decay=weight_decay,
    )
    return optimizer, [p for _, p in trainable]


# --------------------------------------------------------------------------------------------
# device figures: FLOPs, MFU and memory of a compiled step
# --------------------------------------------------------------------------------------------

# Dense (no sparsity) peak TFLOP/s of one chip, keyed by a substring of JAX's `device_kind`
# ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "TPU v4", "TPU v5 lite",
# "TPU v5p" / "TPU v5", "TPU v6 lite"); the first matching key wins, so the more specific ones
# come first ("NVIDIA GH200 480GB" matches "H200": its GPU has the H100 SXM's peaks). NVIDIA
# figures are the SXM parts' datasheet numbers; the float32 entry is the TF32 tensor-core peak,
# because XLA on GPU runs float32 matmuls and convolutions in TF32 by default
# (jax_default_matmul_precision). TPUs run float32 matmuls as bfloat16 passes, so both
# dtypes get the bfloat16 peak. `PEAK_TFLOPS` in the environment overrides the table; a device
# the table does not know (a CPU) gets `measured_matmul_tflops` instead.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 378.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float32": 418.0}),
    ("H200", {"bfloat16": 989.0, "float32": 494.0}),
    ("H100", {"bfloat16": 989.0, "float32": 494.0}),
    ("A100", {"bfloat16": 312.0, "float32": 156.0}),
    ("TPU v4", {"bfloat16": 275.0, "float32": 275.0}),
    ("TPU v5 lite", {"bfloat16": 197.0, "float32": 197.0}),
    ("TPU v5e", {"bfloat16": 197.0, "float32": 197.0}),
    ("TPU v5", {"bfloat16": 459.0, "float32": 459.0}),  # v5p ("TPU v5p" or "TPU v5")
    ("TPU v6 lite", {"bfloat16": 918.0, "float32": 918.0}),
    ("TPU v6e", {"bfloat16": 918.0, "float32": 918.0}),
)

# Side of the square matmul that stands for a device's peak where no datasheet figure is known:
# at 4096 XLA:CPU's dot runs at its best rate (2 cores: ~0.4 s a call); --smoke's 256 only runs
# the code, its "peak" means nothing.
PEAK_MATMUL_SIZE, SMOKE_MATMUL_SIZE = 4096, 256
PEAK_MATMUL_REPEATS = 5


def peak_tflops(device_kind: str, dtype: str) -> tuple[float | None, str]:
    """(Dense peak TFLOP/s, where it comes from) for `dtype` ("float32" or "bfloat16") on a
    `device_kind`: `PEAK_TFLOPS` from the environment if set, else the table, else None."""
    override = os.environ.get("PEAK_TFLOPS")
    if override:
        try:
            return float(override), "PEAK_TFLOPS"
        except ValueError:
            raise SystemExit(f"PEAK_TFLOPS={override!r} is not a number") from None
    for key, peaks in PEAK_TFLOPS:
        if key in device_kind:
            note = ""
            if dtype == "float32":
                note = " (TF32 tensor cores)" if "NVIDIA" in device_kind else " (bf16 passes)"
            return peaks[dtype], f"{key} {dtype} dense peak{note}"
    return None, f"no peak known for {device_kind!r}; set PEAK_TFLOPS"


def measured_matmul_tflops(dtype: str, size: int = PEAK_MATMUL_SIZE) -> tuple[float, str]:
    """(TFLOP/s, how it was measured) of one jitted `size` x `size` by `size` x `size`
    `jnp.dot` in `dtype` on the first device, in this process: 2 * size**3 FLOPs over the
    median of `PEAK_MATMUL_REPEATS` calls after one untimed call (the compile). The best rate a
    step on this device can hope for, taken in the bench's own run so that a shared machine's
    load weighs on it much as on the steps (not exactly: the load moves between the two)."""
    import jax
    import jax.numpy as jnp

    matrix = jax.random.normal(jax.random.key(0), (size, size), dtype)
    dot = jax.jit(jnp.dot)
    dot(matrix, matrix).block_until_ready()
    times = []
    for _ in range(PEAK_MATMUL_REPEATS):
        start = time.perf_counter()
        dot(matrix, matrix).block_until_ready()
        times.append(time.perf_counter() - start)
    how = f"measured: {size}^2 {dtype} jnp.dot, median of {PEAK_MATMUL_REPEATS}"
    return 2 * size**3 / statistics.median(times) / 1e12, how


def mfu_peak(dtype: str, smoke: bool = False) -> dict[str, Any]:
    """The peak that MFU divides by, for `dtype` on the first device: {"tflops", "source",
    "note"}, source "PEAK_TFLOPS" (the environment), "datasheet" (the `PEAK_TFLOPS` table) or
    "measured" (`measured_matmul_tflops`, where the table knows no figure: a CPU; with `smoke`
    the tiny matmul). Prints it as the line "  peak for MFU: P TFLOP/s (how)"."""
    import jax

    tflops, note = peak_tflops(jax.devices()[0].device_kind, dtype)
    if tflops is None:
        source = "measured"
        tflops, note = measured_matmul_tflops(
            dtype, SMOKE_MATMUL_SIZE if smoke else PEAK_MATMUL_SIZE
        )
    else:
        source = "PEAK_TFLOPS" if note == "PEAK_TFLOPS" else "datasheet"
    print(f"  peak for MFU: {tflops:.4g} TFLOP/s ({note})")
    return {"tflops": tflops, "source": source, "note": note}


def step_flops(compiled) -> float:
    """FLOPs of one call of a `jax.stages.Compiled`, from XLA's cost analysis of the optimized
    module. `cost_analysis()` returns a dict, or in older JAX a list with one dict per module
    (one for a single-device jit: its first is taken)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        keys = sorted(analysis) if isinstance(analysis, dict) else analysis
        raise RuntimeError(f"XLA's cost analysis gives no 'flops' for this step (got {keys})")
    return float(analysis["flops"])


def compiled_memory(compiled) -> dict[str, int] | None:
    """Bytes of a `jax.stages.Compiled` from its `memory_analysis()` (None where the backend
    gives none): temp, arguments, outputs, aliased, and "peak" = temp + arguments + outputs -
    aliased (a donated argument's outputs reuse its buffers, so they are counted once)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    sizes = {
        "temp": stats.temp_size_in_bytes,
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
    }
    sizes["peak"] = sizes["temp"] + sizes["arguments"] + sizes["outputs"] - sizes["aliased"]
    return sizes


def device_peak_bytes() -> int | None:
    """The first device's peak bytes in use so far in this process (`memory_stats()`'s
    "peak_bytes_in_use"), or None where the backend keeps no such count (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])


def step_figures(
    kind: str,
    compiled,
    seconds: float | None,
    batch: int,
    peak: dict[str, Any] | None,
    device_peak: int | None = None,
    device_note: str = "",
) -> dict[str, Any]:
    """Prints and returns the figures of one compiled step (`jax.stages.Compiled`) whose median
    is `seconds` for `batch` images: the line "device figures: <kind> step S s, I images/s,
    G GFLOP, T TFLOP/s, MFU M%, compiled peak C GB, device peak D GB (<device_note>)", whose
    fields launch/gpu_bench.sh reads by position. FLOPs from XLA's cost analysis, MFU against
    `peak` (`mfu_peak`'s); "n/a" for what does not exist (no `seconds`: compiled, not run; no
    `peak`; no `device_peak`, as on CPU). The returned "mfu" is a fraction of the peak, the
    printed one a percentage."""
    flops = step_flops(compiled)
    memory = compiled_memory(compiled)
    achieved = None if seconds is None else flops / seconds / 1e12
    figure = {
        "seconds": seconds,
        "images_per_s": None if seconds is None else batch / seconds,
        "gflop": flops / 1e9,
        "tflops": achieved,
        "mfu": None if peak is None or achieved is None else achieved / peak["tflops"],
        "compiled_peak_gb": None if memory is None else memory["peak"] / 1e9,
        "device_peak_gb": None if device_peak is None else device_peak / 1e9,
    }

    def show(value, spec: str, unit: str = "") -> str:
        return "n/a" if value is None else f"{value:{spec}}{unit}"

    device_gb = show(figure["device_peak_gb"], ".2f", " GB")
    if device_peak is not None and device_note:
        device_gb += f" ({device_note})"
    mfu = None if figure["mfu"] is None else 100 * figure["mfu"]
    print(
        f"device figures: {kind} step {show(seconds, '.4f', ' s')}, "
        f"{show(figure['images_per_s'], '.2f')} images/s, {figure['gflop']:.1f} GFLOP, "
        f"{show(achieved, '.3f')} TFLOP/s, MFU {show(mfu, '.1f', '%')}, "
        f"compiled peak {show(figure['compiled_peak_gb'], '.2f', ' GB')}, "
        f"device peak {device_gb}"
    )
    return figure


def device_figures(
    train,
    predict,
    train_s: float | None,
    predict_s: float | None,
    batch: int,
    dtype: str,
    predict_device_peak: int | None = None,
    train_device_peak: int | None = None,
    smoke: bool = False,
) -> dict[str, Any]:
    """Prints the figures of the compiled train and predict steps (`jax.stages.Compiled`)
    whose median seconds are `train_s` and `predict_s` at `batch` images in `dtype`, and returns
    them as result-line keys: "{train,predict}_{gflop,tflops,mfu}" (mfu a fraction),
    "peak_tflops" and "peak_source".

    First the line "  peak for MFU: ..." (`mfu_peak`: the datasheet's, or on a CPU a matmul
    measured now, right after the step timings; skipped when neither step was timed,
    `--compile-only`), then one `step_figures` line per step kind. The device peak is the
    process's peak so far, setup included: for the train line `train_device_peak` (read by
    the caller right after the train timings, which follow the predict timings) or else read
    now (before the matmul), so the max over both steps; the predict line shows
    `predict_device_peak` (read after the predict timings, before any train step) if given,
    else the same as the train line."""
    final_peak = device_peak_bytes() if train_device_peak is None else train_device_peak
    if train_s is None and predict_s is None:
        peak = None
        print("  peak for MFU: n/a (compiled only, nothing timed)")
    else:
        peak = mfu_peak(dtype, smoke)
    both = "max over predict and train steps"
    kinds = {"train": (train, train_s, final_peak, both)}
    if predict_device_peak is None:
        kinds["predict"] = (predict, predict_s, final_peak, both)
    else:
        kinds["predict"] = (predict, predict_s, predict_device_peak, "before any train step")
    record = {
        "peak_tflops": None if peak is None else peak["tflops"],
        "peak_source": None if peak is None else peak["source"],
    }
    for kind, (compiled, seconds, device_peak, device_note) in kinds.items():
        figure = step_figures(kind, compiled, seconds, batch, peak, device_peak, device_note)
        record.update({f"{kind}_{key}": figure[key] for key in ("gflop", "tflops", "mfu")})
    return record
