"""The 15 ImageNet-C corruptions at 5 severities, as the `imagecorruptions` package applies them.

`imagecorruptions` 1.1.2 (Michaelis et al., "Benchmarking Robustness in Object Detection", 2019:
Hendrycks & Dietterich's ImageNet-C code, packaged for COCO-C) is the corruption code; nothing
here reimplements a corruption. Its `corruptions.py` no longer imports or runs on today's stack,
so it is compiled here from the installed package's own file with a few one-line substitutions
(`_COMPAT`), each of which must occur exactly as listed, so another release fails loudly instead
of being patched blindly:

- `pkg_resources` (gone from setuptools) located the frost textures: replaced by the path of
  the same files in the installed package, found without importing it (`importlib.util`);
- `scipy.ndimage.interpolation` (deprecated, removed in SciPy 2): the same `map_coordinates`
  from `scipy.ndimage`;
- `np.float_` (removed in NumPy 2): `np.float64`, which it always was;
- scikit-image's `gaussian(..., multichannel=True)` (gone; today's spelling is
  `channel_axis=-1`): `channel_axis=-1`;
- scikit-image's `random_noise` (impulse noise) now draws from a fresh `Generator` when given
  no `rng`, not from NumPy's global RNG, so it is given a seed drawn from the global RNG.

The package itself is not imported (its `__init__` imports the broken module), so it needs no
shim in `sys.modules` and nothing global is changed. `corrupt` applies a corruption as the
package's own `imagecorruptions.corrupt` does (a PIL image in, `np.uint8` of the result out), then
checks that the shape is the input's, which boxes rely on. tests/test_corruptions.py checks each
corruption against the unmodified package's `corrupt`.

Randomness: the corruptions draw from NumPy's global RNG. `corrupt` seeds it from `seed` (use
`seed_of` on what identifies the image and the corruption, so a rebuild is byte-identical),
under a lock (two threads would interleave draws), and restores the caller's RNG state after.
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

# (text in imagecorruptions/corruptions.py, replacement, how many times it occurs).
_COMPAT = (
    ("from pkg_resources import resource_filename\n", "", 1),
    (
        "from scipy.ndimage.interpolation import map_coordinates\n",
        "from scipy.ndimage import map_coordinates\n",
        1,
    ),
    ("dtype=np.float_)", "dtype=np.float64)", 1),
    ("multichannel=True)", "channel_axis=-1)", 3),
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
    """imagecorruptions' corruptions.py, compiled with the `_COMPAT` substitutions."""
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
    drawing its randomness from `seed`; uint8 of the same shape."""
    check(name, severity)
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] image, got {image.dtype} {image.shape}")
    if min(image.shape[:2]) < MIN_SIZE:
        raise ValueError(f"{PACKAGE} needs images of at least {MIN_SIZE} px, got {image.shape}")
    function = getattr(package_module(), name)
    words = [(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)]
    with _RNG_LOCK:
        state = np.random.get_state()
        np.random.seed(words)
        try:
            # As imagecorruptions.corrupt: PIL in, np.uint8 (truncation) of whatever comes out.
            out = np.uint8(function(Image.fromarray(image), severity))
        finally:
            np.random.set_state(state)
    if out.shape != image.shape:
        raise RuntimeError(f"{name} at severity {severity} gave {out.shape} for {image.shape}")
    return out
