"""One model served by several endpoints (`eval-mllm --endpoint URL1 --endpoint URL2 ...`): a
run's requests spread over the replicas, each with its own adaptive concurrency; a replica that
keeps failing leaves the rotation, saying so, while the others serve on."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

from ood_jax.eval.clients import ClientError, Reply, Request, RunControl
from ood_jax.eval.http_client import OpenAIChatClient

# Enough to tell a replica that is down from one that failed a request or two under load.
MAX_FAILURES = 3
# What a replica that is down answers: no connection, a timeout, an error of its own.
_DOWN_KINDS = ("connection", "timeout")


def _server_side(error: ClientError) -> bool:
    return error.kind in _DOWN_KINDS or error.kind.startswith("HTTP 5")


class Replica:
    """A replica's client, its share of the run's control and its failures in a row."""

    def __init__(self, client: OpenAIChatClient, concurrency: int):
        self.client, self.concurrency = client, concurrency
        self.control: RunControl | None = None
        self.failures, self.asked, self.in_rotation = 0, 0, True


class Replicas:
    """`clients` (one per endpoint, the same model and options) as one client of the runner."""

    accepts_run_control = True

    def __init__(self, clients: Sequence[OpenAIChatClient], concurrency: int):
        identities = {repr(sorted(c.identity().items())) for c in clients}
        if len(identities) != 1:
            raise ValueError("replicas must serve one model with the same options")
        self.replicas = [Replica(client, concurrency) for client in clients]
        self.endpoints = [client.endpoint for client in clients]
        # The runner's worker threads: every replica's limit together.
        self.concurrency_limit = concurrency * len(clients)
        self._lock = threading.Lock()
        self._turn = 0

    def identity(self) -> dict:
        return self.replicas[0].client.identity()

    def generate(self, request: Request, control: RunControl) -> Reply:
        tried: set[int] = set()
        last: ClientError | None = None
        while (replica := self._pick(control, tried)) is not None:
            tried.add(id(replica))
            try:
                reply = replica.client.generate(request, replica.control)
            except ClientError as error:
                if not _server_side(error):
                    raise
                self._failed(replica, error)
                last = error
                continue
            with self._lock:
                replica.failures = 0
            return reply
        raise last or ClientError(
            f"no replica is left in the rotation ({', '.join(self.endpoints)})", "connection"
        )

    def _pick(self, control: RunControl, tried: set[int]) -> Replica | None:
        with self._lock:
            for replica in self.replicas:
                if replica.control is None:  # the run's budget and stop flag, its own limit
                    replica.control = control.sharing(replica.concurrency)
            candidates = [r for r in self.replicas if r.in_rotation and id(r) not in tried]
            if not candidates:
                return None
            replica = max(candidates, key=lambda r: (r.control.room(), -r.asked))
            self._turn += 1
            replica.asked = self._turn
            return replica

    def _failed(self, replica: Replica, error: ClientError) -> None:
        with self._lock:
            replica.failures += 1
            if replica.failures < MAX_FAILURES or not replica.in_rotation:
                return
            replica.in_rotation = False
            serving = sum(r.in_rotation for r in self.replicas)
        print(
            f"replica {replica.client.url} left the rotation after {MAX_FAILURES} failures in a "
            f"row (the last: {error}); {serving} of {len(self.replicas)} replicas serve on",
            file=sys.stderr,
            flush=True,
        )
