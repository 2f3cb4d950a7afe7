"""MLLM clients: an OpenAI-compatible chat-completions endpoint over HTTP (`OpenAIChatClient`, on
httpx: adaptive concurrency, deadlines and a run-wide retry budget shared through a
`RunControl`; `check_model` is the preflight) and a local transformers model
(`TransformersClient`). Both take a `Request` and return what the model said (a `Reply`). How
they behave under load and keep the API key safe: docs/guide/mllm.md, "Servers"."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import difflib
import email.utils
import functools
import hashlib
import io
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

from ood_jax.prompts import IMAGE_PLACEHOLDER

# HTTP statuses worth another attempt besides 5xx (the ones OpenAI's own client retries):
# request timeout, conflict, rate limiting.
RETRYABLE_STATUSES = frozenset({408, 409, 429})
# Answers that say the server has more work than it can take (with every 5xx and a timeout):
# they lower the concurrency. A conflict (409) says nothing of load.
OVERLOAD_STATUSES = frozenset({408, 429})
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
TOKEN_PARAMS = ("max_tokens", "max_completion_tokens")
# Defaults for the hardest common case, one slow local server that generates one request at a
# time (transformers serve, llama.cpp without slots): few requests out, so little waits in the
# server's queue; a deadline a 512-token reply on a CPU meets; few attempts. Servers that batch
# (vLLM, SGLang) and hosted APIs go faster with a larger --concurrency.
DEFAULT_CONCURRENCY = 4
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_MAX_RETRY_AFTER_S = 60.0
# The listing is one small GET: a server that takes longer is busy, not missing.
PREFLIGHT_TIMEOUT_S = 30.0
# Keys of the request body the client sets from its own options; --extra-body may not hide them
# (they are part of the run's identity under their own names).
RESERVED_BODY_KEYS = frozenset({"model", "messages", "stream", "n", "temperature", *TOKEN_PARAMS})
# How often a waiting request looks at the run's stop flag: Ctrl-C is never held up longer.
POLL_S = 0.1


class ClientError(RuntimeError):
    """A request that failed for good (after retries, or at once for a non-retryable answer).

    `kind` classes the failure ("HTTP 500", "timeout", "connection", "malformed reply", ...): the
    runner stops a run after several items in a row fail with the same kind. `attempts`: how many
    were made. The runner records it as the item's failure; it never carries the API key.
    """

    def __init__(self, message: str, kind: str = "request", attempts: int = 1):
        super().__init__(message)
        self.kind, self.attempts = kind, attempts


class Abandoned(ClientError):
    """The run was stopped (Ctrl-C, or it stopped early) while this request waited."""

    def __init__(self, attempts: int = 0):
        super().__init__("abandoned: the run was stopped", "abandoned", attempts)


@dataclasses.dataclass(frozen=True)
class Reply:
    """What the server said to one request.

    `text`: the message content ("" when it was null); `finish_reason`: "stop", "length" (cut at
    the token budget), ...; `refusal`: the refusal text a model gave instead of content;
    `reasoning`: reasoning the server kept apart from the content (`reasoning_content`);
    `usage`: prompt/completion/total token counts as reported; `latency_s`: the successful
    attempt's time from sending to the whole reply; `attempts`: how many were made; `model`: the
    model id the server reports.
    """

    text: str
    finish_reason: str | None = None
    refusal: str | None = None
    reasoning: str | None = None
    usage: dict | None = None
    latency_s: float | None = None
    attempts: int = 1
    model: str | None = None

    @classmethod
    def of(cls, value: "Reply | str") -> "Reply":
        """A client's answer as a Reply; a plain string (all a client may know) is its text."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        raise TypeError(f"a client returned {type(value).__name__}, not a str or a Reply")


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One encoded image as sent: PNG or JPEG bytes."""

    data: bytes
    mime: str

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "image") -> "ImageInput":
        """Wraps encoded bytes, telling PNG from JPEG by their signature."""
        if data.startswith(b"\x89PNG\r\n\x1a\n"):
            return cls(data, "image/png")
        if data.startswith(b"\xff\xd8\xff"):
            return cls(data, "image/jpeg")
        raise ValueError(f"{where}: not a PNG or JPEG file")

    @classmethod
    def from_array(cls, pixels: Any) -> "ImageInput":
        """PNG-encodes a uint8 HxWx3 array (lossless, so the model sees exactly these pixels)."""
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return cls(buffer.getvalue(), "image/png")

    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"

    def to_pil(self):
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Request:
    """A single-turn prompt. Each "<image>" in `prompt` stands for the next image of `images`."""

    prompt: str
    images: tuple[ImageInput, ...] = ()

    def segments(self) -> list[str | ImageInput]:
        """The prompt as text pieces and images in order; empty text pieces are dropped."""
        pieces = self.prompt.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(self.images):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders but "
                f"{len(self.images)} images"
            )
        out: list[str | ImageInput] = []
        for k, text in enumerate(pieces):
            if text:
                out.append(text)
            if k < len(self.images):
                out.append(self.images[k])
        return out


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
# What a run's requests share: the concurrency limit, the retry budget, the stop flag
# ---------------------------------------------------------------------------------------------


class AdaptiveLimit:
    """AIMD concurrency: at most `limit` requests out at once, `limit` within [1, maximum].

    An overload answer (429, 408, 5xx, a timeout) halves `limit`, once per round: answers to
    requests sent before the last cut, which were sent into the same overload, do not cut it
    again. RAISE_AFTER successes in a row raise it by one. As TCP's congestion control, and as
    Inspect AI and VLMEvalKit back off on rate limits: a server that serves two requests at a
    time settles near two, whatever the maximum, and the requests it would only queue are not
    sent.

    A timeout says more: the server may still be computing the abandoned request (transformers
    serve does), and whatever is sent next queues behind it and times out in turn. So after a
    timeout one request at a time goes out, a probe, until a request sent after the timeout
    comes back: then the server has got past the abandoned work, and `limit` applies again.
    """

    # Slow to rise, so that a server at its capacity sees one overload per RAISE_AFTER replies
    # at most, yet a long run climbs back after a bad minute.
    RAISE_AFTER = 8

    def __init__(self, maximum: int):
        if maximum < 1:
            raise ValueError(f"concurrency must be at least 1, got {maximum}")
        self.maximum = self.limit = maximum
        self._out = self._successes = self._round = 0
        # Requests are numbered as they are sent; 0: no timeout waits for a later success.
        self._sent = self._timed_out = 0
        self._changed = threading.Condition()

    @property
    def allowed(self) -> int:
        """How many requests may be out now: `limit`, or 1 while a timeout is unresolved."""
        return 1 if self._timed_out else self.limit

    @property
    def room(self) -> int:
        """How many more requests may go out now."""
        return self.allowed - self._out

    def acquire(self, stop: threading.Event) -> tuple[int, int]:
        """Waits for a free slot; returns the ticket `release` takes (round, request number)."""
        with self._changed:
            while self._out >= self.allowed:
                if stop.is_set():
                    raise Abandoned()
                self._changed.wait(POLL_S)
            self._out += 1
            self._sent += 1
            return self._round, self._sent

    def release(self, ticket: tuple[int, int], outcome: str) -> None:
        """`outcome`: "success", "overload", "timeout", or "other" (a failure that says nothing
        of load)."""
        taken_in, number = ticket
        with self._changed:
            self._out -= 1
            if outcome in ("overload", "timeout"):
                self._successes = 0
                if outcome == "timeout":
                    self._timed_out = max(self._timed_out, number)
                if taken_in == self._round:
                    self.limit = max(1, self.limit // 2)
                    self._round += 1
            elif outcome == "success":
                if number > self._timed_out:
                    self._timed_out = 0
                self._successes += 1
                if self._successes >= self.RAISE_AFTER and self.limit < self.maximum:
                    self.limit += 1
                    self._successes = 0
            self._changed.notify_all()


class RetryBudget:
    """The retries a run may make in all, beyond each item's first attempt.

    `total`: a fixed number. None: BASE, plus PER_ITEM for every item asked so far, so that a
    long run may ride out a server's bad minutes while a server that fails every request costs
    a few retries, not `max_attempts` per item.
    """

    BASE = 10
    PER_ITEM = 0.25

    def __init__(self, total: int | None = None):
        if total is not None and total < 0:
            raise ValueError(f"retry budget must be non-negative, got {total}")
        self.total = total
        self.spent = 0
        self._allowed = float(self.BASE if total is None else total)
        self._lock = threading.Lock()

    def item_started(self) -> None:
        if self.total is None:
            with self._lock:
                self._allowed += self.PER_ITEM

    def take(self) -> bool:
        """Spends one retry; False when none is left."""
        with self._lock:
            if self.spent + 1 > self._allowed:
                return False
            self.spent += 1
            return True

    def describe(self) -> str:
        if self.total is None:
            return (
                f"{self.spent} retries, the default budget of {self.BASE} plus one per "
                f"{round(1 / self.PER_ITEM)} items asked"
            )
        return f"{self.spent} retries, the --retry-budget"


class RunControl:
    """What the requests of one run share: the adaptive concurrency limit (none when
    `concurrency` is None), the retry budget and the stop flag that `abandon` sets."""

    def __init__(self, concurrency: int | None = None, retry_budget: int | None = None):
        self.limit = AdaptiveLimit(concurrency) if concurrency is not None else None
        self.budget = RetryBudget(retry_budget)
        self.stop = threading.Event()

    def abandon(self) -> None:
        """Every request of the run gives up at its next wait (within POLL_S)."""
        self.stop.set()

    def sharing(self, concurrency: int) -> "RunControl":
        """A control with a concurrency limit of its own (one replica's) that spends this one's
        retry budget and stops with it."""
        shared = RunControl(concurrency)
        shared.budget, shared.stop = self.budget, self.stop
        return shared

    def room(self) -> float:
        """How many more requests may go out now (unbounded without a limit)."""
        return self.limit.room if self.limit is not None else math.inf

    def acquire(self) -> tuple[int, int]:
        if self.stop.is_set():
            raise Abandoned()
        return self.limit.acquire(self.stop) if self.limit is not None else (0, 0)

    def release(self, ticket: tuple[int, int], outcome: str) -> None:
        if self.limit is not None:
            self.limit.release(ticket, outcome)

    def wait(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Abandoned()


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


class TransformersClient:
    """A local transformers LVLM: the processor's chat template, greedy decoding.

    `path` is a directory saved with save_pretrained holding the model and its processor
    (tokenizer, image processor, chat template). Images go to the processor in placeholder
    order, and the model reads each where the prompt puts it: where the chat template would
    move images ahead of the text (LLaVA-1.5's does), a turn with an image after text is
    rendered with the model's image token at each placeholder instead, or refused with a message
    naming the model and `task` (ood_jax.eval.interleaving.LocalPrompts). Not thread-safe: the
    runner calls it from one thread (the model already uses every core).
    """

    concurrency_limit = 1

    def __init__(
        self,
        path: str,
        max_new_tokens: int = 10,
        device: str | None = None,
        dtype: str = "auto",
        task: str | None = None,
    ):
        try:
            import torch
            import transformers
        except ImportError as e:
            raise ImportError(f"the local client needs PyTorch and transformers: {e}") from None
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such model directory")
        self.path = path
        self.max_new_tokens = int(max_new_tokens)
        self._torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        else:
            torch_dtype = getattr(torch, dtype)
        self.processor = transformers.AutoProcessor.from_pretrained(path, local_files_only=True)
        # Imported here, as torch and transformers are: only the local client needs it.
        from ood_jax.eval import interleaving

        # Before the weights load: a template that cannot be used fails at once.
        self.prompts = interleaving.LocalPrompts(self.processor, path, task)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype
        ).to(self.device)
        self.model.eval()

    def identity(self) -> dict:
        return {
            "client": "transformers",
            "model": os.path.abspath(self.path),
            "max_new_tokens": self.max_new_tokens,
            **self.prompts.identity(),
        }

    def inputs(self, request: Request):
        """The processor's tensors for `request`: one user turn, its images in place."""
        text = self.prompts.render(request)
        images = [image.to_pil() for image in request.images]
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        # Only floating tensors (pixel values) take the model's dtype; token ids stay integers.
        return inputs.to(self.device).to(self.model.dtype)

    def generate(self, request: Request) -> Reply:
        started = time.monotonic()
        inputs = self.inputs(request)
        with self._torch.inference_mode():
            output = self.model.generate(
                **inputs, do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens
            )
        prompt_tokens = int(inputs["input_ids"].shape[1])
        new_tokens = output[:, prompt_tokens:]
        completion_tokens = int(new_tokens.shape[1])
        # Cut at the budget unless the last token ended the reply, as a server's "length" says.
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        truncated = completion_tokens == self.max_new_tokens and int(output[0, -1]) not in eos
        return Reply(
            self.processor.batch_decode(new_tokens, skip_special_tokens=True)[0].strip(),
            finish_reason="length" if truncated else "stop",
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            latency_s=round(time.monotonic() - started, 3),
            attempts=1,
            model=os.path.abspath(self.path),
        )
