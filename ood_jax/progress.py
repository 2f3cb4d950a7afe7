"""How far a long job is (a split's evaluation, an MLLM run, its judge): one line, rewritten in
place on a terminal and printed every few seconds elsewhere, and a last line when it is done."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

# On a terminal the line is rewritten at most this often: a fast job does not flood it.
IN_PLACE_S = 0.1


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    """`evaluating NAME: i/N images` while a job runs, `evaluated NAME: N images in T s` at its end
    (`close`).

    `verbs`: the words for the job under way and done; `unit`: what is counted. On a terminal
    (`stream.isatty()`) the line is rewritten in place; elsewhere (logs, CI) a line is printed at
    most every `every_s` seconds, so a short job gets only its last line. `rate` adds the rate
    and, with a `total`, the time left. `update(n, **fields)`: n more done, with fields shown
    after the count (`failed=2` -> ", failed 2"). Disabled, it prints nothing.
    """

    def __init__(
        self,
        name: str,
        total: int | None,
        *,
        unit: str = "item",
        verbs: tuple[str, str] = ("evaluating", "evaluated"),
        stream: TextIO | None = None,
        enabled: bool = True,
        rate: bool = True,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.name, self.total, self.unit, self.verbs = name, total, unit, verbs
        self.stream = stream if stream is not None else sys.stderr
        self.enabled, self.rate, self.every_s, self.clock = enabled, rate, every_s, clock
        self.count, self.fields, self.closed = 0, {}, False
        self.in_place = enabled and self.stream.isatty()
        self.started = self.last = clock()

    def update(self, done: int = 1, **fields: Any) -> None:
        self.count += done
        self.fields.update(fields)
        now = self.clock()
        wait = IN_PLACE_S if self.in_place else self.every_s
        if self.enabled and now - self.last >= wait:
            self.last = now
            self._print(self._line(now), final=False)

    def close(self) -> None:
        """The last line (once, however often it is called)."""
        if self.closed:
            return
        self.closed = True
        if self.enabled:
            elapsed = self.clock() - self.started
            line = f"{self.verbs[1]} {self.name}: {self.count} {self.unit}s in {elapsed:.1f} s"
            self._print(line + self._fields(), final=True)

    def _line(self, now: float) -> str:
        count = f"{self.count}/{self.total}" if self.total is not None else str(self.count)
        line = f"{self.verbs[0]} {self.name}: {count} {self.unit}s"
        elapsed = now - self.started
        if self.rate and elapsed > 0 and self.count:
            speed = self.count / elapsed
            line += f", {speed:.3g} {self.unit}s/s"
            if self.total is not None and self.total >= self.count:
                line += f", {_duration((self.total - self.count) / speed)} left"
        return line + self._fields()

    def _fields(self) -> str:
        return "".join(f", {key} {value}" for key, value in self.fields.items())

    def _print(self, line: str, final: bool) -> None:
        if self.in_place:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
