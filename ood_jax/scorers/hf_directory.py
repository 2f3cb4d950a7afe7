"""A transformers checkpoint directory -> `(kind, module, variables, config)`, for the families
whose converters build the module from the config alone (`convert_blip2`, `convert_groupvit`)."""

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ood_jax.scorers import convert


def load(
    kind: str,
    path: str | Path,
    dtype: Any,
    module_from_config: Callable[[dict[str, Any], Any], Any],
    params_from_hf: Callable[[Mapping[str, np.ndarray], Any], dict[str, Any]],
) -> tuple[str, Any, dict, dict]:
    """The module `module_from_config(config, dtype)` builds from the directory's config.json,
    with the variables `params_from_hf(state_dict, module)` converts from its weights.

    A conversion error names the directory, which the converter does not know.
    """
    config = convert.read_config(path)
    module = module_from_config(config, dtype)
    try:
        variables = params_from_hf(convert.read_weights(path), module)
    except ValueError as e:
        raise ValueError(f"{Path(path)}: {e}") from e
    return kind, module, variables, config
