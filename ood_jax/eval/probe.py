"""Where a server puts a turn's images (`eval-mllm --check-interleaving`): exactly, from the
tokens of the turn in three orders where the server tokenizes chat requests (vLLM's /tokenize),
else inferred from greedy replies; a `Probe` that cannot tell says why."""

from __future__ import annotations

import dataclasses

import numpy as np

from ood_jax.eval import clients, http_client

_TEXTS = ("Examples: this picture ", " shows (A). Final: and ", " shows?")


@dataclasses.dataclass(frozen=True)
class Probe:
    """What probe_endpoint found: keeps_images_in_place is None when the server cannot tell."""

    keeps_images_in_place: bool | None
    method: str | None  # "tokenize" (exact), "replies" (inferred), None
    detail: str
    evidence: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _turns() -> dict[str, list[dict]]:
    """The turn as our prompts send it, the same parts with the images first and last, and a
    control with the two images swapped: its reply differs only if the model's replies depend
    on the images (a server that drops images, or a model that ignores them, fails it)."""
    rng = np.random.default_rng(0)
    first, second = (
        {
            "type": "image_url",
            # PNG: lossless, so the server decodes exactly these pixels.
            "image_url": {
                "url": clients.ImageInput.from_array(
                    rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
                ).data_url()
            },
        }
        for _ in range(2)
    )
    texts = [_text(t) for t in _TEXTS]
    return {
        "in_place": [texts[0], first, texts[1], second, texts[2]],
        "images_first": [first, second, *texts],
        "images_last": [*texts, first, second],
        "control": [texts[0], second, texts[1], first, texts[2]],
    }


def _messages(parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": parts}]


def _verdict(same_as_first: bool, same_as_last: bool) -> tuple[bool, str]:
    if same_as_first:
        return False, "renders the images ahead of the text, as a hoisting template does"
    if same_as_last:
        return False, "renders the images after the text"
    return True, "renders the images where they are sent"


def _root(endpoint: str) -> str:
    # vLLM serves /tokenize beside /v1, not under it.
    endpoint = endpoint.rstrip("/")
    return endpoint[: -len("/v1")] if endpoint.endswith("/v1") else endpoint


def _by_tokenize(root: http_client.OpenAIChatClient, model: str, turns: dict) -> Probe | str:
    """Exact: the server's own tokenization of each turn. Where the server cannot answer so,
    the reason, for the inferred answer to say."""
    url = root.endpoint + "/tokenize"
    tokens = {}
    for name in ("in_place", "images_first", "images_last"):
        body = {"model": model, "messages": _messages(turns[name]), "add_generation_prompt": True}
        try:
            status, data = root.post_json("/tokenize", body)
        except clients.ClientError as e:
            return str(e)
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            return f"POST {url} answered HTTP {status} without a token list"
        tokens[name] = data["tokens"]
    keeps, how = _verdict(
        tokens["in_place"] == tokens["images_first"], tokens["in_place"] == tokens["images_last"]
    )
    evidence = {name: len(ids) for name, ids in tokens.items()}
    return Probe(keeps, "tokenize", f"{url}: the server {how} (its tokenization)", evidence)


def _completion(
    client: http_client.OpenAIChatClient, model: str, parts: list[dict], max_tokens: int
) -> dict | str:
    """{reply, prompt_tokens} of one greedy completion, or what went wrong."""
    body = {
        "model": model,
        "messages": _messages(parts),
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    try:
        status, data = client.post_json("/chat/completions", body)
    except clients.ClientError as e:
        return str(e)
    try:
        return {
            "reply": data["choices"][0]["message"]["content"],
            "prompt_tokens": (data.get("usage") or {}).get("prompt_tokens"),
        }
    except (TypeError, KeyError, IndexError, AttributeError):
        return f"HTTP {status} from {client.url} without a chat completion"


def _by_replies(
    client: http_client.OpenAIChatClient, model: str, turns: dict, max_tokens: int, no_tokenize: str
) -> Probe:
    """Inferred from greedy replies (and prompt token counts, where the server reports usage).
    `no_tokenize` says why the exact way was not available."""
    runs = {}
    for name in ("in_place", "in_place_again", "images_first", "images_last", "control"):
        got = _completion(client, model, turns[name.replace("_again", "")], max_tokens)
        if isinstance(got, str):
            return Probe(None, None, f"cannot tell: {got}; {no_tokenize}")
        runs[name] = got
    evidence = {name: dict(run) for name, run in runs.items()}
    if runs["in_place"] != runs["in_place_again"]:
        return Probe(
            None,
            None,
            "cannot tell: the server answers one greedy request differently on two sends "
            f"(sampling or batching noise); {no_tokenize}",
            evidence,
        )
    if runs["control"]["reply"] == runs["in_place"]["reply"]:
        return Probe(
            None,
            None,
            "cannot tell: the model's reply stays the same when the two images are swapped, so "
            "its replies say nothing of where the images were (or the server drops images); "
            f"{no_tokenize}",
            evidence,
        )
    keeps, how = _verdict(
        runs["in_place"] == runs["images_first"], runs["in_place"] == runs["images_last"]
    )
    return Probe(
        keeps,
        "replies",
        f"{client.endpoint}: the server {how} (inferred from greedy replies and prompt token "
        f"counts to the same parts in three orders, not read: {no_tokenize})",
        evidence,
    )


def probe_endpoint(
    endpoint: str,
    model: str,
    api_key_env: str = clients.DEFAULT_API_KEY_ENV,
    timeout_s: float = 120.0,
    max_tokens: int = 16,
) -> Probe:
    """Measures where the server at `endpoint` (an OpenAI-compatible base URL) puts images.

    Returns a Probe whose keeps_images_in_place is None, with the reason in `detail`, when
    neither the server's tokenization nor its replies can tell.
    """

    def client_of(url: str) -> http_client.OpenAIChatClient:
        return http_client.OpenAIChatClient(
            url, model, api_key_env=api_key_env, timeout_s=timeout_s, max_attempts=1
        )

    client = client_of(endpoint)
    turns = _turns()
    exact = _by_tokenize(client_of(_root(endpoint)), model, turns)
    if isinstance(exact, Probe):
        return exact
    return _by_replies(client, model, turns, max_tokens, no_tokenize=exact)
