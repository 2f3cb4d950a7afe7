"""The judge parse mode's judge: a model asked which option a reply chose, for only the replies no
rule reads (as VLMEvalKit's choice extractor, but a reply it places under no option stays
wrong), its verdicts kept in DIR/judge.jsonl (fields: docs/guide/mllm.md, "The run directory")."""

from __future__ import annotations

import hashlib
import json
import pathlib
import string
from collections.abc import Sequence
from typing import Any

from ood_jax import progress as progress_lib
from ood_jax.eval import parsing, scheduling, store
from ood_jax.eval.clients import (
    DEFAULT_CONCURRENCY,
    Abandoned,
    ClientError,
    Reply,
    Request,
    RunControl,
)
from ood_jax.eval.tasks.base import Scoring

JUDGE_FILE = "judge.jsonl"
# Changes whenever the prompt's wording does: verdicts of another version are not reused.
PROMPT_VERSION = "choice-v1"
NO_CHOICE = "Z"
# A letter, or Z: a short budget; a reasoning judge needs --judge-max-tokens.
DEFAULT_MAX_TOKENS = 16

# For the options A. cat, B. rabbit, C. dog, D. teddy bear: a paraphrase, a kind of an option,
# and three ways of choosing none.
_EXAMPLE_OPTIONS = ("cat", "rabbit", "dog", "teddy bear")
_EXAMPLES = (
    ("It looks like a small fluffy bunny.", "B"),
    ("A golden retriever.", "C"),
    ("I cannot see the image clearly enough to say.", NO_CHOICE),
    ("Either a cat or a dog, hard to tell.", NO_CHOICE),
    ("A horse.", NO_CHOICE),
)


def judge_prompt(options: Sequence[str], reply: str) -> str:
    """What the judge is asked about one reply to a lettered multiple-choice question."""
    if not 1 <= len(options) < len(string.ascii_uppercase):
        raise ValueError(f"the judge reads 1 to 25 options (Z means none), got {len(options)}")
    examples = "\n".join(f'Answer: "{text}" -> {verdict}' for text, verdict in _EXAMPLES)
    return (
        "You check which option of a multiple-choice question a model's answer chose.\n\n"
        "Reply with the letter of the option the answer chooses, and nothing else. Reply "
        f"{NO_CHOICE} when it chooses none of them: it refuses, says it cannot tell, weighs "
        "several without settling on one, or names something that is none of the options.\n\n"
        f"Examples, for the options {_lettered(_EXAMPLE_OPTIONS, ', ')}:\n{examples}\n\n"
        f"The options:\n{_lettered(options, chr(10))}\n\n"
        "The model's answer, between the lines of dashes:\n"
        f"----------\n{reply}\n----------\n\n"
        f"Your reply (one letter, or {NO_CHOICE}):"
    )


def _lettered(options: Sequence[str], separator: str) -> str:
    return separator.join(f"{string.ascii_uppercase[k]}. {o}" for k, o in enumerate(options))


def read_verdict(text: str, num_options: int) -> tuple[str, int | None]:
    """(said, verdict) of the judge's reply: ("choice", index), ("none", None) for Z, or
    ("unreadable", None) when it names no option."""
    answer, _ = parsing.split_think(text)
    index = parsing.parse_choice(answer, len(string.ascii_uppercase), mode="strict")
    if index == string.ascii_uppercase.index(NO_CHOICE):
        return "none", None
    if index is not None and index < num_options:
        return "choice", index
    return "unreadable", None


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Verdicts:
    """The verdicts of one judge in a judge.jsonl, looked up by options and reply."""

    def __init__(self, identity: dict, records: dict[str, dict]):
        # `records` may be a store's own dict: verdicts appended to it are seen at once.
        self._identity, self.records = identity, records

    @classmethod
    def load(cls, directory: str | pathlib.Path, identity: dict) -> "Verdicts":
        """The verdicts `identity`'s judge left in DIR/judge.jsonl, read without changing it."""
        path = pathlib.Path(directory) / JUDGE_FILE
        records = store.PredictionStore(path, repair=False).records if path.exists() else {}
        return cls(identity, records)

    def identity(self) -> dict:
        return self._identity

    def key(self, options: Sequence[str], reply: str) -> str:
        content = {"judge": self._identity, "prompt": judge_prompt(options, reply)}
        return _sha256(json.dumps(content, sort_keys=True))

    def lookup(self, options: Sequence[str], reply: str) -> tuple[bool, int | None]:
        """(judged, the option it named or None); not judged while no verdict is kept."""
        record = self.records.get(self.key(options, reply))
        if record is None or record["error"] is not None:
            return False, None
        return True, record["verdict"]


class Judge:
    """A judge model behind a client (`generate(Request)` -> Reply or text, as the runner's),
    its verdicts kept in DIR/judge.jsonl."""

    def __init__(
        self,
        client: Any,
        directory: str | pathlib.Path,
        concurrency: int = DEFAULT_CONCURRENCY,
        max_consecutive_failures: int = scheduling.DEFAULT_MAX_CONSECUTIVE_FAILURES,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.client, self.concurrency = client, concurrency
        self.max_consecutive_failures = max_consecutive_failures
        served = {k: v for k, v in client.identity().items() if k != "client"}
        self._identity = {**served, "prompt_version": PROMPT_VERSION}
        self.path = pathlib.Path(directory) / JUDGE_FILE
        self.store = store.PredictionStore(self.path)
        self.verdicts = Verdicts(self._identity, self.store.records)

    def identity(self) -> dict:
        return self._identity

    def questions(self, scoring: Scoring, records: Sequence[dict]) -> list[tuple]:
        """(key, item id, options, reply) of every reply no rule reads and no verdict covers."""
        pending = {}
        for record in records:
            options = scoring.needs_judge(record)
            if options is None:
                continue
            key = self.verdicts.key(options, record["reply"])
            if key not in pending and not self.verdicts.lookup(options, record["reply"])[0]:
                pending[key] = (key, record["id"], options, record["reply"])
        return list(pending.values())

    def complete(self, scoring: Scoring, records: Sequence[dict], progress: bool = True) -> None:
        """Asks the judge every question `questions` finds, appending each verdict as it comes.

        A request that fails is recorded with its error and asked again by the next run; after
        `max_consecutive_failures` in a row fail the same way the rest wait for the next run too.
        Ctrl-C keeps the verdicts received and says so.
        """
        questions = self.questions(scoring, records)
        if not questions:
            return
        control = RunControl(self.concurrency)
        takes_control = getattr(self.client, "accepts_run_control", False)

        def ask(question: tuple) -> tuple[Reply | None, ClientError | None]:
            request = Request(judge_prompt(question[2], question[3]))
            try:
                if takes_control:
                    return Reply.of(self.client.generate(request, control)), None
                return Reply.of(self.client.generate(request)), None
            except ClientError as e:
                return None, e

        workers = scheduling.Workers(self.concurrency, ask)
        streak = scheduling.Streak(self.max_consecutive_failures)
        bar = progress_lib.Progress(
            "replies", len(questions), verbs=("judging", "judged"), enabled=progress
        )
        in_flight, stop = 0, False
        try:
            for question in questions:
                if stop:
                    break
                workers.submit(question)
                in_flight += 1
                while in_flight > 2 * self.concurrency - 1:
                    in_flight -= 1
                    stop |= self._keep(workers.next_done(), streak, bar)
            while in_flight:
                in_flight -= 1
                self._keep(workers.next_done(), streak, bar)
        except BaseException as e:
            control.abandon()
            workers.stop()
            # Verdicts that came back alongside are kept; abandoned requests are asked again.
            while not workers.done.empty():
                done = workers.done.get_nowait()
                if done[3] is None and not isinstance(done[2], Abandoned):
                    self._keep(done, streak, bar)
            bar.close()
            self.store.close()
            if isinstance(e, KeyboardInterrupt):
                kept = sum(r["error"] is None for r in self.store.records.values())
                raise KeyboardInterrupt(
                    f"{kept} judge verdicts kept in {self.path}; rerun the same command to continue"
                ) from e
            raise
        workers.stop()
        bar.close()
        self.store.close()

    def _keep(self, done: tuple, streak: scheduling.Streak, bar: progress_lib.Progress) -> bool:
        """Appends one verdict (or failure); True when the failures in a row say stop."""
        question, reply, error, crash = done
        if crash is not None:
            raise crash
        key, item_id, options, text = question
        prompt = judge_prompt(options, text)
        record = {
            "id": key,
            "digest": _sha256(prompt),
            "item": item_id,
            "reply_sha256": _sha256(text),
            "judge": self._identity,
        }
        if reply is None:
            record.update(
                verdict=None, said=None, judge_reply=None, error=str(error),
                error_kind=error.kind, usage=None, latency_s=None,
            )  # fmt: skip
        else:
            said, verdict = read_verdict(reply.text, len(options))
            record.update(
                verdict=verdict, said=said, judge_reply=reply.text, error=None,
                error_kind=None, usage=reply.usage, latency_s=reply.latency_s,
            )  # fmt: skip
        self.store.append(record)
        bar.update()
        return streak.add(error)
