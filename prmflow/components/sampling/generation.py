"""Batched text generation with a HF model (used for evaluation by sft and evaluate).

The rollout stage has the full sampling engine (logprobs, stop strings, vLLM); this is the small
shared piece every stage that reports accuracy needs: left-padded batches, KV cache, greedy or
sampled decoding, decoded responses cut at the end-of-sequence token (any of `chat.stop_token_ids`:
Qwen2.5's `<|im_end|>` and `<|endoftext|>`; special tokens are not in the decoded text).
"""

from __future__ import annotations

import sys

import torch
from tqdm.auto import tqdm

from ..models import chat


@torch.no_grad()
def generate_texts(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 64,
                   do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                   add_special_tokens: bool = True, images: list[list[bytes]] | None = None,
                   progress: str = "") -> list[str]:
    """One response per prompt. Deterministic for a given seed.

    `images`: per prompt its encoded images (vision-language models; the prompt text carries their
    placeholders, see tasks.render_prompt); the tokenizer must carry the model's processor.
    `progress`: the label of a progress bar over the responses (none when empty); it redraws at most
    every 10 s when stderr is a log file, not a terminal."""
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    out: list[str] = []
    gen = torch.Generator().manual_seed(seed)
    from ..models.vision import processor_of

    processor = processor_of(tokenizer)
    # a templated prompt (no special tokens added to it) ends at the template's end of turn too
    stops = chat.stop_token_ids(model, tokenizer, templated=not add_special_tokens)
    bar = tqdm(total=len(prompts), desc=progress, unit="seq", dynamic_ncols=True, disable=not progress,
               mininterval=0.2 if sys.stderr.isatty() else 10.0)
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            chunk_images = [b for row in images[i:i + batch_size] for b in row] if images else []
            if chunk_images:
                from ..models.vision import decode_image

                pil = [decode_image(b, f"prompt {i + k}") for k, b in enumerate(chunk_images)]
                enc = processor(text=chunk, images=pil, return_tensors="pt", padding=True,
                                              add_special_tokens=add_special_tokens).to(device)
            else:
                enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens).to(device)
            kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=stops, do_sample=do_sample)
            if processor is not None:  # never generate an image placeholder: no image stands behind it
                kwargs["suppress_tokens"] = [tokenizer.convert_tokens_to_ids(processor.image_token)]
            if do_sample:
                kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)  # 0 = off
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            ids = model.generate(**enc, **kwargs)
            new = ids[:, enc["input_ids"].shape[1]:]
            out += tokenizer.batch_decode(new, skip_special_tokens=True)
            bar.update(len(chunk))
    finally:
        bar.close()
        tokenizer.padding_side = side
        model.train(was_training)
    return out
