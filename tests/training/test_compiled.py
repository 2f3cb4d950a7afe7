"""CompiledOnFirstCall: one compile per set of argument shapes, each announced, none again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ood_jax.train.compiled import CompiledOnFirstCall


def test_one_compile_per_shape_each_announced(capsys):
    traced = []

    def step(state, batch):
        traced.append(batch["image"].shape)
        return state + batch["image"].sum(), {"loss": batch["image"].mean()}

    compiled = CompiledOnFirstCall(jax.jit(step), "train step")
    landscape, portrait = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 3))
    state = jnp.zeros(())
    for image in (landscape, portrait, landscape, portrait):
        state, metrics = compiled(state, {"image": image})
    np.testing.assert_allclose(state, 4 * 24.0)
    np.testing.assert_allclose(metrics["loss"], 1.0)
    assert traced == [(2, 3, 4), (2, 4, 3)]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" in ")[0] for line in lines] == [
        "compiling the train step ...",
        "compiled the train step",
        "compiling the train step for arguments of new shapes ...",
        "compiled the train step for arguments of new shapes",
    ]
    assert compiled.compile_seconds > 0
