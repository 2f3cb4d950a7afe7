"""The MLLM clients: the OpenAI-compatible HTTP client against a chat-completions server started
here on 127.0.0.1, and the local transformers client against a greedy loop written here, on a
tiny random-weight LLaVA built offline."""

from __future__ import annotations

import base64
import http.server
import io
import json
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image

from ood_jax.eval import local_client, store
from ood_jax.eval.clients import ClientError, ImageInput, Request
from ood_jax.eval.http_client import OpenAIChatClient

KEY_ENV = "OOD_JAX_TEST_API_KEY"
KEY = "sk-test-0123456789-secret"
# How long a test waits on an event that should come at once: it fails a wedged test only.
HANG_S = 60


class Clock:
    """A clock for OpenAIChatClient(clock=...) that moves only when a test moves it, so that a
    deadline passes when the test says, however slow the machine is."""

    def __init__(self):
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def completion(text: str) -> dict:
    return {"id": "x", "object": "chat.completion", "choices": [{"message": {"content": text}}]}


def prompt_text(body: dict) -> str:
    """The user turn's text parts, joined: what a deterministic test server answers from."""
    return "".join(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")


def image_parts(body: dict) -> list[bytes]:
    urls = [p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] != "text"]
    return [base64.b64decode(url.split(",", 1)[1]) for url in urls]


class ChatServer:
    """An OpenAI-compatible /v1/chat/completions server on 127.0.0.1, in a thread.

    `respond(body, attempt)` -> (status, headers, payload dict or bytes); `attempt` counts the
    requests seen with the same body (1 for the first). Every request is kept in `requests` as
    (path, headers, body); `max_active` is the most requests it was answering at once.
    GET /v1/models lists `models` ({"data": [{"id": ...}]}); with `models` None it is a 404,
    as on a server without the route. A slow `respond` waits on `closing`, which is set when
    the server shuts down, and a client that hung up is no error.
    """

    def __init__(self, respond, models: list[str] | None = None):
        self.respond, self.models = respond, models
        self.requests: list[tuple[str, dict, dict]] = []
        self.model_queries = 0
        self.active = self.max_active = 0
        self.closing = threading.Event()
        self._attempts: dict[bytes, int] = {}
        self._lock = threading.Lock()

    @property
    def hits(self) -> int:
        return len(self.requests)

    def __enter__(self) -> "ChatServer":
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                with server._lock:
                    server.model_queries += 1
                if self.path != "/v1/models" or server.models is None:
                    self._send(404, {}, {"detail": "Not Found"})
                    return
                listed = [{"id": m, "object": "model"} for m in server.models]
                self._send(200, {}, {"object": "list", "data": listed})

            def do_POST(self):
                length = int(self.headers["Content-Length"])
                raw = self.rfile.read(length)
                if len(raw) < length:  # the client hung up before its body (a run stopping)
                    return
                body = json.loads(raw)
                with server._lock:
                    server.requests.append((self.path, dict(self.headers), body))
                    server._attempts[raw] = server._attempts.get(raw, 0) + 1
                    attempt = server._attempts[raw]
                    server.active += 1
                    server.max_active = max(server.max_active, server.active)
                try:
                    status, headers, payload = server.respond(body, attempt)
                finally:
                    with server._lock:
                        server.active -= 1
                self._send(status, headers, payload)

            def _send(self, status, headers, payload):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this request (a timeout, Ctrl-C)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # A short poll: shutdown waits for it, and the tests start hundreds of servers.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.closing.set()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"


def _png(seed: int, size=(5, 7)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return ImageInput.from_array(pixels).data


def _jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (6, 4, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


def _client(server_url: str, sleeps: list | None = None, **kwargs) -> OpenAIChatClient:
    kwargs.setdefault("max_attempts", 4)
    kwargs.setdefault("backoff_base_s", 0.01)
    return OpenAIChatClient(
        server_url,
        "test-model",
        api_key_env=KEY_ENV,
        sleep=(sleeps.append if sleeps is not None else time.sleep),
        seed=0,
        **kwargs,
    )


# --- requests ------------------------------------------------------------------------------------


def test_payload_interleaves_images_at_placeholders():
    first, second = _png(1), _jpeg(2)
    request = Request("Examples: <image> is (A).\nFinal: <image>\nWhich?", (
        ImageInput.from_bytes(first), ImageInput.from_bytes(second)))  # fmt: skip
    client = OpenAIChatClient("http://127.0.0.1:9/v1", "m", max_tokens=7)
    payload = client.payload(request)
    assert payload["model"] == "m"
    assert payload["temperature"] == 0
    assert payload["max_tokens"] == 7
    parts = payload["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text", "image_url", "text"]
    assert [p["text"] for p in parts if p["type"] == "text"] == [
        "Examples: ",
        " is (A).\nFinal: ",
        "\nWhich?",
    ]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert urls[0].startswith("data:image/png;base64,")
    assert urls[1].startswith("data:image/jpeg;base64,")
    assert image_parts(payload) == [first, second]
    # An image-first prompt sends no empty text part.
    lead = Request("<image>Which?", (ImageInput.from_bytes(first),))
    assert [p["type"] for p in client.payload(lead)["messages"][0]["content"]] == [
        "image_url",
        "text",
    ]
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 images"):
        client.payload(Request("<image><image>", (ImageInput.from_bytes(first),)))


def test_png_from_array_is_lossless_and_bad_bytes_fail():
    pixels = np.random.default_rng(3).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    image = ImageInput.from_array(pixels)
    assert np.array_equal(np.asarray(image.to_pil()), pixels)
    with pytest.raises(ValueError, match="item 7 image 0: not a PNG or JPEG"):
        ImageInput.from_bytes(b"GIF89a....", "item 7 image 0")


# --- retries -------------------------------------------------------------------------------------


def test_retries_rate_limits_and_server_errors_honouring_retry_after(api_key):
    script = {1: (429, {"Retry-After": "3"}), 2: (503, {}), 3: (500, {})}

    def respond(body, attempt):
        if attempt in script:
            status, headers = script[attempt]
            return status, headers, {"error": "busy"}
        return 200, {}, completion(f"echo {prompt_text(body)}")

    sleeps: list[float] = []
    with ChatServer(respond) as server:
        reply = _client(server.url, sleeps).generate(Request("hello"))
    assert reply.text == "echo hello" and reply.attempts == 4
    assert server.hits == 4
    assert all(path == "/v1/chat/completions" for path, _, _ in server.requests)
    assert all(h["Authorization"] == f"Bearer {KEY}" for _, h, _ in server.requests)
    # Retry-After (3 s) beats the 0.01 s backoff; then equal jitter in [d/2, d], d doubling.
    assert sleeps[0] == 3.0
    assert 0.01 <= sleeps[1] <= 0.02
    assert 0.02 <= sleeps[2] <= 0.04


def test_gives_up_after_max_attempts_without_leaking_the_key(api_key):
    def respond(body, attempt):
        # A careless server that echoes the request's headers in its error body.
        return 500, {}, {"error": "boom", "saw": "Authorization: Bearer " + KEY}

    sleeps: list[float] = []
    with ChatServer(respond) as server:
        with pytest.raises(ClientError, match="gave up after 3 attempts.*HTTP 500") as info:
            _client(server.url, sleeps, max_attempts=3).generate(Request("x"))
    assert server.hits == 3
    assert len(sleeps) == 2
    assert KEY not in str(info.value)
    assert "***" in str(info.value)


@pytest.mark.parametrize("status", [400, 401, 404])
def test_client_errors_are_not_retried(api_key, status):
    with ChatServer(lambda body, attempt: (status, {}, {"error": "no"})) as server:
        with pytest.raises(ClientError, match=f"HTTP {status}"):
            _client(server.url, []).generate(Request("x"))
    assert server.hits == 1


def test_connection_refused_is_retried_then_fails():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleeps: list[float] = []
    client = _client(f"http://127.0.0.1:{port}/v1", sleeps, max_attempts=3)
    with pytest.raises(ClientError, match="gave up after 3 attempts.*cannot reach"):
        client.generate(Request("x"))
    assert len(sleeps) == 2


def test_timeout_is_retried():
    clock = Clock()

    def respond(body, attempt):
        if attempt == 1:
            # The server takes longer than the deadline, and answers only once it shuts down.
            clock.advance(60)
            server.closing.wait(HANG_S)
        return 200, {}, completion("late but fine")

    with ChatServer(respond) as server:
        reply = _client(server.url, [], timeout_s=30, clock=clock).generate(Request("slow"))
    # The second attempt's reply: the first was given up on, not waited for (it answers only
    # after `generate` returned); its latency is by the clock, which stood still meanwhile.
    assert reply.text == "late but fine" and reply.attempts == 2 and reply.latency_s == 0
    assert server.hits == 2

    def never(body, attempt):
        server.closing.wait(HANG_S)
        return 200, {}, completion("too late")

    with ChatServer(never) as server:
        with pytest.raises(ClientError, match="gave up after 2 attempts.*within 0.2 s") as info:
            _client(server.url, [], timeout_s=0.2, max_attempts=2).generate(Request("slow"))
    assert info.value.kind == "timeout" and info.value.attempts == 2


@pytest.mark.parametrize(
    "bad",
    [b"<html>oops</html>", {"choices": []}, {"choices": [{"message": {"content": 7}}]}],
    ids=["not JSON", "empty choices", "odd content"],
)
def test_a_reply_that_is_no_completion_is_retried_within_the_run(bad):
    sleeps: list[float] = []
    script = lambda body, attempt: (200, {}, bad if attempt == 1 else completion("B"))  # noqa: E731
    with ChatServer(script) as server:
        reply = _client(server.url, sleeps).generate(Request("x"))
    assert reply.text == "B" and reply.attempts == 2 and server.hits == 2
    with ChatServer(lambda body, attempt: (200, {}, bad)) as server:
        with pytest.raises(ClientError, match="gave up after 4 attempts.*no chat completion"):
            _client(server.url, sleeps).generate(Request("x"))
    assert server.hits == 4


def test_content_parts_reply_is_joined():
    payload = {"choices": [{"message": {"content": [{"type": "text", "text": "B"}, {"x": 1}]}}]}
    with ChatServer(lambda body, attempt: (200, {}, payload)) as server:
        assert _client(server.url, []).generate(Request("x")).text == "B"


# --- where requests go --------------------------------------------------------------------------


def test_no_key_sends_no_authorization(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with ChatServer(lambda body, attempt: (200, {}, completion("ok"))) as server:
        client = _client(server.url, [])
        assert not client.has_api_key
        client.generate(Request("x"))
    assert "Authorization" not in server.requests[0][1]


def test_the_key_goes_over_plain_http_to_loopback(api_key):
    with ChatServer(lambda body, attempt: (200, {}, completion("ok"))) as server:
        for host in ("127.0.0.1", "localhost"):
            _client(server.url.replace("127.0.0.1", host), []).generate(Request("x"))
    assert [h["Authorization"] for _, h, _ in server.requests] == [f"Bearer {KEY}"] * 2
    # Any loopback address will do; telling needs no connection.
    for host in ("127.8.9.10", "LocalHost", "[::1]"):
        assert _client(f"http://{host}:8000/v1", []).has_api_key


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://10.1.2.3:8000/v1",
        "http://api.example.com/v1",
        "http://127.0.0.1.example.com/v1",
        "http://0.0.0.0:8000/v1",
        "http://[::ffff:10.0.0.1]:8000/v1",
    ],
)
def test_the_key_is_not_sent_over_plain_http_elsewhere(api_key, endpoint):
    # Refused at construction: nothing is sent, no connection is needed.
    with pytest.raises(ValueError) as info:
        _client(endpoint, [])
    message = str(info.value)
    assert message.startswith(f"endpoint {endpoint}: the API key in ${KEY_ENV} ")
    assert "allow_plain_http_key" in message and "\n" not in message and KEY not in message
    # Nothing to protect without a key; https protects it.
    _client(endpoint.replace("http://", "https://"), [])


def test_plain_http_to_another_host_sends_the_key_when_allowed(api_key, monkeypatch):
    """0.0.0.0 is no loopback address (not 127.0.0.0/8, ::1 or localhost), yet Linux delivers a
    connection to it to this machine: a host the rule refuses that this test can reach."""
    with ChatServer(lambda body, attempt: (200, {}, completion("ok"))) as server:
        elsewhere = server.url.replace("127.0.0.1", "0.0.0.0")
        with pytest.raises(ValueError, match="allow_plain_http_key"):
            _client(elsewhere, [])
        client = _client(elsewhere, [], allow_plain_http_key=True)
        assert client.generate(Request("x")).text == "ok"
        monkeypatch.delenv(KEY_ENV)
        _client(elsewhere, []).generate(Request("x"))
    assert server.requests[0][1]["Authorization"] == f"Bearer {KEY}"
    assert "Authorization" not in server.requests[1][1]


def test_proxies_are_ignored_and_redirects_refused(api_key, monkeypatch):
    # A proxy from the environment would receive the request (and the key): it is not used.
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:1")
    with ChatServer(lambda body, attempt: (200, {}, completion("direct"))) as server:
        assert _client(server.url, []).generate(Request("x")).text == "direct"
    assert server.hits == 1

    with ChatServer(lambda body, attempt: (200, {}, completion("elsewhere"))) as other:
        location = other.url + "/chat/completions"
        with ChatServer(lambda body, attempt: (307, {"Location": location}, b"")) as server:
            with pytest.raises(ClientError, match="redirect to .* refused"):
                _client(server.url, []).generate(Request("x"))
        assert server.hits == 1
        assert other.hits == 0


def test_concurrent_calls_share_one_client(api_key):
    def respond(body, attempt):
        return 200, {}, completion(prompt_text(body).upper())

    with ChatServer(respond) as server:
        client = _client(server.url, [])
        threads, replies = [], {}
        for k in range(8):

            def call(k=k):
                replies[k] = client.generate(Request(f"item {k}")).text

            threads.append(threading.Thread(target=call))
            threads[-1].start()
        for t in threads:
            t.join()
    assert replies == {k: f"ITEM {k}" for k in range(8)}


# --- the local transformers client ---------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
VOCAB_TEXT = (
    "USER : ASSISTANT Which of these choices is shown in the image ? Choices A . B C D Answer "
    "with the letter from given directly Examples is Final yes no dog cat 1 2 3"
)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    """A random-weight LLaVA (CLIP vision tower + Llama) with a WordLevel tokenizer, saved."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
    tokenizer.train_from_iterator([VOCAB_TEXT], trainers.WordLevelTrainer(special_tokens=specials))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=fast.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    # Sharper logits, so that greedy decoding picks varied tokens, not one token repeated.
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=fast,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token that "default" then drops
        chat_template=CHAT_TEMPLATE,
    )
    path = tmp_path_factory.mktemp("tiny_llava")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _greedy_reference(client: local_client.TransformersClient, request: Request, steps: int):
    """Greedy decoding written out: a full forward pass per token, argmax of the last logits."""
    import torch

    inputs = client.inputs(request)
    ids = inputs["input_ids"]
    eos = client.model.generation_config.eos_token_id
    new = []
    with torch.no_grad():
        for _ in range(steps):
            logits = client.model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=inputs["pixel_values"],
            ).logits
            token = int(logits[0, -1].argmax())
            new.append(token)
            if token == eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


def test_local_client_matches_greedy_reference_with_interleaved_images(tiny_llava):
    import torch

    client = local_client.TransformersClient(str(tiny_llava), max_new_tokens=6)
    assert client.identity()["max_new_tokens"] == 6
    images = tuple(ImageInput.from_bytes(_png(k, size=(40 + k, 30))) for k in range(2))
    requests = [
        Request("<image>Which of these choices is shown in the image ?", images[:1]),
        Request("Examples : <image> is A . Final : <image> Answer ?", images),
    ]
    image_token = client.processor.image_token_id
    for request in requests:
        inputs = client.inputs(request)
        # Each placeholder became the image's 16 patch tokens, in prompt order.
        assert int((inputs["input_ids"] == image_token).sum()) == 16 * len(request.images)
        assert inputs["pixel_values"].shape[0] == len(request.images)
        expected = _greedy_reference(client, request, 6)
        decoded = client.processor.decode(expected, skip_special_tokens=True).strip()
        reply = client.generate(request)
        assert reply.text == decoded
        assert reply.usage["prompt_tokens"] == inputs["input_ids"].shape[1]
        assert reply.usage["completion_tokens"] == len(expected)
    # The images go in placeholder order: swapping them changes what the model sees.
    swapped = Request(requests[1].prompt, images[::-1])
    first, second = client.inputs(requests[1]), client.inputs(swapped)
    assert torch.equal(first["pixel_values"][0], second["pixel_values"][1])
    with torch.no_grad():
        logits = [client.model(**inputs).logits[0, -1] for inputs in (first, second)]
    assert not torch.allclose(logits[0], logits[1])


def test_local_client_needs_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        local_client.TransformersClient(str(tmp_path / "missing"))


def test_local_client_through_eval_mllm(tiny_llava, tmp_path, capsys):
    import argparse

    from ood_jax.cli import mllm as eval_cli
    from ood_jax import prompts

    options = ["dog", "cat", "yes", "no"]
    lines = []
    for k in range(3):
        (tmp_path / f"{k}.png").write_bytes(_png(10 + k, size=(36, 44)))
        item = {
            "id": f"g{k}", "task": "grounding", "setting": "zero_shot", "domain": "dim",
            "size": "SML"[k], "prompt": prompts.counts_grounding(options), "images": [f"{k}.png"],
            "options": options, "answer": k, "category": None, "image_size": [36, 44],
        }  # fmt: skip
        lines.append(json.dumps(item))
    (tmp_path / "items.jsonl").write_text("\n".join(lines) + "\n")
    parser = argparse.ArgumentParser()
    eval_cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    argv = ["eval-mllm", "counts-oodg", "--items", str(tmp_path / "items.jsonl"), "--local"]
    argv += [str(tiny_llava), "--output", str(tmp_path / "run"), "--max-tokens", "4"]
    args = parser.parse_args([*argv, "--no-progress"])
    results = args.run(args)
    assert results["client"] == "transformers" and results["max_new_tokens"] == 4
    assert results["grounding"][0]["num_items"] == 3
    client = local_client.TransformersClient(str(tiny_llava), max_new_tokens=4)
    records = [json.loads(x) for x in (tmp_path / "run" / store.PREDICTIONS_FILE).open()]
    for k, record in enumerate(records):
        image = ImageInput.from_bytes((tmp_path / f"{k}.png").read_bytes())
        assert (
            record["reply"]
            == client.generate(Request(prompts.counts_grounding(options), (image,))).text
        )
    assert "## Visual Grounding" in capsys.readouterr().out
