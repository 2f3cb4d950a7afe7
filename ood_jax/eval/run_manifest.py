"""What a run's DIR/manifest.json says of it (ood_jax.manifest): the benchmark's data, the
client and where its requests went (without credentials), and how the run ended."""

from __future__ import annotations

import pathlib
import urllib.parse
from typing import Any

from ood_jax import manifest
from ood_jax.eval.accounting import Limits
from ood_jax.eval.scheduling import Client, RunStopped
from ood_jax.eval.tasks.base import Benchmark


def dataset(benchmark: Benchmark) -> dict:
    """Where the benchmark's items come from, as its task keeps it: the built TFDS directories
    (DATA_DIR/NAME/CONFIG/VERSION; foci one per config, oodbench one) or the items file
    (counts-oodg), with digests. What the items are is the items digest's job."""
    builds = dict(getattr(benchmark, "directories", None) or {})
    one = getattr(benchmark, "directory", None)
    if isinstance(one, pathlib.Path):
        builds[one.parent.name] = one
    dataset: dict[str, Any] = {"name": benchmark.name}
    if builds:
        dataset["builds"] = [
            {
                "name": path.parent.parent.name,
                "config": path.parent.name,
                "version": path.name,
                "path": str(path.resolve()),
                "digest": manifest.tfds_digest(path)["sha256"],
            }
            for path in builds.values()
        ]
    items_file = getattr(benchmark, "path", None)
    if isinstance(items_file, pathlib.Path) and items_file.is_file():
        dataset["items_file"] = {
            "path": str(items_file.resolve()),
            "sha256": manifest.file_sha256(items_file),
        }
    return dataset


def _without_credentials(url: str) -> str:
    """An endpoint as a manifest may show it: no user, password or query (where keys hide)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# The load settings of the client (http_client's, local_client's) a manifest reports.
_CLIENT_SETTINGS = (
    "api_key_env",
    "timeout_s",
    "max_attempts",
    "backoff_base_s",
    "max_retry_after_s",
    "allow_plain_http_key",
    "device",
)


def client_manifest(client: Client, limits: Limits, **options: Any) -> dict:
    """What the manifest says of a client run: the client's identity (and a local model's
    weights digest), where the requests went and how, the limits and the prices."""
    identity = client.identity()
    model = dict(identity)
    path = getattr(client, "path", None)
    if identity.get("client") == "transformers" and isinstance(path, str):
        model["weights"] = manifest.weights_digest(path)
    request = {}
    endpoint = getattr(client, "endpoint", None)
    if isinstance(endpoint, str):
        request["endpoint"] = _without_credentials(endpoint)
    # Replicas (ood_jax.eval.replicas) share every setting but the endpoint.
    endpoints = getattr(client, "endpoints", None)
    if endpoints:
        request["endpoints"] = [_without_credentials(e) for e in endpoints]
        client = client.replicas[0].client
    request.update({k: getattr(client, k) for k in _CLIENT_SETTINGS if hasattr(client, k)})
    request.update(options, max_requests=limits.max_requests, max_cost=limits.max_cost)
    return {
        "model": model,
        "request": request,
        "packages": ("transformers", "torch") if identity.get("client") == "transformers" else (),
    }


def ending(error: BaseException) -> dict:
    """The manifest's status (and its reason) for a run that `error` ended."""
    if isinstance(error, RunStopped):
        return {"status": "stopped", "reason": str(error)}
    return manifest.ending(error)
