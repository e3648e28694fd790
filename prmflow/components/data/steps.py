"""Reasoning steps: where they are in the text and in the token ids.

A response is split into steps by a separator (a newline by default); empty segments are not
steps. Rollout uses this to place `step_ends` (the index in response_ids of each step's last
token), the PRM to place its score readouts, and PRM labelling to cut step prefixes. All three
must agree, so they all call this module. Boundaries are characters: token positions come from
the tokens' character offsets, never from which tokens hold a newline, so a byte-level BPE token
that merges the separator with its neighbours (Qwen2.5's `.\n`, ` \n`, `\n\n`) moves nothing.
"""

from __future__ import annotations

import bisect


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
    """Index of the last token of each step (one per span), from the tokens' character `offsets`.

    offsets: (start, end) characters of each token (a tokenizer's offset_mapping, or the decoded
    pieces of generated ids), starts non-decreasing; zero-width tokens (special tokens, the first
    bytes of a character split across tokens) are allowed. A step's last token is the last token
    that starts before the step's end character: the token holding the step's last character, even
    when that token runs on into the separator (byte-level BPE's `.\n`, ` \n`, `\n\n` tokens).
    A step whose characters all lie in the token that ends the step before gets that same token
    (both steps share a readout; `lib.prm_model.has_shared_readout`). A step no token starts in
    front of (cannot happen for tokens covering the text) gets -1.
    """
    starts = [a for a, _ in offsets]
    return [bisect.bisect_left(starts, end) - 1 for _, end in spans]
