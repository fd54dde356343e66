"""Blockwise proposal heads (Stern et al. 2018 §4; Medusa's ResBlock heads) and their checkpoints.

``ProposalHeads`` holds k - 1 heads p_2..p_k on a frozen causal LM. Head p_i reads the target's final hidden
state h at a row r (the input of the output projection, after the final norm: the vector whose logits give the
token at position r + 1) and proposes the token at position r + i:

    h_i = h + SiLU(W_i h + b_i)                     (Medusa-1's zero-initialised residual block)
    logits_i = h_i @ E^T (+ bias)                   (the target's own output projection E, tied or not)

p_1 is the target itself, so a draft built from the heads is a tree rooted at the target's own next token, and
greedy verification keeps the output exact.

Sequential heads (``sequential=True``; Hydra, Ankner et al. 2024). The parallel heads above guess position r + i
from h alone, blind to the tokens in between, so each guesses every path at once (Medusa's independence
assumption). Sequential heads read the draft's own tokens: with x_{r+1} the row's next token (the draft's
root, which the target has already chosen) and s_1 = h,

    s_{i} = s_{i-1} + SiLU(W_i s_{i-1} + U_i n(e(x_{r+i-1})) + b_i)      i = 2..k (s_1 = h)
    logits_i = s_i @ E^T (+ bias)

where e is the target's input embedding and n(x) = x / rms(x). Head p_i's state depends on the path above the
node it expands, so the drafter runs the heads level by level through the tree (one projection per level for
all the nodes it expands); training feeds the true tokens (teacher forcing), which is what the node sees
whenever its path is accepted, so the measured conditional accuracy is the probability the tree needs. U_i
starts at zero too. W_i and b_i start at zero (SiLU(0) = 0, so h_i = h): an untrained
head p_i proposes what the target predicts for the row's next position, and training starts from there.

Feed-forward heads (``ffn_size`` F > 0; Hydra++'s deeper heads, in one hidden layer). The residual branch above is
a single square layer, so whatever a head adds to the state is one SiLU of a linear map of it. With F > 0 it is a
feed-forward block with an F-wide hidden layer and an output projection O_i [D, F]:

    s_i = s_{i-1} + O_i SiLU(W_i s_{i-1} + U_i n(e(x_{r+i-1})) + b_i)          (W_i, U_i [F, D]; b_i [F])

(parallel heads: h_i = h + O_i SiLU(W_i h + b_i)). O_i starts at zero, so an untrained head is again the identity;
W_i and U_i start random (a zero hidden layer would get no gradient). F = 0 is the block above (O_i the identity,
F = D). On SmolLM2-135M, F = 2D raised the held-out top-1 of p_2..p_6 by 3-4 points at the same training steps
and the tokens per target forward on Spec-Bench by ~4%, at 2.0M weights per head against 0.66M; on the 2-core CPU
a drafter's level costs more (the block's weights are read at every level, beside the 4.7M of the output
projection at V' = 8192), which there leaves the time even (benchmarks/RESULTS.md, "Feed-forward heads in Q8_0").
The shipped heads (``smollm2-bpd``) are sequential with F = 2D, stored in Q8_0 (below).

Vocabulary subset. A head may propose from a subset of the vocabulary (``vocab_subset`` int64 [V']: the
V' most frequent tokens of the training continuations): its logits are ``h_i @ E[vocab_subset]^T``. The
drafted tokens are only candidates, so exactness does not depend on it; what it buys is the cost of the
heads' pass through the output projection, which on SmolLM2-135M (V = 49152, D = 576, 113 MB of fp32
weights against 540 MB for the whole model) would otherwise add ~20% of a target forward to every step. With
V' = 8192 it adds ~3.5%. Training computes the cross-entropy over the same subset (positions whose target
falls outside it are skipped and counted as misses in the evaluation).

Checkpoint (a directory):

    config.json         {"method": "bpd", "format": 1, "num_heads", "hidden_size", "vocab_size",
                         "vocab_subset_size", "base_model", "base_fingerprint": {...}, "head_acceptance",
                         "training": {...}, "eval": {...}}
    heads.safetensors   "weight" fp32 [H, F, D], "bias" fp32 [H, F], "vocab_subset" int64 [V'] (when used),
                        "token_weight" fp32 [H, F, D] (sequential heads: config "arch": "sequential"),
                        "out_weight" fp32 [H, D, F] (config "ffn_size" F > 0; F = D without it);
                        stored float32, float16 or bfloat16 (config "weights_dtype"), or for "q8_0" the three
                        weights as GGUF Q8_0 blocks: int8 q [..., K] and "<name>_scale" float16 d [..., K / 32],
                        w = d * q per block of 32 along the input dimension K (the bias in float32)

Q8_0 weights (``save_heads(..., dtype="q8_0")``, ``python -m fastverify.train heads --save-dtype q8_0``): 1.06
bytes per weight against float16's 2, and on the CPU the drafter streams them packed (``skinny_linear_packed``: the
same exact float32 values, fewer bytes per tree level); the rounding moves the drafts, never the verified output.

``base_fingerprint`` identifies the output projection the heads were trained against: its shape, the sha256
of its fp32 bytes, and ``probe``: the sums of 16 fixed rows in float64. Loading compares shape (a vocabulary
or hidden-size mismatch is its own error) and then the probe with a tolerance of 1e-2 relative, so the same
base loaded in bf16/fp16 is accepted and another model is refused. The sha256 is informational.
"""

import hashlib
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ProposalHeads", "fingerprint", "check_fingerprint", "save_heads", "load_heads", "output_projection",
           "CheckpointError", "BaseModelMismatch", "SHIPPED", "resolve_checkpoint", "read_checkpoint",
           "quantize_q8_0", "dequantize_q8_0", "round_heads", "HEADS_DTYPES"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "heads.safetensors"
FORMAT = 1
_PROBE_ROWS = 16
# Shipped checkpoints: name -> folder inside the package (fastverify/checkpoints/<name>).
SHIPPED = ("smollm2-bpd", "smollm2-gad", "smollm2-lud", "smollm2-ptp")
_CHECKPOINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


class CheckpointError(ValueError):
    """A heads checkpoint that is missing, unreadable or inconsistent."""


class BaseModelMismatch(ValueError):
    """A heads checkpoint loaded onto a model it was not trained on."""


def unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit root mean square over its last dimension (RMSNorm without a weight): how the sequential
    heads and the EAGLE layer read token embeddings."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)  # one kernel on a GPU; on the CPU x * rsqrt(mean(x^2) + eps)


class ProposalHeads(nn.Module):
    """k - 1 residual heads. weight fp32 [H, F, D], bias fp32 [H, F]; vocab_subset int64 [V'] or None (all V
    tokens); sequential: also token_weight fp32 [H, F, D] (Hydra-style heads, above); ffn_size F > 0: also
    out_weight fp32 [H, D, F] (feed-forward heads, above; zero-initialised, weight and token_weight random), else
    F = D, out_weight None and every weight zero-initialised."""

    def __init__(self, hidden_size: int, num_heads: int, vocab_subset=None, sequential: bool = False,
                 ffn_size: int = 0):
        super().__init__()
        if num_heads < 1 or hidden_size < 1 or ffn_size < 0:
            raise ValueError(f"num_heads, hidden_size, ffn_size: expected >= 1, >= 1, >= 0, got {num_heads}, "
                             f"{hidden_size}, {ffn_size}")
        self.hidden_size, self.num_heads, self.sequential = int(hidden_size), int(num_heads), bool(sequential)
        self.ffn_size = int(ffn_size)
        D, F_ = self.hidden_size, self.ffn_size or self.hidden_size
        # F > 0: the hidden layer reads [state | n(e)] (sequential) or the state, unit-variance preactivations at the
        # start for unit-variance inputs; F = 0: zeros
        std = (2 * D if self.sequential else D) ** -0.5

        def init(*shape):
            return nn.Parameter(torch.randn(*shape, dtype=torch.float32) * std if self.ffn_size
                                else torch.zeros(*shape, dtype=torch.float32))

        self.weight = init(num_heads, F_, D)
        self.bias = nn.Parameter(torch.zeros(num_heads, F_, dtype=torch.float32))
        if self.sequential:
            self.token_weight = init(num_heads, F_, D)
        else:
            self.register_parameter("token_weight", None)
        if self.ffn_size:
            self.out_weight = nn.Parameter(torch.zeros(num_heads, D, F_, dtype=torch.float32))
        else:
            self.register_parameter("out_weight", None)
        if vocab_subset is not None:
            vocab_subset = torch.as_tensor(vocab_subset, dtype=torch.int64).reshape(-1)
        self.register_buffer("vocab_subset", vocab_subset, persistent=False)

    def forward(self, hidden: torch.Tensor, token_emb: torch.Tensor = None) -> torch.Tensor:
        """hidden [N, D] (any float dtype) -> [H, N, D] fp32: each head's residual output h_i. Sequential heads
        also take token_emb [N, H, D]: the input embeddings of x_{r+1} .. x_{r+H}, the tokens each head reads."""
        h = hidden.to(self.weight.dtype)
        if not self.sequential:
            a = F.silu(torch.einsum("nd,hfd->hnf", h, self.weight) + self.bias[:, None, :])
            return h[None] + (a if self.out_weight is None else torch.einsum("hnf,hdf->hnd", a, self.out_weight))
        if token_emb is None or token_emb.shape != (h.shape[0], self.num_heads, self.hidden_size):
            got = None if token_emb is None else tuple(token_emb.shape)
            raise ValueError(f"token_emb: sequential heads expected [{h.shape[0]}, {self.num_heads}, "
                             f"{self.hidden_size}], got {got}")
        out, s = [], h
        for i in range(self.num_heads):
            s = self.step(i, s, token_emb[:, i])
            out.append(s)
        return torch.stack(out)

    def step(self, i: int, state: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """Sequential head p_{i+2}: state [N, D] (h, or the parent head's output), token_emb [N, D] (the input
        embedding of the token the head reads) -> the head's output [N, D] fp32."""
        e = unit_rms(token_emb.to(self.weight.dtype))
        a = F.silu(F.linear(state, self.weight[i], self.bias[i]) + F.linear(e, self.token_weight[i]))
        return state + (a if self.out_weight is None else F.linear(a, self.out_weight[i]))

    def extra_repr(self):
        v = "all" if self.vocab_subset is None else self.vocab_subset.numel()
        arch = ", sequential" if self.sequential else ""
        ffn = f", ffn_size={self.ffn_size}" if self.ffn_size else ""
        return f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, vocab={v}{arch}{ffn}"


def output_projection(model):
    """(weight [V, D], bias [V] or None) of the model's output projection (``get_output_embeddings()``)."""
    out = model.get_output_embeddings()
    if out is None or not hasattr(out, "weight"):
        raise ValueError(f"{type(model).__name__}: get_output_embeddings() returned no linear layer with a weight; "
                         "proposal heads need the target's output projection")
    return out.weight, getattr(out, "bias", None)


def fingerprint(model) -> dict:
    """Identity of the model's output projection: shape, sha256 of its fp32 bytes, probe row sums."""
    w = output_projection(model)[0].detach()
    V, D = w.shape
    rows = torch.linspace(0, V - 1, _PROBE_ROWS, dtype=torch.float32).round().long()  # (as checkpoints hold it)
    probe = w[rows.to(w.device)].double().sum(-1).cpu().tolist()
    digest = hashlib.sha256(w.float().contiguous().cpu().numpy().tobytes()).hexdigest()
    return {"shape": [int(V), int(D)], "sha256": digest, "probe": probe}


def check_fingerprint(expected: dict, model, where: str = "checkpoint") -> None:
    """Raise BaseModelMismatch when ``model``'s output projection is not the one ``expected`` describes."""
    w = output_projection(model)[0]
    V, D = w.shape
    eV, eD = expected["shape"]
    if (V, D) != (eV, eD):
        what = "vocabulary size" if V != eV else "hidden size"
        raise BaseModelMismatch(
            f"{where}: {what} mismatch: the heads were trained on an output projection of shape [{eV}, {eD}] "
            f"(vocabulary {eV}, hidden {eD}); this model's is [{V}, {D}]. Load heads trained on this base model.")
    got = fingerprint(model)["probe"]
    ref = expected["probe"]
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if abs(a - b) > 1e-2 * max(abs(b), 1.0)]
    if bad or len(got) != len(ref):
        raise BaseModelMismatch(
            f"{where}: base model mismatch: this model's output projection does not match the one the heads "
            f"were trained on (same shape [{V}, {D}], but its fingerprint differs at {len(bad)} of {len(ref)} "
            f"probe rows). The heads only work on their base model.")


WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HEADS_DTYPES = (*WEIGHT_DTYPES, "q8_0")  # what a heads checkpoint stores its weights in
_MATRICES = ("weight", "token_weight", "out_weight")  # the heads' weights (q8_0: block-quantised along the last dim)


def quantize_q8_0(w: torch.Tensor):
    """GGUF's Q8_0 of ``w`` [..., K] (K a multiple of 32): (q int8 [..., K], d float16 [..., K / 32]), per block of
    32 along K d = the block's largest magnitude / 127 rounded to float16 and q = round(w / d) in [-127, 127], so
    that ``dequantize_q8_0(q, d)`` (exact float32 products) is what fastverify.ops.linear.pack_blocks packs."""
    if w.shape[-1] % 32 or not w.is_floating_point():
        raise ValueError(f"w: expected a floating tensor [..., K] with K a multiple of 32, got {w.dtype} "
                         f"{tuple(w.shape)}")
    b = w.detach().float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    d = (b.abs().amax(-1) / 127).half()
    if not bool(torch.isfinite(d).all()):
        raise ValueError("w: non-finite values or magnitudes beyond float16's range have no Q8_0 form")
    df = d.float()[..., None]
    q = torch.where(df > 0, torch.round(b / torch.where(df > 0, df, 1.0)), 0.0).clamp(-127, 127)
    return q.to(torch.int8).reshape(w.shape), d


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 w [..., K] = d * q per block of 32 along K (``quantize_q8_0``'s inverse on its image)."""
    b = q.float().reshape(*q.shape[:-1], q.shape[-1] // 32, 32)
    return (b * d.float()[..., None]).reshape(q.shape)


def round_heads(heads: "ProposalHeads", dtype: str) -> None:
    """Round the heads' parameters in place to what ``save_heads(..., dtype)`` stores (they stay float32), so that
    an evaluation before saving describes the file."""
    if dtype not in HEADS_DTYPES:
        raise ValueError(f"dtype: expected one of {list(HEADS_DTYPES)}, got {dtype!r}")
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if dtype != "q8_0":
                p.copy_(p.to(WEIGHT_DTYPES[dtype]).float())
            elif name in _MATRICES:  # the bias stays float32
                p.copy_(dequantize_q8_0(*quantize_q8_0(p)))


def save_heads(heads: ProposalHeads, path: str, config: dict, dtype: str = "float32") -> None:
    """Write ``path``/heads.safetensors and ``path``/config.json (config: base_model, base_fingerprint, ... ;
    method / format / sizes are filled in here). dtype: of the stored weights ("float32"; "float16" halves the
    file; "q8_0" (Q8_0 blocks, the bias in float32) nearly halves it again; loading makes them fp32 again, so the
    file is exact for heads whose weights were rounded to its dtype: ``round_heads``)."""
    from safetensors.torch import save_file
    if dtype not in HEADS_DTYPES:
        raise ValueError(f"dtype: expected one of {list(HEADS_DTYPES)}, got {dtype!r}")
    dt = WEIGHT_DTYPES.get(dtype, torch.float32)
    os.makedirs(path, exist_ok=True)
    tensors = {"bias": heads.bias.detach().to(dt).cpu().contiguous()}
    if heads.vocab_subset is not None:
        tensors["vocab_subset"] = heads.vocab_subset.cpu().contiguous()
    for name in _MATRICES:
        w = getattr(heads, name, None)
        if w is None:
            continue
        if dtype == "q8_0":
            if w.shape[-1] % 32:
                raise ValueError(f"dtype 'q8_0': {name} has input size {w.shape[-1]}, not a multiple of 32 (Q8_0 "
                                 f"blocks); save it in float16")
            tensors[name], tensors[name + "_scale"] = (t.cpu().contiguous() for t in quantize_q8_0(w))
        else:
            tensors[name] = w.detach().to(dt).cpu().contiguous()
    cfg = dict(config)
    cfg.update({"method": "bpd", "format": FORMAT, "num_heads": heads.num_heads, "hidden_size": heads.hidden_size,
                "arch": "sequential" if heads.sequential else "parallel", "ffn_size": heads.ffn_size,
                "weights_dtype": dtype,
                "vocab_subset_size": None if heads.vocab_subset is None else int(heads.vocab_subset.numel())})
    tmp = os.path.join(path, WEIGHTS_NAME + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, CONFIG_NAME + ".tmp"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(os.path.join(path, CONFIG_NAME + ".tmp"), os.path.join(path, CONFIG_NAME))


def resolve_checkpoint(name_or_path: str) -> str:
    """A shipped checkpoint's folder by name, or the given folder. Raises FileNotFoundError."""
    if name_or_path in SHIPPED:
        path = os.path.join(_CHECKPOINTS, name_or_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"shipped checkpoint {name_or_path!r}: expected at {path}, not found (is the "
                                    f"package installed with its package data?)")
        return path
    path = os.path.expanduser(str(name_or_path))
    if not os.path.isdir(path):
        hint = f"; shipped checkpoints: {', '.join(SHIPPED)}" if not os.path.exists(path) else ""
        raise FileNotFoundError(f"heads checkpoint: no such directory {path!r} (expected a folder holding "
                                f"{CONFIG_NAME} and {WEIGHTS_NAME}{hint})")
    return path


def read_checkpoint(path: str, weights_name: str, what: str, methods, fmt: int, describes: str = None,
                    sizes=()):
    """(config dict, tensors) of a checkpoint folder: ``config.json`` (its "method" one of ``methods``, its "format"
    ``fmt``, each field named in ``sizes`` an int >= 1) and the safetensors file ``weights_name``. ``what`` names
    the kind in the errors (``describes``: what its config must describe, default ``what``): FileNotFoundError
    for a missing file, CheckpointError for invalid JSON, another method or format, a size that is no positive int
    (a string or a fraction, which int() would have read), or an unreadable file."""
    cfg_path, w_path = os.path.join(path, CONFIG_NAME), os.path.join(path, weights_name)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{what} checkpoint {path!r}: missing {os.path.basename(p)}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} checkpoint {path!r}: {CONFIG_NAME} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("method") not in methods:
        got = cfg.get("method") if isinstance(cfg, dict) else cfg
        raise CheckpointError(f"{what} checkpoint {path!r}: {CONFIG_NAME} does not describe {describes or what} "
                              f"(expected \"method\" in {list(methods)}, got {got!r})")
    if cfg.get("format") != fmt:
        raise CheckpointError(f"{what} checkpoint {path!r}: format {cfg.get('format')!r}, this fastverify reads {fmt}")
    for key in sizes:
        if type(cfg.get(key)) is not int or cfg[key] < 1:
            raise CheckpointError(f"{what} checkpoint {path!r}: {key} {cfg.get(key)!r}, expected an int >= 1")
    try:
        from safetensors.torch import load_file
        tensors = load_file(w_path)
    except Exception as e:  # safetensors raises its own error types for truncated / garbled files
        raise CheckpointError(f"{what} checkpoint {path!r}: {weights_name} is unreadable ({type(e).__name__}: "
                              f"{e}); the file is corrupt or truncated") from None
    return cfg, tensors


def load_heads(name_or_path: str, model=None):
    """Load (ProposalHeads, config dict). With ``model``, check the base fingerprint (BaseModelMismatch) and put
    the heads on the model's device. Raises FileNotFoundError (missing folder/file) or CheckpointError
    (unreadable or inconsistent)."""
    path = resolve_checkpoint(name_or_path)
    cfg, tensors = read_checkpoint(path, WEIGHTS_NAME, "heads", ("bpd",), FORMAT, "proposal heads",
                                   sizes=("num_heads", "hidden_size"))
    for name in _MATRICES:  # Q8_0 blocks back to their float32 values
        q, d = tensors.get(name), tensors.pop(name + "_scale", None)
        if q is None or (q.dtype != torch.int8 and d is None):
            continue
        if q.dtype != torch.int8 or d is None or q.dim() < 1 or q.shape[-1] % 32 \
                or tuple(d.shape) != (*q.shape[:-1], q.shape[-1] // 32) or not d.is_floating_point():
            raise CheckpointError(f"heads checkpoint {path!r}: {name} in Q8_0 needs int8 q [..., K] (K a multiple "
                                  f"of 32) and {name}_scale [..., K / 32], got {q.dtype} {tuple(q.shape)} and "
                                  f"{None if d is None else (d.dtype, tuple(d.shape))}")
        tensors[name] = dequantize_q8_0(q, d)
    H, D, ffn = cfg["num_heads"], cfg["hidden_size"], cfg.get("ffn_size", 0)
    if type(ffn) is not int or ffn < 0:
        raise CheckpointError(f"heads checkpoint {path!r}: ffn_size {ffn!r}, expected an int >= 0")
    F_ = ffn or D
    w, b = tensors.get("weight"), tensors.get("bias")
    if w is None or b is None or tuple(w.shape) != (H, F_, D) or tuple(b.shape) != (H, F_):
        raise CheckpointError(f"heads checkpoint {path!r}: expected weight [{H}, {F_}, {D}] and bias [{H}, {F_}] as "
                              f"the config says, got {None if w is None else tuple(w.shape)} and "
                              f"{None if b is None else tuple(b.shape)}")
    arch = cfg.get("arch", "parallel")
    if arch not in ("parallel", "sequential"):
        raise CheckpointError(f"heads checkpoint {path!r}: arch {arch!r}, expected 'parallel' or 'sequential'")
    u = tensors.get("token_weight")
    if (arch == "sequential") != (u is not None) or (u is not None and tuple(u.shape) != (H, F_, D)):
        raise CheckpointError(f"heads checkpoint {path!r}: arch {arch!r} with token_weight "
                              f"{None if u is None else tuple(u.shape)} (sequential heads need [{H}, {F_}, {D}], "
                              f"parallel ones none)")
    o = tensors.get("out_weight")
    if bool(ffn) != (o is not None) or (o is not None and tuple(o.shape) != (H, D, F_)):
        raise CheckpointError(f"heads checkpoint {path!r}: ffn_size {ffn} with out_weight "
                              f"{None if o is None else tuple(o.shape)} (feed-forward heads need [{H}, {D}, {F_}], "
                              f"ffn_size 0 none)")
    subset = tensors.get("vocab_subset")
    V = cfg.get("base_fingerprint", {}).get("shape", [None])[0]
    if subset is not None and (subset.numel() != cfg.get("vocab_subset_size")
                               or (V is not None and subset.numel() and int(subset.max()) >= V)):
        raise CheckpointError(f"heads checkpoint {path!r}: vocab_subset is inconsistent with its config")
    if model is not None:
        if "base_fingerprint" not in cfg:
            raise CheckpointError(f"heads checkpoint {path!r}: config has no base_fingerprint")
        check_fingerprint(cfg["base_fingerprint"], model, where=f"heads checkpoint {path!r}")
    heads = ProposalHeads(D, H, subset, sequential=u is not None, ffn_size=ffn)
    with torch.no_grad():
        heads.weight.copy_(w)
        heads.bias.copy_(b)
        if u is not None:
            heads.token_weight.copy_(u)
        if o is not None:
            heads.out_weight.copy_(o)
    heads.requires_grad_(False).eval()
    if model is not None:
        heads.to(output_projection(model)[0].device)
    return heads, cfg
