"""Progress of long loops in a job's log: done/total, rate and the estimated time left.

A job that runs for minutes must say where it is: ``tail -f results/logs/<rule>/...log``
shows a line at most every ``every`` seconds (and at the end), each with an estimate of the
time left from the mean rate so far.
"""

from __future__ import annotations

import logging
import time


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))  # noqa: RUF046 - a numpy float's round is a float
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """``p = Progress(log, "ablation", total=270, unit="heads")``; ``p.advance(k)`` after each piece.

    Logs ``ablation: 90/270 heads (33%), 1m02s elapsed, about 2m04s left`` at most every
    ``every`` seconds, and always when the last piece is done."""

    def __init__(self, log: logging.Logger, what: str, total: int, unit: str = "", every: float = 30.0):
        self.log, self.what, self.total, self.unit, self.every = log, what, max(int(total), 0), unit, every
        self.done = 0
        self.t0 = self._last = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._last >= self.every or self.done >= self.total:
            self._last = now
            self.log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.perf_counter()) - self.t0
        unit = f" {self.unit}" if self.unit else ""
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = f"{self.what}: {self.done}/{self.total}{unit} ({pct:.0f}%), {_clock(elapsed)} elapsed"
        if 0 < self.done < self.total:
            text += f", about {_clock(elapsed / self.done * (self.total - self.done))} left"
        return text
