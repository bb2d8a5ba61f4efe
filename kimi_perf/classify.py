"""Kernel classes (gemm, attention, moe, norm, ...) from an ordered table of regex rules."""

from __future__ import annotations

import hashlib
import re
import stat
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from kimi_perf.errors import TraceError, input_stat, printable

OTHER = "other"


@dataclass(frozen=True)
class Rule:
    cls: str
    pattern: re.Pattern


# what breakdown's CSV writes a layer's classes with: gemm=3/12.5;norm=1/2.0
_CSV_MARKS = ";=/"


def _parse_rules(text: str, source: str | Path) -> list[Rule]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TraceError(source, f"invalid TOML ({exc})") from None
    except RecursionError:   # (tomllib parses nesting by recursion)
        raise TraceError(source, "invalid TOML (arrays or tables nested too deep)") from None
    if unknown := sorted(set(doc) - {"rule"}):
        raise TraceError(source, f"unknown table or key {unknown[0]!r}: the file holds "
                                 "[[rule]] entries only")
    entries = doc.get("rule")
    if not isinstance(entries, list) or not entries:
        raise TraceError(source, "no [[rule]] entries (each needs 'class' and 'pattern')")
    rules = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class"), str) \
                or not isinstance(entry.get("pattern"), str):
            raise TraceError(source, f"rule {i + 1} needs string 'class' and 'pattern'")
        if unknown := sorted(set(entry) - {"class", "pattern"}):
            raise TraceError(source, f"rule {i + 1} has an unknown key {unknown[0]!r} (a rule "
                                     "is 'class' and 'pattern')")
        if not entry["class"].strip() or not entry["pattern"]:
            raise TraceError(source, f"rule {i + 1} has an empty 'class' or 'pattern' (an "
                                     "empty pattern matches every kernel)")
        if bad := sorted(set(entry["class"]) & set(_CSV_MARKS)):
            raise TraceError(source, f"rule {i + 1}'s class {entry['class']!r} holds {bad[0]!r}, "
                                     "which the CSV's classes column separates with "
                                     f"(use none of {' '.join(_CSV_MARKS)})")
        try:
            pattern = re.compile(entry["pattern"], re.IGNORECASE)
        except re.error as exc:
            raise TraceError(source, f"rule {i + 1} has a bad regex ({exc})") from None
        if pattern.search(""):   # (then it matches at the start of any name)
            raise TraceError(source, f"rule {i + 1}'s pattern {entry['pattern']!r} matches an "
                                     "empty name, so every kernel")
        # (control characters written out, as a trace's names are: a class reaches the CSV)
        rules.append(Rule(printable(entry["class"]), pattern))
    return rules


def default_rules() -> list[Rule]:
    return list(_shipped_rules())


@cache
def _shipped_rules() -> tuple[Rule, ...]:
    # parsed once a process: a breakdown asks for them to class, to say and to digest
    text = resources.files("kimi_perf").joinpath("kernel_classes.toml").read_text()
    return tuple(_parse_rules(text, "kernel_classes.toml"))


def rules_said(rules: list[Rule] | None) -> str:
    """Which kernel-class rules a breakdown used, as its source records them: ``default``;
    ``N extra (sha256:…)``, a digest of the rules put before the defaults (``--rules``: the
    same file gives the same digest whatever the defaults of the version); or ``custom
    (sha256:…)``, a list of one's own."""
    defaults = default_rules()
    if rules is None or rules == defaults:
        return "default"
    extra = rules[:len(rules) - len(defaults)]
    own = rules[len(extra):] == defaults
    return (f"{len(extra)} extra" if own else "custom") + f" ({_digest(extra if own else rules)})"


def layout_rules_said(rules: list[Rule] | None) -> str:
    """``rules_said`` of the rules that may move the layers' cuts (``layout_class_name``): of
    extra rules, those naming a shipped class ("default" where none does); a list of one's
    own, whole."""
    defaults = default_rules()
    if rules is None or rules[len(rules) - len(defaults):] != defaults:
        return rules_said(rules)
    extra = rules[:len(rules) - len(defaults)]
    return rules_said([r for r in extra if r.cls in _shipped_classes()] + defaults)


def default_rules_said() -> str:
    """A digest of the shipped default rules: which version's defaults classed a trace."""
    return _digest(list(_shipped_rules()))


def _digest(rules: list[Rule]) -> str:
    text = "\n".join(f"{r.cls}\t{r.pattern.pattern}\t{r.pattern.flags}" for r in rules)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:12]


def load_rules(extra: str | Path | None = None) -> list[Rule]:
    """The default rules, preceded by the rules of a user's TOML file when given."""
    rules = default_rules()
    if extra is None:
        return rules
    path = Path(extra)
    if stat.S_ISDIR(input_stat(path).st_mode):
        raise TraceError(path, "cannot read rules: it is a directory")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, f"cannot read rules ({exc})") from None
    return _parse_rules(text, path) + rules


def classify_name(name: str, rules: list[Rule]) -> str:
    for rule in rules:
        if rule.pattern.search(name):
            return rule.cls
    return OTHER


def layout_class_name(name: str, rules: list[Rule]) -> str:
    """The class the layer finder reads for a kernel: the rules' class where it is one of the
    shipped classes (a user's rule may say that a kernel no default rule knows attends), else
    the default rules' class. A class of one's own (``kda``) relabels the figures alone: it
    would otherwise move the layers' cuts, which look for attention, routers and copies."""
    label = next((rule.cls for rule in rules if rule.pattern.search(name)), None)
    if label in _shipped_classes():   # (no rule's: a list of one's own, which lacks them)
        return label
    return classify_name(name, default_rules())


@cache
def _shipped_classes() -> frozenset[str]:
    return frozenset({r.cls for r in _shipped_rules()} | {OTHER})


def classify(names: np.ndarray, strings: list[str], rules: list[Rule],
             class_name: Callable[[str, list[Rule]], str] = classify_name
             ) -> tuple[np.ndarray, list[str]]:
    """Class code per name code, and the class labels the codes index (one regex pass per
    distinct name, not per kernel), each name's class as ``class_name`` gives it."""
    labels: list[str] = []
    index: dict[str, int] = {}
    uniq, inverse = np.unique(names, return_inverse=True)
    codes = np.empty(len(uniq), np.int32)
    for i, code in enumerate(uniq.tolist()):
        label = class_name(strings[code], rules)
        codes[i] = index.setdefault(label, len(labels))
        if codes[i] == len(labels):
            labels.append(label)
    return codes[inverse].astype(np.int32) if len(names) else np.empty(0, np.int32), labels
