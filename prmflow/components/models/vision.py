"""Images for vision-language prompts: checked decoding, the processor's pixel inputs, the image-token check.

A vision-language (VL) policy is a Hugging Face image-text-to-text model directory with its
processor (`AutoModelForImageTextToText` + `AutoProcessor`: LLaVA, Qwen2-VL, ...). prmflow keeps
token ids as the hand-off currency for VL rows too:

- a prompt's text carries one image placeholder per image (the processor's `image_token`, added
  after the text when the prompt has none: the first position of a sequence becomes the attention
  sink of a causal LM, and an image there is squashed into a constant: the tiny model, images
  first and no BOS token, never learned to read them); `Vision.encode_prompt` runs the processor, which
  expands every placeholder into the image's feature tokens, so `prompt_ids` in the rollouts is
  exactly what the policy was conditioned on;
- the images themselves travel as encoded bytes (`images`, list<binary>, in rollouts and
  advantages) and are turned back into pixel inputs (`Vision.pixels`) by every stage that runs the
  model again (scoring, PRM, PPO), with the same image processor.

Before every update a stage checks that the image tokens in each sequence match the features its
images make (`Vision.mismatch`); HF models raise deep inside the forward pass when they do not
(truncated prompts, a processor with other resize settings than the one that wrote `prompt_ids`),
prmflow skips that batch with a logged reason instead.

Images are validated when read: decodable, at most `MAX_IMAGE_BYTES` encoded and `MAX_PIXELS`
decoded (a decompression bomb is refused before it is decoded); errors name the file, row and
field. A tokenizer loaded from a VL directory carries its processor (`processor_of(tokenizer)`), so
code that only has the tokenizer can still reach the images' processor.
"""

from __future__ import annotations

import io as _io
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ...errors import ConfigError, DataError

log = logging.getLogger(__name__)

MAX_IMAGE_BYTES = 16 * 1024 * 1024
"""Largest encoded image accepted (bytes)."""
MAX_PIXELS = 4096 * 4096
"""Largest decoded image accepted (width x height)."""
PROCESSOR_ATTR = "prmflow_processor"


# --- decoding and validation ------------------------------------------------------------------

def decode_image(data: Any, where: str):
    """A checked RGB PIL image from encoded bytes; DataError naming `where` for anything else."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise DataError(f"{where}: an image must be encoded bytes (PNG, JPEG, ...), got {type(data).__name__}.")
    if not data:
        raise DataError(f"{where}: the image is empty (0 bytes).")
    if len(data) > MAX_IMAGE_BYTES:
        raise DataError(f"{where}: the image is {len(data)} bytes, more than the {MAX_IMAGE_BYTES}-byte limit; "
                        f"resize or recompress it.")
    try:
        img = Image.open(_io.BytesIO(data))
        w, h = img.size
        if w * h > MAX_PIXELS:
            raise DataError(f"{where}: the image is {w}x{h} pixels, more than the limit of {MAX_PIXELS}; resize it.")
        if w < 1 or h < 1:
            raise DataError(f"{where}: the image has no pixels ({w}x{h}).")
        img.load()  # a truncated file fails here, not later inside a stage
        return img.convert("RGB")
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"{where}: not a decodable image ({type(e).__name__}: {e}). Store PNG or JPEG bytes.") from None


def encode_png(img) -> bytes:
    buf = _io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def read_image_field(value: Any, base_dir: Path, where: str) -> bytes:
    """Encoded bytes of one image as a dataset row gives it: a path (relative to the dataset's
    directory), bytes, or a {"bytes": ..., "path": ...} dict (the Hugging Face datasets Image
    feature). The bytes are checked with `decode_image`."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: the image path is empty.")
        path = Path(value) if Path(value).is_absolute() else base_dir / value
        if not path.is_file():
            raise DataError(f"{where}: image file '{path}' does not exist (relative paths are read from the "
                            f"dataset's directory '{base_dir}').")
        value = path.read_bytes()
    decode_image(value, where)
    return bytes(value)


def read_image_list(value: Any, base_dir: Path, where: str) -> list[bytes]:
    """The `images` field of a dataset row: one image or a list of them."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not items:
        return []
    return [read_image_field(v, base_dir, f"{where}, field 'images'[{i}]") for i, v in enumerate(items)]


# --- the processor ------------------------------------------------------------------------------

def processor_of(tokenizer):
    """The processor a VL directory's tokenizer was loaded with, or None (a text model)."""
    return getattr(tokenizer, PROCESSOR_ATTR, None)


def attach(processor):
    """The processor's tokenizer, carrying the processor (what `modeling.load_tokenizer` returns for VL)."""
    tok = processor.tokenizer
    setattr(tok, PROCESSOR_ATTR, processor)
    return tok


class Vision:
    """What a stage needs to feed images to one VL model: its processor and the numbers the
    image-token check compares.

    `Vision.of(tokenizer, model_config)` is None for a text model, so text code paths stay as they were.
    """

    def __init__(self, processor, model_config=None):
        self.processor = processor
        self.config = model_config
        self.image_token = processor.image_token
        tok = processor.tokenizer
        self.image_token_id = int(tok.convert_tokens_to_ids(self.image_token))
        cfg_id = getattr(model_config, "image_token_id", None) if model_config is not None else None
        if cfg_id is None and model_config is not None:
            cfg_id = getattr(model_config, "image_token_index", None)
        if cfg_id is not None and int(cfg_id) != self.image_token_id:
            raise ConfigError(f"the processor's image token {self.image_token!r} is id {self.image_token_id}, but the "
                              f"model config expects image tokens with id {cfg_id}: the processor and the model do "
                              f"not belong together.")

    @classmethod
    def of(cls, tokenizer, model_config) -> "Vision | None":
        proc = processor_of(tokenizer)
        return None if proc is None else cls(proc, model_config)

    # prompts ------------------------------------------------------------------------------------
    def render(self, prompt: str, n_images: int, chat_template: bool = True, messages: list | None = None) -> str:
        """The prompt text with one image placeholder per image: the processor's chat template when
        it has one (images first in the user turn), else placeholders after the text unless the
        text already carries them."""
        if n_images == 0:
            return prompt
        template = getattr(self.processor, "chat_template", None)
        if chat_template and template:
            msgs = [dict(m) for m in (messages or [{"role": "user", "content": prompt}])]
            last = msgs[-1]
            text = last["content"] if isinstance(last["content"], str) else None
            if text is not None:
                last["content"] = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
            return self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        have = prompt.count(self.image_token)
        if have == n_images:
            return prompt
        if have:
            raise DataError(f"the prompt has {have} image placeholders ({self.image_token!r}) for {n_images} images; "
                            f"give one per image or none (then they are put after the text).")
        return prompt + self.image_token * n_images

    def encode_prompt(self, text: str, images: Sequence[bytes], where: str = "prompt",
                      add_special_tokens: bool = True) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Token ids of `text` with every image placeholder expanded, and the images' pixel inputs."""
        pil = [decode_image(b, f"{where}, image {i}") for i, b in enumerate(images)]
        if text.count(self.image_token) != len(pil):
            raise DataError(f"{where}: the prompt has {text.count(self.image_token)} image placeholders for "
                            f"{len(pil)} images.")
        if not pil:
            return self.processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"], {}
        enc = self.processor(text=[text], images=pil, return_tensors="pt", add_special_tokens=add_special_tokens)
        ids = enc["input_ids"][0].tolist()
        return ids, {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}

    def pixels(self, images: Sequence[bytes], where: str = "row") -> dict[str, torch.Tensor]:
        """Pixel inputs of one sequence's images ({} for none), as `encode_prompt` made them."""
        if not images:
            return {}
        pil = [decode_image(b, f"{where}, image {i}") for i, b in enumerate(images)]
        return dict(self.processor.image_processor(images=pil, return_tensors="pt"))

    # the image-token check ----------------------------------------------------------------------
    def count_tokens(self, ids) -> int:
        return int((torch.as_tensor(ids) == self.image_token_id).sum())

    def expected_tokens(self, pixels: dict[str, torch.Tensor]) -> int:
        """Feature tokens the model makes of these pixel inputs (what its image tokens must number)."""
        if not pixels:
            return 0
        if self.config is None:
            raise ValueError("expected_tokens needs the model config: build Vision(processor, model.config)")
        vcfg = self.config.vision_config
        if "image_grid_thw" in pixels:  # Qwen2-VL style: patches merged spatial_merge_size^2 to one token
            merge = int(getattr(vcfg, "spatial_merge_size", 1))
            return int(pixels["image_grid_thw"].prod(-1).sum()) // (merge * merge)
        pv = pixels["pixel_values"]
        patch = int(vcfg.patch_size)
        per_image = (pv.shape[-2] // patch) * (pv.shape[-1] // patch)
        if getattr(self.config, "vision_feature_select_strategy", "default") == "full":
            per_image += 1  # the CLS token is kept
        return int(pv.shape[0]) * per_image

    def mismatch(self, ids, pixels: dict[str, torch.Tensor]) -> str | None:
        """Why this sequence cannot be fed to the model (its image tokens do not match its image
        features), or None."""
        have, want = self.count_tokens(ids), self.expected_tokens(pixels)
        if have != want:
            return f"{have} image tokens in the sequence but its images make {want} features"
        return None


def batch_pixels(items: Sequence[dict[str, torch.Tensor]], device=None) -> dict[str, torch.Tensor]:
    """One batch's pixel inputs: every sequence's tensors concatenated along dim 0, in batch order
    (the order the model meets the image tokens in); {} when no sequence has images."""
    items = [x for x in items if x]
    if not items:
        return {}
    out = {k: torch.cat([x[k] for x in items], dim=0) for k in items[0]}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def check_batch(vision: "Vision | None", ids: Sequence[Sequence[int]], pixels: Sequence[dict], where: str) -> str | None:
    """The first sequence of a batch whose image tokens do not match its images, as a reason to
    skip the batch (None when all match or the model has no vision)."""
    if vision is None:
        return None
    for k, (seq, px) in enumerate(zip(ids, pixels)):
        why = vision.mismatch(seq, px)
        if why:
            return f"{where}, sequence {k}: {why}"
    return None


class BatchGuard:
    """The image-token check before every update of a stage that trains on its own examples (sft,
    prm): `skips(examples, state, tracker)` is True when the batch must be skipped (logged, counted in
    state["skipped_batches"] and `train/skipped_image_mismatch`); a whole epoch of skipped batches in a
    row is a DataError, so a wrong processor cannot spin forever. Examples need `input_ids` and `pixels`."""

    def __init__(self, vision: "Vision | None", stage: str, batches_per_epoch: int):
        self.vision, self.stage, self.batches_per_epoch = vision, stage, batches_per_epoch
        self.in_a_row = 0

    def skips(self, examples: Sequence, state: dict, tracker) -> bool:
        why = check_batch(self.vision, [e.input_ids for e in examples], [e.pixels for e in examples],
                          f"{self.stage} step {state['step'] + 1}")
        if not why:
            self.in_a_row = 0
            return False
        log.warning("skipping the batch of %s", why)
        state["skipped_batches"] = state.get("skipped_batches", 0) + 1
        tracker.log_metrics({"train/skipped_image_mismatch": state["skipped_batches"]}, step=state["step"])
        self.in_a_row += 1
        if self.in_a_row >= self.batches_per_epoch:
            raise DataError(f"{self.stage}: every batch of a whole epoch was skipped because its image tokens do not "
                            f"match its images (last: {why}). Check that the processor saved with the model is the "
                            f"one the data was tokenized with.")
        return True
