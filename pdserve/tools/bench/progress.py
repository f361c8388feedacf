"""A one-line progress bar on a terminal (stderr): requests done of the planned number, failures,
requests in flight, elapsed time. Off a terminal it prints a line at every tenth of the run instead,
so logs stay readable."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30


class Progress:
    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.done = 0
        self.failed = 0
        self.in_flight = 0
        self._start = time.monotonic()
        self._last_tenth = -1

    def sent(self) -> None:
        self.in_flight += 1
        self._draw()

    def finished(self, success: bool) -> None:
        self.in_flight -= 1
        self.done += 1
        self.failed += 0 if success else 1
        self._draw()

    def _line(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * _WIDTH)
        label = f"{self.label} " if self.label else ""
        return (f"{label}[{bar:<{_WIDTH}}] {self.done}/{self.total} done, {self.failed} failed, "
                f"{self.in_flight} in flight, {time.monotonic() - self._start:.0f} s")

    def _draw(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()
            return
        tenth = int(10 * self.done / self.total) if self.total else 10
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + self._line() + "\n")
            self.stream.flush()
