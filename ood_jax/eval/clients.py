"""What every MLLM client takes and returns: a `Request` (the prompt and its images) and a
`Reply`, `ClientError` for a request that failed for good, and what a run's requests share: the
adaptive concurrency limit, the retry budget and the stop flag (`RunControl`). The clients:
http_client.OpenAIChatClient (an OpenAI-compatible endpoint) and local_client.TransformersClient
(a local transformers model)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import math
import threading
from typing import Any


from ood_jax.prompts import IMAGE_PLACEHOLDER

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
