"""ood_jax.data.corruptions against the unmodified imagecorruptions package, and its seeding.

The reference is the installed package imported as it ships. Its import needs `pkg_resources`,
given here as a stand-in holding the real `resource_filename` semantics; three of its functions
then still fail on today's NumPy and scikit-image (fog: `np.float_`; glass_blur:
`multichannel=`; impulse_noise draws from an unseeded Generator of scikit-image's), and run here
under function-level adapters written independently of the module's source substitutions.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types

import numpy as np
import pytest
import scipy.ndimage

from ood_jax.data import corruptions

# ImageNet-C deterministic corruptions: the seed changes nothing.
_DETERMINISTIC = {
    "defocus_blur", "zoom_blur", "brightness", "contrast", "pixelate", "jpeg_compression",
}  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    """The unmodified imagecorruptions package and its corruptions module."""
    saved = {name: sys.modules.get(name) for name in ("pkg_resources", "imagecorruptions")}
    stand_in = types.ModuleType("pkg_resources")
    stand_in.resource_filename = lambda package, name: os.path.join(
        os.path.dirname(sys.modules[package].__file__), name
    )
    sys.modules["pkg_resources"] = stand_in
    if importlib.util.find_spec("scipy.ndimage.interpolation") is None:  # SciPy 2
        sys.modules["scipy.ndimage.interpolation"] = scipy.ndimage
    try:
        package = importlib.import_module("imagecorruptions")
        yield package, sys.modules["imagecorruptions.corruptions"]
    finally:
        for name in [n for n in sys.modules if n.startswith("imagecorruptions")]:
            del sys.modules[name]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _adapted(monkeypatch, module):
    """What today's libraries lack, supplied at call level to the unmodified functions."""
    gaussian = module.gaussian

    def old_gaussian(image, sigma=1, multichannel=None, **kwargs):
        return gaussian(image, sigma, channel_axis=-1 if multichannel else None, **kwargs)

    skimage = module.sk

    def seeded_random_noise(image, **kwargs):
        return skimage.util.random_noise(image, rng=np.random.randint(2**31), **kwargs)

    monkeypatch.setattr(module, "gaussian", old_gaussian)
    # The reference module's own `sk` only: ours reaches the same scikit-image.
    sk = types.SimpleNamespace(
        util=types.SimpleNamespace(random_noise=seeded_random_noise), color=skimage.color
    )
    monkeypatch.setattr(module, "sk", sk)
    monkeypatch.setattr(np, "float_", np.float64, raising=False)


def _seeded(seed: int, fn, *args):
    np.random.seed([(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)])
    return fn(*args)


def test_names_are_imagenet_c_common_order(reference):
    package, _ = reference
    assert list(corruptions.NAMES) == package.get_corruption_names("common")


@pytest.mark.parametrize("name", corruptions.NAMES)
def test_parity_with_the_package(reference, monkeypatch, name):
    package, module = reference
    _adapted(monkeypatch, module)
    rng = np.random.default_rng(corruptions.NAMES.index(name))
    image = rng.integers(0, 256, (40, 52, 3), dtype=np.uint8)
    for severity in (1, 3, 5):
        seed = corruptions.seed_of("parity", name, severity)
        ours = corruptions.corrupt(image, name, severity, seed)
        theirs = _seeded(seed, package.corrupt, image, severity, name)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{name} severity {severity}")


def test_unmodified_functions_that_still_run_need_no_adapter(reference):
    # Everything but the three named in the module doc runs as shipped; equal without help.
    package, _ = reference
    image = np.random.default_rng(1).integers(0, 256, (36, 36, 3), dtype=np.uint8)
    for name in set(corruptions.NAMES) - {"fog", "glass_blur", "impulse_noise"}:
        seed = corruptions.seed_of(name)
        np.testing.assert_array_equal(
            corruptions.corrupt(image, name, 2, seed),
            _seeded(seed, package.corrupt, image, 2, name),
        )


def test_every_corruption_and_severity_keeps_shape_and_dtype():
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    for name in corruptions.NAMES:
        for severity in corruptions.SEVERITIES:
            out = corruptions.corrupt(image, name, severity, seed=severity)
            assert out.dtype == np.uint8 and out.shape == image.shape, (name, severity)
            assert not np.array_equal(out, image), (name, severity)


def test_seeded_determinism_and_difference():
    image = np.random.default_rng(2).integers(0, 256, (34, 38, 3), dtype=np.uint8)
    for name in corruptions.NAMES:
        a = corruptions.corrupt(image, name, 3, seed=11)
        np.testing.assert_array_equal(a, corruptions.corrupt(image, name, 3, seed=11))
        b = corruptions.corrupt(image, name, 3, seed=12)
        assert np.array_equal(a, b) == (name in _DETERMINISTIC), name


def test_caller_rng_state_is_kept():
    np.random.seed(5)
    expected = np.random.random(3)
    np.random.seed(5)
    corruptions.corrupt(np.zeros((32, 32, 3), np.uint8), "gaussian_noise", 1, seed=1)
    np.testing.assert_array_equal(np.random.random(3), expected)


def test_threads_do_not_share_draws():
    image = np.random.default_rng(3).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    expected = {s: corruptions.corrupt(image, "snow", 4, seed=s) for s in range(8)}
    got = {}

    def work(seed):
        got[seed] = corruptions.corrupt(image, "snow", 4, seed=seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed, out in expected.items():
        np.testing.assert_array_equal(got[seed], out)


def test_seed_of_separates_its_parts():
    seeds = {
        corruptions.seed_of("synthetic_shifts/tiny", "test_sky", 3, "fog", 1),
        corruptions.seed_of("synthetic_shifts/tiny", "test_sky", 3, "fog", 2),
        corruptions.seed_of("synthetic_shifts/tiny", "test_sky", 4, "fog", 1),
        corruptions.seed_of("synthetic_shifts/tiny", "test_sky", 3, "snow", 1),
        corruptions.seed_of("synthetic_shifts/tiny", "test_sk", "y3", "fog", 1),
    }
    assert len(seeds) == 5 and all(0 <= s < 2**128 for s in seeds)


@pytest.mark.parametrize(
    "image, name, severity, message",
    [
        (np.zeros((32, 32, 3), np.uint8), "rain", 1, "unknown corruption 'rain'"),
        (np.zeros((32, 32, 3), np.uint8), "fog", 6, "severity must be one of 1-5"),
        (np.zeros((32, 32, 3), np.float32), "fog", 1, "uint8 \\[H, W, 3\\]"),
        (np.zeros((32, 32), np.uint8), "fog", 1, "uint8 \\[H, W, 3\\]"),
        (np.zeros((31, 40, 3), np.uint8), "fog", 1, "at least 32 px"),
    ],
)
def test_bad_arguments(image, name, severity, message):
    with pytest.raises(ValueError, match=message):
        corruptions.corrupt(image, name, severity, seed=0)


def test_another_release_is_refused(tmp_path, monkeypatch):
    (tmp_path / "imagecorruptions").mkdir()
    (tmp_path / "imagecorruptions" / "__init__.py").write_text("")
    (tmp_path / "imagecorruptions" / "corruptions.py").write_text("import numpy as np\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    # The reference fixture may hold the real package, which find_spec would return.
    monkeypatch.delitem(sys.modules, "imagecorruptions", raising=False)
    corruptions.package_module.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="this is not imagecorruptions 1.1.2"):
            corruptions.package_module()
    finally:
        monkeypatch.undo()
        corruptions.package_module.cache_clear()
