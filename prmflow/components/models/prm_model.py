"""The process reward model: a causal-LM backbone read out once per reasoning step.

Two heads, one readout contract: for every step the model yields one *step logit* z, and the
PRM's score is sigmoid(z) = P(step is correct).

- `token_classification` (ours, the default): an `AutoModelForTokenClassification` with one label
  (the backbone + a linear `score` head, `modeling.load_scalar_model`); z = head output at the last
  token of the step. Initialized from a causal-LM directory (e.g. the SFT policy) the head starts at
  zero, so every step starts at 0.5.
- `lm_tokens` (Math-Shepherd style): a plain causal LM; z = logit(good_token) - logit(bad_token)
  at the step's last token (usually a step tag such as " ки" appended to every step). This is
  exactly softmax([l_good, l_bad])[0] of the Math-Shepherd readout, written as a logit difference
  so training uses the same BCE-with-logits as the token-classification head.
- `implicit` (PRIME, arXiv 2502.01456): a causal LM of the policy's architecture and a frozen copy
  of where it started (the reference, saved in `reference/`); z at a token = beta x the sum of
  log pi(y_j) / pi_ref(y_j) over the response tokens up to it, the implicit Q of the response so
  far. Started from the policy itself every step reads 0 (score 0.5); trained with the same BCE on
  outcome labels it learns P(success | prefix) as a token-level decomposition.

Where the readout sits is decided by `encode`, which training, scoring and labelling all call: the
prompt is tokenized, then the response (after the prompt, without special tokens) with its offset
mapping, and `steps.step_end_tokens` places the last token of each step.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForTokenClassification

from ..data import io, steps
from . import modeling
from .head_chunks import chunked_head_scores
from .tensor_ops import token_logprobs
from ...errors import ConfigError, DataError, ModelLoadError
from .vision import Vision, processor_of

log = logging.getLogger(__name__)

#: File (written by modeling.save_pretrained's `extra`) that records how a saved PRM reads its steps.
PRM_META = "prmflow.json"
#: Subdirectory of an implicit PRM holding its frozen reference model.
REFERENCE_DIR = "reference"
#: An implicit PRM reads its LM head for this many bytes of float32 logits at a time (Qwen2.5's 151,936-token
#: vocabulary: 441 positions), whatever the batch: large enough for full-width matrix products, small next to a model.
LOGIT_CHUNK_BYTES = 256 * 2**20


@dataclass
class HeadConfig:
    kind: Literal["token_classification", "lm_tokens", "implicit"] = "token_classification"
    """token_classification: a linear head on the backbone (AutoModelForTokenClassification); lm_tokens: P(good_token)
    vs P(bad_token) of a causal LM (Math-Shepherd); implicit: PRIME's implicit PRM, beta x the log-likelihood ratio of
    an LM to its frozen start."""
    good_token: str = "+"
    """lm_tokens: the token whose probability means 'this step is correct' (Math-Shepherd: '+')."""
    bad_token: str = "-"
    """lm_tokens: the token whose probability means 'this step is wrong' (Math-Shepherd: '-')."""
    step_tag: str = ""
    """Text appended to every step before tokenizing, read at its last token (Math-Shepherd: ' ки'). Empty: read at the
    step's own last token."""
    beta: float = 0.05
    """implicit: the scale of the log-likelihood ratio (PRIME: 0.05); a larger beta lets a small change of the LM move
    the score more."""

    def __post_init__(self):
        if self.kind not in ("token_classification", "lm_tokens", "implicit"):
            raise ConfigError(f"head.kind={self.kind!r} is not one of ['token_classification', 'lm_tokens', 'implicit'].")
        if self.kind == "implicit" and not self.beta > 0:
            raise ConfigError(f"head.beta={self.beta} must be > 0 for head.kind=implicit.")
        if self.kind == "lm_tokens" and (not self.good_token or not self.bad_token or self.good_token == self.bad_token):
            raise ConfigError(f"head.good_token ({self.good_token!r}) and head.bad_token ({self.bad_token!r}) must be "
                              f"two different non-empty tokens for head.kind=lm_tokens.")

    def recorded(self) -> dict:
        """The head as prmflow.json and the prm stage's config identity record it: without beta unless
        the head reads it, so what was written before the key existed still matches."""
        head = asdict(self)
        if self.kind != "implicit":
            head.pop("beta")
        return head


@dataclass
class Encoded:
    """One (prompt, response) pair as the PRM sees it."""

    input_ids: list[int]
    step_ends: list[int]  # index into input_ids of the readout token of each step
    n_steps: int  # steps in the response; > len(step_ends) only when truncated
    response_start: int = 0  # index in input_ids of the response's first token (the prompt's length)
    pixels: dict = field(default_factory=dict, repr=False)  # the prompt's images (vision-language PRM)


def tag_steps(response: str, separator: str, step_tag: str) -> tuple[str, list[tuple[int, int]]]:
    """The response with `step_tag` appended to every step, and the steps' spans in that text
    (each span ends after its tag)."""
    spans = steps.step_spans(response, separator)
    if not step_tag:
        return response, spans
    parts, new_spans, pos, shift = [], [], 0, 0
    for a, b in spans:
        parts += [response[pos:b], step_tag]
        new_spans.append((a + shift, b + shift + len(step_tag)))
        shift += len(step_tag)
        pos = b
    parts.append(response[pos:])
    return "".join(parts), new_spans


def prompt_ids(tokenizer, prompt: str, images: list[bytes] | None = None) -> tuple[list[int], dict]:
    """Prompt tokens and the pixel inputs of its images; special tokens (BOS) are added unless the
    prompt already starts with them (a chat-templated prompt carries its own). With images the
    prompt must carry their placeholders (tasks.render_prompt puts them in)."""
    bos = tokenizer.bos_token
    add = not (bos and prompt.startswith(bos))
    if images:
        processor = processor_of(tokenizer)
        if processor is None:
            raise DataError("a prompt with images needs a vision-language PRM (a model directory with its processor); "
                            "this PRM is text-only.")
        return Vision(processor).encode_prompt(prompt, images, "PRM prompt", add_special_tokens=add)
    return tokenizer(prompt, add_special_tokens=add)["input_ids"], {}


def encode(tokenizer, prompt: str, response: str, separator: str = "\n", step_tag: str = "",
           max_length: int | None = None, images: list[bytes] | None = None) -> Encoded:
    """Token ids of prompt + response and the readout position of every step.

    Steps are `steps.step_spans(response, separator)`; a step's readout is its last token (or the
    last token of its tag). A step whose characters all lie in the token that ends the step before
    (a tokenizer merging across the separator, e.g. "3\nanswer: 3") gets that same token: the two
    steps share a readout, as the rollout stage's step_ends do (`has_shared_readout` tells;
    training refuses such rows, scoring gives both steps the same score). With `max_length`, the
    ids are cut to that many tokens and steps whose readout falls beyond it get no position
    (`n_steps` still counts them).
    """
    p_ids, pixels = prompt_ids(tokenizer, prompt, images)
    text, spans = tag_steps(response, separator, step_tag)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = steps.step_end_tokens(enc["offset_mapping"], spans)  # one per step, shared or not
    ids = p_ids + list(enc["input_ids"])
    ends = [len(p_ids) + e for e in ends]
    if max_length is not None and len(ids) > max_length:
        ids = ids[:max_length]
        ends = [e for e in ends if e < max_length]
    return Encoded(ids, ends, len(spans), len(p_ids), pixels)


def has_shared_readout(enc: Encoded) -> bool:
    """Two steps read out at the same token (see `encode`)."""
    return len(set(enc.step_ends)) != len(enc.step_ends)


def step_logits(logits: torch.Tensor, head: HeadConfig, good_id: int | None = None, bad_id: int | None = None) -> torch.Tensor:
    """Per-token step logit z (score = sigmoid(z)) from the model's output logits.

    token_classification: logits (B, T, 1) -> (B, T), the head output.
    lm_tokens: logits (B, T, V) -> (B, T), l_good - l_bad; sigmoid of it equals
    softmax(logits[..., [good, bad]])[..., 0], the Math-Shepherd readout.
    """
    if head.kind == "token_classification":
        return logits[..., 0].float()
    return (logits[..., good_id] - logits[..., bad_id]).float()


def implicit_step_logits(logits: torch.Tensor, ref_logits: torch.Tensor, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor, response_start: torch.Tensor, beta: float) -> torch.Tensor:
    """PRIME's implicit step logit at every token: z_t = beta * sum_{response_start <= j <= t}
    (log pi(x_j | x_<j) - log pi_ref(x_j | x_<j)), the log-ratio of the tokens read so far.

    logits, ref_logits (B, T, V); input_ids, attention_mask (B, T); response_start (B,) -> (B, T)
    float32 (0 before the response and at padding). Gradients flow through `logits` only.
    """
    B, T = input_ids.shape
    ratio = (token_logprobs(logits[:, :-1], input_ids[:, 1:])
             - token_logprobs(ref_logits[:, :-1].detach(), input_ids[:, 1:]))  # (B, T-1): entry j-1 scores token j
    ratio = torch.cat([ratio.new_zeros(B, 1), ratio], dim=1)  # (B, T): entry j scores token j
    pos = torch.arange(T, device=input_ids.device)[None, :]
    keep = (pos >= response_start.to(input_ids.device)[:, None]) & attention_mask.bool()
    return beta * torch.cumsum(ratio * keep, dim=1)


def response_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       response_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) of every response token an implicit step logit sums over: position >=
    response_start, not padding, and not position 0 (no token before it predicts it). (N,) each."""
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
    keep = (pos >= response_start.to(input_ids.device)[:, None]) & attention_mask.bool() & (pos >= 1)
    return keep.nonzero(as_tuple=True)


def logit_chunk_rows(lm: torch.nn.Module) -> int:
    """Positions whose float32 logits over `lm`'s vocabulary fill LOGIT_CHUNK_BYTES (at least one)."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * lm.config.get_text_config().vocab_size))


def selected_logprobs(call, lm: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      rows: torch.Tensor, positions: torch.Tensor, chunk_rows: int, temperature: float = 1.0,
                      **pixels) -> torch.Tensor | None:
    """log p(input_ids[r, t] | input_ids[r, :t]) for each (r, t) of (rows, positions): (N,) float32, of
    softmax(logits / temperature), from one forward pass of `call` (`lm` itself, or a training engine running it) in which the LM
    head reads only those N positions, `chunk_rows` at a time (`head_chunks.chunked_head_scores`): the
    (B, T, V) logits are never made.

    None when `lm`'s head cannot be read so (no backbone or head found, no logits_to_keep, or logits
    that are not its head applied to its backbone's output: a logit soft-cap or scale, an architecture
    that ignores logits_to_keep; checked on every call), with a warning that says why. The caller then
    computes the logits the plain way.
    """
    out, why = chunked_head_scores(call, lm, input_ids, rows, positions, chunk_rows, attention_mask=attention_mask,
                                   temperature=temperature, **pixels)
    if out is None:
        log.warning("the LM head cannot be read in chunks (%s); computing the logits whole, (B, T, vocabulary) per "
                    "pass", why)
        return None
    return out.logp


def single_token_id(tokenizer, text: str, what: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ConfigError(f"{what} {text!r} is {len(ids)} tokens for this tokenizer ({ids}); lm_tokens needs a "
                          f"single token. Pick a string the tokenizer keeps whole (Math-Shepherd: '+' and '-').")
    return ids[0]


class PRM:
    """A loaded PRM: the HF model, its tokenizer, its head and the token ids the head reads.

    `PRM.load(path_or_preset, head)` builds the right model class for the head; `forward` returns
    step logits (B, T) for every token (training gathers the step positions, scoring too).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, head: HeadConfig, reference: torch.nn.Module | None = None,
                 reference_dir: Path | None = None):
        self.model, self.tokenizer, self.head = model, tokenizer, head
        self.reference = reference  # implicit: the frozen LM the log-likelihood ratio is taken against
        self.reference_dir = reference_dir  # implicit, loaded from a saved PRM: where its reference's files are
        self.chunked = True  # implicit: read the head chunk by chunk (False once a model's logits were not its head's)
        self.logit_chunk_rows: int | None = None  # implicit: positions per chunk; None: LOGIT_CHUNK_BYTES of float32 logits
        if head.kind == "implicit" and reference is None:
            raise ConfigError("head.kind=implicit needs a reference model.")
        self.good_id = self.bad_id = None
        if head.kind == "lm_tokens":
            self.good_id = single_token_id(tokenizer, head.good_token, "head.good_token")
            self.bad_id = single_token_id(tokenizer, head.bad_token, "head.bad_token")

    @classmethod
    def load(cls, path: str | Path, head: HeadConfig | None = None, dtype: str = "float32", seed: int = 0) -> "PRM":
        """A PRM from a HF directory or a tiny preset name.

        With `head` None the head recorded in the directory's prmflow.json is used (a PRM written by
        this stage), else token_classification. A directory whose recorded head differs from the
        requested one is an error: the weights would be read the wrong way.
        """
        saved = saved_head(path)
        if head is None:
            head = saved or HeadConfig()
        elif saved is not None and saved.kind != head.kind:
            raise ConfigError(f"'{path}' is a PRM with head.kind={saved.kind}, but head.kind={head.kind} was asked "
                              f"for. Set head.kind={saved.kind} (or start from a plain causal-LM directory).")
        if head.kind == "token_classification" and modeling.is_vision(path) and saved is None:
            raise ConfigError(f"'{path}' is a vision-language model: read its steps with head.kind=lm_tokens (the LM's "
                              f"own good/bad-token logits, so the PRM sees the image through the model's own class); "
                              f"a token-classification head exists for text models only.")
        reference = ref_dir = None
        if head.kind in ("lm_tokens", "implicit"):
            model, tok = modeling.load_causal_lm(path, dtype, seed=seed)
        elif modeling.is_tiny(str(path)):
            model, tok = _tiny_scalar_model(str(path), seed, dtype)
        else:
            model, tok = modeling.load_scalar_model(path, dtype)
        if isinstance(getattr(model, "dropout", None), torch.nn.Dropout):
            # HF token classifiers default to dropout 0.1 before the head; a scalar regression head
            # (like a value head) trains better and reproducibly without it
            model.dropout.p = 0.0
            model.config.classifier_dropout = 0.0
        if head.kind == "implicit":
            if saved is not None:  # a trained implicit PRM carries the model it started from
                ref_dir = Path(str(path)) / REFERENCE_DIR
                if not (ref_dir / "config.json").is_file():
                    raise ModelLoadError(f"'{path}' is an implicit PRM without its reference model ('{ref_dir}' is "
                                         f"missing); it cannot be read. Re-create it from its policy.")
                reference, _ = modeling.load_causal_lm(ref_dir, dtype, seed=seed)
            else:  # started from a policy: the reference is that policy, so every step starts at 0.5
                reference = copy.deepcopy(model)
            reference.eval().requires_grad_(False)
        return cls(model, tok, head, reference, ref_dir)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model=None,
                 response_start: torch.Tensor | None = None, **pixels) -> torch.Tensor:
        """Step logits for every token: (B, T) ids and mask -> (B, T) float32. `model` lets a
        training engine's wrapper run the forward pass; `response_start` (B,): where each row's
        response begins (the implicit head sums over the response only); `pixels`: the batch's
        image inputs."""
        if self.head.kind == "implicit":
            if response_start is None:
                raise ValueError("an implicit PRM needs response_start (where each row's response begins)")
            return self._implicit_step_logits(model or self.model, input_ids, attention_mask, response_start, pixels)
        out = (model or self.model)(input_ids=input_ids, attention_mask=attention_mask, **pixels)
        return step_logits(out.logits, self.head, self.good_id, self.bad_id)

    def _implicit_step_logits(self, call, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              response_start: torch.Tensor, pixels: dict) -> torch.Tensor:
        """`implicit_step_logits` without the (B, T, V) logits: the log-ratio of the response tokens
        only, read chunk by chunk from each model's head (`selected_logprobs`); the plain computation
        when a model's logits are not its head's output. (B, T) float32."""
        B, T = input_ids.shape
        self._move_reference(input_ids.device)
        if self.chunked:
            rows, positions = response_positions(input_ids, attention_mask, response_start)
            chunk = self.logit_chunk_rows or logit_chunk_rows(self.model)
            logp = selected_logprobs(call, self.model, input_ids, attention_mask, rows, positions, chunk, **pixels)
            with torch.no_grad():
                ref = None if logp is None else selected_logprobs(self.reference, self.reference, input_ids, attention_mask,
                                                                  rows, positions, chunk, **pixels)
            if ref is not None:
                ratio = logp.new_zeros(B, T).index_put((rows, positions), logp - ref)  # (B, T): entry t scores token t
                return self.head.beta * torch.cumsum(ratio, dim=1)
            self.chunked = False  # selected_logprobs said why
        out = call(input_ids=input_ids, attention_mask=attention_mask, **pixels)
        return implicit_step_logits(out.logits, self._reference_logits(input_ids, attention_mask, **pixels),
                                    input_ids, attention_mask, response_start, self.head.beta)

    def _move_reference(self, device: torch.device) -> None:
        if next(self.reference.parameters()).device != device:
            self.reference.to(device)

    @torch.no_grad()
    def _reference_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **pixels) -> torch.Tensor:
        self._move_reference(input_ids.device)
        return self.reference(input_ids=input_ids, attention_mask=attention_mask, **pixels).logits

    def save(self, directory: str | Path, separator: str, chat_template: bool | None = None, model=None,
             extra: dict | None = None) -> None:
        """Write the PRM as an HF directory with its prmflow.json (`metadata` plus `extra`); `model`: the
        trained weights' module when not self.model (a training engine's). An implicit head's reference
        goes to `directory`/reference (the PRM is readable only with it): hard links to the files it was
        loaded from when there are some (it is frozen, so every update of an implicit PRM shares its
        reference's bytes), else written."""
        modeling.save_pretrained(model or self.model, self.tokenizer, directory,
                                 extra={**self.metadata(separator, chat_template), **(extra or {})})
        if self.head.kind != "implicit":
            return
        if self.reference_dir is not None:
            io.link_or_copy_tree(self.reference_dir, Path(directory) / REFERENCE_DIR)
        else:
            modeling.save_pretrained(self.reference, self.tokenizer, Path(directory) / REFERENCE_DIR)

    def metadata(self, separator: str, chat_template: bool | None = None) -> dict:
        """What save() records so a scorer reads the checkpoint the way it was trained: the head, the
        step separator, and (when given) whether prompts went through the tokenizer's chat template."""
        meta = {"stage": "prm", "prm_head": self.head.recorded(), "step_separator": separator}
        if chat_template is not None:
            holder = processor_of(self.tokenizer) or self.tokenizer
            meta["chat_template"] = bool(chat_template and getattr(holder, "chat_template", None))
        return meta


def append_identity_layers(model: torch.nn.Module, n: int, seed: int = 0) -> torch.nn.Module:
    """Append `n` decoder layers to the backbone whose residual branches start at zero.

    The model computes exactly what it did before (each new layer adds o_proj(...) = 0 and
    down_proj(...) = 0 to the residual stream), but the new layers can attend from a token to the
    backbone's *finished* prediction at the previous token. A verifier needs that comparison (was
    this digit the one the backbone expected?) and a backbone whose last layer makes its predictions
    has no layer left to make it. The result is still a plain HF model with num_hidden_layers + n.
    """
    if n <= 0:
        return model
    backbone = getattr(model, model.base_model_prefix)
    layers = getattr(backbone, "layers", None)
    if layers is None or not len(layers):
        raise ConfigError(f"extra_layers needs a decoder with a `layers` list; {type(backbone).__name__} has none. "
                          f"Set extra_layers=0.")
    cfg = model.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7919)
        for _ in range(n):
            layer = copy.deepcopy(layers[-1])
            for module in layer.modules():  # fresh weights, residual outputs at zero
                if isinstance(module, torch.nn.Linear):
                    module.reset_parameters()
            for name, module in layer.named_modules():
                if name.endswith(("o_proj", "down_proj")):
                    torch.nn.init.zeros_(module.weight)
                    if module.bias is not None:
                        torch.nn.init.zeros_(module.bias)
            attn = getattr(layer, "self_attn", None)
            if attn is not None and hasattr(attn, "layer_idx"):
                attn.layer_idx = len(layers)
            layers.append(layer)
    cfg.num_hidden_layers = len(layers)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types + [cfg.layer_types[-1]] * n
    return model


def freeze_below(model: torch.nn.Module, train_layers: int) -> None:
    """Freeze everything but the last `train_layers` decoder layers, the final norm and the head.

    lm_tokens models keep their tied input embeddings frozen too (the head reads them), so only the
    top of the network adapts.
    """
    backbone = getattr(model, model.base_model_prefix)
    layers = backbone.layers
    if train_layers > len(layers):
        raise ConfigError(f"train_layers={train_layers} but the model has {len(layers)} decoder layers.")
    keep = {id(p) for layer in list(layers)[len(layers) - train_layers:] for p in layer.parameters()}
    keep |= {id(p) for p in getattr(backbone, "norm", torch.nn.Identity()).parameters()}
    head = getattr(model, "score", None)
    keep |= {id(p) for p in (head.parameters() if head is not None else [])}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def saved_head(path: str | Path) -> HeadConfig | None:
    meta = Path(str(path)) / PRM_META
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"'{meta}' is not valid JSON ({e}).") from None
    return HeadConfig(**data["prm_head"]) if "prm_head" in data else None


def saved_chat_template(path: str | Path) -> bool:
    """Whether the PRM at `path` read its training prompts through its tokenizer's chat template
    (the prm stage's `chat_template`, default true; it renders only when the tokenizer has a
    template): from prmflow.json when recorded there, else from the config in the output's
    manifest.json; a foreign checkpoint (no prmflow.json) reads plain prompts."""
    p = Path(str(path))
    if not (p / PRM_META).is_file():
        return False
    data = json.loads((p / PRM_META).read_text())
    if "chat_template" in data:
        return bool(data["chat_template"])
    try:
        config = json.loads((p / "manifest.json").read_text()).get("config", {})
    except (OSError, ValueError):
        config = {}
    return data.get("stage") == "prm" and bool(config.get("chat_template", True))


def saved_separator(path: str | Path) -> str | None:
    meta = Path(str(path)) / PRM_META
    if meta.is_file():
        return json.loads(meta.read_text()).get("step_separator")
    return None


def _tiny_scalar_model(preset: str, seed: int, dtype: str):
    """A token-classification model on a freshly initialized tiny backbone (score head at zero)."""
    lm, tok = modeling.build_tiny_model(preset, seed=seed)
    cfg = lm.config
    cfg.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_config(cfg)
    prefix = model.base_model_prefix  # 'model' for llama/qwen2
    getattr(model, prefix).load_state_dict(getattr(lm, prefix).state_dict())
    with torch.no_grad():
        model.score.weight.zero_()
        if getattr(model.score, "bias", None) is not None:
            model.score.bias.zero_()
    return model.to(modeling.torch_dtype(dtype)), tok
