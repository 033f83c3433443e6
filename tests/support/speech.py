"""Scoring recognized speech against what was said."""

from __future__ import annotations


def word_errors(reference: str, hypothesis: str) -> int:
    """Substitutions + insertions + deletions turning `hypothesis` into `reference`
    (word-level Levenshtein distance)."""
    ref, hyp = reference.split(), hypothesis.split()
    row = list(range(len(hyp) + 1))
    for i, word in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, heard in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (word != heard))
    return row[-1]


def word_error_rate(pairs: list[tuple[str, str]]) -> float:
    """Total word errors over total reference words, for (reference, hypothesis) pairs."""
    words = sum(len(ref.split()) for ref, _ in pairs)
    return sum(word_errors(ref, hyp) for ref, hyp in pairs) / max(1, words)
