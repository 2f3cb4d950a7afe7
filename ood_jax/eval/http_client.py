"""The OpenAI-compatible chat-completions client (`OpenAIChatClient`), on httpx: adaptive
concurrency, deadlines and a run-wide retry budget shared through a `clients.RunControl`;
`check_model` is the preflight. How it behaves under load and keeps the API key safe:
docs/guide/mllm.md, "Servers"."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import difflib
import email.utils
import functools
import ipaddress
import json
import math
import os
import random
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import httpx


from ood_jax.eval.clients import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_RETRY_AFTER_S,
    DEFAULT_TIMEOUT_S,
    POLL_S,
    TOKEN_PARAMS,
    Abandoned,
    ClientError,
    Reply,
    Request,
    RunControl,
)

# HTTP statuses worth another attempt besides 5xx (the ones OpenAI's own client retries):
# request timeout, conflict, rate limiting.
RETRYABLE_STATUSES = frozenset({408, 409, 429})
# Answers that say the server has more work than it can take (with every 5xx and a timeout):
# they lower the concurrency. A conflict (409) says nothing of load.
OVERLOAD_STATUSES = frozenset({408, 429})

# The listing is one small GET: a server that takes longer is busy, not missing.
PREFLIGHT_TIMEOUT_S = 30.0
# Keys of the request body the client sets from its own options; --extra-body may not hide them
# (they are part of the run's identity under their own names).
RESERVED_BODY_KEYS = frozenset({"model", "messages", "stream", "n", "temperature", *TOKEN_PARAMS})


def _redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds: either a number or an HTTP date."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# ---------------------------------------------------------------------------------------------
# The OpenAI-compatible HTTP client
# ---------------------------------------------------------------------------------------------

# Idle pooled connections are dropped sooner than servers close them (uvicorn, under vLLM and
# transformers serve, after 5 s), so a request is not sent down a connection the server is
# closing at that moment: that fails as a dropped connection and costs a retry.
KEEPALIVE_S = 2.0


class _Failure(Exception):
    """One attempt's failure: its class, and whether another attempt may help."""

    def __init__(
        self,
        message: str,
        kind: str,
        retryable: bool,
        overload: bool = False,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.kind, self.retryable, self.overload = kind, retryable, overload
        self.retry_after = retry_after

    @property
    def load(self) -> str:
        """What the failure says of the server's load (AdaptiveLimit.release's outcome)."""
        if self.kind == "timeout":
            return "timeout"
        return "overload" if self.overload else "other"


class _EventLoop:
    """One asyncio loop, on a daemon thread, that carries every client's requests.

    The thread that asks waits for its request in short steps, so that at its deadline or once
    the run stops it cancels the request, which closes the connection at once, instead of
    sitting in a socket read until the server answers.
    """

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        with self._lock:
            if self._loop is None:
                # A daemon: requests still out when the program ends do not hold it up.
                loop = self._loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="ood-jax-http", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)


_EVENT_LOOP = _EventLoop()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The system's trust store, loaded once (~40 ms) and shared by every client."""
    return ssl.create_default_context()


def _http_client(api_key: str | None) -> httpx.AsyncClient:
    """An httpx client that goes where its requests say and nowhere else."""
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return httpx.AsyncClient(
        headers=headers,
        # A proxy named in the environment would receive every request, and the key.
        trust_env=False,
        # A redirect would carry the key elsewhere: a 3xx answer is an error instead.
        follow_redirects=False,
        verify=_tls_context(),
        # The deadline is the caller's own, from sending to the whole reply (`_exchange`).
        timeout=None,
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
    )


def _endpoint_parts(endpoint: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint must be an http(s) URL, got {endpoint!r}")
    try:
        _ = parts.port  # parsed on access
    except ValueError:
        raise ValueError(f"endpoint {endpoint!r}: bad port") from None
    return parts


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: a host whose traffic never leaves this machine."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_tls(error: BaseException | None) -> bool:
    """Whether an ssl.SSLError is behind `error` (httpx's wraps httpcore's, which wraps it)."""
    while error is not None and not isinstance(error, ssl.SSLError):
        error = error.__cause__ or error.__context__
    return error is not None


def _connection_failure(url: str, error: httpx.RequestError) -> _Failure:
    """A request the server never answered: TLS failed (not retried), or the connection did
    (refused, reset, dropped; retried)."""
    detail = str(error) or type(error).__name__
    if _is_tls(error):
        return _Failure(f"TLS with {url} failed: {detail}", "TLS", retryable=False)
    if isinstance(error, httpx.ConnectError):
        return _Failure(f"cannot reach {url}: {detail}", "connection", retryable=True)
    return _Failure(f"connection to {url} failed: {detail}", "connection", retryable=True)


def _text_of(content: Any) -> str | None:
    """A message's content as text (None: not a content a chat completion has)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # some servers answer with content parts
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return None


def _optional_text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _usage(usage: Any) -> dict | None:
    """The token counts of a reply's `usage`, those that are integers."""
    if not isinstance(usage, dict):
        return None
    out = {
        k: usage[k]
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        if isinstance(usage.get(k), int)
    }
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
        out["reasoning_tokens"] = details["reasoning_tokens"]
    return out or None


def _model_ids(raw: bytes) -> list[str] | None:
    """The ids of a GET /models answer ({"data": [{"id": ...}]}); None: not such an answer."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    listed = data.get("data") if isinstance(data, dict) else None
    if not isinstance(listed, list):
        return None
    return [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]


def check_extra_body(extra_body: Any) -> dict:
    """--extra-body as merged into each request: a JSON object that leaves the client's own
    keys alone (they are options of their own, and part of the run's identity)."""
    if not isinstance(extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {type(extra_body).__name__}")
    reserved = sorted(RESERVED_BODY_KEYS & extra_body.keys())
    if reserved:
        raise ValueError(
            f"--extra-body may not set {', '.join(reserved)}: the client sets them "
            "(--model, --max-tokens, --token-param, --temperature)"
        )
    return extra_body


@dataclasses.dataclass
class OpenAIChatClient:
    """POST {endpoint}/chat/completions, one user turn per request; returns a `Reply`.

    Images are base64 data URLs in `image_url` parts, interleaved with the text at the prompt's
    placeholders. The body has `temperature` (omitted when None), the budget under
    `token_param` (max_tokens, or max_completion_tokens for o-series style models) and
    `extra_body` merged in. `timeout_s` bounds each attempt, from sending to the whole reply.
    A 408/409/429 or 5xx answer, a timeout, a dropped connection and a reply that is no chat
    completion are retried, up to `max_attempts` in all and while the run's retry budget lasts,
    waiting an exponential backoff with jitter, or the server's Retry-After when that is longer
    (and at most `max_retry_after_s`); any other answer ends the item at once. Thread-safe: the
    runner calls `generate` from several threads with one `RunControl`.

    The API key goes over plain http:// only to a loopback host, unless `allow_plain_http_key`:
    anywhere else anyone on the path could read it.
    """

    # The runner hands `generate` the run's RunControl.
    accepts_run_control: ClassVar[bool] = True

    endpoint: str
    model: str
    max_tokens: int = 16
    api_key_env: str = DEFAULT_API_KEY_ENV
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    max_retry_after_s: float = DEFAULT_MAX_RETRY_AFTER_S
    token_param: str = "max_tokens"
    temperature: float | None = 0
    extra_body: dict | None = None
    # Injected in tests so that backoff is observed rather than waited for; None waits on the
    # run's stop flag, so that Ctrl-C ends a backoff at once.
    sleep: Callable[[float], None] | None = None
    seed: int | None = None
    allow_plain_http_key: bool = False
    # What deadlines and latencies are measured with; injected in tests, so that a deadline
    # passes when the test says, not when a loaded machine happens to be slow.
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self):
        parts = _endpoint_parts(self.endpoint)
        self._check_options()
        self.extra_body = check_extra_body(self.extra_body if self.extra_body is not None else {})
        # What requests go to and messages name: no user, password or query (where keys hide).
        host = parts.netloc.rpartition("@")[2]
        self._base = urllib.parse.urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))
        self.url = self._base + "/chat/completions"
        self._api_key = os.environ.get(self.api_key_env) or None
        # Over plain http:// anyone on the path reads the key; loopback traffic has no path.
        readable = parts.scheme == "http" and not _is_loopback(parts.hostname)
        if self._api_key and readable and not self.allow_plain_http_key:
            raise ValueError(
                f"endpoint {self._base}: the API key in ${self.api_key_env} would travel "
                "unencrypted over http:// to a host that is not loopback; use https://, or "
                "allow it explicitly (eval-mllm --allow-plain-http-key; "
                "allow_plain_http_key=True here)"
            )
        # httpx clients not in use, the last used last. Each serves one request at a time:
        # httpcore's pool does bookkeeping quadratic in its connections on every request (1.0),
        # which at 32 connections costs more than a loopback request. Only the event loop's
        # thread touches the list.
        self._idle: list[httpx.AsyncClient] = []
        self._rng = random.Random(self.seed)
        self._rng_lock = threading.Lock()
        # Calls made without a run's control share this one: no concurrency limit of its own
        # (the caller's threads are the limit), the default retry budget.
        self._standalone = RunControl()

    def _check_options(self) -> None:
        for name, value, least in (
            ("max_attempts", self.max_attempts, 1),
            ("max_tokens", self.max_tokens, 1),
        ):
            if value < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if not self.max_retry_after_s >= 0:
            raise ValueError(
                f"max_retry_after_s must be non-negative, got {self.max_retry_after_s}"
            )
        if self.token_param not in TOKEN_PARAMS:
            raise ValueError(f"token_param must be one of {TOKEN_PARAMS}, got {self.token_param!r}")
        if self.temperature is not None and not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a non-negative number, got {self.temperature}")

    @property
    def has_api_key(self) -> bool:
        return self._api_key is not None

    def identity(self) -> dict:
        """What makes two runs' replies comparable (never the key; the endpoint may move)."""
        return {
            "client": "openai",
            "model": self.model,
            "max_tokens": self.max_tokens,
            "token_param": self.token_param,
            "temperature": self.temperature,
            "extra_body": self.extra_body,
        }

    def payload(self, request: Request) -> dict:
        content = [
            {"type": "text", "text": part}
            if isinstance(part, str)
            else {"type": "image_url", "image_url": {"url": part.data_url()}}
            for part in request.segments()
        ]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        body[self.token_param] = self.max_tokens
        return {**body, **self.extra_body}

    # --- a request -----------------------------------------------------------------------------

    def generate(self, request: Request, control: RunControl | None = None) -> Reply:
        control = control or self._standalone
        body = json.dumps(self.payload(request)).encode()
        control.budget.item_started()
        for attempt in range(1, self.max_attempts + 1):
            ticket = control.acquire()
            # The deadline starts once a slot is taken: waiting for one is not the server's time.
            started, outcome = self.clock(), "other"
            try:
                reply = self._attempt(body, control.stop)
                outcome = "success"
            except _Failure as failure:
                outcome = failure.load
                last = failure
            except Abandoned:
                raise Abandoned(attempt) from None
            finally:
                control.release(ticket, outcome)
            if outcome == "success":
                latency = round(self.clock() - started, 3)
                return dataclasses.replace(reply, latency_s=latency, attempts=attempt)
            self._wait_to_retry(last, attempt, control)
        raise AssertionError("unreachable: the last attempt's failure raises")

    def _wait_to_retry(self, failure: _Failure, attempt: int, control: RunControl) -> None:
        """Waits before the next attempt, or raises the ClientError that ends the item."""

        def give_up(why: str = "") -> ClientError:
            if attempt == 1 and not why:
                return ClientError(str(failure), failure.kind, attempt)
            attempts = f"{attempt} attempt{'s' if attempt > 1 else ''}"
            return ClientError(
                f"gave up after {attempts}{why}; last error: {failure}", failure.kind, attempt
            )

        if not failure.retryable:
            raise give_up()
        if failure.retry_after is not None and failure.retry_after > self.max_retry_after_s:
            raise ClientError(
                f"{failure}; the server asks to wait {failure.retry_after:g} s before a retry "
                f"(Retry-After), more than the {self.max_retry_after_s:g} s cap "
                "(--max-retry-after): not retried in this run",
                failure.kind,
                attempt,
            )
        if attempt == self.max_attempts:
            raise give_up()
        delay = self._delay(attempt, failure.retry_after)
        if not control.budget.take():
            raise give_up(f": the run's retry budget is spent ({control.budget.describe()})")
        if self.sleep is not None:
            self.sleep(delay)
        else:
            control.wait(delay)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        ceiling = min(self.backoff_cap_s, self.backoff_base_s * 2 ** (attempt - 1))
        with self._rng_lock:
            # "Equal jitter": at least half the backoff, so retries never bunch up at zero.
            backoff = ceiling / 2 + self._rng.uniform(0, ceiling / 2)
        return backoff if retry_after is None else max(backoff, retry_after)

    def _attempt(self, body: bytes, stop: threading.Event) -> Reply:
        response = self._exchange("POST", "/chat/completions", body, self.timeout_s, stop)
        status = response.status_code
        if 300 <= status < 400:
            where = response.headers.get("Location", "elsewhere")
            raise _Failure(
                f"HTTP {status} from {self.url}: redirect to {where} refused",
                f"HTTP {status}",
                retryable=False,
            )
        if status >= 400:
            detail = self._preview(response.content)
            raise _Failure(
                f"HTTP {status} from {self.url}: {detail or _reason(status)}",
                f"HTTP {status}",
                retryable=status in RETRYABLE_STATUSES or status >= 500,
                overload=status in OVERLOAD_STATUSES or status >= 500,
                retry_after=_retry_after_seconds(response.headers.get("Retry-After")),
            )
        return self._read_reply(response.content)

    def _preview(self, raw: bytes) -> str:
        """The start of what the server sent, for a message: never the key, even echoed."""
        return _redact(raw[:300].decode("utf-8", "replace"), self._api_key)

    def _read_reply(self, raw: bytes) -> Reply:
        try:
            data = json.loads(raw)
            choice = data["choices"][0]
            message = choice["message"]
            text = _text_of(message["content"] if "content" in message else None)
        except (ValueError, KeyError, IndexError, TypeError):
            text = data = None
        if text is None:
            raise _Failure(
                f"{self.url} sent no chat completion: {self._preview(raw)!r}",
                "malformed reply",
                retryable=True,
            )
        return Reply(
            text,
            finish_reason=_optional_text(choice.get("finish_reason")),
            refusal=_optional_text(message.get("refusal")),
            reasoning=_optional_text(message.get("reasoning_content"))
            or _optional_text(message.get("reasoning")),
            usage=_usage(data.get("usage")),
            model=_optional_text(data.get("model")),
        )

    def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | None,
        timeout_s: float,
        stop: threading.Event | None = None,
    ) -> httpx.Response:
        """One request and the server's whole answer within `timeout_s` by `clock`. Raises
        Abandoned once `stop` is set, _Failure when the deadline passes or no answer comes."""
        url = self._base + path
        deadline = self.clock() + timeout_s
        future = _EVENT_LOOP.submit(self._send(method, url, body))
        try:
            while True:
                if stop is not None and stop.is_set():
                    raise Abandoned()
                left = deadline - self.clock()
                # Short waits: Ctrl-C is never held up longer than POLL_S.
                done, _ = concurrent.futures.wait([future], timeout=max(0.0, min(left, POLL_S)))
                if done:
                    response, answered = future.result()
                    if answered < deadline:
                        return response
                if done or left <= 0:
                    # Retried, but the run's AdaptiveLimit sends one probe at a time until the
                    # server shows it got past this request, which it may still be computing.
                    raise _Failure(
                        f"no reply from {url} within {timeout_s:g} s",
                        "timeout",
                        retryable=True,
                        overload=True,
                    )
        except httpx.RequestError as e:
            raise _connection_failure(url, e) from None
        finally:
            # A request given up on is cancelled, which closes its connection (a no-op once
            # answered).
            future.cancel()

    async def _send(
        self, method: str, url: str, body: bytes | None
    ) -> tuple[httpx.Response, float]:
        """The server's whole answer, and when it came by `clock`: read on the event loop, so
        that a deadline does not depend on when the asking thread next looks."""
        headers = {"Content-Type": "application/json"} if body is not None else None
        # The one used last: its connection is the likeliest to be kept alive.
        http = self._idle.pop() if self._idle else _http_client(self._api_key)
        try:
            response = await http.request(method, url, content=body, headers=headers)
        finally:
            self._idle.append(http)
        return response, self.clock()

    def post_json(self, path: str, body: dict) -> tuple[int, Any]:
        """One POST of `body` to {endpoint}{path}, not retried: (HTTP status, the decoded JSON
        or None). Raises ClientError when the server cannot be reached or does not answer
        within `timeout_s`. For requests besides chat completions (the interleaving probe)."""
        try:
            response = self._exchange("POST", path, json.dumps(body).encode(), self.timeout_s)
        except _Failure as failure:
            raise ClientError(str(failure), failure.kind) from None
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, None

    # --- the preflight -------------------------------------------------------------------------

    def check_model(self) -> str | None:
        """GET {endpoint}/models before a run: the model must be listed.

        Raises ClientError when the server cannot be reached, refuses the key, or lists models
        without this one (the message names the listed ones and the closest). Returns a note
        when the server cannot tell (no such route, an empty or odd list), None when listed.
        """
        url = self._base + "/models"
        limit = min(self.timeout_s, PREFLIGHT_TIMEOUT_S)
        unchecked = f"the model name {self.model!r} is not checked"
        try:
            response = self._exchange("GET", "/models", None, limit)
        except _Failure as failure:
            if failure.kind == "timeout":
                return f"{url} did not answer within {limit:g} s; {unchecked}"
            hint = ""
            if failure.kind == "connection":
                hint = (
                    "; is the server running, and is --endpoint its base URL (such as "
                    "http://127.0.0.1:8000/v1)?"
                )
            raise ClientError(f"{failure}{hint}", failure.kind) from None
        status = response.status_code
        if status in (401, 403):
            raise ClientError(
                f"HTTP {status} from {url}: the server refuses the API key "
                f"{'in $' + self.api_key_env if self._api_key else '(none sent)'}; "
                "see --api-key-env",
                f"HTTP {status}",
            )
        if status in (404, 405, 501):
            return f"{url} answers HTTP {status}: the server lists no models; {unchecked}"
        if status != 200:
            return f"{url} answers HTTP {status}; {unchecked}"
        ids = _model_ids(response.content)
        if ids is None:
            return f"{url} sent no model list; {unchecked}"
        if not ids:
            return f"{url} lists no models; {unchecked}"
        # Ollama lists "llava:latest" and serves it as "llava".
        if self.model in ids or f"{self.model}:latest" in ids:
            return None
        raise ClientError(self._not_listed(ids), "model not listed")

    def _not_listed(self, ids: list[str]) -> str:
        by_lower = {i.lower(): i for i in ids}
        close = difflib.get_close_matches(self.model.lower(), list(by_lower), n=1, cutoff=0.5)
        hint = f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
        shown = ", ".join(repr(i) for i in ids[:20])
        more = f" and {len(ids) - 20} more" if len(ids) > 20 else ""
        return (
            f"model {self.model!r} is not served by {self._base}{hint}; it lists {shown}{more} "
            "(--model must be one of them; a server that loads models on demand, as "
            "transformers serve does a local path, may list a model only once it is loaded: "
            "--no-model-check skips this check)"
        )


def _reason(status: int) -> str:
    return httpx.codes.get_reason_phrase(status) or "no detail"
