import torch

from prmflow.components.common import tensor_ops


def test_token_logprobs_matches_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    slow = torch.stack([torch.stack([torch.log_softmax(logits[b, t], -1)[tokens[b, t]] for t in range(5)]) for b in range(3)])
    assert torch.allclose(tensor_ops.token_logprobs(logits, tokens), slow, atol=1e-5)


def test_entropy_matches_definition():
    logits = torch.randn(2, 4, 7)
    p = torch.softmax(logits, -1)
    assert torch.allclose(tensor_ops.entropy_from_logits(logits), -(p * p.log()).sum(-1), atol=1e-5)


def test_masked_mean_ignores_nan_in_masked_positions():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert tensor_ops.masked_mean(x, mask).item() == (1 + 2 + 4 + 6) / 4
    assert torch.equal(tensor_ops.masked_sum(x, mask, dim=1), torch.tensor([3.0, 10.0]))


def test_sequence_logprobs_left_and_right_padding_agree():
    from prmflow.components.common.modeling import build_tiny_model

    model, tok = build_tiny_model("tiny-llama", seed=1)
    model.eval()
    ids = tok("1+2=3\n", add_special_tokens=False)["input_ids"]
    n = len(ids)
    right = torch.tensor([ids + [tok.pad_token_id] * 2])
    right_mask = torch.tensor([[1] * n + [0, 0]])
    left = torch.tensor([[tok.pad_token_id] * 2 + ids])
    left_mask = torch.tensor([[0, 0] + [1] * n])
    with torch.no_grad():
        lr = tensor_ops.sequence_logprobs(model, right, right_mask)[0, : n - 1]
        ll = tensor_ops.sequence_logprobs(model, left, left_mask)[0, 2:]
    assert torch.allclose(lr, ll, atol=1e-5)
