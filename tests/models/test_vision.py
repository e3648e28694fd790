"""Images for vision-language prompts: every bad image input fails clearly, the tiny VL model is a
complete HF directory, and the image-token check counts what the model will see."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from prmflow.components.models import modeling, vision
from prmflow import tasks
from prmflow.errors import DataError
from prmflow.tasks.datasets import load_records


def png(w=56, h=56, color="white") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    """The tiny VL preset saved as a HF directory and loaded back (model, tokenizer carrying the processor)."""
    path = tmp_path_factory.mktemp("vl") / "policy"
    model, tok = modeling.load_causal_lm("tiny-llava")
    modeling.save_pretrained(model, tok, path)
    return path, *modeling.load_causal_lm(path)


# --- bad image inputs -------------------------------------------------------------------------

BAD_IMAGES = {
    "empty": (b"", "empty"),
    "not an image": (b"hello, not a picture", "not a decodable image"),
    "truncated": (png()[:60], "not a decodable image"),
    "wrong type": ("iVBORw0KGgo=", "must be encoded bytes"),
    "a number": (12, "must be encoded bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_bytes_name_where_they_came_from(case):
    data, message = BAD_IMAGES[case]
    with pytest.raises(DataError, match=message) as e:
        vision.decode_image(data, "data.parquet, row 7, field 'images'[0]")
    assert "data.parquet, row 7" in str(e.value)


def test_oversized_images_are_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(vision, "MAX_PIXELS", 50 * 50)
    with pytest.raises(DataError, match="56x56 pixels, more than the limit"):
        vision.decode_image(png(), "row 3")
    monkeypatch.setattr(vision, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(DataError, match="bytes, more than the 10-byte limit"):
        vision.decode_image(png(), "row 3")


def test_a_good_image_decodes_to_rgb():
    img = vision.decode_image(png(30, 20, "red"), "x")
    assert img.mode == "RGB" and img.size == (30, 20) and img.getpixel((0, 0)) == (255, 0, 0)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dataset_images_by_relative_path_and_as_datasets_dicts(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png(color="blue"))
    data = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "What colour?", "answer": "1", "images": "imgs/a.png"},
        {"prompt": "Two?", "answer": "2", "images": [{"path": str(tmp_path / "imgs" / "a.png")}, "imgs/a.png"]},
        {"prompt": "None", "answer": "3"},
    ])
    recs = load_records(data)
    assert recs[0].images == [png(color="blue")]
    assert len(recs[1].images) == 2 and recs[2].images is None


def test_parquet_image_bytes_are_read_and_checked(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"],
                             "images": pa.array([[png()], [b"garbage"]], pa.list_(pa.binary()))}), path)
    with pytest.raises(DataError, match=r"d.parquet, row 1, field 'images'\[0\]: not a decodable image"):
        load_records(path)


@pytest.mark.parametrize("value,message", [
    ("missing.png", "image file '.*missing.png' does not exist"),
    ("", "the image path is empty"),
    (["ok.png", 5], r"field 'images'\[1\]: an image must be encoded bytes"),
    ("bad.png", r"field 'images'\[0\]: not a decodable image"),
])
def test_bad_dataset_image_fields_name_line_and_field(tmp_path, value, message):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "bad.png").write_bytes(png()[:-30])  # cut short
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1", "images": "ok.png"},
                                         {"prompt": "q", "answer": "1", "images": value}])
    with pytest.raises(DataError, match=message) as e:
        load_records(data)
    assert "d.jsonl, line 2" in str(e.value)


def test_a_text_model_refuses_prompts_with_images():
    tok = modeling.load_tokenizer("tiny-llama")
    rec = tasks.PromptRecord("p1", "Compute.\n", "3", images=[png()])
    with pytest.raises(DataError, match="prompt 'p1' has 1 image.*text-only"):
        tasks.render_prompt(tok, rec)


# --- the tiny VL model ------------------------------------------------------------------------

def test_tiny_vl_model_is_a_complete_hf_directory(tiny_vl):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path, model, tok = tiny_vl
    assert (path / "processor_config.json").is_file()
    proc = AutoProcessor.from_pretrained(path)  # plain transformers loads it: no prmflow code needed
    plain = AutoModelForImageTextToText.from_pretrained(path)
    enc = proc(text=["<image>Compute left+right.\n"], images=[Image.new("RGB", (56, 56), "white")], return_tensors="pt")
    assert torch.equal(plain(**enc).logits, model(**enc).logits)
    assert vision.processor_of(tok) is not None and modeling.is_vision(path) and not modeling.is_vision("tiny-llama")


def test_prompt_placeholders_expand_to_one_token_per_image_feature(tiny_vl):
    _, model, tok = tiny_vl
    rec = tasks.load("visual", "train", 1, 0)[0]
    text, ids, pixels = tasks.encode_prompt(tok, rec)
    assert text == rec.prompt + "<image>"  # after the text: the first position is a causal LM's attention sink
    image_id = model.config.image_token_index
    # a 56x56 image is 2x2 patches of 28 pixels (CLS dropped): the text, then 4 image tokens
    assert ids[-4:] == [image_id] * 4 and image_id not in ids[:-4]
    assert tok.decode(ids[:-4]) == rec.prompt
    assert pixels["pixel_values"].shape == (1, 3, 56, 56)


def test_image_token_check_counts_tokens_against_features(tiny_vl):
    _, model, tok = tiny_vl
    v = vision.Vision.of(tok, model.config)
    ids, pixels = v.encode_prompt("<image><image>two images\n", [png(), png(color="black")])
    assert v.count_tokens(ids) == 8 and v.expected_tokens(pixels) == 8 and v.mismatch(ids, pixels) is None
    assert v.mismatch(ids[1:], pixels) == "7 image tokens in the sequence but its images make 8 features"
    one = v.pixels([png()])
    assert v.mismatch(ids, one) == "8 image tokens in the sequence but its images make 4 features"
    assert vision.check_batch(v, [ids, ids[1:]], [pixels, pixels], "ppo update 3") == \
        "ppo update 3, sequence 1: 7 image tokens in the sequence but its images make 8 features"
    # what the check guards against: the model itself refuses the mismatched sequence deep inside forward
    with pytest.raises(ValueError):
        model(input_ids=torch.tensor([ids[1:]]), **pixels)


def test_placeholders_in_the_prompt_must_match_the_images(tiny_vl):
    _, model, tok = tiny_vl
    v = vision.Vision.of(tok, model.config)
    assert v.render("<image> and text", 1) == "<image> and text"
    with pytest.raises(DataError, match="2 image placeholders .* for 1 images"):
        v.render("<image><image>", 1)
