"""``kimi-perf``: thin click commands over the library API."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import shlex
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kimi_perf import gate as gate_mod
from kimi_perf import render
from kimi_perf import runs as runs_mod
from kimi_perf.attribution import range_kernel_summary
from kimi_perf.classify import load_rules
from kimi_perf.comparison import (
    compare_files,
    compute_units,
    device_overviews,
    overview,
    type_pairs,
)
from kimi_perf.decode import floors as floors_mod
from kimi_perf.decode.fallbacks import fell_back_text, paths_that_fell_back
from kimi_perf.errors import COMMAND_LINE, TraceError, is_out_of_memory
from kimi_perf.layer_breakdown import note_lines, units_word
from kimi_perf.layers import PHASES
from kimi_perf.readers import read_trace
from kimi_perf.text import also_as, counted, distinct_words, header_labels
from kimi_perf.trace import (
    GPU_RANGE,
    atomic_write_text,
    check_not_read_only,
    json_text,
    named_descriptor,
    printable,
    whole_stdout,
)

if TYPE_CHECKING:
    from rich.console import Console

    from kimi_perf.capture import TraceRequest
    from kimi_perf.layer_breakdown import Breakdown

LAYERS_HELP = ("auto: per-layer ranges when the trace has them, else the repeating kernel "
               "pattern; repeat: the pattern only; nvtx or nvtx:REGEX: ranges only (REGEX may "
               "name groups 'index' and 'type')")


# A shell's status for a command its reader left (SIGPIPE): not 1, which `gate` gives a
# regression
BROKEN_PIPE = 141


def _stdout_to_devnull() -> None:
    """Whatever the command still prints goes nowhere (the reader went away)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@contextlib.contextmanager
def _reader_may_leave():
    """Output whose reader may go away (`| head`) without changing what the command does
    after it (gate: its --update and its exit code, the verdict)."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()


def _help_of_option(exc: TraceError) -> str:
    """Where an option's value (``--layers bogus``) or options together are the problem, the
    command's help, as for click's own usage errors."""
    ctx = click.get_current_context(silent=True)
    if exc.path is None and exc.problem.startswith("--") and ctx is not None:
        return f" (see {ctx.command_path} --help)"
    return ""


def _fail_cleanly(fn):
    """Bad input ends in one line on stderr and exit code 2, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TraceError as exc:
            _interrupted_first()
            click.echo(f"kimi-perf: error: {exc}{_help_of_option(exc)}", err=True)
            sys.exit(2)
        except BrokenPipeError:  # the reader went away (`| head`): nothing left to say
            _stdout_to_devnull()
            sys.exit(BROKEN_PIPE)
        except OSError as exc:  # a file the command was pointed at, not a bug of ours
            _interrupted_first()
            where = f"{printable(str(exc.filename))}: " if exc.filename else ""
            click.echo(f"kimi-perf: error: {where}{exc.strerror or exc}", err=True)
            sys.exit(2)
    return wrapper


@contextlib.contextmanager
def _memory_said(sizes: str, smaller: str = "batch, context or step count"):
    """A run whose buffers (KV cache, activations: ``sizes`` says what asked for them; to
    make ``smaller``) the machine cannot allocate ends in one line, not torch's traceback.
    (The weights are checked before any work: ``memory_problem``.)"""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # torch's CPU message leads with its source line; the size asked for is what says
        asked = re.search(r"tried to allocate (\d+) bytes|tried to allocate ([\d.]+ \w+)",
                          said, re.IGNORECASE)
        if asked:
            size = (f"{int(asked.group(1)) / 1e9:,.1f} GB" if asked.group(1)
                    else asked.group(2))
            said = f"an allocation of {size} failed"
        raise TraceError(None, f"out of memory for {sizes} ({said}): take a smaller "
                               f"{smaller}") from None


class NamedPath(click.Path):
    """A file or directory named on the command line: an empty name names none (as a path
    it would be ".", the current directory, read or written by mistake); a name ending in /
    names a directory (a Path drops the /: a file of that name would be read, or written
    where a directory was meant). ``file``: a file to write, which such a name cannot be;
    ``placed``: in a folder that is there, not a directory itself (said before the work;
    gate's verdicts are checked by the gate, which first removes last night's)."""

    def __init__(self, file: bool = False, placed: bool = False):
        super().__init__(path_type=Path)
        self.file, self.placed = file, placed

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value:
            self.fail("an empty file name", param, ctx)
        if not isinstance(value, str):
            return super().convert(value, param, ctx)
        said = printable(value)   # (a newline in it would split the error's line)
        if value.endswith("/") and value.strip("/"):
            if self.file:
                self.fail(f"{said}: names a directory (its trailing /), not a file to write",
                          param, ctx)
            if os.path.lexists(value.rstrip("/")) and not os.path.isdir(value):
                self.fail(f"{said}: not a directory, as its trailing / says", param, ctx)
        if self.placed and value != "-":
            # said before the work (a trace read for a minute, then nowhere to write)
            if os.path.isdir(value):
                self.fail(f"{said}: cannot write: it is a directory", param, ctx)
            if not os.path.isdir(os.path.dirname(value) or "."):
                self.fail(f"{said}: cannot write: no such directory", param, ctx)
        return super().convert(value, param, ctx)


PATH = NamedPath()
OUTPUT_FILE = NamedPath(file=True, placed=True)
VERDICT_FILE = NamedPath(file=True)


class Count(click.IntRange):
    """A whole number in range, said so when it is not one (click's words: "not a valid
    integer range")."""

    name = "integer"


class FiniteFloatRange(click.FloatRange):
    """A float in range, and a number: nan passes every bound, and inf is no tolerance."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def _not_an_input(output: Path | None, *inputs: Path | None) -> None:
    """Refuse an output that is one of the command's inputs (a run directory stands for its
    breakdown.json and run.json, a trace in one for the run.json read with it): writing it
    would destroy what is being read."""
    if (given := _input_it_is(output, *inputs)) is not None:
        raise TraceError(output, f"is an input of this command ({given}): writing it would "
                                 "destroy it")


def _input_it_is(output: Path | None, *inputs: Path | None) -> Path | None:
    """The input (as given) that ``output`` is, or that holds it; None if none."""
    if output is None or str(output) == "-" or not output.exists():
        return None
    for given in filter(None, inputs):
        read = ([given / "breakdown.json", given / "run.json"] if given.is_dir()
                else [given, given.parent / "run.json"] if runs_mod.captured_path(given) is not None
                else [given])
        for file in read:
            with contextlib.suppress(OSError):
                if os.path.samefile(output, file):
                    return given
    return None


def _echo(text: str, nl: bool = True) -> None:
    """``click.echo``, whose reader's leaving mid-way (`| head`) the command hears of
    (``WholeWrites``)."""
    text += "\n" if nl else ""
    if (out := whole_stdout()) is None:
        click.echo(text, nl=False)
        return
    out.write(text.encode(sys.stdout.encoding or "utf-8", sys.stdout.errors or "strict"))


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        _echo(text, nl=False)
    else:
        atomic_write_text(output, text)


def _emit_tables(tables: list, output: Path | None) -> None:
    """Tables to the terminal, or as plain text to ``output``."""
    if output is None:
        render.print_tables(tables)
    else:
        atomic_write_text(output, render.tables_text(tables))


TRACE_OPTIONS = ("layers", "step_regex", "phase", "rules")  # how a trace is broken down


def _command_said() -> str:
    """The command as given, from what click parsed of it: ``kimi-perf CMD``, the options the
    command line gave with their values, then the arguments."""
    ctx = click.get_current_context()
    options, arguments = [], []
    for p in ctx.command.params:
        if ctx.get_parameter_source(p.name) is not click.core.ParameterSource.COMMANDLINE:
            continue
        values = ctx.params[p.name]
        values = list(values) if isinstance(values, tuple | list) else [values]
        if isinstance(p, click.Argument):
            arguments += map(str, values)
        elif isinstance(p, click.Option) and p.is_flag:
            options.append(max(p.opts if values[0] else p.secondary_opts, key=len))
        else:
            options += [w for v in values for w in (max(p.opts, key=len), str(v))]
    return shlex.join(["kimi-perf", ctx.info_name, *options, *arguments])


def _given(*names: str) -> list[str]:
    """The options among these parameter names that the command line gave, as spelled there."""
    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    return [max(params[n].opts, key=len) for n in names
            if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]


def _no_trace_among(files: list[Path], say_stored: bool = True) -> None:
    """Options that break traces down, given where every input is a stored breakdown, would
    change nothing: say so rather than ignore them. Where some are (a stored baseline beside
    a new trace), the options break the traces down alone: a note says which stored input was
    broken down otherwise (``say_stored``; the gate says it of its own)."""
    if not (given := _given(*TRACE_OPTIONS)):
        return
    stored = [f for f in files if runs_mod.is_stored(f)]
    verb = "applies" if len(given) == 1 else "apply"
    if len(stored) == len(files):
        what = "is a stored breakdown" if len(files) == 1 else "are stored breakdowns"
        raise TraceError(None, f"{', '.join(given)} {verb} to traces, and "
                               f"{', '.join(map(str, files))} {what}")
    for file in stored if say_stored else []:
        if otherwise := _stored_otherwise(file):
            click.echo(printable(f"note: {', '.join(given)} {verb} to the traces alone: {file} "
                                 f"is a stored breakdown, broken down with {otherwise}"),
                       err=True)


# each option that breaks a trace down, as a stored breakdown records it
RECORDED_AS = {"layers": "layers", "step_regex": "steps", "phase": "phase", "rules": "rules"}


def _stored_otherwise(file: Path) -> str | None:
    """How a stored breakdown's options differ from those the command line gave (each as its
    ``source.breakdown_options`` records it: the rules by ``rules_said``), said; None where
    they agree."""
    from kimi_perf.classify import load_rules, rules_said

    ctx = click.get_current_context()
    asked = {name: ctx.params[name] for name in RECORDED_AS if name in ctx.params
             and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}
    if "rules" in asked:
        asked["rules"] = rules_said(load_rules(asked["rules"]))
    runs, _ = runs_mod.stored_breakdowns(file)
    said = []
    for name, value in asked.items():
        held = {(b.source.get("breakdown_options") or {}).get(RECORDED_AS[name], "unrecorded")
                for b in runs.values()}
        if held != {value}:
            option = "--steps" if name == "step_regex" else f"--{name}"
            said.append(f"{option} " + " and ".join(
                "(unrecorded)" if v == "unrecorded" else "(the default)" if v is None else repr(v)
                for v in sorted(held, key=str)))
    return ", ".join(said) or None


def _layers_option(fn):
    return click.option("--layers", default="auto", show_default=True, help=LAYERS_HELP)(fn)


def _phase_option(fn):
    return click.option("--phase", type=click.Choice(PHASES), default="auto", show_default=True,
                        help="which steps count, by the phase their names say (vLLM's "
                        "execute_... annotation, decode_step[i]): auto keeps the decode steps "
                        "when others are prefill or mixed; all keeps every step")(fn)


def _capture_option(fn):
    return click.option("--capture", type=PATH,
                        help="a trace of the same process, saved apart, that recorded the "
                        "CUDA/HIP graph captures TRACE replays (vLLM profiles its capture at "
                        "start-up): joined to TRACE, it places replayed kernels in the ranges "
                        "open at capture")(fn)


def _steps_option(fn):
    return click.option("--steps", "step_regex", help="regex for step ranges (default: "
                        "decode_step[i], step[i], vLLM's execute_... annotations, "
                        "execute_model, a layerwise NVTX root module, ProfilerStep#N; the "
                        "first that finds GPU work)")(fn)


def _rules_option(fn):
    return click.option("--rules", type=PATH, help="TOML file of extra kernel-class rules, "
                        "tried before the defaults")(fn)


def _format_option(choices: list[str]):
    """--format of a command that writes with -o: what the -o file's suffix names where it is
    not given (``-o gate.json``: JSON, not a table in a .json file); ``_format_of`` picks."""
    named = ", ".join(f".{c}" for c in choices if c != "table")
    return click.option("--format", "fmt", type=click.Choice(choices),
                        help=f"[default: table, or what -o's suffix names: {named}]")


# Suffixes of what these commands never write: a report (report's), a .kptrace (convert's)
# and traces. -o so named is refused whatever --format says: a table, or JSON, there would
# replace a run's report or a capture, or pass for one.
NOT_WRITTEN = {"html": "a report (kimi-perf report writes one)",
               "kptrace": "a .kptrace (kimi-perf convert writes one)",
               **dict.fromkeys(("sqlite", "gz", "nsys-rep", "qdrep"), "a trace's name")}


def _format_of(fmt: str | None, output: Path | None, choices: tuple[str, ...]) -> str:
    """--format as given, else the format the -o file's suffix names, else table; a suffix
    naming a format the command lacks (floors has no CSV) is an error, not a table in it, and
    a report's, a .kptrace's or a trace's suffix (``NOT_WRITTEN``) whatever the format."""
    suffix = output.suffix.lower().removeprefix(".") if output is not None else ""
    if suffix in NOT_WRITTEN:
        raise TraceError(None, f"-o {printable(str(output))}: {NOT_WRITTEN[suffix]}, not what this "
                               "command writes: name the file otherwise")
    if fmt is not None:
        return fmt
    if suffix in ("csv", "json") and suffix not in choices:
        formats = ["table", *(c for c in choices if c != "table")]
        raise TraceError(None, f"-o {printable(str(output))}: no {suffix} format here "
                               f"({', '.join(formats[:-1])} or {formats[-1]}): give --format, "
                               "or another name")
    return suffix if suffix in choices and suffix != "table" else "table"


def _kernels_option(fn):
    return click.option("--kernels", is_flag=True, help="also each layer type's typical "
                        "layer, kernel by kernel: its kernels in order with their median "
                        "µs")(fn)


def _seed_option(fn):
    # (seed + 1 draws the prompt: both fit torch's 64-bit generator seed)
    return click.option("--seed", default=0, show_default=True, type=Count(0, 2**63 - 1),
                        help="draws the random weights, the prompt and, with --spec-tokens, "
                        "the drafts and their acceptance")(fn)


def _kv_cache_option(fn, bf16: str = "bf16"):
    return click.option("--kv-cache", type=click.Choice(["bf16", "fp8"]), default="bf16",
                        show_default=True,
                        help=f"the latent KV cache's storage: {bf16}, or fp8 e4m3 with a "
                        "per-tensor scale (the absorbed query fp8 too), as vLLM's "
                        "fp8 cache")(fn)


def _experts_option(fn):
    return click.option("--experts", type=click.Choice(["bf16", "mxfp4"]), default="bf16",
                        show_default=True,
                        help="routed experts' storage: bf16, or MXFP4 as K3's checkpoint "
                        "stores them (their values rounded to it; the kernel paths stream "
                        "the codes and scales)")(fn)


def _preset_config(name: str, tp: int | None = None):
    """The preset's config (sharded over ``tp``), checked the same way for every command:
    an unknown preset or a TP that does not divide it is a one-line error."""
    from kimi_perf.decode.config import preset

    try:
        return preset(name, tp=tp)
    except (KeyError, ValueError) as exc:   # (an unknown preset; a TP that does not fit it)
        option = "--preset" if isinstance(exc, KeyError) else "--tp"
        raise TraceError(None, f"{option}: {exc.args[0] if exc.args else exc}") from None


def _mxfp4_fits(config, experts: str) -> None:
    """``--experts mxfp4`` where a rank's expert matrices are not whole groups of 32 values
    (``tiny --tp 4``): a one-line error before any work."""
    from kimi_perf.decode.config import mxfp4_problem  # (no torch: floors checks it too)

    if experts == "mxfp4" and (problem := mxfp4_problem(config)):
        raise TraceError(None, f"--experts mxfp4: {problem}")


def _sharding(tp: int) -> int | None:
    """The TP a capture's --tp shards its preset over: none in one process (a sharded
    preset, k3-tp8, runs its one rank's shapes)."""
    return tp if tp != 1 else None


def _check_layers(value: str) -> str:
    if value in ("auto", "repeat", "nvtx") or value.startswith("nvtx:"):
        if value.startswith("nvtx:"):
            try:
                re.compile(value[5:])
            except re.error as exc:
                raise TraceError(None, f"--layers: bad regex ({exc})") from None
            if value[5:] and re.search(value[5:], ""):   # (nvtx: alone is the default's)
                raise TraceError(None, f"--layers {value!r}: the regex matches an empty "
                                       "name, so every range: name the layer ranges")
        return value
    raise TraceError(None, f"--layers must be auto, repeat, nvtx or nvtx:REGEX, not {value!r}")


def _count_of(option: str, value: str | None, what: str, least: int = 1,
              most: int | None = None) -> int | None:
    """A capture's count (``least`` to ``most``), from an option that takes a pattern with
    --from."""
    if value is None:
        return None
    if not (value.isascii() and value.isdecimal()) or int(value) < least or (
            most is not None and int(value) > most):
        raise TraceError(None, f"{option} takes {what}, not {value!r}")
    return int(value)


# The most layers a capture or a check builds: K3 has 93; a model of more would be no decode
# model anyone runs, and its weights' table alone (a row a tensor) takes minutes to lay out.
MAX_LAYERS = 1024


def _check_steps(value: str | None) -> str | None:
    """A --steps regex; a bare number is a count given where a regex is wanted (trace's
    --steps is a count without --from), refused rather than matched against names."""
    if value is not None:
        if not value:   # (it read as no --steps: the default's steps, without a word)
            raise TraceError(None, "--steps '': an empty regex finds every range: name the "
                                   "step ranges, or leave --steps out for the default's")
        if value.strip().isdigit():
            raise TraceError(None, f"--steps takes a regex for the step ranges here, not a "
                                   f"count ({value!r}; a range named {value.strip()} is "
                                   f"'^{value.strip()}$')")
        try:
            re.compile(value)
        except re.error as exc:
            raise TraceError(None, f"--steps: bad regex ({exc})") from None
        if re.search(value, ""):   # ('.*': every op range a step of one op)
            raise TraceError(None, f"--steps {value!r}: the regex matches an empty name, so "
                                   "every range: name the step ranges")
    return value


INFO_PROCESSES = 8   # processes info lists one by one


LONG_NUMBER = re.compile(r"\d{25,}")


class UsageErrorLine(click.ClickException):
    """A usage error (a bad option value, an unknown option or command) as the one line every
    other bad input gets, naming where the help is, instead of click's usage block."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"kimi-perf: error: {self.format_message()}", err=True)


class Terminated(BaseException):
    """SIGTERM, raised where the command is, so that what it was writing is removed on the
    way out, as for Ctrl-C (a temporary file, a run directory not yet complete)."""


# The signals the command got: an error raised while one unwinds (a profiler stopped halfway
# may assert on the way out) is the interruption's, not a failure of its own
_signalled: list[int] = []


def _terminate(signum, frame) -> None:
    _signalled.append(signum)
    raise Terminated


def _interrupt(signum, frame) -> None:
    _signalled.append(signum)
    raise KeyboardInterrupt


def _interrupted_first() -> None:
    """Raise the interruption again where an error came while it unwound."""
    if signal.SIGTERM in _signalled:
        raise Terminated
    if signal.SIGINT in _signalled:
        raise KeyboardInterrupt


class KimiPerfGroup(click.Group):
    """The CLI: click's group, its usage errors one line each; an interrupted command says so
    and exits 130 (Ctrl-C) or 143 (SIGTERM), not 1, which ``gate`` gives a regression."""

    _command: str | None = None   # the command being run, once resolved

    def _one_line(self, exc: click.UsageError) -> UsageErrorLine:
        # (click's parser raises some errors, an option missing its value, with no context:
        # their help is the command's all the same)
        where = (exc.ctx.command_path if exc.ctx else
                 f"kimi-perf {self._command}" if self._command else "kimi-perf")
        # a number of hundreds of digits given for a count, quoted back, in a few
        message = LONG_NUMBER.sub(lambda m: f"{m[0][:6]}…({len(m[0])} digits)",
                                  exc.format_message())
        return UsageErrorLine(f"{message} (see {where} --help)")

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        self._command = name
        return name, command, rest

    def make_context(self, *args, **kwargs):
        self._command = None
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:
            raise                      # no arguments at all: the help, as click shows it
        except click.UsageError as exc:
            raise self._one_line(exc) from None

    def invoke(self, ctx: click.Context):
        if sys.stdout is None:    # (Python's, where the shell closed it: `>&-`)
            click.echo("kimi-perf: error: stdout is closed: there is nowhere to write (give "
                       "the output a file, or /dev/null)", err=True)
            sys.exit(2)
        for stream in (sys.stdout, sys.stderr):
            # what the terminal's encoding cannot write (µs in ASCII) shown as "?", one
            # character for one (a table's columns stay aligned), not the command's end
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(errors="replace")
        main_thread = threading.current_thread() is threading.main_thread()
        handlers = {signal.SIGTERM: _terminate}
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            handlers[signal.SIGINT] = _interrupt   # (not where the caller ignores Ctrl-C)
        previous = {n: signal.signal(n, h) for n, h in handlers.items()} if main_thread else {}
        _signalled.clear()
        on_command_line = COMMAND_LINE.set(True)   # (errors name options, not parameters)
        try:
            try:
                return super().invoke(ctx)
            except Exception:
                _interrupted_first()
                raise
        except click.UsageError as exc:
            raise self._one_line(exc) from None
        except KeyboardInterrupt:
            click.echo("kimi-perf: interrupted", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("kimi-perf: terminated", err=True)
            sys.exit(143)
        finally:
            _signalled.clear()   # (a later command in this process, a notebook's, got none)
            COMMAND_LINE.reset(on_command_line)
            for number, handler in previous.items():
                if handler is not None:   # None: a handler not set from Python
                    signal.signal(number, handler)


@click.group(cls=KimiPerfGroup)
@click.version_option(package_name="kimi-perf")
def main() -> None:
    """Per-layer kernel counts and µs from nsys and PyTorch-profiler traces.

    A TRACE is an nsys SQLite export (.sqlite, .sqlite.gz), an nsys report (.nsys-rep,
    .qdrep: exported by the Nsight Systems CLI, KIMI_PERF_NSYS or nsys on PATH, unless an
    export no older is beside it), a PyTorch-profiler trace (Kineto JSON, .json, .json.gz) or a
    .kptrace; where a command takes a directory, the traces in it.
    """


@main.command(short_help="Kernels per range, as nsys stats' nvtx_kern_sum report")
@click.argument("trace", type=PATH)
@_format_option(["csv", "table", "json"])
@click.option("--match", "pattern", help="only the ranges whose name this regex finds "
              "(Python's re.search: 'FlashAttn', '^decode')")
@click.option("--top", default=render.RANGES_TABLE_ROWS, show_default=True,
              type=Count(1), help="the table's rows: those with the most kernel "
              "time (CSV and JSON: all)")
@click.option("-o", "--output", type=OUTPUT_FILE, help="write here, not stdout")
@_fail_cleanly
def ranges(trace: Path, fmt: str | None, pattern: str | None, top: int,
           output: Path | None) -> None:
    """Kernels per range, as `nsys stats --report nvtx_kern_sum` attributes them."""
    fmt = _format_of(fmt, output, ("csv", "json"))
    _not_an_input(output, trace)
    try:
        wanted = re.compile(pattern) if pattern is not None else None
    except re.error as exc:
        raise TraceError(None, f"--match: bad regex ({exc})") from None
    read = read_trace(trace)
    rows = range_kernel_summary(read)
    if wanted is not None:
        rows = [r for r in rows if r.range is not None and wanted.search(r.range)]
    if fmt == "table":
        _emit_tables([render.ranges_table(rows, top, str(trace))], output)
    else:
        _emit(render.ranges_csv(rows) if fmt == "csv"
              else render.ranges_json(rows, str(trace)), output)
    on_streams = int((read.ranges.style == GPU_RANGE).sum())
    in_none = len(read.ranges) == on_streams and len(read.kernels)   # (every row "(none)")
    if untimed := read.meta.get("untimed_ranges"):   # (a step of them would be missing)
        click.echo(f"{printable(str(trace))}: {counted(untimed, 'range')} without a time (a "
                   "missing or negative dur) left out, holding no kernel"
                   + (": every kernel is in none" if in_none and not on_streams else ""),
                   err=True)
    if in_none and (on_streams or not untimed):   # (why every row is "(none)")
        said = ("no ranges (NVTX, record_function)" if not untimed
                else "no other ranges on a thread")
        click.echo(f"{printable(str(trace))}: this trace holds {said}: every kernel is in "
                   "none" + (f" (GPU streams' ranges, Kineto's gpu_user_annotation: "
                             f"{on_streams} here, are not what kernels are attributed by, "
                             "the ranges open on the thread that launched them)"
                             if on_streams else ""), err=True)
    elif not rows:   # (an empty table alone would look like a failure to read)
        if wanted is not None and len(read.kernels):
            why = f"no range that --match {pattern!r} finds holds a kernel"
        elif len(read.kernels):
            why = "no range holds a kernel"
        else:
            cpu_run = not len(read.memops) and len(read.annotated_ops())
            why = "no GPU kernels in this trace" + (
                " (a CPU run: its launches are its op: ranges, which kimi-perf breakdown "
                "counts)" if cpu_run else "")
        click.echo(f"{printable(str(trace))}: {why}", err=True)


EXAMPLE_TRACE = (Path(__file__).parent / "examples"
                 / "vllm_gptoss20b_decode_fullgraph_mi300x.json.gz")


@main.command(name="breakdown", short_help="Kernels and µs per step, layer and layer type")
@click.argument("trace", type=PATH, required=False)
@_format_option(["table", "json", "csv"])
@_layers_option
@_steps_option
@_phase_option
@_rules_option
@click.option("--path", "path_name", help="the decode path to show from a run that holds "
              "several (standard, specialized, ...)")
@_capture_option
@_kernels_option
@click.option("-o", "--output", type=OUTPUT_FILE, help="write here, not stdout")
@_fail_cleanly
def breakdown_cmd(trace: Path | None, fmt: str | None, layers: str, step_regex: str | None,
                  phase: str, rules: Path | None, path_name: str | None, capture: Path | None,
                  kernels: bool, output: Path | None) -> None:
    """Per step and layer: kernels, kernel µs, span µs, gap µs, per class; medians per type.

    Without TRACE, analyses the embedded example: one vLLM GPT-OSS-20B decode step under a
    full HIP graph (see kimi_perf/examples/README.md).
    """
    given, fmt = fmt, _format_of(fmt, output, ("json", "csv"))
    if kernels and fmt != "table":
        chosen = (f"--format {fmt}" if given else
                  f"-o {printable(str(output))} writes {fmt.upper()} (its suffix; --format "
                  "table keeps the tables), which")
        raise TraceError(None, f"--kernels adds tables to the table format; {chosen} "
                               + ("holds each layer type's typical layer already" if fmt == "json"
                                  else "writes a row per layer"))
    trace = trace or EXAMPLE_TRACE
    _not_an_input(output, trace, rules, capture)
    _no_trace_among([trace])
    b = runs_mod.load_breakdown(trace, path_name, phase, capture, layers=_check_layers(layers),
                                rules=rules, step_regex=_check_steps(step_regex))
    if fmt == "table":
        typical = [render.typical_layer_table(t["type"] or "-", {"": t}, b.unit)
                   for t in b.layer_types] if kernels else []
        _emit_tables(render.breakdown_tables(b) + typical, output)
    elif fmt == "csv" and not b.layers:   # (a header alone would pass for a result)
        raise TraceError(trace, f"no layers found in its {counted(len(b.steps), 'step')}: the "
                                "CSV holds a row per layer; --format json or the table gives "
                                "the steps")
    else:
        _emit(render.breakdown_json(b) if fmt == "json" else render.breakdown_csv(b), output)


@main.command(name="compare", short_help="Traces or runs side by side, per layer type")
@click.argument("a", type=PATH)
@click.argument("b", type=PATH, required=False)
@click.option("--path", "path_name", help="the decode path to take from a run that holds "
              "several (standard, specialized, ...)")
@_format_option(["table", "json"])
@_layers_option
@_steps_option
@_phase_option
@_rules_option
@click.option("--labels", help="names for A and B, comma-separated (default: the file names, "
              "in the table without the words both share, or #1 and #2 where still long, "
              "said under it; or a run's path names)")
@_kernels_option
@click.option("-o", "--output", type=OUTPUT_FILE, help="write here, not stdout")
@_fail_cleanly
def compare_cmd(a: Path, b: Path | None, path_name: str | None, fmt: str | None, layers: str,
                step_regex: str | None, phase: str, rules: Path | None, labels: str | None,
                kernels: bool, output: Path | None) -> None:
    """A and B side by side per layer type.

    A and B: traces, breakdown JSON files, or `kimi-perf trace` runs (the run directory or its
    breakdown.json; --path picks the decode path). With A alone, a run: its first two paths
    (standard vs specialized).
    """
    fmt = _format_of(fmt, output, ("json",))
    pair = _split_labels(labels, ["A", "B"]) if labels is not None else None
    _not_an_input(output, a, b, rules)
    layers, step_regex = _check_layers(layers), _check_steps(step_regex)   # (before a note)
    _no_trace_among([a] if b is None else [a, b])
    c = compare_files(a, b, path_name, pair, fmt != "json", phase, layers=layers, rules=rules,
                      step_regex=step_regex)
    if fmt == "json":
        _emit(json_text(c.to_json(kernels)), output)
        return
    unit, unit_b = c.a.unit, c.b.unit
    headline = render.comparison_headline(c.rows, c.label_a, c.label_b, unit, unit_b)
    tables = [render.comparison_table(c.rows, c.label_a, c.label_b, unit, unit_b),
              *([headline] if headline else []),
              *([c.labels_said] if c.labels_said else []), *c.side_notes, *c.fell_back]
    # (a side that is one file of a TP job: which of its ranks is slow)
    sides = {c.label_a: c.a, c.label_b: c.b}
    tables += [render.overview_table(rows, units_word([sides[label].unit]), of=label)
               for label, rows in c.devices.items()]
    for type_pair in type_pairs(c.a, c.b, c.rows) if kernels else ():
        tables.append(render.typical_layer_table(
            type_pair.label, {c.label_a: type_pair.a, c.label_b: type_pair.b},
            units_word((unit, unit_b))))
        if type_pair.ledger is not None:
            swapped, ledger_rows, left = type_pair.ledger
            standard, specialized = ((c.label_b, c.label_a) if swapped
                                     else (c.label_a, c.label_b))
            tables.append(render.fusion_table(type_pair.label, standard, specialized,
                                              ledger_rows, left, "ops" in (unit, unit_b),
                                              specialized_first=swapped))
    _emit_tables(tables, output)


@main.command(name="gate", short_help="A run against a stored baseline: exit 1 on a regression")
@click.argument("baseline", type=PATH)
@click.argument("run", type=PATH)
@click.option("--metrics", help="what to check: kernels (per layer, exact), kernel_us, "
              "span_us  [default: what the baseline keeps, else all three; kernels alone "
              "where both sides are CPU runs]")
@click.option("--rel-tol", default=0.05, show_default="0.05, or what the baseline keeps",
              type=FiniteFloatRange(0),
              help="a time regresses only past this relative rise of its median")
@click.option("--abs-tol", default=1.0, show_default="1, or what the baseline keeps",
              type=FiniteFloatRange(0),
              help="... and past this rise in µs (figures near 0: a kernel under a µs, a "
              "trace in whole µs)")
@click.option("--alpha", default=0.01, show_default="0.01, or what the baseline keeps",
              type=FiniteFloatRange(0, 1, min_open=True, max_open=True),
              help="... and when the Mann-Whitney U test's p-value is below this")
@_format_option(["table", "json"])
@click.option("--all", "show_all", is_flag=True, help="list the checks that pass too")
@click.option("--path", "path_name", help="check only this decode path (a trace given for "
              "BASELINE or RUN stands for it)")
@_layers_option
@_steps_option
@_phase_option
@_rules_option
@click.option("--update", is_flag=True, help="then store the run as the new baseline, with "
              "the tolerances given (or those it kept): later gates use them unless given "
              "others")
@click.option("--spread-from", "spread_from", type=PATH, multiple=True, help="with --update: "
              "another run of RUN's code, captured alike (four or more): the baseline keeps "
              "how much the times move run to run, and later gates pass a time within that "
              "spread as noise (a baseline stored without it keeps none)")
@click.option("-o", "--output", type=VERDICT_FILE, help="write the verdict here (the table as "
              "text, or the JSON), not stdout; where the gate cannot run with its inputs and "
              "options (exit 2), none: an earlier verdict there is removed (a usage error, "
              "an unknown option or a name refused, .xml say, stops it before it starts)")
@click.option("--junit", type=VERDICT_FILE, help="also write the verdict as JUnit XML here (a test "
              "case per check, for a CI server's test report); removed where the gate cannot "
              "run, as -o is")
@click.option("--strict", is_flag=True, help="fail too where the baseline and the run were "
              "captured differently (preset, layers, batch, TP, device, ...) or broken down "
              "differently (--steps, --layers, --phase, --rules): a nightly job against the "
              "wrong baseline")
@_fail_cleanly
def gate_cmd(baseline: Path, run: Path, metrics: str | None, rel_tol: float, abs_tol: float,
             alpha: float, fmt: str | None, show_all: bool, path_name: str | None, layers: str,
             step_regex: str | None, phase: str, rules: Path | None, update: bool,
             spread_from: tuple[Path, ...], strict: bool, output: Path | None,
             junit: Path | None) -> None:
    """Check a run against a stored baseline: exit 1 on a regression (for nightly CI).

    BASELINE and RUN: a `kimi-perf trace` run directory or its breakdown.json, a breakdown
    JSON, or a trace. More kernels per layer fail; a slower median fails when it is more than
    --rel-tol and --abs-tol slower and a Mann-Whitney U test over the steps says it is not
    noise.

    Exit 0: passed (with --update: stored, whatever the verdict); 1: a check failed (with
    --strict, a run captured or broken down differently too, which --update then does not
    store); 2: the gate could not run (a file missing or unreadable, options that do not go
    together).
    """
    # names of what the verdict files are not: refused, and left alone (a run's report.html)
    fmt = _format_of(fmt, output, ("json",))
    if output is not None and output.suffix.lower() == ".xml":
        raise TraceError(None, f"-o {printable(str(output))}: -o writes the table or the "
                               "JSON; --junit writes the XML")
    if junit is not None and str(junit) == "-":
        raise TraceError(None, "--junit takes a file to write, not - (-o - is stdout's)")
    if junit is not None and (suffix := junit.suffix.lower()[1:]) in (*NOT_WRITTEN, "json",
                                                                      "csv"):
        named = NOT_WRITTEN.get(suffix, f"a .{suffix}")
        raise TraceError(None, f"--junit {printable(str(junit))}: {named}, not what "
                               "--junit writes (XML): name the file otherwise")
    verdicts = [(option, file) for option, file in (("-o", output), ("--junit", junit))
                if file is not None and str(file) != "-"]
    # an earlier verdict goes whatever stops the gate, but never a file that is an input, the
    # baseline or a directory (each refused below)
    inputs = (baseline, run, rules, *spread_from)
    stale = [file for _, file in verdicts if _input_it_is(file, *inputs) is None
             and not _same_file(file, baseline) and not file.is_dir()]
    with _no_earlier_verdict(*stale):
        for option, file in verdicts:   # (checked before --update stores a file)
            _not_an_input(file, *inputs)
            if _same_file(file, baseline):
                raise TraceError(file, f"is the baseline: {option} writes the verdict "
                                       "elsewhere")
            if file.is_dir():
                raise TraceError(file, "cannot write: it is a directory")
            if not file.parent.is_dir():
                raise TraceError(file, "cannot write: no such directory")
        if len(verdicts) == 2 and _same_file(output, junit):
            raise TraceError(junit, "is -o's file too: --junit writes the XML elsewhere")
        # the options given, over what the baseline keeps (gate --update stored them);
        # none given: the baseline's, else the defaults (None)
        source = click.get_current_context().get_parameter_source
        given = {key: value for option, key, value in (
            ("rel_tol", "rel_tol", rel_tol), ("abs_tol", "abs_tol_us", abs_tol),
            ("alpha", "alpha", alpha), ("metrics", "metrics", metrics))
            if source(option) not in (click.core.ParameterSource.DEFAULT, None)}
        try:   # (each option checked before any work)
            tolerances = gate_mod.tolerances_over(baseline, given) if given else None
        except ValueError as exc:
            raise TraceError(None, f"--{exc}") from None
        kept = gate_mod.baseline_tolerances(baseline)   # (said, those given over them too)
        if update and path_name is not None:
            raise TraceError(None, "--update stores the whole run: it takes no --path")
        if spread_from and not update:
            raise TraceError(None, "--spread-from goes with --update: the spread of the runs "
                                   "is stored with the baseline")
        _no_trace_among([baseline, run, *spread_from], say_stored=False)
        for file in stale:   # (gone while it runs: a gate killed, SIGKILL too, leaves none)
            with contextlib.suppress(FileNotFoundError):
                _remove_verdict(file)
        _gate(baseline, run, tolerances, kept, fmt, show_all, path_name, layers, step_regex,
              phase, rules, update, spread_from, strict, output, junit)


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file, through links too (either may not exist yet)."""
    return os.path.realpath(a) == os.path.realpath(b)


@contextlib.contextmanager
def _no_earlier_verdict(*files: Path):
    """A gate that cannot run, or is stopped (Ctrl-C, SIGTERM), removes the verdict files an
    earlier one left (``-o``, ``--junit``), so that a job reading them does not take last
    night's pass for tonight's (nor the one written before the other for the pair)."""
    try:
        yield
    except (Exception, KeyboardInterrupt, Terminated) as exc:
        if isinstance(exc, BrokenPipeError):   # (the verdict written, its reader gone)
            raise
        for file in files:
            with contextlib.suppress(OSError, TraceError):
                _remove_verdict(file)
        raise


def _remove_verdict(file: Path) -> None:
    """Remove a verdict file as it would be written: a symlink's target (the link kept, to be
    written through again); never a device or pipe (/dev/null), nor what a descriptor's name
    stands for (/dev/stdout: the file a shell's `>> log` opened), nor a file made read-only."""
    current = Path(os.path.realpath(file.parent)) / file.name
    for _ in range(40):   # (link by link: /dev/stdout leads through /proc into a shell's files)
        if named_descriptor(current) is not None:
            return
        if not current.is_symlink():
            break
        target = Path(os.readlink(current))
        current = Path(os.path.realpath(current.parent / target.parent)) / target.name
    else:
        return   # (a loop)
    if stat.S_ISREG(current.lstat().st_mode):
        check_not_read_only(current)
        current.unlink()


def _gate(baseline: Path, run: Path, tolerances: gate_mod.Tolerances | None, kept: dict,
          fmt: str, show_all: bool, path_name: str | None, layers: str,
          step_regex: str | None, phase: str, rules: Path | None, update: bool,
          spread_from: tuple[Path, ...], strict: bool, output: Path | None,
          junit: Path | None) -> None:
    """``kept``: the settings the baseline keeps, which the verdict says (``tolerances``: the
    options given over them; None, no option given: the baseline's, which ``gate_files``
    reads itself)."""
    # how a trace is broken down, as for `breakdown`
    options = {"layers": _check_layers(layers), "step_regex": _check_steps(step_regex),
               "rules": load_rules(rules)}
    if update:
        dropped = gate_mod.baseline_spread_runs(baseline) if not spread_from else 0
        gated, how = gate_mod.update_baseline(baseline, run, tolerances, phase, strict,
                                              spread_from, **options)
        spread = (f" with the spread of {len(spread_from) + 1} runs" if spread_from
                  else f" (the spread of {dropped} runs it kept is not kept: it was of the "
                       "old code's runs; --spread-from stores a new one)" if dropped
                  else "") if how != "not updated" else ""
        if gated is None:   # nothing to gate against: stored, and said (in JSON too)
            stored = printable(f"baseline {baseline} {how} from {run}{spread}")
            # (the tolerances it keeps now: those given, or the old baseline's)
            keeps = gate_mod.baseline_tolerances(baseline)
            nothing = gate_mod.GateResult([], gate_mod.Tolerances(**keeps),
                                          stored_tolerances=keeps)
            if fmt == "json":
                with _reader_may_leave():
                    _emit(json.dumps({**nothing.to_json(), "headline": stored,
                                      "baseline_file": str(baseline), "run_file": str(run),
                                      "updated": str(baseline)}, indent=1, allow_nan=False)
                          + "\n", output)
            elif output is not None and str(output) != "-":   # (the verdict file is there)
                atomic_write_text(output, stored + "\n")
            if junit is not None:   # (no check: a suite of none, saying why)
                atomic_write_text(junit, render.gate_junit(nothing, (str(baseline), str(run)),
                                                           stored))
            written = output is not None and str(output) != "-"
            click.echo(stored + (printable(f" (in {output})") if written else ""), err=True)
            return
        gated.result.stored_tolerances = gated.result.stored_tolerances or kept
        with _reader_may_leave():
            _print_gate(gated, fmt, show_all, how, output, junit)
        if how == "not updated":   # --strict, another capture: the baseline kept, a failure
            click.echo(printable(f"baseline {gated.baseline_file} not updated from {run}: "
                                 "captured or broken down differently (--strict)"), err=True)
            sys.exit(1)
        click.echo(printable(f"baseline {gated.baseline_file} updated from {run}{spread}")
                   + ("" if gated.result.ok
                      else " (what the gate above failed is now the baseline)"), err=True)
        return
    if not baseline.exists() and not baseline.is_symlink():   # (a dangling link: its reader)
        raise TraceError(baseline, "no such baseline (a first run stores one: kimi-perf gate "
                                   "--update BASELINE RUN)")
    gated = gate_mod.gate_files(baseline, run, tolerances, path_name, phase, strict=strict,
                                **options)
    gated.result.stored_tolerances = gated.result.stored_tolerances or kept
    with _reader_may_leave():
        _print_gate(gated, fmt, show_all, None, output, junit)
    if not gated.result.ok:
        sys.exit(1)


def _print_gate(gated: gate_mod.GatedRun, fmt: str, show_all: bool, update: str | None,
                output: Path | None, junit: Path | None) -> None:
    """The verdict as a table or JSON, to stdout or ``output``, and as JUnit XML to
    ``junit``; ``update``: what --update did ("updated" or "not updated"), None without
    it."""
    if junit is not None:   # (first: a reader of stdout that leaves does not stop it)
        atomic_write_text(junit, render.gate_junit(
            gated.result, (str(gated.files[0]), str(gated.files[1])),
            render.gate_text(gated, show_all)))
    _write_gate(gated, fmt, show_all, update, output)
    if output is not None and str(output) != "-":
        # the verdict's file holds the whole of it; a CI log still gets its last line
        click.echo(printable(f"{render.gate_headline(gated.result)} (in {output})"), err=True)


def _write_gate(gated: gate_mod.GatedRun, fmt: str, show_all: bool, update: str | None,
                output: Path | None) -> None:
    if fmt == "json":
        doc = render.gate_document(gated)
        if update is not None:   # (stored: exit 0, whatever the verdict)
            doc["updated"] = str(gated.baseline_file) if update == "updated" else None
        _emit(json.dumps(doc, indent=1, allow_nan=False) + "\n", output)
        return
    if output is not None:
        atomic_write_text(output, render.gate_text(gated, show_all) + "\n")
        return
    # the verdict's line last and whole, however long: a CI log's last line
    headline = render.gate_headline(gated.result)
    console = render.console()
    for part, style in render.gate_said(gated, show_all):
        console.print(part, style=style)
    console.print(headline, soft_wrap=True)


def _check_plotly_js(ctx, param, value: str) -> str:
    if value not in ("inline", "cdn") and not value.endswith(".js"):
        raise click.BadParameter(f"inline, cdn, or a path or URL ending in .js, not {value!r}")
    if quoted := sorted({c for c in value if c in "\"<>"}):
        # (the page's <script src="..."> holds it as it is)
        raise click.BadParameter(f"{value!r} holds {' '.join(quoted)}, which the report's "
                                 "script tag cannot: rename or move the file")
    return value


@main.command(name="report", short_help="The HTML layer-timeline report of runs or traces")
@click.argument("inputs", nargs=-1, required=True, type=PATH)
@click.option("--path", "path_name", help="take only this decode path from each run")
@click.option("--labels", help="names for what the inputs hold, comma-separated, in order "
              "(default: the file names, or a run's path names)")
@_layers_option
@_steps_option
@_phase_option
@_rules_option
@click.option("--plotly-js", default="inline", show_default=True, callback=_check_plotly_js,
              help="the report's plotly.js: inline (opens offline, about 5 MB), cdn, or a "
              "plotly.min.js (a path from here, or a URL) for the report to refer to")
@click.option("-o", "--output", type=OUTPUT_FILE, default=Path("report.html"),
              show_default=True, help="the HTML file to write (- for stdout)")
@_fail_cleanly
def report_cmd(inputs: tuple[Path, ...], path_name: str | None, labels: str | None,
               layers: str, step_regex: str | None, phase: str, rules: Path | None,
               plotly_js: str, output: Path) -> None:
    """The HTML layer-timeline report of traces, breakdown JSON files or `kimi-perf trace`
    runs: the first against each of the others, per layer type and kernel by kernel. A
    directory that is not a run stands for the traces in it (one per rank, say).

    A run (its directory or its breakdown.json) brings each of its decode paths, or the one
    --path names: `kimi-perf report BASELINE.json RUN --path specialized` shows what a gate
    failure is made of. Breakdowns are drawn as stored; traces are broken down first.
    """
    from kimi_perf.report import plotly_js_for, report_inputs

    if (suffix := output.suffix.lower()) in (".csv", ".json", ".txt", ".kptrace", ".sqlite"):
        # (HTML in a file named for another format: a slip, which -o elsewhere honours)
        raise TraceError(None, f"-o {printable(str(output))}: the report is HTML, not "
                               f"{suffix[1:]}: name it .html")
    plotly_js_for(plotly_js, output.parent)  # a missing file is said before any work
    found, left_out = _traces_in(list(inputs), keep_runs=True)
    inputs = tuple(found)
    _not_an_input(output, *inputs, rules)
    _not_a_runs_own_report(output, inputs, path_name)
    seen: dict[str, Path] = {}
    for file in inputs:   # (drawn twice, its ratios are all 1: a slip, most likely)
        read = file / "breakdown.json" if file.is_dir() else file   # (a run: what is read)
        if (first := seen.setdefault(os.path.realpath(read), file)) is not file:
            twice = (f"{file} read twice" if str(file) == str(first)
                     else f"{file} is {first}")
            click.echo(printable(f"note: {twice}: drawn against itself"), err=True)
    layers, step_regex = _check_layers(layers), _check_steps(step_regex)   # (before a note)
    _no_trace_among(list(inputs))
    got = report_inputs(list(inputs), path_name, phase, layers=layers, rules=rules,
                        step_regex=step_regex)
    if labels is not None:
        got = got.relabelled(_split_labels(labels, list(got.breakdowns)))
    run_info = got.run
    if run_info is None:   # traces or several inputs: how this report was made
        from kimi_perf import __version__
        from kimi_perf.capture import git_commit

        run_info = {"command": _command_said(), "kimi_perf": __version__,
                    "git_commit": git_commit(),
                    "date": datetime.datetime.now(datetime.UTC).isoformat()}
    got.write(output, "kimi-perf report: " + ", ".join(got.breakdowns), plotly_js=plotly_js,
              run=run_info)
    for line in got.captured_differently():
        click.echo(line, err=True)
    if str(output) != "-" and named_descriptor(output) is None:   # (the report went there)
        click.echo(printable(f"report: {output}"))
    _say_left_out(left_out)


def _not_a_runs_own_report(output: Path, inputs: tuple[Path, ...], path_name: str | None
                           ) -> None:
    """Refuse to write over a run's own report (the file its run.json names) a report of
    other than that run whole (other inputs beside it, one path of it, a trace in it): drawn
    again alone, it is the same report, renewed."""
    if str(output) == "-" or not output.exists():
        return
    for given in inputs:
        run_dir = given if given.is_dir() else given.parent
        if not runs_mod.is_kimi_perf_run_json(run_dir / "run.json"):
            continue
        try:
            named = json.loads((run_dir / "run.json").read_text()).get("report")
            own = os.path.samefile(output, run_dir / (named if isinstance(named, str)
                                                      else "report.html"))
        except (OSError, ValueError, AttributeError):
            continue   # (a run.json that cannot say: its run is refused where it is read)
        whole = given.is_dir() or given.name == "breakdown.json"
        if own and (len(inputs) > 1 or path_name is not None or not whole):
            drawn = (f"{len(inputs)} inputs" if len(inputs) > 1 else
                     f"its {path_name} path alone" if whole else f"{given.name} alone")
            raise TraceError(output, f"is the run {run_dir}'s own report: a report of "
                                     f"{drawn} would replace it (name it otherwise)")


@main.command(short_help="Save a trace as .kptrace: one Arrow file, fast to reload")
@click.argument("trace", type=PATH)
@click.argument("output", type=OUTPUT_FILE)
@_capture_option
@_fail_cleanly
def convert(trace: Path, output: Path, capture: Path | None) -> None:
    """Save any trace in kimi-perf's own format (.kptrace: one Arrow file, fast to reload).

    OUTPUT is named *.kptrace (lower case: directories are searched for it). With
    --capture, the trace saved is TRACE joined by its graph captures: every command then
    reads the pair as one.
    """
    _not_an_input(output, trace, capture)
    if trace.is_dir():   # (one trace a .kptrace: a run's, or a folder's, each by its name)
        raise TraceError(trace, "is a directory: convert saves one trace file (kimi-perf info "
                                "names the traces a directory or run holds)")
    if output.suffix != ".kptrace":   # (binary: not for a terminal, nor under another name)
        raise TraceError(output, "convert writes a .kptrace file (Arrow): name it so (lower "
                                 "case: directories are searched for *.kptrace)")
    read = read_trace(trace, capture=capture)
    read.save(output)
    click.echo(printable(f"wrote {output}: {counted(len(read.kernels), 'kernel')}, "
                         f"{counted(len(read.memops), 'memcpy/memset op')}, "
                         f"{counted(len(read.ranges), 'range')}, "
                         f"{counted(len(read.api), 'API call')}"), err=True)


@main.command(short_help="What traces hold: format, tool, GPUs, event counts")
@click.argument("traces", nargs=-1, required=True, type=PATH)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]),
              help="json: {schema, traces: [{file, ...each trace's summary}]}  [default: table, or "
              "what -o's suffix names]")
@click.option("-o", "--output", type=OUTPUT_FILE, help="write here, not stdout")
@_fail_cleanly
def info(traces: tuple[Path, ...], fmt: str | None, output: Path | None) -> None:
    """What traces hold: format, tool, GPUs, and how many events of each kind. Of a
    `kimi-perf trace` run directory: each of its saved traces (one per decode path; of a
    --tp run, every rank's), or of a `trace --from` run, the traces it was made from; of a
    directory of traces (a profiler's, one per rank), each."""
    fmt = _format_of(fmt, output, ("json",))
    files: list[tuple[Path, Path | None]] = []   # each with its graph captures
    left_out: list[tuple[Path, str]] = []
    # all read, then said; an input that cannot be read is said after those that can (a
    # rank's trace cut short hides no other rank's), and the exit is still 2
    unreadable: list[TraceError] = []
    for trace in traces:
        try:
            if trace.is_dir() and (trace / "breakdown.json").is_file():
                files += [(f, None) for f in _saved_traces(trace)] or _analysed_files(trace)
            elif trace.is_dir():   # (a folder of runs: given each, DIR/*/, info reads them)
                found, left = _traces_in([trace], keep_runs=True)
                files += [(f, None) for f in found]
                left_out += left
            else:
                files.append((trace, None))
        except TraceError as exc:
            if len(traces) == 1:
                raise
            unreadable.append(exc)
    # (a directory's traces too: -o among them would destroy one)
    _not_an_input(output, *traces, *(f for f, _ in files), *(c for _, c in files if c))
    summaries = []
    for file, c in files:
        try:
            summaries.append((file, read_trace(file, capture=c).summary()))
        except TraceError as exc:
            if len(files) == 1 and not unreadable:
                raise
            unreadable.append(exc)
    if unreadable and not summaries:   # nothing to tell: the first problem, one line
        raise unreadable[0]
    if fmt == "json":
        _emit(json.dumps({"schema": 1, "traces": [{"file": str(file), **info}
                                                  for file, info in summaries],
                          **({"unreadable": [{"file": str(exc.path), "problem": exc.problem}
                                             for exc in unreadable]} if unreadable else {})},
                         indent=1) + "\n", output)
    else:
        _emit("".join(line + "\n" for file, info in summaries
                      for line in _info_lines(file, info)), output)
    _say_left_out(left_out)
    for exc in unreadable:
        click.echo(f"kimi-perf: error: {exc}", err=True)
    if unreadable:
        sys.exit(2)


def _traces_in(paths: list[Path], keep_runs: bool = False
               ) -> tuple[list[Path], list[tuple[Path, str]]]:
    """``runs.trace_files``: the traces of the directories among ``paths``, and the files
    in them left out, each with why (``_say_left_out`` once the command is done: an error
    stays one line)."""
    from kimi_perf.runs import trace_files

    left_out: list[tuple[Path, str]] = []
    return trace_files(paths, keep_runs, left_out), left_out


def _say_left_out(left_out: list[tuple[Path, str]]) -> None:
    if left_out:
        click.echo("left out: " + "; ".join(f"{printable(str(f))} ({why})"
                                            for f, why in left_out), err=True)


def _saved_traces(run_dir: Path) -> list[Path]:
    """A capture's saved traces, in the order its paths ran (standard first, as run.json
    lists them; others after, by name), each path's normalised trace (rank 0's) followed,
    in a ``--tp`` run, by the raw traces of its other ranks (each named whether there or
    not: one missing is said, as an unreadable one is)."""
    try:
        doc = json.loads((run_dir / "run.json").read_text())
        ran = list(doc.get("paths") or ())
        tp = doc["tp"] if type(doc.get("tp")) is int else 1
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        ran, tp = [], 1
    saved = sorted(run_dir.glob("*.kptrace"), key=lambda f: (
        ran.index(f.stem) if f.stem in ran else len(ran), f.name))
    return [t for f in saved for t in (
        f, *(run_dir / f"{f.stem}.rank{r}.trace.json.gz" for r in range(1, min(tp, 1024))))]


def _analysed_files(run_dir: Path) -> list[tuple[Path, Path | None]]:
    """The traces a `trace --from` run was made from, as its run.json names them, each with
    the graph captures joined to it (``--capture``), if any."""
    try:
        doc = json.loads((run_dir / "run.json").read_text())
        files, captures = doc.get("files"), doc.get("captures")
    except (OSError, ValueError, AttributeError, RecursionError):
        files = captures = None

    def names(value) -> bool:
        return isinstance(value, list) and all(isinstance(f, str) for f in value)

    if not (names(files) and files):
        raise TraceError(run_dir, "a kimi-perf run directory without its saved traces "
                                  "(*.kptrace) or a run.json naming the traces it analysed")
    if not (names(captures) and len(captures) == len(files)):
        captures = [None] * len(files)

    def located(name: str) -> Path:
        try:
            path = (run_dir / name).resolve()   # relative to the run directory
            found = path.exists()
        except (OSError, ValueError) as exc:   # (a NUL in it, a name too long)
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise TraceError(run_dir / "run.json", f"names a trace by what is no usable path "
                                                   f"({why}): {name!r}") from None
        if not found:
            raise TraceError(run_dir / "run.json", f"names the trace {printable(name)}, not "
                                                   f"found (at {printable(str(path))}): moved "
                                                   "since the run?")
        return path

    return [(located(f), located(c) if c is not None else None)
            for f, c in zip(files, captures, strict=True)]


def _path_names(paths: str) -> tuple[str, ...]:
    """``--paths``: the decode paths named, comma-separated (spaces around each and empty
    names dropped), each once."""
    named = tuple(p for p in (name.strip() for name in paths.split(",")) if p)
    if len(set(named)) < len(named):
        raise TraceError(None, f"--paths names a path twice: {paths!r}")
    return named


def _split_labels(labels: str, of: list[str]) -> list[str]:
    """``--labels``: a distinct name for each of ``of``, comma-separated, spaces around each
    dropped, control characters written out (as a trace's names are: labels reach every
    table)."""
    names = [printable(name.strip()) for name in labels.split(",")]
    if len(names) != len(of) or not all(names) or len(set(names)) != len(names):
        wanted = "1 name" if len(of) == 1 else f"{len(of)} distinct names"
        raise TraceError(None, f"--labels takes {wanted} (for {', '.join(of)}): not "
                               f"{labels!r}")
    return names


def _info_lines(trace: Path, info: dict) -> list[str]:
    """What ``info`` says of one trace, a line each."""
    lines = []
    # (the trace's own words, and file names, with their control characters written out: an
    # escape sequence in them would act on the terminal, a line break forge a line)
    saved = ("a .kptrace (saved by kimi-perf) of " if info["kptrace"]
             else f"a {trace.suffix} read through its SQLite export: "
             if info["exported_by_nsys"] else "")
    lines.append(printable(f"{trace}: {saved}{info['format']} from {info['tool']}"
                           + (f", schema {info['schema']}" if info["schema"] else "")))
    if info.get("converted_from"):
        lines.append(printable(f"  saved from {info['converted_from']}"
                               + (" (read through its SQLite export)"
                                  if info["exported_by_nsys"] else "")))
    for capture in info.get("captures") or []:
        lines.append(f"  joined by the graph captures of {printable(str(capture))}")
    if replay := info.get("replay"):   # (the counts and span below hold the captures' too)
        span = (f", {replay['span_ns'] / 1e6:,.3f} ms from first to last event"
                if replay["span_ns"] is not None else "")
        gpu = (f" (GPU work: {replay['gpu_span_ns'] / 1e6:,.3f} ms, kernel time "
               f"{replay['kernel_ns'] / 1e6:,.3f} ms)"
               if replay.get("gpu_span_ns") is not None else "")
        lines.append(f"  the replay alone: {counted(replay['kernels'], 'kernel')}, "
                     f"{counted(replay['memops'], 'memcpy/memset op')}, "
                     f"{counted(replay['ranges'], 'range')}, "
                     f"{counted(replay['api_calls'], 'API call')}{span}{gpu}; with its "
                     "captures (profiled apart, at another time: the span below is "
                     "both's):")
    lines.append(f"  {counted(info['kernels'], 'kernel')}, "
                 f"{counted(info['memops'], 'memcpy/memset op')}, "
                 f"{counted(info['ranges'], 'range')}, "
                 f"{counted(info['api_calls'], 'API call')}")
    if info["kernels"] or info["memops"] or info["graph_launches"]:
        launches = counted(info["graph_launches"], "graph launch", "graph launches")
        graphs = ("" if not info["graph_launches"]
                  else f"; {counted(info['graph_kernels'], 'kernel')} replayed by {launches}"
                  if info["graph_kernels"] else
                  f"; {launches}, none of their kernels in the trace (nsys --cuda-graph-trace="
                  "graph records a graph's launch, not its kernels: node traces them)")
        lines.append(f"  kernel time {info['kernel_ns'] / 1e6:,.3f} ms in all; GPU work "
                     f"(kernels, copies) on {counted(info['streams'], 'stream')}{graphs}")
    if info.get("annotated_ops") and not info["kernels"] and not info["memops"]:
        lines.append(f"  {counted(info['annotated_ops'], 'op')} annotated (op: ranges): the "
                     "launches a CPU run of the decode paths makes, which breakdown counts")
    if (untimed := info["untimed"])["kernels"] or untimed["memops"]:
        lines.append(f"  left out, without a time: {counted(untimed['kernels'], 'kernel')}, "
                     f"{counted(untimed['memops'], 'memcpy/memset op')}")
    if info["untimed_ranges"]:
        lines.append(f"  left out, without a time: {counted(info['untimed_ranges'], 'range')} "
                     "(a missing or negative dur)")
    if (duplicates := info["duplicates"])["kernels"] or duplicates["memops"]:
        lines.append(f"  left out, exact repeats of another event: "
                     f"{counted(duplicates['kernels'], 'kernel')}, "
                     f"{counted(duplicates['memops'], 'memcpy/memset op')}")
    if info["span_ns"] is not None:
        processes = info["processes"]
        gpu = (f" (GPU work: {info['gpu_span_ns'] / 1e6:,.3f} ms)"
               if info["gpu_span_ns"] is not None else "")
        lines.append(f"  {info['span_ns'] / 1e6:,.3f} ms from first to last event{gpu}; "
                     f"{counted(len(processes), 'process', 'processes')} with GPU "
                     "work or API calls")
        for p in processes[:INFO_PROCESSES]:   # which of a trace's processes launched what
            name = f" ({printable(p['name'])})" if p["name"] else ""
            lines.append(f"  process {p['pid']}{name}: {counted(p['kernels'], 'kernel')}, "
                         f"{counted(p['api_calls'], 'API call')}")
        if len(processes) > INFO_PROCESSES:
            lines.append(f"  and {len(processes) - INFO_PROCESSES} more processes")
        if unlaunched := info["unlaunched_kernels"]:
            lines.append(f"  {counted(unlaunched, 'kernel')} whose launching call the trace "
                         "does not hold (launched before the profile began, or by a graph "
                         "launch it lacks)")
        if (unowned := info["kernels_without_process"]) and unowned != unlaunched:
            lines.append(f"  {counted(unowned, 'kernel')} with no process recorded")
    # GPUs: those the trace describes, and those its kernels ran on (a GPU table may list
    # devices that ran nothing, or be missing).
    for gpu in info["gpus"]:
        name = (f": {printable(gpu['name'])}" if gpu["name"] else " (unnamed)" if gpu["described"]
                else " (not described in the trace)")
        lines.append(f"  GPU {gpu['device']}{name}"
                     + (f", {gpu['sm_count']} {compute_units(info['tool'])}"
                        if gpu["sm_count"] else "")
                     + (f": {counted(gpu['kernels'], 'kernel')}" if gpu["kernels"]
                        else ": no kernels"))
    return lines


@main.command(name="floors", short_help="Memory floors per layer and launch: bytes over bandwidth")
@click.option("--preset", "preset_name", default="k3-tp8", show_default=True,
              help="model shapes: k3, k3-tp8, k3-tp16, tiny")
@click.option("--tp", type=Count(1), help="the TP ranks the model is sharded over "
              "(the k3 and tiny presets: 1 unless given; k3-tpN: N)")
@click.option("--batch", default=1, show_default=True,
              type=Count(1, floors_mod.MAX_BATCH), help="sequences per decode step")
@click.option("--context", default=4096, show_default=True,
              type=Count(0, floors_mod.MAX_CONTEXT),
              help="cached tokens per sequence the gated-MLA layer reads")
@click.option("--weights", type=click.Choice(["bf16", "fp8", "mxfp4"]), default="bf16",
              show_default=True, help="non-expert weights (and shared experts)")
@click.option("--experts", type=click.Choice(["bf16", "fp8", "mxfp4"]), default="bf16",
              show_default=True, help="routed experts (this model: bf16; K3's checkpoint: "
              "mxfp4)")
@_kv_cache_option
@click.option("--spec-tokens", default=0, show_default=True,
              type=Count(0, floors_mod.MAX_SPEC_TOKENS),
              help="speculative decoding's draft tokens K: steps verify 1+K tokens per sequence")
@click.option("--bandwidth", default=4.3, show_default=True,
              type=FiniteFloatRange(0.001, floors_mod.MAX_BANDWIDTH_TBPS),
              help="memory bandwidth, TB/s (H200: about 4.3 measured by a device copy)")
@_format_option(["table", "json"])
@click.option("-o", "--output", type=OUTPUT_FILE, help="write here, not stdout")
@_fail_cleanly
def floors_cmd(preset_name: str, tp: int | None, batch: int, context: int, weights: str,
               experts: str, kv_cache: str, spec_tokens: int, bandwidth: float, fmt: str | None,
               output: Path | None) -> None:
    """Memory floors per layer and per launch: the bytes a decode step must move at least,
    over a bandwidth (no GPU needed): what the measured µs of a layer are held against."""
    fmt = _format_of(fmt, output, ("json",))
    from kimi_perf.decode.floors import Storage, floors

    c = _preset_config(preset_name, tp=tp)
    _mxfp4_fits(c, experts)
    doc = floors(c, batch, context, Storage(weights, experts, kv_cache), bandwidth * 1e12,
                 tokens=1 + spec_tokens)
    doc["preset"] = preset_name
    if fmt == "json":   # (the options' bounds keep every figure finite: JSON, not Infinity)
        _emit(json.dumps(doc, indent=1, allow_nan=False) + "\n", output)
    else:
        _emit_tables([render.floors_table(doc), render.floors_headline(doc)], output)


@main.command(short_help="Decode paths against a float64 reference of their weights")
@click.option("--preset", "preset_name", default="tiny", show_default=True,
              help="model preset of the whole model: tiny or k3 (the float64 reference "
              "cannot check one rank's shapes, k3-tp8 or k3-tp16)")
@click.option("--layers", "n_layers", type=Count(2, MAX_LAYERS),
              help=f"override the preset's layer count (2 to {MAX_LAYERS}: layer 0 has the "
              "dense MLP, the last the gated MLA)")
@click.option("--paths", default="standard,specialized", show_default=True,
              help="comma-separated decode paths to check: standard, standard_kernels (the "
              "standard path one kernel per step, as on a GPU), specialized")
@click.option("--steps", default=8, show_default=True, type=Count(1),
              help="decode steps checked after the prompt")
@click.option("--spec-tokens", default=0, show_default=True, type=Count(0, 31),
              help="speculative decoding with K draft tokens: each decode step verifies 1+K "
              "tokens per sequence, then accepts a seeded random 1..1+K of them and rolls "
              "back the rest (the specialized path's kernels take K up to 7; beyond, it "
              "falls back and says so)")
@click.option("--batch", default=2, show_default=True, type=Count(1),
              help="sequences per decode step")
@click.option("--prompt", "--context", "prompts", multiple=True, type=Count(1),
              help="prompt tokens prefilled before the decode steps (--context, as trace "
              "names them)  [default: 4]")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              show_default=True, help="activation and weight dtype of the paths")
@functools.partial(_kv_cache_option, bf16="the paths' dtype (bf16; float32 with --dtype "
                   "float32)")
@_experts_option
@_seed_option
@_format_option(["table", "json"])
@click.option("-o", "--output", type=OUTPUT_FILE, help="write here, not stdout (the verdict's line "
              "also on stderr)")
@_fail_cleanly
def validate(preset_name: str, n_layers: int | None, paths: str, steps: int,
             spec_tokens: int, batch: int, prompts: tuple[int, ...], dtype: str,
             kv_cache: str, experts: str, seed: int, fmt: str | None,
             output: Path | None) -> None:
    """Check decode paths against a float64 reference of the same weights (CPU is enough):
    each layer on the path's own inputs, bounded at any depth, and the whole model's drift.

    Exit code 1 when an error exceeds its bound for the dtype.
    """
    if len(prompts) > 1:   # (two names of one option: the last would win without a word)
        raise TraceError(None, "--prompt and --context are one option (the prompt's tokens): "
                               f"give it once, not {len(prompts)} times")
    prompt = prompts[0] if prompts else 4
    fmt = _format_of(fmt, output, ("json",))
    # The paths run on the CPU, their Triton kernels in the interpreter: chosen before
    # anything imports triton, with a GPU present too (its compiled kernels take no CPU
    # tensors), whatever TRITON_INTERPRET says (0 failed after the standard path ran)
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import torch

        from kimi_perf.decode import validate as v
    except ImportError as exc:
        raise TraceError(None, f"validate needs torch ({exc}); pip install "
                               "'kimi-perf[model]'") from None
    _preset_config(preset_name)
    chosen = _path_names(paths)
    if not chosen:
        raise TraceError(None, f"--paths names no path (available: {', '.join(v.PATHS)})")
    unknown = [p for p in chosen if p not in v.PATHS]
    if unknown:
        raise TraceError(None, f"--paths: unknown path(s) {', '.join(unknown)} (available: "
                               f"{', '.join(v.PATHS)})")
    try:
        config = v.whole_model(preset_name, n_layers)
    except ValueError as exc:
        raise TraceError(None, str(exc)) from None
    _mxfp4_fits(config, experts)
    from kimi_perf.capture import available_memory, decode_memory_problem, memory_problem
    from kimi_perf.memory import address_space_capped

    if problem := memory_problem(config, preset_name, "cpu", need_of=v.memory_need(dtype),
                                 holding="with the paths' copies and the float64 reference",
                                 otherwise="take the tiny preset"):
        raise TraceError(None, problem)
    sizes = f"batch {batch}, a prompt of {prompt}, {counted(steps, 'step')}"
    smaller = "batch, prompt or step count"
    if problem := decode_memory_problem(
            v.decode_need(config, batch, prompt, steps, dtype, kv_cache, spec_tokens),
            v.memory_need(dtype)(config), "cpu", sizes, smaller):
        raise TraceError(None, problem)
    # (the paths run on the CPU; a GPU's driver maps more than it uses: no cap beside one)
    cap = None if torch.cuda.is_available() else available_memory("cpu")
    with _memory_said(sizes, smaller), address_space_capped(cap):
        result = v.validate(preset_name, chosen, steps=steps, batch=batch, prompt=prompt,
                            dtype=dtype, kv_cache=kv_cache, seed=seed, n_layers=n_layers,
                            spec_tokens=spec_tokens, experts=experts)
    checked = ", ".join(result["paths"])
    verdict = (f"validate: pass ({checked} within bounds)" if result["ok"] else
               f"validate: FAIL ({counted(len(result['failures']), 'failure')}: above)")
    if fmt == "json":   # (an error that is not a number: null)
        _emit(json_text(result), output)
    else:
        lines = [*(f"FAIL {failure}" for failure in result["failures"]), verdict]
        if output is None:
            render.print_tables([render.validation_table(result)])
            click.echo("\n".join(lines))
        else:
            _emit(render.tables_text([render.validation_table(result)]) + "\n".join(lines)
                  + "\n", output)
    if output is not None and str(output) != "-":
        click.echo(verdict.replace("above", f"in {output}"), err=True)
    if not result["ok"]:
        sys.exit(1)


@main.command(name="trace", short_help="Capture both decode paths per layer (the main job)")
@click.option("--from", "from_files", multiple=True, type=PATH,
              help="analyse these existing traces instead of capturing (repeatable; a "
              "directory: the traces in it, e.g. one per rank)")
@click.option("--capture", "captures", multiple=True, type=PATH,
              help="with --from: the graph captures of a --from trace, saved apart (see "
              "kimi-perf breakdown --help); one per --from, in the same order")
@click.option("--phase", type=click.Choice(PHASES), default="auto", show_default=True,
              help="with --from: which steps count (see kimi-perf breakdown --help)")
@click.option("--rules", type=PATH, help="with --from: a TOML file of "
              "extra kernel-class rules, tried before the defaults")
@click.option("--preset", "preset_name", help="tiny, k3, k3-tp8, k3-tp16 (default: tiny on a "
              "CPU, k3-tp8 on a GPU)")
@click.option("--layers", "layers_arg", help=f"layer count, 2 to {MAX_LAYERS} (default: the "
              "preset's own; with no --preset on a GPU, 4 of k3-tp8's); with --from, how "
              "layers are found: auto, repeat, nvtx or nvtx:REGEX")
@click.option("--batch", type=Count(1), help="sequences per decode step (default: 2 on a CPU, "
              "1 on a GPU)")
@click.option("--context", type=Count(1), help="prompt tokens before decoding (default: 8 on "
              "a CPU, 512 on a GPU)")
@click.option("--steps", "steps_arg", help="profiled decode steps (default: 3 on a CPU, 40 on "
              "a GPU); with --from, a regex for the step ranges")
@click.option("--warmup", type=Count(0), help="decode steps before profiling (default: 1 on "
              "a CPU, 3 on a GPU)")
@click.option("--tp", default=1, show_default=True, type=Count(1),
              help="TP ranks: one process each on the CPU (gloo, torch backend), each "
              "profiling its shard; rank 0's trace is broken down")
@click.option("--paths", default="standard,specialized", show_default=True,
              help="the decode paths to capture, comma-separated")
@click.option("--graphs/--no-graphs", default=False, show_default=True,
              help="replay each decode step as one CUDA graph (GPU only)")
@click.option("--backend", type=click.Choice(["torch", "nsys"]), default="torch",
              show_default=True, help="profiler: torch (Kineto JSON) or nsys (Nsight "
              "Systems: KIMI_PERF_NSYS, else nsys on PATH; scripts/install-nsys.sh installs "
              "its CLI on Debian)")
@_kv_cache_option
@_experts_option
@click.option("--spec-tokens", default=0, show_default=True, type=Count(0, 7),
              help="speculative decoding with K synthetic draft tokens: each decode step "
              "verifies 1+K tokens per sequence and accepts a seeded random 1..1+K")
@click.option("--l2-prefetch", is_flag=True, help="the specialized path's opt-in: o_proj's "
              "weights read into L2 beside the attention (one launch more per layer)")
@click.option("--group-experts-from", type=Count(1), help="the specialized path's "
              "opt-in: from this many tokens a step on, route first and run the routed "
              "experts grouped by expert (one launch more per MoE layer)")
@click.option("--pdl", is_flag=True, help="the specialized path's opt-in (GPU, sm_90+): its "
              "kernels launched with programmatic dependent launch (no launch more; on a CPU "
              "the interpreter runs them as without it)")
@_seed_option
@click.option("-o", "--out", "out_dir", type=PATH, default=Path("traces/runs"),
              show_default=True, help="parent of the run directory")
@click.option("--plotly-js", default="inline", show_default=True, callback=_check_plotly_js,
              help="the HTML report's plotly.js: inline (opens offline, about 5 MB), cdn, or "
              "a plotly.min.js (a path from here, or a URL) for the report to refer to")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="what is printed: the tables, or the run's document "
              "as JSON (what the run directory's files hold; the run is written either way)")
@_fail_cleanly
def trace_cmd(from_files: tuple[Path, ...], captures: tuple[Path, ...], phase: str,
              rules: Path | None,
              preset_name: str | None,
              layers_arg: str | None,
              batch: int | None, context: int | None, steps_arg: str | None,
              warmup: int | None, tp: int, paths: str, graphs: bool, backend: str,
              kv_cache: str, experts: str, spec_tokens: int, l2_prefetch: bool,
              group_experts_from: int | None, pdl: bool, seed: int, out_dir: Path,
              plotly_js: str, fmt: str) -> None:
    """Capture both decode paths per layer and compare them (the main job).

    With no arguments: the tiny preset on a CPU (or four k3-tp8 layers on a GPU), both paths,
    a short prompt and a few decode steps. Writes a run directory under traces/runs/ and ends
    with the per-layer table: kernels (on a CPU: the launches the paths annotate) and µs per
    layer type, standard vs specialized.
    """
    from kimi_perf import capture as cap

    console = render.console(stderr=fmt == "json")
    from kimi_perf.report import plotly_js_for

    plotly_js_for(plotly_js, out_dir)  # a missing file is said now, not after the capture
    if str(out_dir) == "-":   # (-o - is stdout for every other command)
        raise TraceError(None, "-o/--out is the folder the run directory is made in, not "
                               "stdout: --format json prints the run's document")
    if out_dir.suffix.lower() in FILE_SUFFIXES and not out_dir.is_dir():
        # (every other command's -o is a file: `trace -o run.json` is likely meant as one)
        raise TraceError(out_dir, "-o/--out is the folder the run directory is made in (its "
                                  "run.json, breakdown.json, report and traces), not a file")
    named = _checked_trace_options(from_files, captures, paths)
    if from_files:
        layers = _check_layers(layers_arg) if layers_arg is not None else "auto"
        seen: dict[str, Path] = {}
        for given in from_files:   # (a folder given twice: named, not a trace in it)
            if (twin := seen.setdefault(os.path.realpath(given), given)) is not given:
                raise TraceError(given, f"given twice{also_as(given, twin)}: --from takes "
                                        f"each {'folder' if given.is_dir() else 'trace'} once")
        found, left_out = _traces_in(list(from_files))
        seen = {}
        for file in found:   # (a trace against itself: every ratio 1.00, no comparison)
            if (twin := seen.setdefault(os.path.realpath(file), file)) is not file:
                raise TraceError(file, f"given twice{also_as(file, twin)}: --from takes each "
                                       "trace once")
        if (again := runs_mod.same_capture(found)) is not None:
            raise TraceError(again[0], f"given twice ({again[1]}): --from takes each capture "
                                       "once")
        run_dir, results, run_info = cap.analyse(found, out_dir,
                                                 layers=layers, phase=phase, rules=rules,
                                                 step_regex=_check_steps(steps_arg),
                                                 plotly_js=plotly_js,
                                                 captures=list(captures) or None)
        _say_left_out(left_out)   # (the run written: no error line follows)
    else:
        n_layers = _count_of("--layers", layers_arg, f"a layer count of 2 to {MAX_LAYERS} "
                             "(layer 0 has the dense MLP, the last the gated MLA; with --from: "
                             "how layers are found)", least=2, most=MAX_LAYERS)
        steps = _count_of("--steps", steps_arg, "a count of decode steps of 1 or more (with "
                          "--from: a regex for the step ranges)")
        if preset_name is not None:   # said before torch is loaded
            _preset_config(preset_name, tp=_sharding(tp))
        try:
            import torch
        except ImportError as exc:
            raise TraceError(None, f"capture needs torch ({exc}); pip install "
                                   "'kimi-perf[model]', or analyse traces with --from") from None
        given = {"preset": preset_name, "n_layers": n_layers, "batch": batch,
                 "context": context, "steps": steps, "warmup": warmup}
        overrides = {k: v for k, v in given.items() if v is not None}
        if preset_name and n_layers is None:
            overrides["n_layers"] = None  # a chosen preset keeps its own layer count
        req = dataclasses.replace(cap.default_request(torch.cuda.is_available()), **overrides,
                                  tp=tp, paths=named,
                                  graphs=graphs, backend=backend, kv_cache=kv_cache,
                                  experts=experts, spec_tokens=spec_tokens, out_dir=out_dir,
                                  plotly_js=plotly_js, l2_prefetch=l2_prefetch,
                                  group_experts_from=group_experts_from, pdl=pdl,
                                  seed=seed)
        # (again: the preset may be the machine's default, known only now)
        _mxfp4_fits(_preset_config(req.preset, tp=_sharding(req.tp)), req.experts)
        from kimi_perf.decode import interpreter_problem

        if problem := interpreter_problem(torch.cuda.is_available()):
            raise TraceError(None, problem)
        run_dir, results, run_info = _capture_with_progress(req, console)
    if fmt == "json":
        _echo(json_text(cap.run_document(run_dir, results, run_info, lazy_layers=True)),
              nl=False)
    else:
        if from_files:   # (the terminal's names: the run's are from its run directory)
            for b, file, capture in zip(results.values(), found, captures or [None] * len(found),
                                        strict=True):
                b.source["file"] = str(file)
                if capture is not None and b.source.get("captures"):
                    b.source["captures"] = [str(capture)]
        _print_run(console, run_dir, results, run_info)
    _fail_if_unusable(run_info, run_dir)


# Suffixes of the files other commands write with -o, and of traces: a trace --out named so
# is a slip (and a folder of a trace's name would pass for one)
FILE_SUFFIXES = {".json", ".csv", ".html", ".txt", ".xml", ".kptrace", ".gz", ".sqlite",
                 ".nsys-rep", ".qdrep"}


def ranks_crowded(run_info: dict, cores: int | None = None) -> str | None:
    """Where a CPU run's --tp ranks outnumber the machine's cores, which they then share: a
    rank's µs count the time it waited for a core (and the collectives' waits with it)."""
    # the cores this process may use (macOS has no affinity: all of them)
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1)
    tp = run_info.get("tp")
    on_cpu = (run_info.get("environment") or {}).get("device") == "cpu"
    if not (on_cpu and isinstance(tp, int) and tp > cores):
        return None
    return (f"{tp} ranks on {cores} cores: each rank waits its turn for one, and its µs count "
            "the wait (the ops, each rank's launches, are as on a GPU)")


def _checked_trace_options(from_files: tuple[Path, ...], captures: tuple[Path, ...],
                           paths: str) -> tuple[str, ...]:
    """The decode paths ``--paths`` names (``_path_names`` checks them), once ``trace``'s
    options that do not go together are refused, before any work: capture options with
    --from, --from's options without it, opt-ins of a path left out, and --capture files that
    do not pair with the --from traces."""
    capture_only = _given("preset_name", "batch", "context", "warmup", "tp", "paths", "graphs",
                          "backend", "kv_cache", "experts", "spec_tokens", "l2_prefetch",
                          "group_experts_from", "pdl", "seed")
    if from_files and capture_only:
        raise TraceError(None, f"{', '.join(capture_only)} "
                               f"{'sets' if len(capture_only) == 1 else 'set'} up a capture; "
                               "--from analyses traces already made")
    named = _path_names(paths)
    opt_ins = _given("l2_prefetch", "group_experts_from", "pdl")
    if opt_ins and "specialized" not in named:
        raise TraceError(None, f"{', '.join(opt_ins)}: options of the specialized path, which "
                               f"--paths {paths} leaves out")
    if not from_files and captures:
        raise TraceError(None, "--capture: for a trace given with --from, whose graph captures "
                               "were profiled apart")
    if not from_files and (from_only := _given("phase", "rules")):
        raise TraceError(None, f"{', '.join(from_only)}: for traces given with --from (a "
                               "capture records decode steps only, its launches named by class)")
    if captures and len(captures) != len(from_files):
        raise TraceError(None, f"--capture pairs with --from, one each in the same order: "
                               f"{len(from_files)} --from, {len(captures)} --capture (to "
                               "join one of several alone, `kimi-perf convert TRACE T.kptrace "
                               "--capture CAPTURE` first, then --from T.kptrace)")
    if captures and (folder := next((f for f in from_files if f.is_dir()), None)):
        raise TraceError(folder, "a directory: --capture pairs with one trace file each")
    return named


def _capture_with_progress(req: TraceRequest, console: Console
                           ) -> tuple[Path, dict[str, Breakdown], dict]:
    """``capture.capture(req)`` under a progress bar (on a terminal; a pipe gets none)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from kimi_perf import capture as cap

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("capturing", total=cap.work_units(req))
        with _memory_said(f"batch {req.batch}, context {req.context}, "
                          f"{req.warmup} + {req.steps} steps"):
            return cap.capture(req, progress=lambda text, units: bar.update(
                task, description=text, advance=units))


def _print_run(console: Console, run_dir: Path, results: dict[str, Breakdown],
               run_info: dict) -> None:
    """``trace``'s terminal summary of a run: the paths side by side (three or more: in one
    table; a pair, then each one's devices where it ran on several), the notes, the floors,
    each path's decode metrics (a TP run's: rank 0's, and which rank was slowest) and where
    the files are."""
    from kimi_perf.comparison import compare as compare_breakdowns
    from kimi_perf.comparison import sides_notes
    from kimi_perf.report import capture_said, first_forward_text, ranks_text

    labels = list(results)
    a = labels[0]
    fell_back = paths_that_fell_back(run_info)
    compared = [(b, compare_breakdowns(results[a], results[b],
                                       fell_back=a in fell_back or b in fell_back))
                for b in labels[1:]]
    on_cpu = [label for label, b in results.items() if b.unit == "ops"]
    unit = units_word(b.unit for b in results.values())
    if said := capture_said(run_info):   # (the counts below depend on it: opt-ins add launches)
        console.print(f"captured: {said}")
    if crowded := ranks_crowded(run_info):
        console.print(crowded, style="yellow")
    if missing := runs_mod.ranks_missing(labels):   # (a folder of a job's traces, one gone)
        console.print(missing, style="yellow")
    if len(labels) >= 3:  # every one in one table
        _print_overview(console, results, unit)
        console.print(f"{a} against each of the others: the report, or kimi-perf compare")
    else:
        for b, rows in compared:
            if rows:
                units = (results[a].unit, results[b].unit)
                # in the table, the words both names share left out, or numbers for names
                # too long (the notes below and the run's files keep the whole names)
                shown_a, shown_b = header_labels([a, b])
                console.print(render.comparison_table(rows, shown_a, shown_b, *units))
                if headline := render.comparison_headline(rows, shown_a, shown_b, *units):
                    console.print(headline)
                if (shown_a, shown_b) != (a, b):
                    console.print(f"{shown_a}: {a}; {shown_b}: {b}")
                if not on_cpu:   # (a CPU run's line comes below, for every path)
                    for line in sides_notes(results[a], results[b], a, b):
                        console.print(line)   # GPUs of another kind, as compare says
        if compared and compared[0][1]:   # (a pair of TP jobs: which rank of each is slow)
            shown = dict(zip(labels, header_labels(labels), strict=True))
            for label, rows in device_overviews(results).items():
                console.print(render.overview_table(rows, unit, of=shown[label]))
    if any(rows for _, rows in compared):
        for line in note_lines(results):
            console.print(line)
    else:   # one trace, or none with layers: each one's own tables (and their notes)
        for label, b in results.items():
            console.print(f"{label}:")
            render.print_tables(render.breakdown_tables(b), console)
    if not on_cpu and "floors" in run_info:
        console.print(render.floors_headline(run_info["floors"])
                      + f" at {run_info['floors']['bandwidth_Bps'] / 1e12:.1f} TB/s: what a "
                      "layer must move at least (kimi-perf floors)")
    if on_cpu:
        who = "Run" if len(on_cpu) == len(labels) else ", ".join(on_cpu) + " ran"
        first = f"; {said}" if (said := first_forward_text(run_info)) else ""
        console.print(f"{who} on a CPU, with no GPU kernels: 'ops' are the launches each path "
                      f"annotates (one per kernel it would run on a GPU), timed on the CPU{first}.")
    for path, metrics in run_info.get("paths", {}).items():
        console.print(f"{path}: {metrics['decode_tokens_per_s']:.1f} decode tokens/s (the "
                      "profiled steps' tokens over their summed time), "
                      f"time to first token {metrics['time_to_first_token_s'] * 1e3:.1f} ms, "
                      f"step {metrics['step_latency_s']['median'] * 1e3:.1f} ms median "
                      f"({metrics['timed']}); ops: {metrics['ops']}"
                      + (f"; {spec['accepted_tokens_per_step']} of 1+{spec['spec_tokens']} "
                         "tokens accepted per sequence and step (synthetic: a uniform 1 to "
                         f"1+{spec['spec_tokens']}, the verified token counted, drafting free)"
                         if (spec := metrics.get("speculative")) else "")
                      + (f"; fell back: {'; '.join(metrics['fallbacks'])}"
                         if metrics["fallbacks"] else ""))
    if said := ranks_text(run_info):
        console.print(said + ".")
    for path, reason in fell_back.items():
        console.print(fell_back_text(path, reason), style="bold yellow")
    if len(labels) == 2 and compared[0][1]:
        one = unit[:-1] if unit in ("kernels", "ops") else "kernel"
        # (quoted as a shell needs it: the line is for pasting)
        console.print(f"{one} by {one}: kimi-perf compare {printable(shlex.quote(str(run_dir)))}"
                      " --kernels (and the report)")
    console.print(printable(f"run directory: {run_dir}  "
                            f"({', '.join(sorted(p.name for p in Path(run_dir).iterdir()))})"))
    console.print(printable(f"report: {Path(run_dir).resolve() / run_info['report']}"))


def _print_overview(console: Console, results: dict[str, Breakdown], unit: str) -> None:
    """Every trace in one table (a row per device of a trace of several), its rows without
    the words every name shares, as compare's table (the JSON, the notes below and the run's
    files keep the whole names), and a line saying which is which."""
    rows = overview(results)
    labels = list(results)
    shown = distinct_words(labels)
    if shown != labels:
        short = dict(zip(labels, shown, strict=True))
        rows = [dataclasses.replace(r, trace=short[r.trace], label=short[r.trace] + (
            "" if r.device is None else f" device {r.device}")) for r in rows]
    console.print(render.overview_table(rows, unit))
    if shown != labels:
        console.print("; ".join(f"{s}: {label}" for s, label in zip(shown, labels,
                                                                    strict=True)))


def _fail_if_unusable(run_info: dict, run_dir: Path) -> None:
    """A captured path whose last decode step's logits hold a NaN or an infinity computes
    no usable output (its greedy tokens are argmax's picks of NaN); one whose every step fell
    back to the standard path's ops (a batch over 64) ran none of its kernels, and the run
    compares the standard path with itself. Their figures are written, and the run fails (as
    ``validate`` does), so that a job does not take it for a comparison."""
    said = []
    if broken := [path for path, m in run_info.get("paths", {}).items()
                  if m.get("logits_finite") is False]:
        said.append(f"the last decode step's logits of {' and '.join(broken)} are not all "
                    "finite (NaN or infinity): its figures measure a path that computes no "
                    "usable output")
    said += [fell_back_text(path, reason)
             for path, reason in paths_that_fell_back(run_info).items()]
    if said:
        click.echo(printable(f"kimi-perf: {run_dir}: {'; '.join(said)}"), err=True)
        sys.exit(1)
