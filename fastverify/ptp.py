"""Parallel Token Prediction (PTP) utilities: embedding the auxiliary variables u that make sampling a
deterministic function of the model's input (t = F_p^-1(u), PTP §2.3), and drawing the in-bin positions v.

  AuxiliaryEmbedding(hidden_size, mode="bits" | "interp")   u [...] -> [..., hidden_size]
  beta_v(shape, a, generator=None, device=None)              v ~ Beta(a, a) (PTP Appendix D)
  sample_v                                                   re-exported from fastverify.ops.sampling

A training step of O-PTP / C-PTP draws v, maps the teacher's tokens to u = cdf_invert(logits, token, v) and
feeds u through AuxiliaryEmbedding into the model; at inference u comes from fastverify.uniform(seed, position),
so the emitted tokens equal autoregressive sampling with the same u stream (verify's `coupled` rule).
"""

import torch
from torch import nn

from fastverify.ops.sampling import aux_bits, sample_v

__all__ = ["AuxiliaryEmbedding", "beta_v", "sample_v"]


class AuxiliaryEmbedding(nn.Module):
    """Embeds auxiliary variables u in (0, 1) into the model's hidden space.

    Args:
        hidden_size: width of the embedding.
        mode: "bits" (PTP §3.1): the 32 IEEE-754 bits of float32 u, most significant first, through
            nn.Linear(32, hidden_size). "interp" (the PTP authors' default): (1 - u) * e_0 + u * e_1 with two
            learned embeddings e_0, e_1 [hidden_size], i.e. a linear interpolation by u.
        dtype, device: of the parameters.
    forward(u): u float [...] -> [..., hidden_size] in the parameters' dtype.
    """

    MODES = ("bits", "interp")

    def __init__(self, hidden_size, mode="bits", *, dtype=None, device=None):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        if mode not in self.MODES:
            raise ValueError(f"mode: expected one of {self.MODES}, got {mode!r}")
        self.hidden_size = hidden_size
        self.mode = mode
        if mode == "bits":
            self.proj = nn.Linear(32, hidden_size, dtype=dtype, device=device)
        else:
            self.ends = nn.Parameter(torch.empty(2, hidden_size, dtype=dtype, device=device))
            nn.init.normal_(self.ends, std=hidden_size**-0.5)

    def forward(self, u):
        if not isinstance(u, torch.Tensor) or not u.is_floating_point():
            raise TypeError(f"u: expected a floating-point tensor, got {getattr(u, 'dtype', type(u).__name__)}")
        if self.mode == "bits":
            # The bits of the float32 value: u itself is float32 when it comes from fastverify.uniform.
            bits = aux_bits(u.to(torch.float32))
            return self.proj(bits.to(self.proj.weight.dtype))
        e0, e1 = self.ends[0], self.ends[1]
        t = u.to(self.ends.dtype)[..., None]
        return e0 + t * (e1 - e0)

    def extra_repr(self):
        return f"hidden_size={self.hidden_size}, mode={self.mode!r}"


def beta_v(shape, a, generator=None, device=None):
    """float32 v ~ Beta(a, a) in the open interval (0, 1) (PTP Appendix D). a > 0."""
    return sample_v(shape, a=a, generator=generator, device=device)
