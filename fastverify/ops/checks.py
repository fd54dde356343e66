"""Argument checks shared by the op wrappers. Each raises TypeError / ValueError with a message that starts with
the argument's name and says what was expected and what came."""

import math

import torch

__all__ = ["INT_DTYPES", "FLOAT_DTYPES", "LOGIT_DTYPES", "check_tensor", "check_range", "range_error",
           "index_tensor", "constant_rows"]

INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name, t, device=None, dtypes=None, dim=None):
    """A torch.Tensor on ``device`` (the device of logits; None: any), of one of ``dtypes``, with ``dim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of logits), got {t.device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-d tensor, got shape {tuple(t.shape)}")


def range_error(name, got, lo=None, hi=None, lo_open=False, hi_open=False):
    """ValueError "<name>: expected values in [lo, hi), got <got>" (brackets by openness; None bounds are -inf /
    inf)."""
    lb = "(" if lo_open else "["
    rb = ")" if hi_open else "]"
    return ValueError(f"{name}: expected values in {lb}{'-inf' if lo is None else lo}, "
                      f"{'inf' if hi is None else hi}{rb}, got {got}")


def check_range(name, x, lo=None, hi=None, lo_open=False, hi_open=False, *, first=False):
    """Every value of ``x`` (a tensor or a Python number) in the range; NaN never is. The error shows up to four
    offending values as a list, or with ``first`` the first one alone. A Python number costs no tensor op."""
    if not isinstance(x, torch.Tensor):
        if not (math.isnan(x) or (lo is not None and (x <= lo if lo_open else x < lo))
                or (hi is not None and (x >= hi if hi_open else x > hi))):
            return
        x = torch.tensor([x], dtype=torch.float64)
    bad = torch.isnan(x)
    if lo is not None:
        bad |= (x <= lo) if lo_open else (x < lo)
    if hi is not None:
        bad |= (x >= hi) if hi_open else (x > hi)
    if bool(bad.any()):
        raise range_error(name, x[bad][0].item() if first else x[bad][:4].tolist(), lo, hi, lo_open, hi_open)


def index_tensor(x, name, device, length=None, validate=True):
    """int32 [n], contiguous, from an integer tensor [n] on ``device`` (int64 values must fit in int32: checked
    with ``validate``, a device read), a list, or (with ``length``) an int repeated ``length`` times; ``length``
    also fixes n."""
    if isinstance(x, bool):
        raise TypeError(f"{name}: expected an int or an integer tensor, got bool")
    if isinstance(x, int):
        if length is None:
            raise TypeError(f"{name}: expected an integer tensor, got int")
        if not -2**31 <= x < 2**31:
            raise ValueError(f"{name}: values must fit in int32, got {x}")
        return torch.full((length,), x, dtype=torch.int32, device=device)
    if isinstance(x, (list, tuple)):
        x = torch.tensor(x, dtype=torch.int64, device=device)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected an int or an integer tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor (int32 or int64), got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {x.device}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if length is not None and x.numel() != length:
        raise ValueError(f"{name}: expected {length} entries (one per request), got {x.numel()}")
    if validate and x.dtype == torch.int64 and x.numel() and bool(((x < -2**31) | (x >= 2**31)).any()):
        raise ValueError(f"{name}: values must fit in int32")
    return x.to(torch.int32).contiguous()


class _ConstantRows:
    """Read-only float32 [rows, n] tensors of Python numbers (and other constants of the shapes alone), cached per
    (key, device): the op wrappers' all-scalar
    parameters (the usual call: the same rule and warping every step) then cost no host-to-device copy, which on
    CUDA waits for the stream. Bounded; nothing is kept while torch.compile traces."""

    def __init__(self, size=64):
        self.size, self.cache = size, {}

    def get(self, key):
        return None if torch.compiler.is_compiling() else self.cache.get(key)

    def __call__(self, key, values, rows, device):
        return self.keep(key, torch.tensor(values, dtype=torch.float32, device=device).expand(rows, len(values))
                         .contiguous())

    def build(self, key, make):
        """The cached tensor of ``key``, or ``make()`` kept under it (any read-only constant of the shapes)."""
        t = self.get(key)
        return t if t is not None else self.keep(key, make())

    def keep(self, key, t):
        # not while tracing, nor while capturing a CUDA graph (its kernels only fill the tensor at replay)
        cuda = (t[0] if isinstance(t, tuple) else t).is_cuda
        if not torch.compiler.is_compiling() and not (cuda and torch.cuda.is_current_stream_capturing()):
            if len(self.cache) >= self.size:
                self.cache.clear()
            self.cache[key] = t
        return t


constant_rows = _ConstantRows()
