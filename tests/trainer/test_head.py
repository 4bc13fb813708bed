"""The chunked LM head + logprob equals the full head: values and gradients (hidden, weight, bias), with
per-row temperatures, soft-capping, chunks that do not divide the rows, and in bfloat16."""

import pytest
import torch
from trainer_references import dense_logprobs

from loomrl.trainer.head import chunked_logprobs


def _case(n=37, h=16, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    temps = torch.tensor([0.7, 1.0, 0.0, 1.3] * (n // 4 + 1))[:n]  # 0: greedy rows scored at 1
    upstream = torch.randn(n, generator=g)
    return hidden, weight, targets, temps, upstream


def _grads(fn, hidden, weight, targets, temps, upstream, **kw):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, targets, temps, **kw)
    (out * upstream).sum().backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_equals_dense_in_float32(chunk, softcap):
    case = _case()
    want = _grads(dense_logprobs, *case, softcap=softcap)
    got = _grads(chunked_logprobs, *case, chunk=chunk, softcap=softcap)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert got[0].dtype == torch.float32 and bool((got[0] <= 0).all())


def test_bias_gets_its_gradient():
    hidden, weight, targets, temps, upstream = _case()
    bias = torch.randn(weight.shape[0], requires_grad=True)
    for fn, kw in ((dense_logprobs, {}), (chunked_logprobs, {"chunk": 8})):
        bias.grad = None
        (fn(hidden, weight, targets, temps, bias=bias, **kw) * upstream).sum().backward()
        if fn is dense_logprobs:
            want = bias.grad.clone()
    torch.testing.assert_close(bias.grad, want, rtol=1e-5, atol=1e-6)


def test_bfloat16_matches_dense_bfloat16_and_keeps_dtypes():
    """In bf16 the logits are rounded as the dense path rounds them (the matmul in bf16, the softmax in
    float32), so both agree closely; gradients come back in the parameters' dtype."""
    case = _case(dtype=torch.bfloat16)
    want = _grads(dense_logprobs, *case)
    got = _grads(chunked_logprobs, *case, chunk=7)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    for w, g in zip(want[1:], got[1:]):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_frozen_head_and_bad_shapes():
    hidden, weight, targets, temps, upstream = _case()
    frozen = weight.detach()
    hidden.grad = None
    (chunked_logprobs(hidden, frozen, targets, temps, chunk=4) * upstream).sum().backward()
    h_dense = hidden.grad.clone()
    hidden.grad = None
    (dense_logprobs(hidden, frozen, targets, temps) * upstream).sum().backward()
    torch.testing.assert_close(h_dense, hidden.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"must be \[N, H\] and \[V, H\]"):
        chunked_logprobs(hidden, weight.t(), targets)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_logprobs(hidden, weight, targets, chunk=0)


def test_saves_no_full_logits_for_backward():
    """What autograd keeps between forward and backward: the dense head keeps [N, V] float32 logits (and
    their softmax); the chunked one only its inputs and N log-sum-exps."""
    n, v = 512, 4096
    hidden, weight, targets, temps, _ = _case(n=n, v=v)
    for fn, kw in ((dense_logprobs, {}), (chunked_logprobs, {"chunk": 64})):
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(hidden, weight, targets, temps, **kw)
        if fn is dense_logprobs:
            assert max(saved) >= n * v * 4
        else:
            assert max(saved) < n * v * 4 / 8 and sum(saved) <= (hidden.numel() + weight.numel()) * 4 + 4 * n * 8


def test_rows_serving_several_targets_equal_repeated_rows():
    """A prefix-tree node feeds several targets (its children): reading it through `rows` equals
    repeating the row once per target, values and gradients."""
    hidden, weight, _, temps, _ = _case(n=9)
    rows = torch.tensor([4, 0, 4, 8, 1, 4, 0])
    targets = torch.tensor([3, 5, 7, 2, 9, 11, 5])
    upstream = torch.randn(len(rows))
    hidden.grad = weight.grad = None
    (dense_logprobs(hidden[rows], weight, targets, temps[rows]) * upstream).sum().backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got = chunked_logprobs(hidden, weight, targets, temps, rows=rows, chunk=3)
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, dense_logprobs(hidden[rows], weight, targets, temps[rows]).detach(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, want[1], rtol=1e-5, atol=1e-6)


def test_the_plan_is_the_devices():
    """CPU: 128-row blocks and a float32 head gradient (as measured there). CUDA: blocks as large as one float32
    [chunk, V] block within CUDA_BLOCK_BYTES allows, whole 128-row tiles, and the gradient GEMMs in the compute
    dtype. Both used to be the CPU's everywhere: 256 passes over a 152k x 4096 head and its float32 gradient for a
    32k-token step, each a float32 GEMM of K=128."""
    from loomrl.trainer.head import CPU_CHUNK, CUDA_BLOCK_BYTES, CUDA_MAX_CHUNK, HeadPlan, head_plan

    assert head_plan(torch.device("cpu"), 151_936) == HeadPlan(chunk=CPU_CHUNK, grads_in_compute_dtype=False)
    for vocab, rows in ((151_936, 1664), (49_152, 5376), (32_000, CUDA_MAX_CHUNK), (1_000_000, 512)):
        plan = head_plan(torch.device("cuda", 0), vocab)  # a device name: no GPU needed to plan for one
        assert plan == HeadPlan(chunk=rows, grads_in_compute_dtype=True), vocab
        assert plan.chunk % 128 == 0 and (plan.chunk * vocab * 4 <= CUDA_BLOCK_BYTES or plan.chunk == 512)
    assert -(-32_768 // head_plan(torch.device("cuda"), 151_936).chunk) == 20  # passes at 32k tokens (CPU: 256)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_cuda_plans_backward_matches_dense_autocast(softcap):
    """The CUDA plan's backward (dz cast once, the head's gradient as a compute-dtype GEMM added in float32), run on
    the CPU under bf16 autocast, against the dense head under the same autocast, and against the float32 plan."""
    from loomrl.trainer.head import HeadPlan

    case = _case(n=64, h=32, v=257)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _grads(dense_logprobs, *case, softcap=softcap)
        cuda = _grads(chunked_logprobs, *case, plan=HeadPlan(chunk=16, grads_in_compute_dtype=True), softcap=softcap)
        exact = _grads(chunked_logprobs, *case, plan=HeadPlan(chunk=16, grads_in_compute_dtype=False), softcap=softcap)
    torch.testing.assert_close(cuda[0], exact[0], rtol=0, atol=0)  # the forward is the same
    for w, g in zip(want, cuda):
        assert g.dtype == torch.float32  # float32 parameters: float32 gradients
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    # the head's gradient differs from the float32 GEMM's by bf16 rounding (a relative 2^-8), no more
    assert float((cuda[2] - exact[2]).norm() / exact[2].norm()) < 1e-2
    assert not torch.equal(cuda[2], exact[2])  # the compute-dtype GEMM did run
