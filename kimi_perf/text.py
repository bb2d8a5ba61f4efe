"""Counts in words, and labels made short, for tables, notes and errors."""

from __future__ import annotations

import re


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 step', '2 steps', '1,832 kernels' (``plural`` where it is not ``noun`` + 's')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


_WORD_BREAKS = re.compile(r"([-_ /])")   # (kept by split: words and breaks alternate)


def distinct_words(labels: list[str]) -> list[str]:
    """Labels without the whole words (runs between ``-_ /``) that all of them begin or end
    with (``wan2.1_train_before``, ``wan2.1_train_after``: ``before``, ``after``), where what
    is left still reads apart and each keeps a letter (``trace_0``, ``trace_1`` stay: ``0``
    and ``1`` say nothing); else the labels as they are. For display: a name that identifies
    a trace (a stored path name) keeps its file's whole name."""
    if len(labels) < 2:
        return labels
    words = [_WORD_BREAKS.split(label) for label in labels]
    shortest = min(map(len, words))

    def shared(sides: list[list[str]]) -> int:
        """Leading tokens all sides share, as whole words with their breaks (even: a word
        shared up to a differing break is kept)."""
        columns = enumerate(zip(*sides, strict=False))
        n = next((i for i, tokens in columns if len(set(tokens)) > 1), shortest)
        return n - n % 2

    head, tail = shared(words), shared([w[::-1] for w in words])
    for drop_head, drop_tail in ((head, tail), (head, 0), (0, tail)):   # (both, else one)
        while drop_head + drop_tail:
            kept = ["".join(w[drop_head:len(w) - drop_tail]) for w in words]
            if all(_LETTER.search(k) for k in kept):
                if len(set(kept)) == len(kept):
                    return kept
                break
            # a label left empty or a bare number: keep one word more
            drop_head, drop_tail = ((drop_head - 2, drop_tail) if drop_head
                                    else (drop_head, drop_tail - 2))
    return labels


_LETTER = re.compile(r"[^\W\d_]")


LABEL_MOST = 24   # characters of a column header's label: a longer one wraps, a few a line


def header_labels(labels: list[str]) -> list[str]:
    """``labels`` for a table's column headers: ``distinct_words``, or "#1", "#2", … where one
    is still longer than LABEL_MOST characters or they are one name twice (``x`` and ``x'``:
    one file given twice). Beside the table, say what each label is."""
    shown = distinct_words(labels)
    twice = len({label.removesuffix("'") for label in labels}) < len(labels)
    if twice or max(map(len, shown), default=0) > LABEL_MOST:
        return [f"#{i}" for i in range(1, len(labels) + 1)]
    return shown


def also_as(given: object, twin: object) -> str:
    """How a file given twice was given the first time, where it was named otherwise (" (also
    as X)"; nothing where the two names are one)."""
    return "" if str(given) == str(twin) else f" (also as {twin})"
