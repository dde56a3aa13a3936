"""ringfa4.nn's attention operators (torch.library custom operators) around what a backend returns."""
import torch

from ringfa4.backends import torch_ref
from ringfa4.nn import ops


def test_gradients_a_backend_returns_in_one_allocation_come_out_as_tensors_of_their_own(monkeypatch):
    """A backend may return gradients that share storage (the cute backward once cast split
    heads' dK and dV back from one fp32 allocation as one tensor); an operator's results may not
    alias each other (torch.library refuses them), so the backward operator hands them on as
    separate tensors holding the backend's values."""
    real = torch_ref.backward

    def one_allocation(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return (dq, *torch.stack((dk, dv)).unbind(0))

    q, k, v = (torch.randn(1, 64, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 64, 2, 16, dtype=torch.float64)

    def grads():
        out, _ = ops.attention(q, k, v, True, 0.25, "torch", False)
        return torch.autograd.grad(out, (q, k, v), dout)

    expected = grads()
    monkeypatch.setattr(torch_ref, "backward", one_allocation)
    got = grads()
    assert len({g.untyped_storage().data_ptr() for g in got}) == 3
    for name, g, e in zip("dq dk dv".split(), got, expected):
        assert torch.equal(g, e), name
