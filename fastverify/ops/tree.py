"""Tree and block attention masks and position ids: validation, normalisation and backend dispatch.

Public API:

  tree_mask(parents, cu_nodes, prefix_len, format="bool"|"additive"|"packed", dtype=torch.float32)
  block_mask(block_sizes, prefix_len, kind="causal"|"bidirectional", format=..., dtype=...)
  tree_positions(parents, cu_nodes, prefix_len)

Normalised arguments and the key layout are those of csrc/tree.cpp (reference: fastverify/reference/tree.py).
Backends: torch (reference), cpp (csrc/cpu/tree.cpp), triton (fastverify.kernels.tree), cuda
(csrc/cuda/tree.cu), each used only where its code exists: see ``implemented_backends``.
"""

import torch

from fastverify import _ext
from fastverify.ops import dispatch
from fastverify.ops.checks import index_tensor as _as_index_tensor
from fastverify.reference import tree as ref

__all__ = ["tree_mask", "block_mask", "tree_positions", "normalise_tree", "implemented_backends"]

FORMATS = ("bool", "additive", "packed")


def implemented_backends(op: str, module: str = None) -> tuple:
    """The backends whose code for ``op`` exists (fastverify.ops.dispatch.implemented_backends; ``module`` is
    accepted for older callers and not needed)."""
    return dispatch.implemented_backends(op)


def _call_tree_op(op: str, backend: str, par, cu, validate: bool, *args):
    """dispatch.call for the mask / position ops. The C++ CPU kernels check the tree layout themselves (one pass
    over the nodes), so on that backend the Python-side parents check runs only when the kernel rejects its input,
    to turn the kernel's RuntimeError into the wrapper's ValueError naming the node; elsewhere it runs first."""
    name = dispatch.resolve(op, backend, par.device)
    if name != "cpp" and validate:
        _check_parents(par, cu)
    try:
        return dispatch.call(op, name, par.device, *args)
    except RuntimeError:
        if name == "cpp" and validate:
            _check_parents(par, cu)
        raise


# ----------------------------------------------------------------------------------------------------------
# Validation and normalisation


def _check_parents(par, cu):
    """ValueError naming the first node whose parent is out of range or does not precede it."""
    N = par.numel()
    if not N:
        return
    counts = (cu[1:] - cu[:-1]).long()
    local = torch.arange(N, device=par.device, dtype=torch.int32) - torch.repeat_interleave(
        cu[:-1], counts, output_size=N)
    bad = (par < -1) | (par >= local)
    if bool(bad.any()):
        g = int(bad.nonzero()[0])
        b = int(torch.searchsorted(cu[1:].long(), torch.tensor(g, device=par.device), right=True))
        j, p = int(local[g]), int(par[g])
        why = "is out of range (expected -1 for a child of the root or a local node index)" if (
            p < -1 or p >= int(counts[b])) else "does not precede its child (parents must satisfy parents[j] < j)"
        raise ValueError(f"parents: node {j} of request {b} has parent {p}, which {why}")


def normalise_tree(parents, cu_nodes, prefix_len=None, *, validate: bool = True, check_parents: bool = True,
                   max_nodes=None, max_prefix=None):
    """Validate and normalise the batch layout.

    parents: int32/int64 [N] (local, -1 = child of the root, parents[j] < j) or None (every request a chain);
    cu_nodes: int32/int64 [B + 1] node offsets, or None (one request holding all N nodes; needs parents);
    prefix_len: int (every request) or integer tensor [B], or None.
    max_nodes, max_prefix: ints that fix n and P instead of reading them from the device (validate=True checks
    that no request is larger).
    Returns (parents int32 [N], cu_nodes int32 [B + 1], prefix_len int32 [B] or None, n, P) where n is the
    largest request (or max_nodes) and P the largest prefix (or max_prefix; 0 when prefix_len is None). Nothing is
    read back from the device when validate=False, parents is given, and n and P are known (given, or an int
    prefix_len).
    """
    if parents is None and cu_nodes is None:
        raise ValueError("parents and cu_nodes: at least one is required")
    for name, val in (("max_nodes", max_nodes), ("max_prefix", max_prefix)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 0):
            raise ValueError(f"{name}: expected None or an int >= 0, got {val!r}")
    device = next((x.device for x in (parents, cu_nodes, prefix_len) if isinstance(x, torch.Tensor)),
                  torch.device("cpu"))
    par = None if parents is None else _as_index_tensor(parents, "parents", device, validate=validate)
    if cu_nodes is None:
        cu_nodes = torch.arange(2, dtype=torch.int32, device=device) * par.numel()  # [0, N], no host copy
    cu = _as_index_tensor(cu_nodes, "cu_nodes", device, validate=validate)
    if cu.numel() < 1:
        raise ValueError("cu_nodes: expected B + 1 >= 1 offsets, got an empty tensor")
    B = cu.numel() - 1
    # the requests' sizes, where something reads them (a call that reads nothing back launches nothing for them)
    counts = cu[1:] - cu[:-1] if validate or max_nodes is None or par is None else None
    N = int(cu[-1]) if par is None else par.numel()
    if validate and bool((cu[0] != 0) | (counts < 0).any()):
        if int(cu[0]) != 0:
            raise ValueError(f"cu_nodes: must start at 0, got cu_nodes[0] = {int(cu[0])}")
        if B and bool((counts < 0).any()):
            b = int((counts < 0).nonzero()[0])
            raise ValueError(f"cu_nodes: offsets must be non-decreasing, got cu_nodes[{b}] = {int(cu[b])} > "
                             f"cu_nodes[{b + 1}] = {int(cu[b + 1])}")
    if validate and int(cu[-1]) != N:
        raise ValueError(f"parents: expected {int(cu[-1])} entries (cu_nodes[-1]), got {N}")
    n = max_nodes
    if n is None or validate:
        largest = int(counts.max()) if B else 0
        if n is not None and largest > n:
            raise ValueError(f"max_nodes: request sizes go up to {largest}, more than max_nodes = {n}")
        n = largest if n is None else n
    if par is None:
        local = torch.arange(N, device=device, dtype=torch.int32) - torch.repeat_interleave(
            cu[:-1], counts.long(), output_size=N)
        par = local - 1
    elif validate and check_parents:
        _check_parents(par, cu)
    plen, P = None, 0
    if prefix_len is not None:
        plen = _as_index_tensor(prefix_len, "prefix_len", device, length=B, validate=validate)
        if isinstance(prefix_len, int):
            if validate and prefix_len < 0:
                raise ValueError(f"prefix_len: must be >= 0, got {prefix_len}")
            P = prefix_len if max_prefix is None else max_prefix
            if validate and prefix_len > P:
                raise ValueError(f"max_prefix: prefix_len = {prefix_len} is more than max_prefix = {P}")
        elif max_prefix is not None and not validate:
            P = max_prefix
        else:
            lo, P = torch.stack(torch.aminmax(plen)).tolist() if B else (0, 0)  # one host sync for both
            if validate and lo < 0:
                raise ValueError(f"prefix_len: must be >= 0, got {plen.tolist()}")
            if max_prefix is not None:
                if P > max_prefix:
                    raise ValueError(f"max_prefix: prefix_len goes up to {P}, more than max_prefix = {max_prefix}")
                P = max_prefix
    return par, cu, plen, n, P


# ----------------------------------------------------------------------------------------------------------
# Public ops


def _check_prefix(prefix_len):
    # (None is normalise_tree's "no prefix", for the packed format's callers; a public op's mask needs one)
    if prefix_len is None:
        raise TypeError("prefix_len: expected an int or an integer tensor [B], got None")


def _check_format(format, dtype):
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    if format == "additive" and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype: the additive mask needs a floating dtype, got {dtype!r}")


def tree_mask(parents, cu_nodes=None, prefix_len=0, format: str = "bool", dtype: torch.dtype = torch.float32,
              backend: str = "auto", validate: bool = True, *, max_nodes=None, max_prefix=None) -> torch.Tensor:
    """Attention mask of B draft trees over their prefixes.

    parents int32/int64 [N] (local, -1 = child of the root; None = chains), cu_nodes int32 [B + 1] (None =
    one request), prefix_len int or integer tensor [B]. With n = largest request, P = max(prefix_len):

      "bool"      bool [B, n, P + n]; True where query node i sees key slot s: its prefix [0, prefix_len[b]),
                  its ancestors and itself at P + j.
      "additive"  [B, 1, n, P + n] in ``dtype``: 0 where visible, -inf elsewhere (Hugging Face 4D mask).
      "packed"    int32 [B, n, ceil(n / 32)]: the draft part only; bit j % 32 of word j // 32 (little-endian)
                  set iff node j is an ancestor of i or i (prefix visibility comes from prefix_len).

    Padding rows (i >= n_b) see only the prefix; padding columns are never visible.

    max_nodes / max_prefix fix n and P (fixed-shape outputs). With validate=False, parents given, and n and P
    known (given, or an int prefix_len), the call reads nothing back from the device (CUDA-graph capturable).
    max_nodes must cover the largest request: unvalidated, a smaller one is refused by the C++ kernels and cuts
    the request's rows on the GPU ones, never writing out of bounds. Likewise malformed offsets or parents
    (unvalidated) give unspecified results, never an access out of bounds nor an endless walk: the C++ kernels
    refuse them; the others read a parent that does not precede its node as the root, and a request whose offsets
    do not lie in order within [0, N) as empty (its nodes' positions -1).
    """
    _check_format(format, dtype)
    if format != "packed":
        _check_prefix(prefix_len)
    par, cu, plen, n, P = normalise_tree(parents, cu_nodes, prefix_len, validate=validate, check_parents=False,
                                         max_nodes=max_nodes, max_prefix=max_prefix)
    if format == "packed":
        return _call_tree_op("tree_mask_packed", backend, par, cu, validate, par, cu, n)
    if format == "bool":
        return _call_tree_op("tree_mask_bool", backend, par, cu, validate, par, cu, plen, n, P)
    return _call_tree_op("tree_mask_additive", backend, par, cu, validate, par, cu, plen, n, P, dtype)


def tree_positions(parents, cu_nodes=None, prefix_len=0, backend: str = "auto", validate: bool = True):
    """int64 [N]: position id of each draft node, prefix_len[b] + depth(j) - 1 (a child of the root has
    depth 1, so it takes position prefix_len[b], right after the last committed token). With validate=False
    and parents given, nothing is read back from the device."""
    _check_prefix(prefix_len)
    unread = {} if validate else dict(max_nodes=0, max_prefix=0)  # n and P are not needed here
    par, cu, plen, _, _ = normalise_tree(parents, cu_nodes, prefix_len, validate=validate, check_parents=False,
                                         **unread)
    return _call_tree_op("tree_positions", backend, par, cu, validate, par, cu, plen)


def _block_sizes(block_sizes, cu_nodes, prefix_len, validate):
    if cu_nodes is not None:
        if block_sizes is not None:
            raise ValueError("block_sizes and cu_nodes: give one of them, not both")
        cu = _as_index_tensor(cu_nodes, "cu_nodes", cu_nodes.device if isinstance(cu_nodes, torch.Tensor)
                              else torch.device("cpu"), validate=validate)
        return cu, (cu[1:] - cu[:-1])
    if block_sizes is None:
        raise ValueError("block_sizes: required (an int, or an integer tensor [B]) unless cu_nodes is given")
    if isinstance(block_sizes, int) and not isinstance(block_sizes, bool):
        if isinstance(prefix_len, torch.Tensor):
            B, device = prefix_len.numel(), prefix_len.device
        else:
            B, device = 1, torch.device("cpu")
        sizes = torch.full((B,), block_sizes, dtype=torch.int32, device=device)
    else:
        dev = block_sizes.device if isinstance(block_sizes, torch.Tensor) else torch.device("cpu")
        sizes = _as_index_tensor(block_sizes, "block_sizes", dev, validate=validate)
    if validate and sizes.numel() and bool((sizes < 0).any()):
        raise ValueError(f"block_sizes: must be >= 0, got {sizes.tolist()}")
    cu = torch.zeros(sizes.numel() + 1, dtype=torch.int32, device=sizes.device)
    cu[1:] = torch.cumsum(sizes, 0)
    return cu, sizes


def block_mask(block_sizes=None, prefix_len=0, kind: str = "causal", format: str = "bool",
               dtype: torch.dtype = torch.float32, *, cu_nodes=None, backend: str = "auto", validate: bool = True,
               max_nodes=None, max_prefix=None) -> torch.Tensor:
    """Attention mask of B blocks of draft positions after their prefixes (same formats as ``tree_mask``).

    block_sizes: int (every request drafts that many positions; B = len(prefix_len), or 1 for an int
    prefix_len) or integer tensor [B]; alternatively cu_nodes int32 [B + 1] (keyword).
    kind "causal": position i of the block sees the prefix, positions 0..i (Stern et al. 2018's blockwise
    parallel decoding: a chain, so this is ``tree_mask`` with parents j - 1 and runs on its kernels).
    kind "bidirectional": every block position sees the prefix and all positions of its block (GAD's
    non-autoregressive [MASK] block); built by a few vectorised torch comparisons on every backend (no
    per-node work to speed up).
    validate, max_nodes, max_prefix: as in ``tree_mask``; with validate=False, max_nodes given (or an int
    block_sizes) and P known, the bidirectional mask reads nothing back from the device; so does the causal one
    for an int block_sizes (ragged causal blocks need the node count: ``tree_mask`` with explicit parents).
    """
    if kind not in ("causal", "bidirectional"):
        raise ValueError(f"kind: expected 'causal' or 'bidirectional', got {kind!r}")
    _check_format(format, dtype)
    if format != "packed":
        _check_prefix(prefix_len)
    cu, sizes = _block_sizes(block_sizes, cu_nodes, prefix_len, validate)
    if max_nodes is None and isinstance(block_sizes, int) and not isinstance(block_sizes, bool):
        max_nodes = block_sizes
    if kind == "causal":
        parents = None
        if isinstance(block_sizes, int) and not isinstance(block_sizes, bool):  # chains known from the shapes
            parents = (torch.arange(block_sizes, dtype=torch.int32, device=cu.device) - 1).repeat(sizes.numel())
        return tree_mask(parents, cu, prefix_len, format=format, dtype=dtype, backend=backend, validate=validate,
                         max_nodes=max_nodes, max_prefix=max_prefix)
    n = max_nodes
    if n is None or validate:
        _, cu, plen, n, P = normalise_tree(None, cu, prefix_len, validate=validate, max_nodes=max_nodes,
                                           max_prefix=max_prefix)
    else:  # no parents to build: the node count N is not needed
        _, cu, plen, n, P = normalise_tree(torch.empty(0, dtype=torch.int32, device=cu.device), cu, prefix_len,
                                           validate=False, max_nodes=max_nodes, max_prefix=max_prefix)
    dispatch.resolve_backend(backend, cu.device)  # reject unusable backend names as the other ops do
    if format == "packed":
        i = torch.arange(n, device=cu.device)
        real = i[None, :] < sizes.long()[:, None]
        return ref.pack_bits(real[:, :, None] & real[:, None, :])
    visible = ref.block_mask_bool(sizes, plen, n, P, causal=False)
    if format == "bool":
        return visible
    zero = torch.zeros((), dtype=dtype, device=cu.device)
    return torch.where(visible, zero, torch.full((), float("-inf"), dtype=dtype, device=cu.device))[:, None]


# ----------------------------------------------------------------------------------------------------------
# Fake (meta) implementations of the compiled ops, for torch.compile and opcheck

if _ext.HAS_CPP:
    @torch.library.register_fake("fastverify::tree_mask_bool")
    def _tree_mask_bool_fake(parents, cu_nodes, prefix_len, n, P):
        return cu_nodes.new_empty((cu_nodes.shape[0] - 1, n, P + n), dtype=torch.bool)

    @torch.library.register_fake("fastverify::tree_mask_additive")
    def _tree_mask_additive_fake(parents, cu_nodes, prefix_len, n, P, dtype):
        return cu_nodes.new_empty((cu_nodes.shape[0] - 1, 1, n, P + n), dtype=dtype)

    @torch.library.register_fake("fastverify::tree_mask_packed")
    def _tree_mask_packed_fake(parents, cu_nodes, n):
        return cu_nodes.new_empty((cu_nodes.shape[0] - 1, n, (n + 31) // 32), dtype=torch.int32)

    @torch.library.register_fake("fastverify::tree_positions")
    def _tree_positions_fake(parents, cu_nodes, prefix_len):
        return parents.new_empty(parents.shape, dtype=torch.int64)
