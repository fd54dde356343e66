"""A feature-level draft layer on a frozen causal LM (EAGLE, Li et al. 2024), and its checkpoints.

Proposal heads (fastverify.heads) read the target's final hidden state at one row. The draft layer here reads
the sequence of them: it is one transformer decoder block whose row for the token g_j at generated position j
takes the pair (F_j, e(g_j)), F_j being the target's final hidden state (the input of its output projection)
that produced g_j and e the target's input embedding, and attends causally over the rows before it:

    z_j = W_in [F_j ; n(e(g_j))]                                  (n(x) = x / rms(x))
    h_j = z_j + W_o Attn(RoPE(W_q a_j), RoPE(W_k a_i), W_v a_i : i <= j)       a = RMSNorm(z)
    u_j = h_j + W_down (SiLU(W_gate b_j) * W_up b_j)                             b = RMSNorm(h)
    logits_j = u_j @ E^T (+ bias)                                 (the target's output projection E)

u_j is trained to be F_{j+1}, the hidden state that produces g_{j+1}: its logits propose the next token, and it
stands in for F_{j+1} in the row of the token after that, so the layer drafts several tokens ahead one row at a
time. Positions count from the first generated token (the layer never sees the prompt; the target's features
carry it).

Draft tree. After a verify forward the rows of the committed tokens are all known (the loop hands the drafter the
target's hidden states along the accepted path: ``observe_path``); the drafter runs them through the layer,
keeping their keys and values, and the last row's u proposes the candidates for the first draft position. A
draft node at depth m (its token at position t + m, t the last committed row) is the row (u of its parent's row,
e(its token)); it attends to the committed rows and its own ancestors' rows, and its u proposes its children.

Training (fastverify.train.eagle) unrolls this: pass 1 feeds the true features, pass d >= 2 feeds pass d - 1's
outputs, with each pass-d row attending to the true rows up to its depth-1 ancestor, then the rows of its
ancestors of the passes 2..d-1 and itself, exactly the keys a depth-(d-1) tree node sees when drafting (EAGLE-3's
training-time test). The loss sums the passes' cross-entropy against the target's greedy tokens and a smooth-L1
regression of u onto the true next feature.

Checkpoint (a directory): ``config.json`` {"method": "eagle", "format": 1, "hidden_size", "num_heads",
"intermediate_size", "rope_theta", "vocab_subset_size", "base_model", "base_fingerprint", "calibration", ...} and
``eagle.safetensors`` (the parameters below by name, plus "vocab_subset" int64 [V'] when used). The fingerprint
check is fastverify.heads'.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastverify.heads import (WEIGHT_DTYPES, CheckpointError, check_fingerprint, output_projection, read_checkpoint,
                              resolve_checkpoint, unit_rms)

__all__ = ["EagleLayer", "save_eagle", "load_eagle"]

WEIGHTS_NAME = "eagle.safetensors"
FORMAT = 1


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, hd] rotated by cos, sin [..., T, hd] (rotate-half convention)."""
    half = x.shape[-1] // 2
    return x * cos[..., None, :] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[..., None, :]


class EagleLayer(nn.Module):
    """One decoder block over (feature, token embedding) rows. Parameters fp32: fc [D, 2D], qkv [3D, D], o [D, D],
    gate_up [2I, D], down [D, I], norm1 / norm2 [D]; vocab_subset int64 [V'] or None (a buffer)."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, vocab_subset=None,
                 rope_theta: float = 10000.0):
        super().__init__()
        D, I = int(hidden_size), int(intermediate_size)
        if D < 1 or I < 1 or num_heads < 1 or D % num_heads or (D // num_heads) % 2:
            raise ValueError(f"hidden_size {D}, num_heads {num_heads}, intermediate_size {I}: expected positive "
                             f"sizes with hidden_size a multiple of num_heads and an even head size")
        self.hidden_size, self.num_heads, self.intermediate_size = D, int(num_heads), I
        self.head_dim, self.rope_theta = D // self.num_heads, float(rope_theta)
        # the input projection starts as [I | small]: u_j starts near F_j (the projection's own input), so the
        # untrained layer proposes what the target's row predicts, as zero-initialised proposal heads do
        f32 = {"dtype": torch.float32}
        self.fc = nn.Parameter(torch.cat([torch.eye(D, **f32), torch.randn(D, D, **f32) / (4 * math.sqrt(D))], 1))
        self.qkv = nn.Parameter(torch.randn(3 * D, D, **f32) / math.sqrt(D))
        self.o = nn.Parameter(torch.zeros(D, D, **f32))
        self.gate_up = nn.Parameter(torch.randn(2 * I, D, **f32) / math.sqrt(D))
        self.down = nn.Parameter(torch.zeros(D, I, **f32))
        self.norm1 = nn.Parameter(torch.ones(D, **f32))
        self.norm2 = nn.Parameter(torch.ones(D, **f32))
        if vocab_subset is not None:
            vocab_subset = torch.as_tensor(vocab_subset, dtype=torch.int64).reshape(-1)
        self.register_buffer("vocab_subset", vocab_subset, persistent=False)

    # -- the block, split where the attention sits (the drafter runs the halves around its own cache) ----------
    # ``lin(x, name)`` computes x @ W^T for the parameter ``name``; the drafter passes one that streams float16
    # copies through skinny_linear on the CPU.

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ getattr(self, name).t()

    def inputs(self, feature: torch.Tensor, token_emb: torch.Tensor, lin=None) -> torch.Tensor:
        """feature [..., D], token_emb [..., D] -> z [..., D]."""
        return (lin or self._linear)(torch.cat([feature.float(), unit_rms(token_emb.float())], -1), "fc")

    def rope_table(self, positions: torch.Tensor):
        """(cos, sin) [..., T, hd] of positions [..., T] (rotate-half convention, every head alike)."""
        half = self.head_dim // 2
        inv = self.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
        ang = positions.float()[..., None] * inv  # [..., T, half]
        return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def qkv_of(self, z: torch.Tensor, rope, lin=None):
        """z [..., T, D], rope: ``rope_table`` of the rows' positions -> q, k, v [..., T, heads, hd] (q and k
        rotated)."""
        a = unit_rms(z) * self.norm1
        q, k, v = (lin or self._linear)(a, "qkv").unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        return _rotate(q, *rope), _rotate(k, *rope), v

    def finish(self, z: torch.Tensor, attn: torch.Tensor, lin=None) -> torch.Tensor:
        """z [..., D], attn [..., heads, hd] (the attention's output) -> u [..., D]."""
        lin = lin or self._linear
        h = z + lin(attn.flatten(-2), "o")
        g, up = lin(unit_rms(h) * self.norm2, "gate_up").chunk(2, -1)
        return h + lin(F.silu(g) * up, "down")

    # -- training: the unrolled passes ------------------------------------------------------------------------

    def unrolled(self, feature: torch.Tensor, token_emb: torch.Tensor, passes: int):
        """feature [B, T, D] (F_j), token_emb [B, T, D] (e(g_j)) -> list of ``passes`` outputs u [B, T, D]. Pass 1
        reads the true features; pass d reads pass d - 1's output of the row before, and its row j (a depth-(d-1)
        draft node at position j) attends to the true rows <= j - d + 1 and to the rows j - d + k of the passes
        k = 2..d (its ancestors, then itself). Rows j < d - 1 of pass d have no such node (garbage, unused)."""
        B, T, D = feature.shape
        pos = torch.arange(T, device=feature.device)
        rope = self.rope_table(pos)
        scale = 1.0 / math.sqrt(self.head_dim)
        outs, keys, vals = [], [], []
        prev = None
        for d in range(1, passes + 1):
            feat = feature if d == 1 else F.pad(prev, (0, 0, 1, 0))[:, :T]  # row j reads pass d-1's row j - 1
            z = self.inputs(feat, token_emb)
            q, k, v = self.qkv_of(z, rope)  # [B, T, h, hd]
            keys.append(k)
            vals.append(v)
            qh = q.transpose(1, 2)  # [B, h, T, hd]
            s1 = qh @ keys[0].permute(0, 2, 3, 1) * scale  # [B, h, T, T]
            allowed = pos[None, :] <= pos[:, None] - (d - 1)  # key i <= j - d + 1
            s1 = s1.masked_fill(~allowed, float("-inf"))
            extra, extra_v = [], []
            for kk in range(2, d + 1):  # pass kk's key at row j - (d - kk)
                shift = d - kk
                ks = F.pad(keys[kk - 1], (0, 0, 0, 0, shift, 0))[:, :T].transpose(1, 2)  # [B, h, T, hd]
                vs = F.pad(vals[kk - 1], (0, 0, 0, 0, shift, 0))[:, :T].transpose(1, 2)
                extra.append((qh * ks).sum(-1, keepdim=True) * scale)
                extra_v.append(vs)
            # every row has a finite score (its own key: pass 1's diagonal, or pass d's own row), so no NaN
            p = torch.cat([s1] + extra, -1).softmax(-1)
            out = p[..., :T] @ vals[0].transpose(1, 2)
            for i, vs in enumerate(extra_v):
                out = out + p[..., T + i:T + i + 1] * vs
            prev = self.finish(z, out.transpose(1, 2))
            outs.append(prev)
        return outs

    def extra_repr(self):
        v = "all" if self.vocab_subset is None else self.vocab_subset.numel()
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"intermediate_size={self.intermediate_size}, vocab={v}")


_PARAMS = ("fc", "qkv", "o", "gate_up", "down", "norm1", "norm2")


def save_eagle(layer: EagleLayer, path: str, config: dict, dtype: str = "float16") -> None:
    """Write ``path``/eagle.safetensors and ``path``/config.json (config: base_model, base_fingerprint, ...)."""
    import json
    import os

    from safetensors.torch import save_file
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype: expected one of {list(WEIGHT_DTYPES)}, got {dtype!r}")
    os.makedirs(path, exist_ok=True)
    tensors = {n: getattr(layer, n).detach().to(WEIGHT_DTYPES[dtype]).cpu().contiguous() for n in _PARAMS}
    if layer.vocab_subset is not None:
        tensors["vocab_subset"] = layer.vocab_subset.cpu().contiguous()
    cfg = dict(config)
    cfg.update({"method": "eagle", "format": FORMAT, "hidden_size": layer.hidden_size,
                "num_heads": layer.num_heads, "intermediate_size": layer.intermediate_size,
                "rope_theta": layer.rope_theta, "weights_dtype": dtype,
                "vocab_subset_size": None if layer.vocab_subset is None else int(layer.vocab_subset.numel())})
    tmp = os.path.join(path, WEIGHTS_NAME + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, "config.json.tmp"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(os.path.join(path, "config.json.tmp"), os.path.join(path, "config.json"))


def load_eagle(name_or_path: str, model=None):
    """(EagleLayer, config dict) of a checkpoint folder (or shipped name). With ``model``: its fingerprint checked
    (fastverify.heads.BaseModelMismatch), the layer put on its device. FileNotFoundError / CheckpointError for a
    missing, unreadable or inconsistent checkpoint."""
    path = resolve_checkpoint(name_or_path)
    cfg, tensors = read_checkpoint(path, WEIGHTS_NAME, "eagle", ("eagle",), FORMAT, "an EAGLE draft layer",
                                   sizes=("hidden_size", "num_heads", "intermediate_size"))
    try:
        D, H, I = cfg["hidden_size"], cfg["num_heads"], cfg["intermediate_size"]
        layer = EagleLayer(D, H, I, tensors.get("vocab_subset"), float(cfg.get("rope_theta", 10000.0)))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"eagle checkpoint {path!r}: config does not describe a layer ({e})") from None
    for n in _PARAMS:
        t, want = tensors.get(n), tuple(getattr(layer, n).shape)
        if t is None or tuple(t.shape) != want:
            raise CheckpointError(f"eagle checkpoint {path!r}: {n}: expected {list(want)} as the config says, got "
                                  f"{None if t is None else list(t.shape)}")
    subset = layer.vocab_subset
    V = cfg.get("base_fingerprint", {}).get("shape", [None])[0]
    if subset is not None and (subset.numel() != cfg.get("vocab_subset_size")
                               or (V is not None and subset.numel() and int(subset.max()) >= V)):
        raise CheckpointError(f"eagle checkpoint {path!r}: vocab_subset is inconsistent with its config")
    with torch.no_grad():
        for n in _PARAMS:
            getattr(layer, n).copy_(tensors[n])
    layer.requires_grad_(False).eval()
    if model is not None:
        if "base_fingerprint" not in cfg:
            raise CheckpointError(f"eagle checkpoint {path!r}: config has no base_fingerprint")
        check_fingerprint(cfg["base_fingerprint"], model, where=f"eagle checkpoint {path!r}")
        layer.to(output_projection(model)[0].device)
    return layer, cfg
