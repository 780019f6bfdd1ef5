"""Streaming generated text to the terminal with one live status line under it.

`TokenStreamer` is a transformers `TextStreamer`: `generate(..., streamer=...)` hands it
each new token, it writes the finished words to stdout as they come and counts tokens
and time. `LiveOutput` owns the terminal: the text goes to stdout, the status line to
stderr, redrawn in place (at most `REFRESH` times a second) only where stderr is a
terminal, so that piped or captured output holds the text and nothing else.

`TokenStreamer` is built on first use (PEP 562), so that importing this module does not import
transformers (the CLI's `--help` stays fast).

The status reads `PatchHandle.stats()`: host-side ints that the cache updates at the end
of every decode step, before generate hands the step's token to the streamer, so the
numbers are current at every token and reading them costs no device sync.
"""

from __future__ import annotations

import shutil
import time
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

REFRESH = 0.1  # seconds between status redraws
MIB = 2**20

# how `LiveOutput` shows the status line
INLINE = "inline"  # stdout and stderr are terminals: the status sits on the line under the text
SEPARATE = "separate"  # only stderr is a terminal: a `\r`-updated line there
OFF = "off"  # stderr is not a terminal: no live status (the summary still comes)


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _char_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


class LiveOutput:
    """Text on `out`, one status line on `err` (see the module docstring for the modes).

    With both on one terminal the status line lives under the text: before more text is
    written it is erased and the cursor goes back to where the text ended (its column is
    tracked here), and after it the status is drawn again one line below.
    """

    def __init__(self, out: TextIO, err: TextIO, mode: str | None = None) -> None:
        self.out, self.err = out, err
        if mode is None:
            mode = (INLINE if _is_tty(out) else SEPARATE) if _is_tty(err) else OFF
        self.mode = mode
        self.column = 0  # where the text's cursor is on its line
        self.shown = ""  # the status line on screen ("" = none)

    def width(self) -> int:
        """Columns of the terminal (the status line is kept shorter, so that it never wraps)."""
        return max(20, shutil.get_terminal_size((100, 24)).columns)

    def text(self, chunk: str) -> None:
        if not chunk:
            return
        status = self.shown if self.mode == INLINE else ""  # only an inline status is in the text's way
        if status:
            self._hide()
        self.out.write(chunk)
        for char in chunk:
            self.column = 0 if char in "\r\n" else self.column + _char_width(char)
        width = self.width()
        if self.mode == INLINE and self.column >= width:
            self.column %= width
            if self.column == 0:  # the line is exactly full: end it ourselves (the terminal waits to wrap)
                self.out.write("\n")
        self.out.flush()
        if status:
            self._show(status)

    def status(self, line: str) -> None:
        if self.mode == OFF:
            return
        self._hide()
        self._show(line)

    def _show(self, line: str) -> None:
        line = line[: self.width() - 1]
        if self.mode == INLINE:
            self.err.write("\n" + line)
        elif self.mode == SEPARATE:
            self.err.write("\r" + line)
        self.err.flush()
        self.shown = line

    def _hide(self) -> None:
        if not self.shown:
            return
        self.err.write("\r\x1b[K")
        if self.mode == INLINE:
            self.err.write("\x1b[A" + (f"\x1b[{self.column + 1}G" if self.column else ""))
        self.err.flush()
        self.shown = ""

    def close(self) -> None:
        """Erase the status line and end the text's line."""
        self._hide()
        if self.column:
            self.out.write("\n")
            self.column = 0
        self.out.flush()


def human_bytes(n: int) -> str:
    """`10.00 KiB`, `7.03 MiB`, `1.20 GiB`."""
    for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def status_line(tokens: int, rate: float | None, stats: dict[str, int] | None, width: int = 1000) -> str:
    """`57 tokens | 11.2 tok/s | occupancy 150/160 | 3 evictions | KV 7.03 MiB (full cache 12.10 MiB)`;
    the full-cache figure is left out where the line would not fit in `width` columns."""
    parts = [f"{tokens} token{'' if tokens == 1 else 's'}", f"{rate:.1f} tok/s" if rate else "- tok/s"]
    if not stats:
        return " | ".join(parts)
    parts.append(f"occupancy {stats['occupancy']}/{stats['capacity']}")
    parts.append(f"{stats['evictions']} eviction{'' if stats['evictions'] == 1 else 's'}")
    parts.append(f"KV {human_bytes(stats['kv_bytes'])}")
    line = " | ".join(parts)
    full = f" (full cache {human_bytes(full_cache_bytes(stats))})"
    return line + full if len(line + full) < width else line


def full_cache_bytes(stats: dict[str, int]) -> int:
    """K+V bytes a full (never-evicting) cache would hold for the same tokens: the patched
    buffers' bytes per slot times the tokens seen (exactly what transformers' dynamic
    cache holds, in the same dtype)."""
    if not stats.get("capacity"):
        return 0
    return stats["kv_bytes"] // stats["capacity"] * stats["tokens_seen"]


class _TokenStreaming:
    """Writes the generated text through `live` as it comes, counts tokens and time, and
    keeps the status line current. `stats` (e.g. `handle.stats`) is read at every token
    until the first eviction, to note when it happened: a few dozen host ints, microseconds.
    (The body of `TokenStreamer`, a transformers `TextStreamer`.)"""

    def __init__(
        self,
        tokenizer: Any,
        live: LiveOutput,
        stats: Callable[[], dict[str, int]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.live, self.stats, self.clock = live, stats, clock
        self.tokens = 0
        self.started = self.first = self.last = self.drawn = 0.0
        self.first_evicted: int | None = None
        """Index of the first generated token computed from an evicted cache (None: no eviction).
        A step evicts after its attention, so the token it yields saw the whole cache."""

    def put(self, value: Any) -> None:
        now = self.clock()
        if self.next_tokens_are_prompt:  # generate hands over the prompt first, before the prefill
            self.started = self.last = self.drawn = now
            self.live.status(f"prefill of {value.shape[-1]} prompt tokens ...")
            super().put(value)
            return
        if self.tokens == 0:
            self.first = now
        self.tokens += value.numel()
        self.last = now
        self._note_eviction()
        super().put(value)
        if now - self.drawn >= REFRESH or self.tokens == 1:
            self.drawn = now
            stats = self.stats() if self.stats else None
            self.live.status(status_line(self.tokens, self.decode_rate, stats, self.live.width()))

    def _note_eviction(self) -> None:
        if self.stats is not None and self.first_evicted is None and self.stats()["evictions"]:
            self.first_evicted = self.tokens

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.live.text(text)
        if stream_end:
            self.live.close()

    @property
    def seconds(self) -> float:
        """From the call to generate to the last token."""
        return self.last - self.started

    @property
    def prefill_seconds(self) -> float:
        return self.first - self.started if self.tokens else self.seconds

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first one (the prompt's prefill excluded)."""
        span = self.last - self.first
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else None


if TYPE_CHECKING:
    from transformers import TextStreamer

    class TokenStreamer(_TokenStreaming, TextStreamer):
        """`_TokenStreaming` as a transformers `TextStreamer`."""


def __getattr__(name: str) -> Any:
    if name != "TokenStreamer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from transformers import TextStreamer

    cls = type(
        "TokenStreamer", (_TokenStreaming, TextStreamer), {"__module__": __name__, "__doc__": _TokenStreaming.__doc__}
    )
    globals()["TokenStreamer"] = cls
    return cls
