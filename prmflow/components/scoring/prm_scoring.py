"""Score responses step by step with a trained PRM (used by rollout, best-of-N and evaluation).

    scorer = PRMScorer("outputs/prm")
    scores = scorer.score(prompts, responses)   # [[p_step0, p_step1, ...], ...]
    scorer.tokens_per_s                          # throughput of the last call

The text is re-tokenized with the PRM's own tokenizer (the policy's token ids are never used, so
a PRM and a policy with different tokenizers work together); the score of a step is
sigmoid(step logit) read at exactly the step's last token (`prm_model.encode`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ...errors import DataError
from ...tasks import PromptRecord, render_prompt
from ..models import modeling
from ..models.vision import batch_pixels, processor_of
from ..models.prm_model import PRM, HeadConfig, encode, has_shared_readout, saved_chat_template, saved_separator

log = logging.getLogger(__name__)


class PRMScorer:
    """Per-step probabilities of being correct, from a PRM directory.

    The head (token_classification or lm_tokens) and, when not given, the step separator come
    from the directory's prmflow.json (written by the prm stage); pass `head` to read a foreign
    checkpoint (e.g. Math-Shepherd: HeadConfig("lm_tokens", "+", "-", " ки")).
    """

    def __init__(self, path: str, batch_size: int = 32, device: str | None = None, step_separator: str = "\n",
                 max_length: int | None = None, head: HeadConfig | None = None, dtype: str = "float32"):
        self.prm = PRM.load(path, head, dtype)
        self.device = modeling.placement(device or "")[0]  # empty: cuda when available, else cpu
        self.prm.model.to(self.device).eval()
        self.chat_template = saved_chat_template(path)  # prompts are rendered as in training
        saved = saved_separator(path)
        if saved is not None and saved != step_separator:
            log.warning("PRM %s was trained with step separator %r, scoring with %r", path, saved, step_separator)
        self.batch_size = batch_size
        self.step_separator = step_separator
        text_cfg = getattr(self.prm.model.config, "text_config", None) or self.prm.model.config
        self.max_length = max_length or getattr(text_cfg, "max_position_embeddings", None)
        self.path = str(path)
        self.tokens_per_s = 0.0

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str], images: list[list[bytes]] | None = None) -> list[list[float]]:
        """Per-step probability of being correct, one list per response, one float per step
        (steps = steps.steps(response, step_separator)). Re-tokenizes the text with the PRM's own
        tokenizer (never takes policy token ids). `prompts` are the task's prompts as written (not
        chat-templated): the scorer renders them the way the PRM was trained (its chat template when
        prmflow.json says so, `saved_chat_template`; image placeholders for `images`, per response
        its prompt's images, which a vision-language PRM sees too).

        A step whose readout token lies beyond max_length cannot be seen by the model and scores 0.0
        (a logged warning says how many). Steps that end in the same token (a tokenizer merging across
        the separator) get that token's score each, with a logged warning.
        """
        if len(prompts) != len(responses):
            raise DataError(f"score() got {len(prompts)} prompts but {len(responses)} responses; pass one prompt per response.")
        t0 = time.perf_counter()
        images = images or [[] for _ in prompts]
        if any(images) and processor_of(self.prm.tokenizer) is None:
            raise DataError(f"responses with images need a vision-language PRM; '{self.path}' is text-only.")
        prompts = [render_prompt(self.prm.tokenizer, PromptRecord("", p, images=im or None), self.chat_template)
                   for p, im in zip(prompts, images)]
        encoded = [encode(self.prm.tokenizer, p, r, self.step_separator, self.prm.head.step_tag, self.max_length, im)
                   for p, r, im in zip(prompts, responses, images)]
        out: list[list[float]] = [[0.0] * e.n_steps for e in encoded]
        shared = sum(has_shared_readout(e) for e in encoded)
        if shared:
            log.warning("%d responses have steps that end in the same token of this PRM's tokenizer; those steps "
                        "share one score (set head.step_tag to give every step a token of its own)", shared)
        cut = sum(e.n_steps - len(e.step_ends) for e in encoded)
        if cut:
            log.warning("%d steps lie beyond max_length=%d tokens and score 0.0", cut, self.max_length)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))  # similar lengths share a batch
        tokens = 0
        pad = self.prm.tokenizer.pad_token_id
        for b in range(0, len(order), self.batch_size):
            idx = [i for i in order[b:b + self.batch_size] if encoded[i].step_ends]
            if not idx:
                continue
            ids, mask = right_pad([encoded[i].input_ids for i in idx], pad)
            pixels = batch_pixels([encoded[i].pixels for i in idx], self.device)
            starts = torch.tensor([encoded[i].response_start for i in idx], dtype=torch.long, device=self.device)
            z = self.prm(ids.to(self.device), mask.to(self.device), response_start=starts, **pixels)  # (B, T)
            probs = torch.sigmoid(z).cpu()
            for row, i in enumerate(idx):
                ends = encoded[i].step_ends
                out[i][:len(ends)] = probs[row, ends].tolist()
            tokens += int(mask.sum())
        self.tokens_per_s = tokens / max(time.perf_counter() - t0, 1e-9)
        return out


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids padded on the right with `pad_id`, and the (B, T) attention mask."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def load_scorer(path: str | Path, **kwargs) -> PRMScorer:
    """A scorer whose step separator defaults to the one the PRM was trained with."""
    kwargs.setdefault("step_separator", saved_separator(path) or "\n")
    return PRMScorer(str(path), **kwargs)
