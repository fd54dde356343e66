"""Reproducible uniforms, inverse-CDF sampling and its inverse (PTP), auxiliary-variable bits: validation,
normalisation and backend dispatch.

Public API:

  uniform(seed, position, stream=0)                     -> float32, shape of position (Philox 4x32-10)
  cdf_sample(logits [R, V], u [R], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)   -> int64 [R]
  cdf_invert(logits [R, V], token [R], v [R], same warping)                           -> float64 [R]
  sample_v(shape, a=None, generator=None, device=None)  -> float32 in (0, 1): uniform, or Beta(a, a)
  aux_bits(u)                                           -> float32 [..., 32]

Normalised arguments are those of csrc/sampling.cpp; the warping is defined in fastverify/reference/sampling.py.
Backends: torch (reference), cpp (csrc/cpu/sampling.cpp), triton (fastverify.kernels.sampling), cuda
(csrc/cuda/sampling.cu), each used only where its code exists (``implemented_backends``).
"""

import math
import struct

import torch

from fastverify import _ext
from fastverify.ops import dispatch
from fastverify.ops.checks import INT_DTYPES, LOGIT_DTYPES, check_range, check_tensor, constant_rows
from fastverify.reference import sampling as ref

__all__ = ["uniform", "cdf_sample", "cdf_invert", "sample_v", "aux_bits", "normalise_warp", "implemented_backends"]


def implemented_backends(op):
    """The backends whose code for ``op`` exists (fastverify.ops.dispatch.implemented_backends)."""
    return dispatch.implemented_backends(op)


# Fake (meta) implementations, so the compiled ops trace under torch.compile.
if _ext.HAS_CPP:

    @torch.library.register_fake("fastverify::uniform")
    def _uniform_fake(seed, position, stream):
        return position.new_empty(position.shape, dtype=torch.float32)

    @torch.library.register_fake("fastverify::verify_uniforms")
    def _verify_uniforms_fake(seed, position, request, offset, stream, rows):
        return (position.new_empty((rows,), dtype=torch.float32),
                position.new_empty((request.shape[0] - rows,), dtype=torch.float32))

    @torch.library.register_fake("fastverify::cdf_sample")
    def _cdf_sample_fake(logits, u, warp):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("fastverify::cdf_invert")
    def _cdf_invert_fake(logits, token, v, warp):
        return logits.new_empty((logits.shape[0],), dtype=torch.float64)

    @torch.library.register_fake("fastverify::aux_bits")
    def _aux_bits_fake(u):
        return u.new_empty((*u.shape, 32), dtype=torch.float32)


def _per_row(name, x, R, device, integral=False, validate=True):
    """A scalar or an [R] tensor as float32 [R] (a tensor's values are checked only with ``validate``)."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            x = x.reshape(1).expand(R)
        check_tensor(name, x, device=device)
        if x.shape != (R,):
            raise ValueError(f"{name}: expected a scalar or a tensor of shape ({R},), got {tuple(x.shape)}")
        if x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"{name}: expected a real number dtype, got {x.dtype}")
        if validate and integral and x.is_floating_point() and bool((x != x.round()).any()):
            raise ValueError(f"{name}: expected integers")
        return x.to(torch.float32)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name}: expected a number or a tensor, got {type(x).__name__}")
    if integral and float(x) != int(x):
        raise ValueError(f"{name}: expected an integer, got {x}")
    return torch.full((R,), float(x), dtype=torch.float32, device=device)


# (name, lo, hi, lo_open, hi_open, integral) of the warping parameters, in the column order of the [R, 4] tensor
_WARP_PARAMS = (("temperature", 0, math.inf, False, True, False), ("top_k", 0, None, False, False, True),
                ("top_p", 0, 1, True, False, False), ("min_p", 0, 1, False, False, False))


def normalise_warp(R, device, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, validate=True):
    """float32 [R, 4] (temperature, top_k, top_p, min_p) from scalars or [R] tensors, validated: temperature
    >= 0 and finite, top_k a non-negative integer, top_p in (0, 1], min_p in [0, 1]. Python numbers are always
    checked (no device read); tensors only with ``validate``."""
    values = (temperature, top_k, top_p, min_p)
    if not any(isinstance(v, torch.Tensor) for v in values):
        # All Python numbers (the common call): checked as numbers, then one cached constant tensor (no
        # per-parameter tensor ops, no host-to-device copy per call).
        for (name, *_, integral), v in zip(_WARP_PARAMS, values):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name}: expected a number or a tensor, got {type(v).__name__}")
            if integral and not (math.isfinite(v) and float(v) == int(v)):
                raise ValueError(f"{name}: expected an integer, got {v}")
        key = (values, R, device)
        hit = constant_rows.get(key)
        if hit is not None:
            return hit
        row = [_float32(v) for v in values]  # checked as the kernels see them
        for (name, lo, hi, lo_open, hi_open, _), v in zip(_WARP_PARAMS, row):
            check_range(name, v, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, first=True)
        return constant_rows(key, row, R, device)
    t = _per_row("temperature", temperature, R, device, validate=validate)
    k = _per_row("top_k", top_k, R, device, integral=True, validate=validate)
    p = _per_row("top_p", top_p, R, device, validate=validate)
    mp = _per_row("min_p", min_p, R, device, validate=validate)
    if validate:
        for (name, lo, hi, lo_open, hi_open, _), x in zip(_WARP_PARAMS, (t, k, p, mp)):
            check_range(name, x, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, first=True)
    return torch.stack([t, k, p, mp], dim=1)


def _float32(x):
    """x rounded to the nearest float32 (inf beyond its range), in plain Python."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _check_logits(logits):
    check_tensor("logits", logits, dtypes=LOGIT_DTYPES, dim=2)
    if logits.shape[1] == 0:
        raise ValueError("logits: expected at least one column (V >= 1)")
    if logits.stride(1) != 1:  # the kernels read rows with a unit inner stride (a single column: any stride is one)
        logits = logits.contiguous() if logits.shape[1] > 1 else logits.as_strided(logits.shape, (logits.stride(0), 1))
    return logits


def _check_unit(name, u, R, device, validate):
    """u in the open interval (0, 1) (its values checked only with ``validate``), one per logits row."""
    check_tensor(name, u, device=device, dtypes=(torch.float32, torch.float64), dim=1)
    if u.shape[0] != R:
        raise ValueError(f"{name}: expected shape ({R},) (one per logits row), got {tuple(u.shape)}")
    if validate:
        check_range(name, u, lo=0, hi=1, lo_open=True, hi_open=True, first=True)


def _invalid_rows_error(logits, warp, rows):
    r = int(rows[0])
    raise ValueError(
        f"logits: row {r} has no distribution (it holds NaN or +inf, is entirely -inf, or l / temperature "
        f"overflows float32)")


def uniform(seed, position, stream=0, backend="auto", validate=True):
    """Reproducible uniforms u in the open interval (0, 1) (DESIGN.md "Sampling and auxiliary variables").

    Args:
        seed: int, or int64 tensor broadcastable to position: the request's seed (all 64 bits are used).
        position: int64 tensor (any shape): absolute sequence positions.
        stream: int, or int64 tensor broadcastable to position, in [0, 2^32): independent streams at one position
            (verify uses 0 for sampling, 1 + j for the acceptance test of node j).
    Returns:
        float32, shape of position: ((x >> 9) + 0.5) * 2^-23 (exact, in [2^-24, 1 - 2^-24]) with x the first word of
        Philox 4x32-10 under key (seed lo, seed hi) and counter (position lo, position hi, stream, 0). Bit-identical
        on every backend.
    """
    if isinstance(position, int) and not isinstance(position, bool):
        position = torch.tensor(position, dtype=torch.int64)
    check_tensor("position", position, dtypes=INT_DTYPES)
    if isinstance(seed, bool) or not isinstance(seed, (int, torch.Tensor)):
        raise TypeError(f"seed: expected an int or an integer tensor, got {type(seed).__name__}")
    if isinstance(seed, int):
        if not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed: expected a 64-bit integer, got {seed}")
        seed = torch.full((), seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=position.device)
    check_tensor("seed", seed, device=position.device, dtypes=INT_DTYPES)
    if isinstance(stream, torch.Tensor):
        check_tensor("stream", stream, device=position.device, dtypes=INT_DTYPES)
        if validate and stream.numel() and bool(((stream < 0) | (stream >= 2**32)).any()):
            bad = stream[(stream < 0) | (stream >= 2**32)][:4]
            raise ValueError(f"stream: expected values in [0, 2^32), got {bad}")
    elif isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 2**32:
        raise ValueError(f"stream: expected an int in [0, 2^32) or an integer tensor, got {stream!r}")
    else:
        stream = torch.full((), stream, dtype=torch.int64, device=position.device)
    try:
        seed_b, pos_b, stream_b = torch.broadcast_tensors(seed.to(torch.int64), position.to(torch.int64),
                                                          stream.to(torch.int64))
    except RuntimeError as e:
        raise ValueError(f"seed, stream: shapes {tuple(seed.shape)}, {tuple(stream.shape)} do not broadcast to "
                         f"position's {tuple(position.shape)}") from e
    return _uniform_op(seed_b, pos_b, stream_b, backend)


def _uniform_op(seed, position, stream, backend="auto"):
    """uniform on validated int64 tensors of one shape (no checks: verify's seeded draws come through here)."""
    shape = position.shape
    out = dispatch.call("uniform", backend, position.device, seed.reshape(-1).contiguous(),
                        position.reshape(-1).contiguous(), stream.reshape(-1).contiguous())
    return out.reshape(shape)


def cdf_sample(logits, u, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, backend="auto", validate=True):
    """Inverse-CDF sampling of warped logits rows (PTP Eq. 8).

    Args:
        logits: [R, V] float32 / bfloat16 / float16 (any strides).
        u: float32 or float64 [R] in the open interval (0, 1), e.g. from ``uniform`` (whose values lie in
            [2^-24, 1 - 2^-24]). 0 and 1 are refused: u = 1 would select no token (C(t) > Z never holds), and a
            boundary value would make the result depend on how each backend rounds u * Z.
        temperature, top_k, top_p, min_p: Python scalars or [R] tensors (warping of
            fastverify.reference.sampling; temperature 0 = argmax, top_k 0 / top_p 1 / min_p 0 = off).
        validate: check the values of u and of tensor parameters, and raise for rows with no distribution. With
            False the call reads nothing back from the device (no host synchronisation; CUDA-graph capturable),
            and such a row returns -1.
    Returns:
        int64 [R]: the smallest token t with C(t) > u * Z, C the float64 prefix sum of the warped weights in
        token-id order and Z = C(V - 1).
    Raises ValueError naming the argument for bad shapes, devices, dtypes and ranges, and naming ``logits`` for a
    row with no distribution (NaN or +inf, all -inf, overflow of l / temperature).
    """
    logits = _check_logits(logits)
    R = logits.shape[0]
    _check_unit("u", u, R, logits.device, validate)
    warp = normalise_warp(R, logits.device, temperature, top_k, top_p, min_p, validate)
    out = dispatch.call("cdf_sample", backend, logits.device, logits, u, warp)
    if not validate:
        return out
    bad = out < 0
    if R and bool(bad.any()):
        _invalid_rows_error(logits, warp, bad.nonzero()[:, 0])
    return out


def cdf_invert(logits, token, v, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, backend="auto", validate=True):
    """The auxiliary variable that maps back to a token (PTP Eq. 9): u = (C(t - 1) + v * w(t)) / Z.

    Args:
        logits: [R, V] float32 / bfloat16 / float16. token: integer [R] in [0, V).
        v: float32 or float64 [R] in the open interval (0, 1): the position inside the token's bin (uniform, or
            Beta(a, a) from ``sample_v``, PTP Appendix D). 0 and 1 are refused: they are the bin's edges, which
            belong to the neighbouring tokens' bins as much as to this one.
        temperature, top_k, top_p, min_p: as in ``cdf_sample``.
        validate: as in ``cdf_sample``; with False, tokens outside [0, V) and rows with no distribution give NaN
            (or an unspecified u), never an out-of-bounds read.
    Returns:
        float64 [R], in (0, 1), moved by float64 ulps so that cdf_sample(logits, u, same warping, same backend)
        == token exactly. NaN where the token has warped probability 0, or (on an astronomically small bin)
        where no float64 u selects it.
    """
    logits = _check_logits(logits)
    R, V = logits.shape
    check_tensor("token", token, device=logits.device, dtypes=INT_DTYPES, dim=1)
    if token.shape[0] != R:
        raise ValueError(f"token: expected shape ({R},) (one per logits row), got {tuple(token.shape)}")
    if validate and R and bool(((token < 0) | (token >= V)).any()):
        raise ValueError(f"token: expected ids in [0, {V}), got {token[(token < 0) | (token >= V)][0].item()}")
    _check_unit("v", v, R, logits.device, validate)
    warp = normalise_warp(R, logits.device, temperature, top_k, top_p, min_p, validate)
    out = dispatch.call("cdf_invert", backend, logits.device, logits, token.to(torch.int64), v, warp)
    if not validate:
        return out
    nan = torch.isnan(out)
    if R and bool(nan.any()):
        rows = nan.nonzero()[:, 0]
        bad = ref.invalid_rows(logits[rows], warp[rows])
        if bool(bad.any()):
            _invalid_rows_error(logits, warp, rows[bad])
    return out


def sample_v(shape, a=None, generator=None, device=None):
    """Positions inside a token's bin for ``cdf_invert``, float32 in the open interval (0, 1).

    a None: uniform. a > 0: Beta(a, a) (PTP Appendix D: a > 1 concentrates v at the bin's centre, away from the
    edges the model finds hard to resolve). Drawn with ``generator`` as Beta(a, a) = G1 / (G1 + G2), G_i ~
    Gamma(a), clamped into (0, 1).
    """
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(shape)
    if generator is not None and device is None:
        device = generator.device
    device = torch.device(device if device is not None else "cpu")
    if a is None:
        x = torch.randint(0, 2**23, shape, generator=generator, device=device, dtype=torch.int64)
        return ((x.double() + 0.5) * 2.0**-23).float()  # exact in float32, strictly inside (0, 1)
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0 or not math.isfinite(a):
        raise ValueError(f"a: expected a finite number > 0 (Beta(a, a)), got {a!r}")
    conc = torch.full(shape, float(a), dtype=torch.float64, device=device)
    g1 = torch._standard_gamma(conc, generator=generator)
    g2 = torch._standard_gamma(conc, generator=generator)
    v = g1 / (g1 + g2)
    lo, hi = 2.0**-25, 1.0 - 2.0**-24  # open interval, representable in float32
    v = torch.nan_to_num(v, nan=0.5).clamp(lo, hi)
    return v.float()


def aux_bits(u, backend="auto"):
    """The IEEE-754 bits of float32 u, most significant first (PTP §3.1), as float32 [..., 32] of 0 / 1."""
    check_tensor("u", u, dtypes=(torch.float32,))
    return dispatch.call("aux_bits", backend, u.device, u.reshape(-1).contiguous()).reshape(*u.shape, 32)
