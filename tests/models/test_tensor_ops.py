import torch

from prmflow.components.models import tensor_ops


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
    from prmflow.components.models.modeling import build_tiny_model

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


def _head_and_rows(n=11, hidden=16, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    return head, h, tokens


def test_chunked_entropy_and_logprobs_match_the_whole_logits_values_and_gradients():
    """Entropy and log p from the head chunk by chunk (3 rows a chunk: 11 rows do not divide, so the last
    chunk is short) equal those of the whole logits by the definition, in float64, and so do the
    gradients of a loss mixing both with respect to the hidden states and the head's weight (the
    backward pass recomputes each chunk). float32 vs float64: ~1e-6 relative at these sizes."""
    head, h, tokens = _head_and_rows()
    w_lp, w_ent = torch.linspace(-1, 1, 11), torch.linspace(2, 0.5, 11)

    def reference(hidden, weight):  # the definition, float64, the whole (N, V) logits
        logp = torch.log_softmax(hidden.double() @ weight.double().T, -1)
        return logp.gather(-1, tokens[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    ref_lp, ref_ent = reference(h, head.weight)
    (w_lp * ref_lp + w_ent * ref_ent).sum().backward()
    ref_gh, ref_gw = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None

    lp, ent = tensor_ops.chunked_logprobs_entropy(head, h, tokens, 3)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (11,)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    (w_lp * lp + w_ent * ent).sum().backward()
    torch.testing.assert_close(h.grad, ref_gh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.weight.grad, ref_gw, rtol=1e-5, atol=1e-5)

    h.grad, head.weight.grad = None, None
    ent_only = tensor_ops.chunked_entropy(head, h, 4)
    torch.testing.assert_close(ent_only.double(), ref_ent, rtol=1e-5, atol=1e-5)
    (w_ent * ent_only).sum().backward()
    ref_h = h.detach().clone().requires_grad_(True)
    ref_w = head.weight.detach().clone().requires_grad_(True)
    (w_ent * reference(ref_h, ref_w)[1]).sum().backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.weight.grad, ref_w.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # no rows: an empty float32 result, not an error
        assert tensor_ops.chunked_entropy(head, h[:0], 4).shape == (0,)
