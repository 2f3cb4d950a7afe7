"""Every experiment config loads in every variant and builds its model."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from ood_jax import config_files
from ood_jax.data import pipeline
from ood_jax.models import registry

CONFIGS = {
    "configs/synthetic_detr.py": ("", "smoke"),
    "configs/counts_detr_r50.py": ("", "gpu8", "runlocal"),
    "configs/counts_detr_vit.py": ("", "gpu8", "runlocal"),
    "configs/synthetic_dino.py": ("", "smoke"),
    "configs/counts_dino_r50.py": ("", "gpu8", "runlocal"),
    "configs/counts_dino_vit.py": ("", "gpu8", "runlocal"),
}
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", [f"{path}:{arg}" if arg else path for path, args in CONFIGS.items() for arg in args]
)
def test_config_loads_and_builds(spec):
    config = config_files.load_spec(str(ROOT / spec))
    assert config.total_steps > 0 and config.checkpoint_every > 0
    # The pipeline validates its fields; an unknown or invalid one fails here, naming it.
    pipeline._checked(config.input)
    model = registry.build_model(config.model)
    # At the training size: two-stage detectors need as many encoder positions as queries.
    size = config.input.image_size
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
    )
    assert "backbone" in shapes["params"]


def test_every_config_file_is_covered():
    assert {f"configs/{p.name}" for p in (ROOT / "configs").glob("*.py")} == set(CONFIGS)


def test_unknown_variant_names_it():
    with pytest.raises(ValueError, match="nope"):
        config_files.load_spec(str(ROOT / "configs/synthetic_detr.py:nope"))
