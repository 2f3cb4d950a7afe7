"""Images where the prompt puts them (issue 15, finding 1), without a real server: the published
chat templates' layouts read back from tiny models built offline, the local client's in-place
prompts down to the token ids, and the endpoint probe's decisions against small loopback servers
(one that tokenizes as vLLM's /tokenize does, with the real templates; others that answer as
deterministic, noisy or image-blind models)."""

from __future__ import annotations

import hashlib
import http.server
import json
import random
import threading

import numpy as np
import pytest

from ood_jax.eval import interleaving, local_client
from ood_jax.eval import store
from ood_jax.eval import probe as endpoint_probe
from ood_jax.eval.clients import ImageInput, Request
from ood_jax.eval.interleaving import IMAGE
from ood_jax.testing import tiny_vlms

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

IN_PLACE = ("text0", IMAGE, "text1", IMAGE, "text2")
ICE_PROMPT = "Examples: <image> is A. Final: <image> Answer?"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_vlms")
    return {
        "llava": str(tiny_vlms.build_llava(root / "llava")),
        "qwen2_vl": str(tiny_vlms.build_qwen2_vl(root / "qwen2_vl")),
    }


def _processor(path: str, chat_template: str | None = None):
    processor = transformers.AutoProcessor.from_pretrained(path, local_files_only=True)
    if chat_template is not None:
        processor.chat_template = chat_template
    return processor


def _images(n: int) -> tuple[ImageInput, ...]:
    rng = np.random.default_rng(7)
    return tuple(
        ImageInput.from_array(rng.integers(0, 256, (40, 52, 3), dtype=np.uint8)) for _ in range(n)
    )


# --- what the published templates do ------------------------------------------------------------


def test_llava_templates_put_every_image_first(models):
    for template in (tiny_vlms.LLAVA_1_5_CHAT_TEMPLATE, tiny_vlms.LLAVA_ONEVISION_CHAT_TEMPLATE):
        layout = interleaving.template_layout(_processor(models["llava"], template))
        assert layout.sent == IN_PLACE
        assert layout.rendered == (IMAGE, IMAGE, "text0", "text1", "text2")
        assert not layout.keeps_images_in_place
        assert layout.image_text == "<image>\n"


def test_qwen2_vl_template_keeps_images_in_place(models):
    layout = interleaving.template_layout(_processor(models["qwen2_vl"]))
    assert layout.keeps_images_in_place and layout.rendered == IN_PLACE
    assert layout.image_text == "<|vision_start|><|image_pad|><|vision_end|>"


# --- the local client ----------------------------------------------------------------------------


def test_hoisting_template_is_bypassed_with_images_in_place(models):
    prompts = interleaving.LocalPrompts(_processor(models["llava"]), "tiny-llava", "counts-oodg")
    assert prompts.moves_images
    assert prompts.render(Request(ICE_PROMPT, _images(2))) == (
        "USER: Examples: <image>\n is A. Final: <image>\n Answer? ASSISTANT:"
    )
    # A turn whose image comes first is what the template renders (FOCI's prompts are unchanged).
    single = Request("<image>Which of these choices is shown in the image?", _images(1))
    template = _processor(models["llava"]).apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": single.prompt[7:]}],
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompts.render(single) == template


def test_onevision_template_rebuilt_in_place(models):
    processor = _processor(models["llava"], tiny_vlms.LLAVA_ONEVISION_CHAT_TEMPLATE)
    prompts = interleaving.LocalPrompts(processor, "tiny-onevision")
    assert prompts.render(Request(ICE_PROMPT, _images(2))) == (
        "<|im_start|>user\nExamples: <image>\n is A. Final: <image>\n Answer?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_interleaving_template_is_used_as_it_is(models):
    processor = _processor(models["qwen2_vl"])
    prompts = interleaving.LocalPrompts(processor, "tiny-qwen")
    assert not prompts.moves_images and prompts.identity() == {}
    request = Request(ICE_PROMPT, _images(2))
    parts = [
        {"type": "text", "text": "Examples: "},
        {"type": "image"},
        {"type": "text", "text": " is A. Final: "},
        {"type": "image"},
        {"type": "text", "text": " Answer?"},
    ]
    template = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    assert prompts.render(request) == template


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, end) of each run of `token` in `ids`."""
    runs, k = [], 0
    while k < len(ids):
        if ids[k] == token:
            start = k
            while k < len(ids) and ids[k] == token:
                k += 1
            runs.append((start, k))
        else:
            k += 1
    return runs


def test_local_llava_reads_each_image_where_the_prompt_puts_it(models):
    import torch

    client = local_client.TransformersClient(models["llava"], max_new_tokens=4, task="counts-oodg")
    assert client.identity()["images"] == "in place, chat template bypassed"
    images = _images(2)
    inputs = client.inputs(Request(ICE_PROMPT, images))
    ids = inputs["input_ids"][0].tolist()
    decode = client.processor.tokenizer.decode
    runs = _runs(ids, client.processor.image_token_id)
    # 16 patch tokens per image, each run between the texts that surround its placeholder.
    assert [end - start for start, end in runs] == [16, 16]
    assert decode(ids[: runs[0][0]]) == "USER: Examples: "
    assert decode(ids[runs[0][1] : runs[1][0]]) == "\n is A. Final: "
    assert decode(ids[runs[1][1] :]) == "\n Answer? ASSISTANT:"
    # The pixels are the prompt's images, in placeholder order.
    swapped = client.inputs(Request(ICE_PROMPT, images[::-1]))
    assert torch.equal(inputs["pixel_values"][0], swapped["pixel_values"][1])
    reply = client.generate(Request(ICE_PROMPT, images))
    assert isinstance(reply.text, str) and reply.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage["prompt_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= client.max_new_tokens


def test_eval_mllm_local_runs_a_hoisting_model_with_images_in_place(models, tmp_path):
    import json

    from ood_jax import cli, prompts

    options = ["cat", "dog", "cow", "hen"]
    items, requests = [], {}
    for k, ice in enumerate((0, 2)):
        paths = [f"{k}_{j}.png" for j in range(ice + 1)]
        images = _images(ice + 1)
        for path, image in zip(paths, images):
            (tmp_path / path).write_bytes(image.data)
        examples = [prompts.InContextExample(options, "(B)")] * ice
        prompt = prompts.counts_grounding(options, examples)
        items.append(
            {"id": f"g{k}", "task": "grounding", "setting": "iid" if ice else "zero_shot",
             "domain": "dim", "size": "S", "prompt": prompt, "images": paths,
             "options": options, "answer": 1, "category": None, "image_size": [52, 40]}
        )  # fmt: skip
        requests[f"g{k}"] = Request(prompt, images)
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    output = tmp_path / "run"
    argv = ["eval-mllm", "counts-oodg", "--items", str(tmp_path / "items.jsonl"), "--local"]
    cli.main(
        [*argv, models["llava"], "--output", str(output), "--max-tokens", "4", "--no-progress"]
    )
    results = json.loads((output / store.RESULTS_JSON).read_text())
    assert results["images"] == "in place, chat template bypassed"
    client = local_client.TransformersClient(models["llava"], max_new_tokens=4)
    for line in (output / store.PREDICTIONS_FILE).open():
        record = json.loads(line)
        assert record["reply"] == client.generate(requests[record["id"]]).text


def test_a_template_that_cannot_be_rebuilt_is_refused_naming_model_and_task(models):
    # The published template with the text upper-cased: the slots for the images do not survive.
    template = tiny_vlms.LLAVA_1_5_CHAT_TEMPLATE.replace(
        "content['text'] + ' '", "content['text'] | upper + ' '"
    )
    prompts = interleaving.LocalPrompts(
        _processor(models["llava"], template), "tiny-llava", "counts-oodg"
    )
    with pytest.raises(interleaving.InterleavingError, match="tiny-llava.*counts-oodg prompts"):
        prompts.render(Request(ICE_PROMPT, _images(2)))
    # The images of an image-first prompt are where the prompt puts them anyway.
    assert prompts.render(Request("<image>Which?", _images(1))).startswith("USER: <image>\n")


def test_a_template_without_images_fails_at_once(models):
    text_only = "{% for m in messages %}{{ m['content'][-1]['text'] }}{% endfor %}"
    with pytest.raises(
        interleaving.InterleavingError, match="tiny: .*renders no text for an image"
    ):
        interleaving.LocalPrompts(_processor(models["llava"], text_only), "tiny")


# --- endpoints -----------------------------------------------------------------------------------


def test_endpoint_warning_only_for_several_images():
    assert interleaving.endpoint_warning("foci", 1) is None
    warning = interleaving.endpoint_warning("counts-oodg", 3)
    assert warning.startswith("counts-oodg: items carry up to 3 images")
    assert "LLaVA-1.5" in warning and interleaving.PROBE_FLAG in warning


class Server:
    """A loopback HTTP server: `route(path, body)` -> (status, payload); requests kept."""

    def __init__(self, route):
        self.route, self.paths = route, []

    def __enter__(self):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.paths.append(self.path)
                status, payload = outer.route(self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"


def _as_processor_parts(messages: list[dict]) -> list[dict]:
    return [
        {
            "role": m["role"],
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in messages
    ]


def _tokenizing_server(processor):
    """vLLM's POST /tokenize (messages form): the chat template, then the tokenizer."""

    def route(path, body):
        if path != "/tokenize":
            return 404, {"detail": "Not Found"}
        text = processor.apply_chat_template(
            _as_processor_parts(body["messages"]), add_generation_prompt=True, tokenize=False
        )
        ids = processor.tokenizer.encode(text, add_special_tokens=False)
        return 200, {"count": len(ids), "max_model_len": 2048, "tokens": ids}

    return route


@pytest.mark.parametrize("family, keeps", [("llava", False), ("qwen2_vl", True)])
def test_probe_reads_the_servers_tokenization(models, family, keeps):
    with Server(_tokenizing_server(_processor(models[family]))) as server:
        probe = endpoint_probe.probe_endpoint(server.url, "m")
    assert probe.method == "tokenize" and probe.keeps_images_in_place is keeps
    # Exact where the server tokenizes: no completion was needed.
    assert server.paths == ["/tokenize"] * 3


def _part_key(part: dict) -> str:
    if part["type"] == "image_url":
        return hashlib.sha256(part["image_url"]["url"].encode()).hexdigest()
    return part["text"]


def _chat_server(reply_of):
    """/tokenize is missing (as on transformers serve); completions answer reply_of(parts)."""

    def route(path, body):
        if path != "/v1/chat/completions":
            return 404, {"detail": "Not Found"}
        reply = reply_of(body["messages"][0]["content"])
        return 200, {"choices": [{"message": {"content": reply}, "finish_reason": "stop"}]}

    return route


def _digest(keys: list[str]) -> str:
    return hashlib.sha256("|".join(keys).encode()).hexdigest()[:12]


def _hoisted(parts):
    images = [_part_key(p) for p in parts if p["type"] == "image_url"]
    return _digest(images + [_part_key(p) for p in parts if p["type"] == "text"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "reply_of, keeps, says",
    [
        (lambda parts: _digest([_part_key(p) for p in parts]), True, "where they are sent"),
        (_hoisted, False, "ahead of the text"),
        (lambda parts: str(random.random()), None, "differently on two sends"),
        (
            lambda parts: _digest([p["text"] for p in parts if p["type"] == "text"]),
            None,
            "images are swapped",
        ),
    ],
    ids=["in-order", "hoisting", "noisy", "image-blind"],
)
def test_probe_infers_from_replies_and_says_when_it_cannot(reply_of, keeps, says):
    with Server(_chat_server(reply_of)) as server:
        probe = endpoint_probe.probe_endpoint(server.url, "m")
    assert probe.keeps_images_in_place is keeps
    assert probe.method == (None if keeps is None else "replies")
    assert says in probe.detail and "/tokenize answered HTTP 404" in probe.detail
    assert server.paths.count("/v1/chat/completions") == 5


def test_probe_of_an_unreachable_server_says_so():
    probe = endpoint_probe.probe_endpoint("http://127.0.0.1:9/v1", "m", timeout_s=5)
    assert probe.keeps_images_in_place is None
    assert probe.detail.startswith("cannot tell: cannot reach http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="http"):
        endpoint_probe.probe_endpoint("127.0.0.1:9/v1", "m")
