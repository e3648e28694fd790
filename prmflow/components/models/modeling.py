"""Load and save models in Hugging Face format; build the tiny model prmflow trains on CPU.

Every checkpoint is a plain HF directory (config.json, model.safetensors, tokenizer files), so any
stage, `transformers` and vLLM load it unchanged. `model_path` is either such a directory (a real
model on a cluster, e.g. a Qwen2.5 math model) or the name of a tiny preset (`tiny-llama`,
`tiny-qwen2`, and the vision-language `tiny-llava`) that is built from a config with a character
tokenizer (and for `tiny-llava` an image processor) the project makes, or `tiny-qwen2-bpe`: Qwen2
with a byte-level BPE tokenizer, Qwen2.5's special tokens and chat template (bpe_tokenizer.py), the
stand-in for a real Qwen2.5-Instruct directory. Nothing is downloaded at run time.

A vision-language directory (its config has a `vision_config`: LLaVA, Qwen2-VL, ...) loads through
`AutoModelForImageTextToText`; its tokenizer comes from `AutoProcessor` and carries the processor
(`vision.processor_of`), and `save_pretrained` writes the processor back, so every stage's output
is again a complete VL directory.

Loading is safe by default: weights come from safetensors only (a pickled pytorch_model.bin, which
can run code when unpickled, is refused), `trust_remote_code` stays off unless a config turns it on,
and a shard index cannot name a file outside the model directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from . import hf_quiet
from ...errors import ConfigError, ModelLoadError
from .vision import attach, processor_of

log = logging.getLogger(__name__)

#: The characters the tiny tokenizer knows: enough for the arithmetic task and plain English prompts.
ALPHABET = list("0123456789+-*/=()[]<>.,:;?!'\"% \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

#: Tiny presets: small enough to train in minutes on 2 CPU cores, real HF architectures.
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # Qwen2.5-Instruct in miniature: byte-level BPE (bpe_tokenizer.py), <|im_end|> ends a response,
    # <|endoftext|> pads, prompts go through Qwen2.5's chat template
    "tiny-qwen2-bpe": dict(model_type="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
}
TINY_PRESETS["tiny-llama-tools"] = dict(TINY_PRESETS["tiny-llama"], max_position_embeddings=512)
"""tiny-llama for tool-using episodes (the memory-agent task): its character tokenizer adds `{`, `}` and `_` (JSON
tool calls), has a minimal chat template (TOOLS_CHAT_TEMPLATE) and a 512-token window for multi-turn episodes."""
#: Presets whose tokenizer is the project's Qwen2.5-style byte-level BPE (the others are character-level).
BPE_PRESETS = frozenset({"tiny-qwen2-bpe"})
#: Character presets for tool calls, and the characters they add (appended: every other preset keeps its ids).
TOOLS_PRESETS = frozenset({"tiny-llama-tools"})
TOOLS_CHARS = ["{", "}", "_"]
#: Each message's content, then the turn's end: a newline after user / tool / system text, eos after an assistant
#: turn (chat.end_of_turn_id reads it); no role markers and no generation prompt, so an episode costs only its text.
TOOLS_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
                       "{% else %}{{ '\\n' }}{% endif %}{% endfor %}")


#: Tiny vision-language presets: a LLaVA model (CLIP vision tower, Llama text model). Its 56x56
#: images are 2x2 patches of 28 pixels, so an image is 4 tokens (a column of two per digit of the
#: visual task; 14-pixel patches, 16 tokens, learned to read far slower). (LLaVA rather than Qwen2-VL
#: because Qwen2-VL's processor needs torchvision, whose CPU build does not install next to the
#: CPU torch wheel here; a Qwen2-VL directory loads through the same code where torchvision is.)
TINY_VL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llava": dict(
        text=dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        vision=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, image_size=56, patch_size=28, projection_dim=64),
    ),
}
IMAGE_TOKEN = "<image>"


def build_tokenizer(alphabet: list[str] | None = None, extra_special: list[str] | None = None):
    """A character-level tokenizer (one token per character) in the standard HF fast format;
    `extra_special` tokens (e.g. an image placeholder) are kept whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = alphabet or ALPHABET
    extra = list(extra_special or [])
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS.values()) + extra + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char (newlines too) is a token
    core.decoder = decoders.Fuse()  # join characters back without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **SPECIAL_TOKENS)
    if extra:
        tok.add_special_tokens({"additional_special_tokens": extra})
    tok.model_max_length = 4096
    return tok


def build_tiny_vl_model(preset: str = "tiny-llava", seed: int = 0):
    """A freshly initialized tiny LLaVA model and its tokenizer (carrying the processor)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    spec = TINY_VL_PRESETS[preset]
    tok = build_tokenizer(extra_special=[IMAGE_TOKEN])
    side = spec["vision"]["image_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                   image_mean=[0.9, 0.9, 0.9], image_std=[0.5, 0.5, 0.5])
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=spec["vision"]["patch_size"],
                               vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1)
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = LlavaConfig(text_config=dict(vocab_size=len(tok), tie_word_embeddings=True, **ids, **spec["text"]),
                      vision_config=dict(spec["vision"]), image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                      vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, attach(processor)


def build_tiny_model(preset: str = "tiny-llama", seed: int = 0, **overrides: Any):
    """A freshly initialized tiny causal LM and its tokenizer, from a preset config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in TINY_PRESETS:
        raise ModelLoadError(f"Unknown tiny model preset '{preset}'. Known presets: {sorted(TINY_PRESETS)}.")
    tok = preset_tokenizer(preset)
    spec = {**TINY_PRESETS[preset], **overrides}
    model_type = spec.pop("model_type")
    # Qwen2.5-Instruct's ids: bos = <|endoftext|> in the config (the tokenizer adds none), eos = <|im_end|>
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.pad_token_id
    cfg = AutoConfig.for_model(
        model_type, vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=bos,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=True, **spec,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    if preset in BPE_PRESETS:  # as Qwen2.5-Instruct's generation_config.json: either token ends a response
        model.generation_config.bos_token_id = bos
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    return model, tok


def preset_tokenizer(preset: str):
    """The tokenizer of a tiny text preset: Qwen2.5-style byte-level BPE or the character tokenizer (with `{}_` and a
    chat template for the tools presets)."""
    if preset in BPE_PRESETS:
        from .bpe_tokenizer import build_bpe_tokenizer

        return build_bpe_tokenizer()
    if preset in TOOLS_PRESETS:
        tok = build_tokenizer(ALPHABET + TOOLS_CHARS)
        tok.chat_template = TOOLS_CHAT_TEMPLATE
        return tok
    return build_tokenizer()


def is_tiny(model_path: str) -> bool:
    return model_path in TINY_PRESETS or model_path in TINY_VL_PRESETS


def is_vision(model_path: str | Path) -> bool:
    """A vision-language model: the tiny VL preset, or a directory whose config has a vision_config."""
    if str(model_path) in TINY_VL_PRESETS:
        return True
    if is_tiny(str(model_path)):
        return False
    cfg = Path(model_path) / "config.json"
    try:
        return cfg.is_file() and "vision_config" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def check_model_dir(path: str | Path, what: str = "model") -> Path:
    """Raise a ModelLoadError unless `path` is a directory with a HF config.json."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(
            f"{what} '{p}' does not exist. Point {what} at a Hugging Face model directory (config.json + "
            f"weights + tokenizer) or use a tiny preset: {sorted(TINY_PRESETS)}."
        )
    if not (p / "config.json").is_file():
        raise ModelLoadError(
            f"{what} '{p}' is not a model directory: it has no config.json. Point {what} at a Hugging Face "
            f"model directory (for example the output of the sft stage)."
        )
    _check_shard_names(p, what)
    return p


def _check_shard_names(p: Path, what: str) -> None:
    """Every weight shard a `*.index.json` names must lie inside the model directory."""
    from ...errors import DataError
    from ..data.io import safe_child

    for index in p.glob("*.index.json"):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            names = set(weight_map.values()) if isinstance(weight_map, dict) else {weight_map}
        except (ValueError, AttributeError, RecursionError) as e:
            raise ModelLoadError(f"{what} '{p}': '{index.name}' is not a valid shard index ({e}).") from None
        for name in names:
            try:
                safe_child(p, name)
            except DataError as e:
                raise ModelLoadError(f"{what} '{p}': field 'weight_map' of '{index.name}' names a shard outside "
                                     f"the model directory: {e}") from None


def model_window(path: str) -> int | None:
    """Positions the model can attend over (max_position_embeddings), None if it does not say."""
    if is_tiny(path):
        spec = TINY_PRESETS.get(path) or TINY_VL_PRESETS[path]["text"]
        return spec.get("max_position_embeddings")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(check_model_dir(path, "policy"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Cannot read the config of policy '{path}': {e}") from None
    cfg = getattr(cfg, "text_config", None) or cfg
    return getattr(cfg, "max_position_embeddings", None)


def context_window(path: str, max_model_len: int = 0) -> tuple[int | None, str]:
    """Positions a prompt and its response share, and what sets them: the policy's window, or the smaller of it
    and vLLM's `max_model_len` (0: not capped; vLLM refuses a whole generate call when one prompt does not fit in
    it). None when the model does not say and vLLM is not capped."""
    window = model_window(path)
    if max_model_len and (window is None or max_model_len < window):
        return max_model_len, f"vllm.max_model_len={max_model_len}"
    return window, f"the policy's {window}-token window"


def load_tokenizer(model_path: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a model directory (or of the tiny presets), with a pad token set."""
    if str(model_path) in TINY_VL_PRESETS:
        return build_tiny_vl_model(str(model_path))[1]
    if is_tiny(str(model_path)):
        return preset_tokenizer(str(model_path))
    from transformers import AutoTokenizer

    p = check_model_dir(model_path)
    if is_vision(p):
        return _load_vl_tokenizer(p, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Cannot load a tokenizer from '{p}': {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _load_vl_tokenizer(p: Path, trust_remote_code: bool):
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(p, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"Cannot load the processor of vision-language model '{p}': {e}") from None
    if getattr(processor, "image_token", None) is None or getattr(processor, "tokenizer", None) is None:
        raise ModelLoadError(f"'{p}' is a vision-language model, but its processor ({type(processor).__name__}) has no "
                             f"tokenizer or image token; save the model's own processor into the directory.")
    tok = attach(processor)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(model_path: str | Path, dtype: str = "float32", seed: int = 0, trust_remote_code: bool = False,
                   tokenizer=None):
    """(model, tokenizer) from a model directory or a tiny preset name. A vision-language directory
    gives an image-text-to-text model and a tokenizer carrying its processor. `tokenizer`: one the caller
    already loaded from the same directory (`load_tokenizer`), returned instead of loading it again."""
    if str(model_path) in TINY_VL_PRESETS:
        model, tok = build_tiny_vl_model(str(model_path), seed=seed)
        return model.to(torch_dtype(dtype)), tok
    if is_tiny(str(model_path)):
        model, tok = build_tiny_model(str(model_path), seed=seed)
        return model.to(torch_dtype(dtype)), tok
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    p = check_model_dir(model_path)
    auto = AutoModelForImageTextToText if is_vision(p) else AutoModelForCausalLM
    try:
        with hf_quiet.transformers_quiet():
            model = auto.from_pretrained(p, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
                                         use_safetensors=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"Cannot load a causal LM from '{p}': {e}") from None
    tok = tokenizer if tokenizer is not None else load_tokenizer(p, trust_remote_code=trust_remote_code)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def freeze(model, prefixes: list[str]) -> None:
    """Stop training the parameters whose names start with one of `prefixes` (each must match one)."""
    names = [n for n, _ in model.named_parameters()]
    for prefix in prefixes:
        hits = [n for n in names if n.startswith(prefix)]
        if not hits:
            parts = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ConfigError(f"freeze: no parameter name starts with '{prefix}'; this model's start with {parts}.")
        for n, p in model.named_parameters():
            if n in hits:
                p.requires_grad_(False)


def placement(device: str = "", dtype: str = "auto") -> tuple[torch.device, str]:
    """(device, dtype) of a model that only runs forward passes (sampling, scoring): device empty = cuda when
    available, else cpu; dtype auto = bfloat16 on a GPU (half the memory of float32), float32 on CPU (exact)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dev, dtype if dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")


def sampling_dtype(sampler: str, device: str = "", dtype: str = "auto") -> str:
    """`dtype` of a model that samples, `auto` resolved: bfloat16 for vLLM (a float32 engine is slow and large) and
    on a GPU, float32 on CPU (exact there). The vLLM case asks no question of CUDA, so its engine's GPUs can still
    be chosen afterwards."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if sampler == "vllm" else placement(device, dtype)[1]


def load_for_sampling(model_path: str | Path, device: str = "", dtype: str = "auto"):
    """(model, tokenizer) for generation: loaded in `dtype` and moved to `device`, both resolved by `placement`
    (a GPU in bfloat16 when there is one, else the CPU in float32). `generate_texts` runs where the model is."""
    dev, dt = placement(device, dtype)
    model, tok = load_causal_lm(model_path, dtype=dt)
    return model.to(dev), tok


def torch_dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ModelLoadError(f"dtype '{name}' is not supported; use float32, bfloat16 or float16.") from None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare HF model inside a DeepSpeed engine and/or a peft wrapper, with LoRA merged on save."""
    return getattr(model, "module", model)


def own_positions(model) -> bool:
    """A model that places its tokens itself (Qwen2-VL's multimodal rope: 3-D positions over the
    image grid), so callers must not pass 1-D position_ids; it then needs right-padded batches."""
    cfg = unwrap(model).config
    cfg = getattr(cfg, "text_config", None) or cfg
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return isinstance(rope, dict) and "mrope_section" in rope


def save_pretrained(model: torch.nn.Module, tokenizer, directory: str | Path, extra: dict | None = None) -> None:
    """Save a HF directory (safetensors). A peft model is saved merged, so later stages load it plainly."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = unwrap(model)
    params = list(model.parameters())
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):  # DeepSpeed ZeRO-3: each rank holds only a shard
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        # only what is not gathered yet: a caller may already hold some inside its own context
        missing = [p for p in params if getattr(p, "ds_status", None) != ZeroParamStatus.AVAILABLE]
        if missing:
            gathered = deepspeed.zero.GatheredParameters(missing, modifier_rank=None)
    with gathered:
        if hasattr(model, "merge_and_unload") and hasattr(model, "peft_config"):
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        with hf_quiet.transformers_quiet(), hf_quiet.no_deepspeed_import():
            model.save_pretrained(directory, safe_serialization=True)
    (processor_of(tokenizer) or tokenizer).save_pretrained(directory)  # a VL processor saves its tokenizer too
    if extra:
        (directory / "prmflow.json").write_text(json.dumps(extra, indent=2, sort_keys=True, default=str))


def load_scalar_model(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False):
    """A model with one scalar per token (PRM scores, critic values) as a plain HF directory.

    It is an `AutoModelForTokenClassification` with num_labels=1 (e.g. LlamaForTokenClassification):
    the backbone plus a linear `score` head. Pointed at a causal-LM directory (the SFT policy), the
    backbone weights are loaded and the head starts at zero, so initial scalars are 0 everywhere.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    p = check_model_dir(path)
    held: list[logging.LogRecord] = []
    try:
        cfg = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
        from_lm = not any(a.endswith("ForTokenClassification") for a in (cfg.architectures or []))
        cfg.num_labels = 1
        # from a causal LM the score head is new by design: transformers' load report (a table of
        # MISSING keys, at warning level) is held back and shown only if something else is off
        with hf_quiet.transformers_quiet(hold=held if from_lm else None):
            model, info = AutoModelForTokenClassification.from_pretrained(
                p, config=cfg, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
                use_safetensors=True, output_loading_info=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"Cannot load a scalar-head model from '{p}': {e}") from None
    if from_lm:
        off = sorted(k for k in info.get("missing_keys", ()) if not k.startswith("score."))
        off += sorted(k for k in info.get("unexpected_keys", ()) if not k.startswith("lm_head."))  # untied LM head
        off += sorted(str(k) for k in info.get("mismatched_keys", ()))
        if off:
            hf_quiet.release(held)
        log.info("'%s' is a causal LM: its backbone is loaded and the scalar head ('score') starts at zero.", p)
        with torch.no_grad():
            model.score.weight.zero_()
            if getattr(model.score, "bias", None) is not None:
                model.score.bias.zero_()
    return model, load_tokenizer(p, trust_remote_code=trust_remote_code)
