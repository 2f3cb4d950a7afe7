"""`ood-jax eval-mllm` against a real OpenAI-compatible server nobody here wrote (issue 15).

`transformers serve` (the `serving` extra) is started once for the module on 127.0.0.1, on CPU,
serving two tiny random-weight VLMs built offline with their published chat templates
(ood_jax/testing/tiny_vlms.py): LLaVA-1.5, whose template renders every image first, and
Qwen2-VL, whose template keeps images in place. FOCI and COUNTS OODG run end to end through
`ood_jax.cli.main`, and the replies are checked against the same models run here with the local
client: equal wherever the server shows the model what the prompt says.

Also checked here: a reply's finish reason and usage are kept, the model is checked with
GET /v1/models before anything is sent, exit codes are honest, request options for reasoning
models reach the server, a client does not pile work onto a serial server, and a multi-image
run against an endpoint says in results.json where the images may have gone. The fault cases a real server will not produce
on demand (429 with Retry-After, malformed JSON, ...) are in test_clients.py's loopback server.
"""

from __future__ import annotations

import collections
import contextlib
import http.server
import importlib.util
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from ood_jax import cli, datasets, prompts
from ood_jax.eval import http_client, interleaving, local_client, runner, store, tasks
from ood_jax.eval import probe as endpoint_probe
from ood_jax.eval.clients import ImageInput, Request
from ood_jax.testing import tiny_vlms

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("transformers")
_MISSING = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(
        f"transformers' serving extra is not installed (no {', '.join(_MISSING)}): "
        "pip install 'transformers[serving]', or the project's '.[test]'",
        allow_module_level=True,
    )

STARTUP_TIMEOUT_S = 120
# How long a test waits on the server for what should come soon: it fails a wedged test only.
HANG_S = 600
# Enough to tell replies apart, little enough that a reply takes a fraction of a second on CPU.
MAX_TOKENS = "6"
OPTIONS = ["cat", "dog", "cow", "hen"]
REQUEST_LOG = "[Request received] Model: "


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _chat(url: str, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    request = urllib.request.Request(
        url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as response:
        return json.loads(response.read())


class Serve:
    """`transformers serve` in its own process group, its log kept to count what it computed."""

    def __init__(self, workdir: pathlib.Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = workdir / "serve.log"
        env = {
            **os.environ,
            # Nothing is downloaded: models are local directories, and an unknown name must fail
            # at once rather than wait on the network.
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(workdir / "hf_home"),
            "CUDA_VISIBLE_DEVICES": "",
            # One thread: the test's client runs beside it on a small machine.
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"]
        # Loaded models stay loaded (and listed by GET /v1/models) for the whole module.
        command += ["--model-timeout", "3600"]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited: {self.log_tail()}")
            with contextlib.suppress(OSError):
                if _get(self.url[: -len("/v1")] + "/health")[0] == 200:
                    return
            time.sleep(0.25)
        raise RuntimeError(
            f"transformers serve not ready in {STARTUP_TIMEOUT_S} s: {self.log_tail()}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def log_tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def generations(self, model: str) -> int:
        """Chat requests for `model` the server started computing so far (it logs each one once
        the model is loaded, before generating; "Model: PATH, CB: False")."""
        needle = f"{REQUEST_LOG}{model},"
        return sum(needle in line for line in self.log.read_text().splitlines())

    def chat_posts(self) -> int:
        """POST /v1/chat/completions answered so far, whatever the status (uvicorn's access log)."""
        return self.log.read_text().count('"POST /v1/chat/completions HTTP/1.1"')


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_vlms")
    return {
        "llava": str(tiny_vlms.build_llava(root / "llava")),
        "qwen2_vl": str(tiny_vlms.build_qwen2_vl(root / "qwen2_vl")),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    serve = Serve(tmp_path_factory.mktemp("serve"))
    try:
        serve.wait_ready()
        # A model given by its path is listed by GET /v1/models only once loaded: load both.
        for path in models.values():
            _chat(serve.url, path)
        yield serve
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def local(models):
    """The same models through --local's client, for the replies the server should give."""
    return {
        name: local_client.TransformersClient(path, max_new_tokens=int(MAX_TOKENS))
        for name, path in models.items()
    }


def run_eval(*argv: str) -> tuple[int, dict]:
    """`ood-jax eval-mllm ...` as the command line runs it: (exit code, the results it wrote).

    An exit with a message (an error before or during the run) is raised as it is."""
    try:
        cli.main(["eval-mllm", *argv, "--no-progress"])
        code = 0
    except SystemExit as e:
        if not isinstance(e.code, int):
            raise
        code = e.code
    output = pathlib.Path(argv[argv.index("--output") + 1])
    return code, json.loads((output / store.RESULTS_JSON).read_text())


def _predictions(output: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (output / store.PREDICTIONS_FILE).open()]


def _png(path: pathlib.Path, seed: int, size=(64, 48)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")


# ---------------------------------------------------------------------------------------------
# Benchmark inputs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def foci_data(tmp_path_factory) -> pathlib.Path:
    """A FOCI build from a four-image source (the `custom` config, as test_eval_runner's)."""
    root = tmp_path_factory.mktemp("foci")
    entries = collections.defaultdict(list)
    for c, label in enumerate(OPTIONS):
        image = f"photos/{label}.jpg"
        (root / "src" / "photos").mkdir(parents=True, exist_ok=True)
        pixels = np.random.default_rng(c).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "src" / image, format="JPEG")
        options = [OPTIONS[(c + j) % len(OPTIONS)] for j in range(4)]
        entries[label].append({"image": image, "options": options, "groundtruth": label})
    (root / "src" / "options.json").write_text(json.dumps(entries))
    datasets.build("foci", str(root / "tfds"), source=str(root / "src"), config="custom")
    return root / "tfds"


def _oodg_record(k: int, task: str, ice: int) -> dict:
    images = [f"images/{k}_{j}.png" for j in range(ice + 1)]
    record = {
        "id": f"{task}-{k}", "task": task, "setting": "iid" if ice else "zero_shot",
        "domain": "dim", "size": "SML"[k % 3], "images": images, "options": OPTIONS,
        "answer": k % 4, "category": None, "image_size": [64, 48],
    }  # fmt: skip
    if task == "grounding":
        examples = [prompts.InContextExample(OPTIONS, "(B)")] * ice
        record["prompt"] = prompts.counts_grounding(OPTIONS, examples)
    elif task == "mapping":
        record["answer"] = [1, 0, 3, 2]
        record["prompt"] = prompts.counts_mapping(OPTIONS)
    else:
        record.update(options=None, category="dog", size=None, answer=[[4.0, 5.0, 20.0, 10.0]])
        record["prompt"] = (
            prompts.IMAGE_PLACEHOLDER + "\n" + prompts.counts_localization("dog", 64, 48)
        )
    return record


@pytest.fixture(scope="module")
def oodg_items(tmp_path_factory) -> pathlib.Path:
    """Grounding with 0 and 2 in-context examples (1 and 3 images), mapping and localization."""
    root = tmp_path_factory.mktemp("oodg")
    shapes = [("grounding", 0), ("grounding", 2), ("grounding", 0), ("grounding", 2)]
    shapes += [("mapping", 0), ("localization", 0)]
    records = [_oodg_record(k, task, ice) for k, (task, ice) in enumerate(shapes)]
    for k, record in enumerate(records):
        for j, image in enumerate(record["images"]):
            _png(root / image, seed=10 * k + j)
    (root / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "items.jsonl"


def _oodg_requests(items: pathlib.Path) -> dict[str, Request]:
    out = {}
    for line in items.read_text().splitlines():
        record = json.loads(line)
        images = tuple(
            ImageInput.from_bytes((items.parent / p).read_bytes()) for p in record["images"]
        )
        out[record["id"]] = Request(record["prompt"], images)
    return out


def _endpoint_argv(server: Serve, model: str, output: pathlib.Path, *extra: str) -> list[str]:
    argv = ["--endpoint", server.url, "--model", model, "--output", str(output)]
    return [*argv, "--max-tokens", MAX_TOKENS, "--concurrency", "2", *extra]


# ---------------------------------------------------------------------------------------------
# Finding 1: images where the prompt puts them
# ---------------------------------------------------------------------------------------------


def test_probe_measures_where_each_template_puts_images(server, models):
    hoisting = endpoint_probe.probe_endpoint(server.url, models["llava"])
    assert hoisting.keeps_images_in_place is False and hoisting.method == "replies"
    assert "ahead of the text" in hoisting.detail
    # transformers serve has no /tokenize: the probe says its answer is inferred, not read.
    assert "not read: POST http://127.0.0.1" in hoisting.detail
    assert "/tokenize answered HTTP 404" in hoisting.detail
    in_place = endpoint_probe.probe_endpoint(server.url, models["qwen2_vl"])
    assert in_place.keeps_images_in_place is True and in_place.method == "replies"


def test_counts_oodg_end_to_end(server, models, local, oodg_items, tmp_path):
    requests = _oodg_requests(oodg_items)
    for name, path in models.items():
        output = tmp_path / name
        code, results = run_eval(
            "counts-oodg", "--items", str(oodg_items), *_endpoint_argv(server, path, output)
        )
        assert code == 0 and results["complete"] is True and results["model"] == path
        assert results["grounding"][0]["num_items"] == 2  # zero-shot; the iid row holds the rest
        for record in _predictions(output):
            request = requests[record["id"]]
            if name == "qwen2_vl" or not interleaving.image_after_text(request):
                # The template shows the model the prompt as it is: the local client agrees.
                assert record["reply"].strip() == local[name].generate(request).text, record["id"]
            else:
                # LLaVA's template moved the images ahead of the text: the server answered that
                # hoisted prompt, which the local client no longer builds.
                n = len(request.images)
                hoisted = local[name].processor.apply_chat_template(
                    [{"role": "user", "content": _template_parts(request)}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                assert (
                    hoisted.startswith("USER: " + "<image>\n" * n) and hoisted.count("<image>") == n
                )
                assert record["reply"].strip() == _decode_greedy(local[name], hoisted, request)
                in_place = local[name].prompts.render(request)
                assert in_place.startswith("USER: " + request.prompt.split("<image>")[0])
                assert in_place.count("<image>\n") == n


def _template_parts(request: Request) -> list[dict]:
    return [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
        for p in request.segments()
    ]


def _decode_greedy(client, text: str, request: Request) -> str:
    """The local model's greedy reply to `text` (a rendered turn) with the request's images."""
    import torch

    images = [i.to_pil() for i in request.images]
    inputs = client.processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        out = client.model.generate(**inputs, do_sample=False, max_new_tokens=int(MAX_TOKENS))
    new = out[:, inputs["input_ids"].shape[1] :]
    return client.processor.batch_decode(new, skip_special_tokens=True)[0].strip()


def test_multi_image_run_against_an_endpoint_warns_in_results(server, models, oodg_items, tmp_path):
    _, results = run_eval(
        "counts-oodg",
        "--items",
        str(oodg_items),
        *_endpoint_argv(server, models["qwen2_vl"], tmp_path),
    )
    assert interleaving.endpoint_warning("counts-oodg", 3) in json.dumps(results)


@pytest.mark.parametrize("family, warned", [("llava", True), ("qwen2_vl", False)])
def test_check_interleaving_puts_the_measured_finding_in_results(
    server, models, oodg_items, tmp_path, family, warned, capsys
):
    _, results = run_eval(
        "counts-oodg",
        "--items",
        str(oodg_items),
        interleaving.PROBE_FLAG,
        *_endpoint_argv(server, models[family], tmp_path),
    )
    said = capsys.readouterr().err
    assert f"{interleaving.PROBE_FLAG}: {server.url}: the server renders the images" in said
    if warned:
        (warning,) = results["warnings"]
        assert "ahead of the text, as a hoisting template does" in warning
        assert (tmp_path / store.RESULTS_MD).read_text().count("Warning: ") == 1
    else:
        assert "warnings" not in results


# ---------------------------------------------------------------------------------------------
# FOCI end to end, resuming; a failed item (findings 3 and 5 where they need nothing new)
# ---------------------------------------------------------------------------------------------


def test_foci_end_to_end_then_resume_sends_nothing(server, models, local, foci_data, tmp_path):
    model, output = models["llava"], tmp_path / "foci"
    argv = ["foci", "--data-dir", str(foci_data), *_endpoint_argv(server, model, output)]
    code, results = run_eval(*argv)
    assert code == 0 and results["complete"] is True and results["num_items"] == 4
    assert results["request_failures"] == 0
    records = _predictions(output)
    # One image, first: what the server rendered is what the local client renders.
    benchmark = tasks.make_benchmark("foci", data_dir=str(foci_data))
    for item, record in zip(benchmark.items(), records):
        assert record["reply"].strip() == local["llava"].generate(item.request).text
    sent = server.chat_posts()
    _, again = run_eval(*argv)
    assert server.chat_posts() == sent
    assert again["accuracy"] == results["accuracy"]


def test_two_replicas_answer_as_one_server(server, models, local, foci_data, tmp_path):
    """Two `transformers serve` instances as replicas of one model (--endpoint twice): both
    compute, and every reply is the one local model's."""
    model = models["llava"]
    (tmp_path / "second").mkdir()
    second = Serve(tmp_path / "second")
    try:
        second.wait_ready()
        _chat(second.url, model)  # loaded, so that it lists the model by its path
        before = (server.generations(model), second.generations(model))
        output = tmp_path / "replicas"
        argv = ["foci", "--data-dir", str(foci_data), *_endpoint_argv(server, model, output)]
        code, results = run_eval(*argv, "--endpoint", second.url)
        after = (server.generations(model), second.generations(model))
    finally:
        second.stop()
    assert code == 0 and results["complete"] is True and results["num_items"] == 4
    assert after[0] > before[0] and after[1] > before[1]  # both replicas computed
    benchmark = tasks.make_benchmark("foci", data_dir=str(foci_data))
    for item, record in zip(benchmark.items(), _predictions(output)):
        assert record["reply"].strip() == local["llava"].generate(item.request).text


@pytest.fixture
def broken_items(tmp_path) -> pathlib.Path:
    """Two grounding items, the second with a PNG the server cannot decode."""
    records = [_oodg_record(k, "grounding", 0) for k in range(2)]
    _png(tmp_path / records[0]["images"][0], seed=1)
    (tmp_path / records[1]["images"][0]).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path / "items.jsonl"


def _broken_run(server, model, broken_items) -> list[str]:
    argv = ["counts-oodg", "--items", str(broken_items)]
    return argv + _endpoint_argv(server, model, broken_items.parent / "run", "--max-attempts", "1")


def test_a_failed_item_is_recorded_and_the_run_incomplete(server, models, broken_items):
    _, results = run_eval(*_broken_run(server, models["llava"], broken_items))
    assert results["complete"] is False
    assert results["grounding"][0]["request_failures"] == 1
    failed = [r for r in _predictions(broken_items.parent / "run") if r["error"]]
    assert [r["id"] for r in failed] == ["grounding-1"] and "HTTP 500" in failed[0]["error"]


def test_an_incomplete_run_exits_non_zero(server, models, broken_items):
    with pytest.raises(SystemExit) as stopped:
        cli.main(
            ["eval-mllm", *_broken_run(server, models["llava"], broken_items), "--no-progress"]
        )
    assert stopped.value.code not in (0, None)


def test_a_misspelled_model_fails_before_any_request(server, models, oodg_items, tmp_path):
    wrong = models["llava"] + "-typo"
    posts = server.chat_posts()
    with pytest.raises(SystemExit) as stopped:
        cli.main(
            ["eval-mllm", "counts-oodg", "--items", str(oodg_items), "--no-progress",
             *_endpoint_argv(server, wrong, tmp_path / "run", "--backoff", "0.01")]
        )  # fmt: skip
    # The preflight's error, and not one chat request: nothing was sent, so nothing retried.
    assert f"model {wrong!r} is not served by {server.url}" in str(stopped.value.code)
    assert server.chat_posts() == posts


# ---------------------------------------------------------------------------------------------
# Findings 2, 4 and 5: what the client is gaining
# ---------------------------------------------------------------------------------------------


def test_truncated_replies_keep_finish_reason_and_usage(server, models, oodg_items, tmp_path):
    run_eval(
        "counts-oodg",
        "--items",
        str(oodg_items),
        *_endpoint_argv(server, models["llava"], tmp_path),
    )
    records = _predictions(tmp_path)
    # Random weights rarely say end-of-sequence: most replies stop at the budget, and say so.
    truncated = [r for r in records if r["finish_reason"] == "length"]
    assert truncated
    for record in truncated:
        assert record["usage"]["completion_tokens"] == int(MAX_TOKENS)
        assert record["usage"]["prompt_tokens"] > 0


def test_max_completion_tokens_and_extra_body_reach_the_server(
    server, models, oodg_items, tmp_path
):
    extra = ["--token-param", "max_completion_tokens", "--extra-body", '{"seed": 1}']
    argv = _endpoint_argv(server, models["qwen2_vl"], tmp_path, *extra)
    argv[argv.index("--max-tokens") + 1] = "3"
    code, results = run_eval("counts-oodg", "--items", str(oodg_items), *argv)
    assert code == 0 and results["complete"] is True
    # transformers serve reads max_completion_tokens before max_tokens: 3 tokens, not the default.
    assert {r["usage"]["completion_tokens"] for r in _predictions(tmp_path)} <= {1, 2, 3}


class ReplyClock:
    """A loopback relay in front of `server` that counts the replies the server finished,
    those whose client hung up included: the relay still waits for them, as the server computes
    them either way. Called, it is a clock in server replies: a deadline of N falls after N
    replies' time, on an idle machine and a loaded one alike. Closing waits for what is still
    being computed, so that the server is idle for what follows."""

    def __init__(self, server: Serve):
        self.upstream = f"http://127.0.0.1:{server.port}"
        self.replies = self.relaying = 0
        self._changed = threading.Condition()

    def __call__(self) -> float:
        return float(self.replies)

    def __enter__(self) -> "ReplyClock":
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with relay._changed:
                    relay.relaying += 1
                try:
                    status, data = relay._ask(self.path, body)
                finally:
                    with relay._changed:
                        relay.replies += 1
                        relay.relaying -= 1
                        relay._changed.notify_all()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this request (a timeout)

            def log_message(self, *args):
                pass

        self._relay = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._relay.serve_forever, daemon=True).start()
        return self

    def _ask(self, path: str, body: bytes) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(self.upstream + path, body, headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=HANG_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def __exit__(self, *exc):
        with self._changed:
            self._changed.wait_for(lambda: not self.relaying, timeout=HANG_S)
        self._relay.shutdown()
        self._relay.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._relay.server_address[1]}/v1"


def test_timeouts_do_not_pile_work_onto_a_serial_server(server, models, tmp_path):
    # transformers serve generates one request at a time and finishes requests their client
    # gave up on. With 8 in flight and a deadline of 3.5 replies' time, the last four time out
    # while queued, and retrying them at once queues more work behind the abandoned ones: the
    # issue saw 16 generations for 6 items, 5 of them failed; so does this test with a client
    # that resends timeouts at once. The deadline is counted in the server's replies, not
    # seconds, so that it falls in the same place however loaded the machine is.
    count = 8
    records = [_oodg_record(k, "grounding", 0) for k in range(count)]
    for k, record in enumerate(records):
        _png(tmp_path / record["images"][0], seed=k)
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    benchmark = tasks.make_benchmark("counts-oodg", items=str(tmp_path / "items.jsonl"))
    model = models["llava"]
    before = server.generations(model)
    with ReplyClock(server) as clock:
        client = http_client.OpenAIChatClient(
            clock.url, model, max_tokens=256, timeout_s=3.5, max_attempts=3,
            backoff_base_s=0.01, clock=clock,
        )  # fmt: skip
        options = runner.RunOptions(concurrency=count, progress=False)
        results = runner.run(benchmark, client, tmp_path / "run", options=options)
    assert results["complete"] is True
    assert max(r["attempts"] for r in _predictions(tmp_path / "run")) >= 2  # timeouts happened
    # 14: the 8 items, 2 probes (the first times out), then the 4 others resent.
    assert server.generations(model) - before <= 2 * count
