from prmflow.components.models import modeling
from prmflow.components.data import steps


def test_steps_skip_empty_segments():
    text = "a=1\n\nb=2\n  \nanswer: 3\n"
    assert steps.steps(text) == ["a=1", "b=2", "answer: 3"]
    assert steps.steps("one step") == ["one step"]
    assert steps.steps("x ки y ки", separator=" ки") == ["x", " y"]


def test_step_end_tokens_are_the_last_token_of_each_step():
    tok = modeling.build_tokenizer()
    text = "7+5=12\n12*3=36\n\nanswer: 36"
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    ends = steps.step_end_tokens(enc["offset_mapping"], steps.step_spans(text))
    # slow reference: the character just before each separator (or the end of the text)
    want = [i for i, ch in enumerate(text) if ch != "\n" and (i + 1 == len(text) or text[i + 1] == "\n")]
    assert ends == want == [5, 13, 25]
    assert [tok.decode(enc["input_ids"][e]) for e in ends] == ["2", "6", "6"]
