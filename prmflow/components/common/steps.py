"""Reasoning steps: where they are in the text and in the token ids.

A response is split into steps by a separator (a newline by default); empty segments are not
steps. Rollout uses this to place `step_ends` (the index in response_ids of each step's last
token), the PRM to place its score readouts, and PRM labelling to cut step prefixes. All three
must agree, so they all call this module.
"""

from __future__ import annotations


def step_spans(text: str, separator: str = "\n") -> list[tuple[int, int]]:
    """(start, end) character spans of the non-empty steps of `text`; `end` is exclusive and
    excludes the separator."""
    spans, start = [], 0
    while start <= len(text):
        idx = text.find(separator, start) if separator else -1
        end = len(text) if idx < 0 else idx
        if text[start:end].strip():
            spans.append((start, end))
        if idx < 0:
            break
        start = idx + len(separator)
    return spans


def steps(text: str, separator: str = "\n") -> list[str]:
    """The non-empty steps of `text`, in order."""
    return [text[a:b] for a, b in step_spans(text, separator)]


def step_end_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Index of the last token of each step, from the tokens' character `offsets`.

    offsets: (start, end) characters of each token (a tokenizer's offset_mapping of the response);
    a step's last token is the last token that starts before the step's end character. Steps with
    no token (cannot happen for non-empty text) are skipped.
    """
    ends: list[int] = []
    t = 0
    for _, end in spans:
        last = None
        while t < len(offsets) and offsets[t][0] < end:
            last = t
            t += 1
        if last is not None:
            ends.append(last)
    return ends
