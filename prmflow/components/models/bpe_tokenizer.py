"""The tokenizer of the `tiny-qwen2-bpe` preset: a byte-level BPE tokenizer in Qwen2.5's format,
trained here on the built-in tasks' text (nothing is downloaded).

What makes it behave like a real Qwen2.5-Instruct tokenizer, and what it is for:
- Qwen2's pre-tokenizer regex (`QWEN2_PATTERN`) then byte-level BPE, NFC normalization and the
  byte-level decoder: digits are single tokens, and punctuation and spaces merge with the newlines
  after them (`.\\n`, ` \\n`, `\\n\\n` are one pre-token), so a step separator can sit inside a token
  that also ends the step. Step boundaries must come from offsets, never from token identities.
- Qwen2.5's special tokens: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos: the end of
  an assistant turn), and Qwen2.5-Instruct's chat template (`QWEN25_CHAT_TEMPLATE`, verbatim,
  default system prompt included), so prompts are templated and responses end at `<|im_end|>`.
- It is the transformers `Qwen2Tokenizer` class, saved as a standard directory (tokenizer.json +
  tokenizer_config.json), so `AutoTokenizer.from_pretrained` loads it like a downloaded Qwen2.5.

The corpus is fixed (`corpus()`: arithmetic problems of a fixed seed in the task's own format,
chat-wrapped, and in worded and GSM8K/MATH-style answer formats that put punctuation and blank
lines before newlines), so the same merges come out on every machine. That text is narrow and
Qwen2 splits digits, so the trainer stops at 145 merges (256 bytes + 145 merges + 3 special tokens =
404 ids) well before VOCAB_SIZE; a real Qwen2.5 has 151k ids, through the same code paths.
"""

from __future__ import annotations

import functools
import random

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

#: Qwen2's pre-tokenizer split (tokenizer.json of every Qwen2/2.5 model).
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
                 r"""|\s+(?!\S)|\s+""")

#: Qwen2.5-Instruct's chat template, as in its tokenizer_config.json.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

VOCAB_SIZE = 4096
"""Target vocabulary (bytes + merges); the trainer stops earlier when the corpus has no more pairs."""
CORPUS_PROBLEMS = 1000
CORPUS_SEED = 20251124

_WORDS = {"+": ("plus", "add", "adding"), "-": ("minus", "subtract", "subtracting"),
          "*": ("times", "multiply by", "multiplying by")}
_OPENERS = ("First", "Next", "Then", "After that", "Now", "Finally")


def _worded(steps: list[str], answer: str, rng: random.Random) -> list[str]:
    """The same solution in words, in the answer formats of public math data: sentences that end with
    a period before the newline, blank lines between paragraphs, trailing spaces, GSM8K's `#### N`
    and MATH's `\\boxed{N}`."""
    import re

    lines = []
    for k, s in enumerate(steps[:-1]):
        m = re.match(r"(-?\d+)([+\-*])(-?\d+)=(-?\d+)", s)
        if not m:
            continue
        a, op, b, c = m.groups()
        word = rng.choice(_WORDS[op])
        opener = _OPENERS[min(k, len(_OPENERS) - 1)]
        lines.append(rng.choice([f"{opener}, {a} {word} {b} is {c}.", f"{opener} we {word} {b}: {a} {op} {b} = {c}.",
                                 f"Step {k + 1}: {s}", f"{a} {op} {b} = {c} "]))
    end = rng.choice([f"So the answer is {answer}.", f"#### {answer}", f"The answer is $\\boxed{{{answer}}}$.",
                      f"Therefore, the final answer is {answer}.", f"answer: {answer}"])
    sep = rng.choice(["\n", "\n\n", " \n"])
    return [sep.join(lines + [end])]


def corpus(n: int = CORPUS_PROBLEMS, seed: int = CORPUS_SEED) -> list[str]:
    """The fixed training text: per arithmetic problem its prompt and solution as the task writes them,
    the chat-templated conversation, and a worded solution (see `_worded`)."""
    from ...tasks import arithmetic

    rng = random.Random(seed)
    texts = []
    for p in arithmetic.generate(n, seed=seed, split="train"):
        texts.append(p.prompt + p.solution)
        texts.append(f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n{IM_START}user\n{p.prompt}{IM_END}\n"
                     f"{IM_START}assistant\n{p.solution}{IM_END}\n")
        texts += _worded(p.steps, p.answer, rng)
    return texts


@functools.lru_cache(maxsize=4)
def train_bpe(vocab_size: int, n: int, seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of byte-level BPE trained on `corpus(n, seed)` with Qwen2's pre-tokenizer."""
    import json

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # the special tokens are not text to learn merges from: cut them out of the corpus
    texts = [t for text in corpus(n, seed) for t in _split_special(text)]
    core.train_from_iterator(texts, trainer)
    model = json.loads(core.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _split_special(text: str) -> list[str]:
    import re

    return [t for t in re.split("|".join(map(re.escape, SPECIAL_TOKENS)), text) if t]


def build_bpe_tokenizer(vocab_size: int = VOCAB_SIZE, n: int = CORPUS_PROBLEMS, seed: int = CORPUS_SEED):
    """A fresh `Qwen2Tokenizer` (transformers' fast, tokenizers-backed class) with the trained vocab,
    Qwen2.5-Instruct's special tokens (after the BPE vocab, as in Qwen2.5: eos `<|im_end|>`, pad
    `<|endoftext|>`, no bos/unk) and chat template. Deterministic: the same ids on every call."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = train_bpe(vocab_size, n, seed)
    vocab = dict(vocab)
    for tok in SPECIAL_TOKENS:  # ids after the BPE vocab, in Qwen2.5's order
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=list(merges), unk_token=None, bos_token=None, eos_token=IM_END,
                         pad_token=ENDOFTEXT, errors="replace", clean_up_tokenization_spaces=False,
                         split_special_tokens=False, model_max_length=4096)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in SPECIAL_TOKENS]})
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok
