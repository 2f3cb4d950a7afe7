"""MLLM clients: an OpenAI-compatible chat-completions endpoint over HTTP, or a local transformers
model. Both take a `Request` (a prompt with "<image>" placeholders and its images) and return the
reply text.

The HTTP client uses only the standard library. It contacts nothing but the endpoint it is given:
proxy settings in the environment are ignored and redirects are refused. The API key comes from an
environment variable; it is sent as a Bearer header and kept out of every message this module
produces, so it cannot reach a log or a predictions file.
"""

from __future__ import annotations

import base64
import dataclasses
import email.utils
import hashlib
import http.client
import io
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from ood_jax.prompts import IMAGE_PLACEHOLDER

# HTTP statuses worth another attempt besides 5xx (the ones OpenAI's own client retries):
# request timeout, conflict, rate limiting.
RETRYABLE_STATUSES = frozenset({408, 409, 429})
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"


class ClientError(RuntimeError):
    """A request that failed for good (after retries, or at once for a non-retryable answer).

    The runner records it as the item's failure; it never carries the API key.
    """


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


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect would send the request, and its key, to an address the user did not give."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(
            req.full_url, code, f"redirect to {newurl} refused", headers, fp
        )


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds: either a number or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclasses.dataclass
class OpenAIChatClient:
    """POST {endpoint}/chat/completions with temperature 0, one user turn per request.

    Images are base64 data URLs in `image_url` parts, interleaved with the text at the prompt's
    placeholders. A 408/409/429 or 5xx answer, a refused or dropped connection and a timeout are
    retried up to `max_attempts` in all, waiting an exponential backoff with jitter, or the
    server's Retry-After when that is longer; any other answer fails at once. Thread-safe:
    the runner calls `generate` from `concurrency` threads.
    """

    endpoint: str
    model: str
    max_tokens: int = 16
    api_key_env: str = DEFAULT_API_KEY_ENV
    timeout_s: float = 120.0
    max_attempts: int = 6
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    # Injected in tests so that backoff is observed rather than waited for.
    sleep: Callable[[float], None] = time.sleep
    seed: int | None = None

    def __post_init__(self):
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self.url = self.endpoint.rstrip("/") + "/chat/completions"
        self._api_key = os.environ.get(self.api_key_env) or None
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), _RefuseRedirects()
        )
        self._rng = random.Random(self.seed)
        self._rng_lock = threading.Lock()

    @property
    def has_api_key(self) -> bool:
        return self._api_key is not None

    def identity(self) -> dict:
        """What makes two runs' replies comparable (never the key; the endpoint may move)."""
        return {"client": "openai", "model": self.model, "max_tokens": self.max_tokens}

    def payload(self, request: Request) -> dict:
        content = [
            {"type": "text", "text": part}
            if isinstance(part, str)
            else {"type": "image_url", "image_url": {"url": part.data_url()}}
            for part in request.segments()
        ]
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": self.max_tokens,
        }

    def generate(self, request: Request) -> str:
        body = json.dumps(self.payload(request)).encode()
        last = "no attempt made"
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self._post(body)
            except _Retryable as e:
                last = str(e)
                if attempt == self.max_attempts:
                    break
                self.sleep(self._delay(attempt, e.retry_after))
        raise ClientError(f"gave up after {self.max_attempts} attempts; last error: {last}")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        ceiling = min(self.backoff_cap_s, self.backoff_base_s * 2 ** (attempt - 1))
        with self._rng_lock:
            # "Equal jitter": at least half the backoff, so retries never bunch up at zero.
            backoff = ceiling / 2 + self._rng.uniform(0, ceiling / 2)
        return backoff if retry_after is None else max(backoff, retry_after)

    def _post(self, body: bytes) -> str:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = _redact(e.read()[:300].decode("utf-8", "replace"), self._api_key)
            message = f"HTTP {e.code} from {self.url}: {detail or e.reason}"
            if e.code in RETRYABLE_STATUSES or e.code >= 500:
                retry_after = _retry_after_seconds(e.headers.get("Retry-After"))
                raise _Retryable(message, retry_after) from None
            raise ClientError(message) from None
        except urllib.error.URLError as e:
            raise _Retryable(f"cannot reach {self.url}: {e.reason}") from None
        except (TimeoutError, socket.timeout) as e:
            raise _Retryable(f"timed out after {self.timeout_s} s: {e}") from None
        except (ConnectionError, http.client.HTTPException) as e:
            raise _Retryable(f"connection to {self.url} failed: {e!r}") from None
        return self._reply_text(raw)

    def _reply_text(self, raw: bytes) -> str:
        try:
            data = json.loads(raw)
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            preview = _redact(raw[:300].decode("utf-8", "replace"), self._api_key)
            raise ClientError(f"{self.url} sent no chat completion: {preview!r}") from None
        if content is None:
            return ""
        if isinstance(content, list):  # some servers answer with content parts
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ClientError(f"{self.url}: message content is {type(content).__name__}")
        return content


class TransformersClient:
    """A local transformers LVLM: the processor's chat template, greedy decoding.

    `path` is a directory saved with save_pretrained holding the model and its processor
    (tokenizer, image processor, chat template). Images go to the processor in placeholder
    order, each at its place in the user turn. Not thread-safe: the runner calls it from one
    thread (the model already uses every core).
    """

    concurrency_limit = 1

    def __init__(
        self, path: str, max_new_tokens: int = 10, device: str | None = None, dtype: str = "auto"
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
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype
        ).to(self.device)
        self.model.eval()

    def identity(self) -> dict:
        return {
            "client": "transformers",
            "model": os.path.abspath(self.path),
            "max_new_tokens": self.max_new_tokens,
        }

    def inputs(self, request: Request):
        """The processor's tensors for `request` (the chat template applied to one user turn)."""
        content, images = [], []
        for part in request.segments():
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
            else:
                content.append({"type": "image"})
                images.append(part.to_pil())
        messages = [{"role": "user", "content": content}]
        text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        # Only floating tensors (pixel values) take the model's dtype; token ids stay integers.
        return inputs.to(self.device).to(self.model.dtype)

    def generate(self, request: Request) -> str:
        inputs = self.inputs(request)
        with self._torch.inference_mode():
            output = self.model.generate(
                **inputs, do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens
            )
        new_tokens = output[:, inputs["input_ids"].shape[1] :]
        return self.processor.batch_decode(new_tokens, skip_special_tokens=True)[0].strip()
