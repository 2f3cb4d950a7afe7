"""tf.data iterators are let go on a daemon thread: the caller never waits for their teardown."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf

from ood_jax.data import iteration

HANG_GUARD_S = 60  # a release that never happens fails the test instead of stalling it


class Recorded:
    """An item that says on which thread it was deleted; its deletion may be held back."""

    def __init__(self, held_back: threading.Event | None = None):
        self.held_back = held_back
        self.deleted = threading.Event()
        self.deleted_on: list[str] = []

    def __del__(self):
        if self.held_back is not None:
            self.held_back.wait(HANG_GUARD_S)
        self.deleted_on.append(threading.current_thread().name)
        self.deleted.set()


def test_numpy_iterator_yields_what_as_numpy_iterator_yields():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(7, 3)).astype(np.float32)
    names = [f"image {i}".encode() for i in rng.permutation(7)]
    dataset = tf.data.Dataset.from_tensor_slices({"x": values, "name": names, "i": np.arange(7)})
    dataset = dataset.map(lambda e: {**e, "y": e["x"] * 2.0}, num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.batch(3).prefetch(tf.data.AUTOTUNE)
    ours, theirs = list(iteration.numpy_iterator(dataset)), list(dataset.as_numpy_iterator())
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            assert type(a[key]) is type(b[key])
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_the_caller_goes_on_while_the_teardown_waits():
    held_back = threading.Event()
    item = Recorded(held_back)
    held, deleted = [item], item.deleted
    deleted_on = item.deleted_on
    del item
    thread = iteration.drop_in_background(held)  # returns although the deletion is held back
    assert thread.daemon and not deleted.is_set()
    held_back.set()
    thread.join(HANG_GUARD_S)
    assert deleted.is_set() and deleted_on == [iteration.RELEASE_THREAD_NAME]
    assert held == []


class Numbers(Recorded):
    def __iter__(self):
        return iter(range(3))


class FakeDataset:
    """A dataset whose iterator yields 0, 1, 2 and says where it was deleted; the dataset keeps
    only what it says, so nothing but the generator keeps the iterator alive."""

    def as_numpy_iterator(self) -> Numbers:
        numbers = Numbers()
        self.deleted, self.deleted_on = numbers.deleted, numbers.deleted_on
        return numbers


@pytest.mark.parametrize("how", ["exhausted", "closed", "dropped"])
def test_the_iterator_is_deleted_on_the_release_thread(how):
    dataset = FakeDataset()
    numbers = iteration.numpy_iterator(dataset)
    if how == "exhausted":
        assert list(numbers) == [0, 1, 2]
    else:
        assert next(numbers) == 0
        if how == "closed":
            numbers.close()
        else:
            del numbers
    assert dataset.deleted.wait(HANG_GUARD_S)
    assert dataset.deleted_on == [iteration.RELEASE_THREAD_NAME]
