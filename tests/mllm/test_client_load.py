"""The HTTP client under load and faults, against the loopback server of test_clients: request
options, the reply record, the preflight, Retry-After beyond the cap, adaptive concurrency, the
retry budget, deadlines on a server that computes one request at a time, and Ctrl-C with
requests still out. No assertion reads a wall clock: deadlines and latencies are measured on an
injected clock, and an order of events is asserted on events."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_clients import HANG_S, ChatServer, Clock, completion, prompt_text

from ood_jax.eval import clients, runner, store
from ood_jax.eval.clients import (
    AdaptiveLimit,
    ClientError,
    Reply,
    Request,
    RetryBudget,
    RunControl,
)
from ood_jax.eval.http_client import OpenAIChatClient
from ood_jax.eval.tasks.base import Benchmark, Item, answer_summary


def _client(url: str, sleeps: list | None = None, **kwargs) -> OpenAIChatClient:
    kwargs.setdefault("backoff_base_s", 0.005)
    kwargs.setdefault("max_attempts", 4)
    if sleeps is not None:
        kwargs["sleep"] = sleeps.append
    return OpenAIChatClient(url, "test-model", seed=0, **kwargs)


class Letters(Benchmark):
    """Text-only multiple choice: item k's answer is "ABCD"[k % 4]; no data to build."""

    name = "letters"
    default_max_tokens = 8

    def __init__(self, n: int):
        self.n = n

    def count(self) -> int:
        return self.n

    def items(self):
        for k in range(self.n):
            yield Item(f"q{k}", Request(f"question {k}"), {"answer": k % 4})

    def score(self, meta, reply):
        parsed = {"A": 0, "B": 1, "C": 2, "D": 3}.get(reply.strip()[:1])
        return parsed, parsed == meta["answer"]

    def results(self, records):
        return answer_summary(records)

    def markdown(self, results):
        return f"## Letters\n\naccuracy {results['accuracy']}\n"


def right_answer(body: dict) -> str:
    return "ABCD"[int(prompt_text(body).split()[-1]) % 4]


# --- request options and what a reply keeps ----------------------------------------------------


def test_request_options_shape_the_body_and_the_identity():
    client = _client(
        "http://127.0.0.1:9/v1",
        max_tokens=64,
        token_param="max_completion_tokens",
        temperature=None,
        extra_body={"reasoning_effort": "low", "top_k": 1},
    )
    body = client.payload(Request("hi"))
    assert "temperature" not in body and "max_tokens" not in body
    assert body["max_completion_tokens"] == 64
    assert body["reasoning_effort"] == "low" and body["top_k"] == 1
    assert client.identity() == {
        "client": "openai", "model": "test-model", "max_tokens": 64,
        "token_param": "max_completion_tokens", "temperature": None,
        "extra_body": {"reasoning_effort": "low", "top_k": 1},
    }  # fmt: skip
    plain = _client("http://127.0.0.1:9/v1").payload(Request("hi"))
    assert plain["temperature"] == 0 and plain["max_tokens"] == 16
    with pytest.raises(ValueError, match="may not set max_tokens, model"):
        _client("http://127.0.0.1:9/v1", extra_body={"model": "x", "max_tokens": 3})
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        _client("http://127.0.0.1:9/v1", extra_body=[1])
    with pytest.raises(ValueError, match="token_param must be one of"):
        _client("http://127.0.0.1:9/v1", token_param="max_new_tokens")


def test_the_reply_keeps_what_the_server_said():
    payload = {
        "id": "x", "model": "served-model-id",
        "choices": [{"finish_reason": "length", "message": {
            "content": None, "refusal": "I can't help with that.",
            "reasoning_content": "The user asks...",
        }}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 16, "total_tokens": 136,
                  "completion_tokens_details": {"reasoning_tokens": 12}},
    }  # fmt: skip
    clock = Clock()

    def respond(body, attempt):
        clock.advance(0.25)  # the server's time over the request
        return 200, {}, payload

    with ChatServer(respond) as server:
        reply = _client(server.url, clock=clock).generate(Request("x"))
    assert reply == Reply(
        text="", finish_reason="length", refusal="I can't help with that.",
        reasoning="The user asks...", latency_s=0.25, attempts=1,
        usage={"prompt_tokens": 120, "completion_tokens": 16, "total_tokens": 136,
               "reasoning_tokens": 12},
        model="served-model-id",
    )  # fmt: skip
    assert Reply.of("plain") == Reply("plain")
    with pytest.raises(TypeError, match="returned int"):
        Reply.of(3)


# --- the preflight -----------------------------------------------------------------------------


def test_preflight_needs_the_model_listed():
    listed = ["Qwen/Qwen2-VL-7B-Instruct", "llava-hf/llava-1.5-7b-hf", "llava:latest"]
    with ChatServer(lambda body, attempt: (200, {}, completion("A")), models=listed) as server:
        assert OpenAIChatClient(server.url, "Qwen/Qwen2-VL-7B-Instruct").check_model() is None
        # Ollama serves "llava:latest" as "llava".
        assert OpenAIChatClient(server.url, "llava").check_model() is None
        with pytest.raises(ClientError) as info:
            OpenAIChatClient(server.url, "qwen/qwen2-vl-7b").check_model()
        assert server.hits == 0
    message = str(info.value)
    assert message.startswith(f"model 'qwen/qwen2-vl-7b' is not served by {server.url}")
    assert "(did you mean 'Qwen/Qwen2-VL-7B-Instruct'?)" in message
    assert "'llava-hf/llava-1.5-7b-hf'" in message and "--no-model-check" in message


def test_preflight_says_when_the_server_cannot_tell():
    with ChatServer(lambda body, attempt: (200, {}, completion("A")), models=None) as server:
        note = OpenAIChatClient(server.url, "m").check_model()
    assert note == (
        f"{server.url}/models answers HTTP 404: the server lists no models; "
        "the model name 'm' is not checked"
    )
    with ChatServer(lambda body, attempt: (200, {}, completion("A")), models=[]) as server:
        assert "lists no models" in OpenAIChatClient(server.url, "m").check_model()
    with ChatServer(lambda body, attempt: (200, {}, b"")) as server:
        server.models = None
        client = OpenAIChatClient(server.url, "m")
    # The server is gone: nothing listens there any more.
    with pytest.raises(ClientError, match="cannot reach .*/models.*is the server running"):
        client.check_model()


# --- Retry-After beyond the cap ----------------------------------------------------------------


@pytest.mark.parametrize("retry_after", ["3600", "Wed, 21 Oct 2099 07:28:00 GMT"])
def test_a_retry_after_beyond_the_cap_ends_the_item_saying_so(retry_after):
    sleeps: list[float] = []
    busy = lambda body, attempt: (429, {"Retry-After": retry_after}, {"error": "quota"})  # noqa: E731
    with ChatServer(busy) as server:
        with pytest.raises(ClientError) as info:
            _client(server.url, sleeps, max_retry_after_s=60).generate(Request("x"))
    # Not waited out: no backoff asked for, no second request.
    assert sleeps == [] and server.hits == 1
    assert info.value.kind == "HTTP 429"
    assert "the server asks to wait" in str(info.value)
    assert "more than the 60 s cap (--max-retry-after)" in str(info.value)
    # Within the cap, Retry-After is waited for as before.
    script = {1: (429, {"Retry-After": "2"}, {"error": "slow down"})}
    with ChatServer(lambda b, a: script.get(a, (200, {}, completion("ok")))) as server:
        assert _client(server.url, sleeps).generate(Request("x")).text == "ok"
    assert sleeps == [2.0]


# --- adaptive concurrency and the retry budget -------------------------------------------------


def test_adaptive_limit_halves_once_per_round_and_climbs_slowly():
    limit, stop = AdaptiveLimit(8), threading.Event()
    rounds = [limit.acquire(stop) for _ in range(8)]
    # Eight requests sent into one overload: their 429s cut the limit once, not eight times.
    for taken_in in rounds:
        limit.release(taken_in, "overload")
    assert limit.limit == 4
    limit.release(limit.acquire(stop), "overload")
    assert limit.limit == 2
    for _ in range(AdaptiveLimit.RAISE_AFTER):
        limit.release(limit.acquire(stop), "success")
    assert limit.limit == 3
    # A failure that says nothing of load leaves it; it never exceeds the maximum.
    limit.release(limit.acquire(stop), "other")
    assert limit.limit == 3
    for _ in range(20 * AdaptiveLimit.RAISE_AFTER):
        limit.release(limit.acquire(stop), "success")
    assert limit.limit == 8
    # A full limit makes a request wait; the stop flag ends the wait.
    taken = [limit.acquire(stop) for _ in range(8)]
    stop.set()
    with pytest.raises(clients.Abandoned):
        limit.acquire(stop)
    assert len(taken) == 8


def test_concurrency_settles_on_what_the_server_can_take(tmp_path):
    """A server that serves two requests at a time and answers 429 beyond: without adapting,
    eight threads drew 429s on most attempts and items failed; the limit settles near two."""
    state = {"serving": 0, "rejected": 0}
    lock = threading.Lock()

    def respond(body, attempt):
        with lock:
            if state["serving"] >= 2:
                state["rejected"] += 1
                return 429, {"Retry-After": "0"}, {"error": "at capacity"}
            state["serving"] += 1
        time.sleep(0.02)
        with lock:
            state["serving"] -= 1
        return 200, {}, completion(right_answer(body))

    with ChatServer(respond) as server:
        client = _client(server.url, max_attempts=6)
        options = runner.RunOptions(concurrency=8, progress=False, retry_budget=200)
        results = runner.run(Letters(48), client, tmp_path, options=options)
    assert results["complete"] and results["accuracy"] == 1.0
    # The first round of eight costs six 429s; after that, a few per climb back to three.
    assert state["rejected"] <= 20, state


def test_the_retry_budget_bounds_a_run_s_retries(tmp_path):
    failing = lambda body, attempt: (503, {}, {"error": "overloaded"})  # noqa: E731
    with ChatServer(failing) as server:
        client = _client(server.url, max_attempts=5)
        options = runner.RunOptions(
            concurrency=1, progress=False, retry_budget=3, max_consecutive_failures=0
        )
        results = runner.run(Letters(20), client, tmp_path, options=options)
    assert server.hits == 20 + 3 and results["outcomes"]["error"] == 20
    records = store.PredictionStore(tmp_path / store.PREDICTIONS_FILE).records
    spent = [r for r in records.values() if "retry budget is spent" in r["error"]]
    # The first item spent the three retries before its fifth attempt; the others got none.
    assert len(spent) == 20 and records["q0"]["attempts"] == 4
    assert all(r["attempts"] == 1 for k, r in records.items() if k != "q0")
    assert "(3 retries, the --retry-budget)" in spent[0]["error"]


def test_the_default_retry_budget_grows_with_the_items_asked():
    budget = RetryBudget()
    for _ in range(8):
        budget.item_started()
    assert sum(budget.take() for _ in range(20)) == RetryBudget.BASE + 8 * RetryBudget.PER_ITEM
    fixed = RetryBudget(2)
    fixed.item_started()
    assert [fixed.take() for _ in range(3)] == [True, True, False]


# --- a server that computes one request at a time ------------------------------------------------


@pytest.mark.slow
def test_timeouts_on_a_one_at_a_time_server_do_not_pile_up_work(tmp_path):
    """Finding 2: `transformers serve` computes requests one at a time, and keeps computing
    those the client gave up on. Six items sent at once, a deadline that four of them miss
    while queued: before, each timeout was resent at once, queueing behind the abandoned
    requests and timing out in turn (18 generations, 4 items failed). Now after a timeout one
    request at a time goes out until the server has caught up, and the run completes.

    Time is counted in generations (the clock moves one unit per reply), so the deadline of
    2.5 falls in the same place on an idle machine and a loaded one."""
    generating, clock = threading.Lock(), Clock()

    def respond(body, attempt):
        with generating:
            # Long enough that each reply has reached its client before the next is computed,
            # also on two cores shared with the suite's training runs (0.1 s was not, once).
            time.sleep(0.3)
            clock.advance(1)
        return 200, {}, completion(right_answer(body))

    with ChatServer(respond) as server:
        client = _client(server.url, timeout_s=2.5, max_attempts=4, clock=clock)
        options = runner.RunOptions(concurrency=6, progress=False)
        results = runner.run(Letters(6), client, tmp_path, options=options)
        assert results["complete"] and results["accuracy"] == 1.0
        records = store.PredictionStore(tmp_path / store.PREDICTIONS_FILE).records.values()
        assert max(r["attempts"] for r in records) >= 2  # the timeouts happened
        # 11: the 6 items, 2 probes (the first times out), the 3 others resent one at a time.
        assert server.hits <= 13, server.hits


def test_after_a_timeout_one_probe_at_a_time_until_a_later_request_succeeds():
    limit, stop = AdaptiveLimit(6), threading.Event()
    early = [limit.acquire(stop) for _ in range(3)]
    limit.release(early[2], "timeout")
    assert limit.limit == 3 and limit.allowed == 1
    # Requests sent before the timeout succeed: the server may still be on the abandoned one.
    limit.release(early[0], "success")
    limit.release(early[1], "success")
    assert limit.allowed == 1
    probe = limit.acquire(stop)
    limit.release(probe, "success")
    assert limit.allowed == limit.limit == 3


# --- Ctrl-C with requests out --------------------------------------------------------------------


_CTRL_C_CHILD = """
import pathlib, signal, sys
# A SIGINT disposition of "ignore" is inherited, and Python then keeps ignoring it: the suite's
# process can have it so (left by some earlier test), a user's terminal does not.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[1])
import test_client_load
test_client_load.ctrl_c_with_a_slow_server(pathlib.Path(sys.argv[2]))
print("ok")
"""


@pytest.mark.slow
def test_ctrl_c_with_a_slow_server_returns_at_once(tmp_path):
    """The server holds every request until it shuts down; Ctrl-C arrives while two are out.
    Before, ThreadPoolExecutor's threads were joined on the way out and the process waited for
    them.

    In a fresh interpreter with Python's SIGINT handler, as a user's run has it: inside the whole
    suite SIGINT can be left ignored by an earlier test, and a real Ctrl-C then never arrives."""
    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", _CTRL_C_CHILD, tests, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=3 * HANG_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def ctrl_c_with_a_slow_server(tmp_path) -> None:
    arrived = threading.Semaphore(0)
    answered = threading.Event()

    def respond(body, attempt):
        arrived.release()
        # Held until the server shuts down: only a run that waited for it would see a reply.
        server.closing.wait(HANG_S)
        answered.set()
        return 200, {}, completion("A")

    def ctrl_c_once_two_are_out():
        # SIGINT to the process, as a terminal sends it, once both requests are at the server
        # (a fixed delay would race the run's start on a loaded machine).
        for _ in range(2):
            if not arrived.acquire(timeout=HANG_S):
                return
        os.kill(os.getpid(), signal.SIGINT)

    with ChatServer(respond) as server:
        client = _client(server.url)
        sender = threading.Thread(target=ctrl_c_once_two_are_out, daemon=True)
        sender.start()
        options = runner.RunOptions(concurrency=2, progress=False)
        with pytest.raises(KeyboardInterrupt, match="0 replies kept in"):
            runner.run(Letters(10), client, tmp_path, options=options)
        sender.join()
        # The run ended while the server still held both requests: it did not wait for them.
        assert not answered.is_set() and server.hits == 2
        # Nor do its threads: they stop waiting on the server, which still has not answered.
        for worker in _workers():
            worker.join(HANG_S)
        assert not _workers() and not answered.is_set()


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("eval-mllm-")]


def test_a_control_abandons_a_backoff_at_once():
    control = RunControl(2)
    threading.Thread(target=control.abandon).start()
    # A backoff that ran its course would return; only the abandonment raises.
    with pytest.raises(clients.Abandoned):
        control.wait(HANG_S)
