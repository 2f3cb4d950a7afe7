"""Parameter path names, and host batches -> global arrays (`ood_jax.sharding`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from ood_jax import sharding
from ood_jax.train import optim


def _tree():
    # A list inside the tree: its indices are where two namers can disagree.
    return {
        "blocks": [{"kernel": jnp.ones((4, 2))}, {"kernel": jnp.ones((4, 2))}],
        "head": {"bias": jnp.ones((2,))},
    }


def test_path_name_spells_every_kind_of_key():
    names = [
        sharding.path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(_tree())[0]
    ]
    assert names == ["blocks/0/kernel", "blocks/1/kernel", "head/bias"]


def test_optimizer_groups_and_partition_rules_see_the_same_names():
    """A rule written for a partition rule's name must select the same parameter as an
    optimizer group: freezing "blocks/0/..." freezes exactly that parameter."""
    params = _tree()
    mesh = sharding.make_mesh([("data", -1)], jax.devices()[:1])
    shardings = sharding.tree_shardings(
        params, mesh, [(r"blocks/0/.*", "replicate"), (".*", "replicate")]
    )
    assert jax.tree.structure(shardings) == jax.tree.structure(params)

    config = ml_collections.ConfigDict(
        {
            "lr": 1e-2,
            "backbone_lr": 1e-3,
            "backbone_pattern": r"head/.*",
            "frozen_pattern": r"blocks/0/.*",
            "decay_epochs": (),
            "decay_factor": 0.1,
            "b1": 0.9,
            "b2": 0.999,
            "weight_decay": 0.0,
            "clip_norm": 1.0,
        }
    )
    optimizer, _ = optim.make_optimizer(config, params, steps_per_epoch=10)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["blocks"][0]["kernel"], params["blocks"][0]["kernel"])
    assert not np.allclose(new["blocks"][1]["kernel"], params["blocks"][1]["kernel"])
    assert not np.allclose(new["head"]["bias"], params["head"]["bias"])


def test_partition_rule_matches_a_list_index():
    mesh = sharding.make_mesh([("data", -1)], jax.devices()[:1])
    with pytest.raises(ValueError, match="blocks/1/kernel"):
        sharding.tree_shardings(
            _tree(), mesh, [(r"blocks/0/kernel", "replicate"), (r"head/.*", "replicate")]
        )


def _host_batches(n):
    for i in range(n):
        yield {
            "image": np.full((2, 3), i, np.float32),
            "image_id": np.array([10 * i, 10 * i + 1], np.int64),
        }


@pytest.mark.parametrize("n_prefetch", [0, 1, 3])
def test_start_global_keeps_order_and_host_keys(n_prefetch):
    data_sharding = sharding.batch_sharding(sharding.make_mesh([("data", -1)], jax.devices()[:1]))
    out = list(
        sharding.start_global(
            _host_batches(5), data_sharding, host_keys=("image_id",), n_prefetch=n_prefetch
        )
    )
    assert len(out) == 5
    for i, (device, host) in enumerate(out):
        assert set(device) == {"image"} and set(host) == {"image_id"}
        assert isinstance(device["image"], jax.Array) and device["image"].sharding == data_sharding
        np.testing.assert_array_equal(device["image"], np.full((2, 3), i, np.float32))
        assert host["image_id"].dtype == np.int64
        np.testing.assert_array_equal(host["image_id"], [10 * i, 10 * i + 1])


def test_start_global_reads_ahead_by_n_prefetch():
    data_sharding = sharding.batch_sharding(sharding.make_mesh([("data", -1)], jax.devices()[:1]))
    pulled = []

    def counting():
        for batch in _host_batches(10):
            pulled.append(1)
            yield batch

    batches = sharding.start_global(
        counting(), data_sharding, host_keys=("image_id",), n_prefetch=2
    )
    next(batches)
    assert len(pulled) == 3


def test_start_global_refuses_an_int64_device_field():
    data_sharding = sharding.batch_sharding(sharding.make_mesh([("data", -1)], jax.devices()[:1]))
    with pytest.raises(ValueError, match="image_id"):
        next(sharding.start_global(_host_batches(1), data_sharding))


def test_weights_read_by_every_process_are_placed_once_their_digests_agree(monkeypatch):
    """Several processes compare one digest of what they read (`multihost.every_process`); one
    that read other values is named with the file. Here the first read stands for process 0's."""
    from ood_jax import multihost

    weights = {"conv": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    other = {"conv": {"kernel": weights["conv"]["kernel"].copy()}}
    other["conv"]["kernel"][1, 2] += 1e-6
    mesh = sharding.make_mesh([("data", -1)], jax.devices()[:1])
    first_read = {}

    def every_process(name, value):
        first_read.setdefault(name, value)
        return [first_read[name], value]

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost, "every_process", every_process)
    replicated = sharding.replicated(mesh)
    for _ in range(2):
        placed = sharding.tree_from_host_copy(weights, replicated, source="w.msgpack")
        np.testing.assert_array_equal(placed["conv"]["kernel"], weights["conv"]["kernel"])
        assert placed["conv"]["kernel"].sharding == replicated
    with pytest.raises(
        ValueError, match=r"^w.msgpack: process 1 read other weights than process 0"
    ):
        sharding.tree_from_host_copy(other, replicated, source="w.msgpack")
    assert list(first_read) == ["weights/w.msgpack"]


def test_a_function_traced_on_a_mesh_keeps_its_name_and_sees_the_mesh():
    def train_step(x, scale):
        assert jax.sharding.get_abstract_mesh().axis_names == ("data",)
        return x * scale

    mesh = sharding.make_mesh([("data", -1)])
    step = jax.jit(sharding.traced_on(mesh, functools.partial(train_step, scale=2.0)))
    lowered = step.lower(jnp.ones(4))
    assert "jit_train_step" in lowered.as_text().split("\n", 1)[0]
    assert float(lowered.compile()(jnp.ones(4))[0]) == 2.0
