"""The 15 ImageNet-C corruptions at 5 severities, as the `imagecorruptions` package applies them.

`imagecorruptions` 1.1.2 (Michaelis et al., 2019: Hendrycks & Dietterich's ImageNet-C code,
packaged for COCO-C) is the corruption code; nothing here reimplements one. Its `corruptions.py`
no longer runs on today's stack, so it is compiled from the installed file with a few one-line
substitutions (`_COMPAT`), without importing the package. `corrupt` applies a corruption as the
package's `corrupt` does, seeded, so a rebuild is byte-identical (tests/data/test_corruptions.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import pathlib
import threading
import types

import numpy as np
from PIL import Image

# ImageNet-C's 15 corruptions in its order (noise, blur, weather, digital), as
# `imagecorruptions.get_corruption_names("common")` lists them.
NAMES = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness",
    "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)  # fmt: skip
SEVERITIES = (1, 2, 3, 4, 5)
PACKAGE = "imagecorruptions"
PACKAGE_VERSION = "1.1.2"
# The package's corruptions.py works on images of at least this many pixels a side.
MIN_SIZE = 32

# (text in imagecorruptions/corruptions.py, replacement, how many times it occurs). Each must
# occur exactly so, so that another release fails loudly instead of being patched blindly.
_COMPAT = (
    # pkg_resources is gone from setuptools; `_resource_filename` finds the frost textures.
    ("from pkg_resources import resource_filename\n", "", 1),
    # scipy.ndimage.interpolation is removed in SciPy 2.
    (
        "from scipy.ndimage.interpolation import map_coordinates\n",
        "from scipy.ndimage import map_coordinates\n",
        1,
    ),
    ("dtype=np.float_)", "dtype=np.float64)", 1),  # removed in NumPy 2; it always was float64
    ("multichannel=True)", "channel_axis=-1)", 3),  # scikit-image's gaussian: today's spelling
    # scikit-image's random_noise (impulse noise) now draws from a fresh Generator when given no
    # rng, not from NumPy's global RNG: give it a seed drawn from the global RNG.
    ("mode='s&p', amount=c)", "mode='s&p', amount=c, rng=np.random.randint(2**31))", 1),
)

_RNG_LOCK = threading.Lock()


def _package_dir() -> pathlib.Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"corruptions need the {PACKAGE} package: pip install --no-deps "
            f"{PACKAGE}=={PACKAGE_VERSION} scikit-image (it declares opencv-python; "
            "opencv-python-headless serves as well)"
        )
    return pathlib.Path(spec.submodule_search_locations[0])


def _resource_filename(package: str, name: str) -> str:
    """What `pkg_resources.resource_filename` gave the module: the path of a file installed
    beside it (only the frost textures are looked up)."""
    del package  # always the corruptions module itself
    return str(_package_dir() / name.removeprefix("./"))


@functools.cache
def package_module() -> types.ModuleType:
    """imagecorruptions' corruptions.py, compiled with the `_COMPAT` substitutions.

    The package itself is never imported (its `__init__` imports the broken module), so no shim
    goes into `sys.modules` and nothing global changes.
    """
    path = _package_dir() / "corruptions.py"
    source = path.read_text(encoding="utf-8")
    for old, new, count in _COMPAT:
        found = source.count(old)
        if found != count:
            raise RuntimeError(
                f"{path}: expected {count} of {old.strip()!r}, found {found}; this is not "
                f"{PACKAGE} {PACKAGE_VERSION}, which ood_jax.data.corruptions adapts"
            )
        source = source.replace(old, new)
    module = types.ModuleType(f"{PACKAGE}.corruptions", f"{PACKAGE} {PACKAGE_VERSION}, adapted")
    module.__file__ = str(path)
    module.resource_filename = _resource_filename
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - the package's code
    return module


def seed_of(*parts: str | int) -> int:
    """A 128-bit seed from what identifies one corrupted image, e.g. (dataset, split, image
    key, corruption, severity): equal parts give the same seed on every machine."""
    digest = hashlib.sha256("\0".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:16], "little")


def check(name: str, severity: int) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown corruption {name!r}; the 15 are {', '.join(NAMES)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of 1-5, got {severity!r}")


def corrupt(image: np.ndarray, name: str, severity: int, seed: int) -> np.ndarray:
    """`image` (uint8, [H, W, 3], H and W >= 32) under corruption `name` at `severity` (1-5),
    drawing its randomness from `seed` (`seed_of` what identifies the image and the corruption,
    so a rebuild is byte-identical); uint8 of the same shape."""
    check(name, severity)
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] image, got {image.dtype} {image.shape}")
    if min(image.shape[:2]) < MIN_SIZE:
        raise ValueError(f"{PACKAGE} needs images of at least {MIN_SIZE} px, got {image.shape}")
    function = getattr(package_module(), name)
    words = [(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)]
    # The corruptions draw from NumPy's global RNG: seed it under a lock (two threads would
    # interleave draws) and give the caller its state back after.
    with _RNG_LOCK:
        state = np.random.get_state()
        np.random.seed(words)
        try:
            # As imagecorruptions.corrupt: PIL in, np.uint8 (truncation) of whatever comes out.
            out = np.uint8(function(Image.fromarray(image), severity))
        finally:
            np.random.set_state(state)
    if out.shape != image.shape:  # boxes rely on it
        raise RuntimeError(f"{name} at severity {severity} gave {out.shape} for {image.shape}")
    return out
