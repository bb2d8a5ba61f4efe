"""The one error type that the CLI turns into a one-line message and exit code 2, and how
errors name what was given: a call's arguments, the command line's options, paths."""

from __future__ import annotations

import contextvars
import errno
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

# C0 and C1 controls, and the bidirectional formatting characters (a right-to-left override
# shows a name's text in another order than it holds)
CONTROL_CHARACTERS = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with its control characters written out (ESC as ``\\x1b``, a right-to-left
    override as ``\\u202e``): a name from a trace reaches terminals and text files, where an
    escape sequence in it would act."""
    if not CONTROL_CHARACTERS.search(text):
        return text
    return CONTROL_CHARACTERS.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
        else f"\\u{ord(m.group()):04x}", text)


# Whether a command of the CLI is running (it sets this): an error names what was given as
# the command line spells it there (--phase prefill), and as a call does elsewhere
# (phase='prefill'): a notebook has no --phase to change.
COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("command_line",
                                                                    default=False)
_NOTHING = object()


def argument(option: str, parameter: str, value: object = _NOTHING) -> str:
    """An argument as an error names it: ``--phase prefill`` on the command line (its value
    as given there), ``phase='prefill'`` in a call; with no value, ``--phase`` or ``phase``."""
    if COMMAND_LINE.get():
        return option if value is _NOTHING else f"{option} {value}"
    return parameter if value is _NOTHING else f"{parameter}={value!r}"


def path_argument(value: object, parameter: str) -> Path:
    """``value`` as a Path, or a TypeError naming the ``parameter`` where it is no path (a
    number, None, a list of them: one file goes there)."""
    if isinstance(value, str | os.PathLike):
        return Path(value)
    said = ("a list: one file goes there" if isinstance(value, list | tuple)
            else type(value).__name__)
    raise TypeError(f"{parameter}: a file's path (a str or Path), not {said}")


def path_list(paths: Iterable[str | Path], parameter: str, what: str) -> list[Path]:
    """``paths`` as a list of Paths; one path given where a list goes is a TypeError naming
    the ``parameter`` and ``what`` goes there (iterated, a path would be read a letter a
    file)."""
    if isinstance(paths, str | Path):
        raise TypeError(f"{parameter}: a list of {what}, not one {type(paths).__name__} "
                        f"({str(paths)!r}): give [{str(paths)!r}]")
    return [path_argument(p, f"{parameter}[{i}]") for i, p in enumerate(paths)]


class TraceError(Exception):
    """Input kimi-perf cannot use: a trace, rules or baseline file that cannot be read (it
    names the file and the problem), or, with no file (``path=None``), options that do not go
    together."""

    MAX_PROBLEM = 300

    def __init__(self, path: str | Path | None, problem: str):
        self.path = str(path) if path is not None else None
        # One line, always: library messages (SQLite, JSON) may quote multi-line text, and
        # a file's name may hold a newline or an escape sequence (written out, not acted on)
        problem = printable(" ".join(problem.split()))
        if len(problem) > self.MAX_PROBLEM:
            problem = problem[: self.MAX_PROBLEM - 1] + "…"
        self.problem = problem
        super().__init__(f"{printable(self.path)}: {problem}" if self.path else problem)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation the machine could not make: Python's MemoryError, or torch's (a
    RuntimeError saying so, on the CPU or a GPU)."""
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError)
        and any(words in str(exc) for words in ("can't allocate", "out of memory")))


class NoStepsMatched(TraceError):
    """What was asked to select steps or layers matches nothing in the trace: a step regex,
    a ``--phase``, ``--layers repeat`` / ``nvtx`` / a layer-index group that finds no layers."""


class NoGpuWork(TraceError):
    """A trace with nothing to break down: no kernel or memcpy/memset with a time, and no
    ``op:`` ranges of a decode run on a CPU (a profile whose GPU activity was not recorded)."""


def input_stat(path: Path) -> os.stat_result:
    """``path``'s status, or the one-line error of an input that cannot be read as a file or
    a directory: missing, a symlink loop or to nothing, unreadable, or a pipe, socket or
    device (read from once and its format told by content, it would be read in part, or wait
    forever)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise TraceError(path, stat_problem(path, exc)) from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise TraceError(path, "not a regular file (a pipe, socket or device): save it to a "
                               "file first")
    return st


def stat_problem(path: Path, exc: OSError) -> str:
    """Why ``path`` could not be looked up (``exc``, from its ``stat``), in words."""
    if exc.errno == errno.ENOENT:
        return "a dangling symlink" if path.is_symlink() else "no such file"
    if exc.errno == errno.ELOOP:
        return "a symlink loop"
    return f"cannot read ({exc.strerror or exc})"
