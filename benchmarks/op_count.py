"""The torch ops a patched generate's host code issues, per call of the loop's and drafters' functions: on a GPU
each op that computes is a kernel launch (or a copy) the host pays for, so on a machine without one this count is
what a change to that code is measured by. Ops are counted at torch's dispatcher (a TorchDispatchMode) over real
steps of SmolLM2, split into ops that compute (kernels on a GPU; a composite op such as logsumexp counts once here
and launches several kernels there) and ops that do not (views; conversions and reshapes that copy nothing).

    python benchmarks/op_count.py                     # bpd+ngram, the default functions
    python benchmarks/op_count.py --variant ngram --functions step_inputs _to_host

A function is ``step_inputs`` or ``_to_host`` (fastverify.hf.loop's), or a HeadsDrafter method (``_sequential_nodes``,
``_grow_level``, ``_top``, ``observe_hidden``), or ``_level``: one tree level on the fixed buffers of
``graphs=True`` (fastverify.hf.bpd._LevelGraphs), what a CUDA graph replays in one launch on a GPU (so there the host
issues ``_sequential_nodes``'s ops less these). Prints, per function, its calls and its ops per call by name.
"""

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafters import (FOUR_CATEGORIES, add_run_args, check_variants, parse_variant, patched_generate,  # noqa: E402
                      prepare)
from e2e import encode  # noqa: E402

# ops that launch nothing: views of a tensor's storage and bookkeeping
VIEWS = {"select", "slice", "view", "_unsafe_view", "expand", "alias", "t", "unsqueeze", "squeeze", "as_strided",
         "detach", "detach_", "resolve_conj", "resolve_neg", "lift_fresh", "split", "split_with_sizes", "unbind"}
LOOP_FUNCTIONS = ("step_inputs", "_to_host")
DRAFTER_FUNCTIONS = ("_sequential_nodes", "_grow_level", "_top", "observe_hidden")
GRAPH_FUNCTIONS = ("_level",)


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched inside it: ``computing`` and ``other`` (views, conversions that return their input),
    by op name."""

    def __init__(self):
        super().__init__()
        self.computing, self.other = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        idle = name in VIEWS or (name in ("to", "reshape", "contiguous") and _shares(out, args[0]))
        (self.other if idle else self.computing)[name] += 1
        return out


def _shares(out, x) -> bool:
    """Whether ``out`` is ``x``'s storage (a conversion or reshape that copied nothing)."""
    return (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)
            and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())


def count_ops(model, tokenizer, questions, variant, functions, max_new_tokens):
    """{function: (calls, computing ops Counter, other ops Counter)} over patched greedy generates of ``questions``
    with a fresh drafter of ``variant`` each (the functions' ops only: each call counted in a mode of its own)."""
    import fastverify.hf.loop as loop
    from fastverify.hf.bpd import HeadsDrafter, _LevelGraphs
    kind, options = parse_variant(variant)
    owners = {f: loop if f in LOOP_FUNCTIONS else _LevelGraphs if f in GRAPH_FUNCTIONS else HeadsDrafter
              for f in functions}
    found = {f: owners[f].__dict__[f] for f in functions}
    counts = {f: [0, collections.Counter(), collections.Counter()] for f in functions}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            with OpCounter() as mode:
                out = fn(*args, **kwargs)
            c = counts[name]
            c[0] += 1
            c[1].update(mode.computing)
            c[2].update(mode.other)
            return out
        return wrapper

    for f, fn in found.items():
        setattr(owners[f], f, counted(f, fn))
    try:
        for q in questions:
            patched_generate(model, encode(tokenizer, q["prompt"]).to(model.device), variant, kind, options,
                             max_new_tokens)
    finally:
        for f, fn in found.items():
            setattr(owners[f], f, fn)
    return {f: tuple(c) for f, c in counts.items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="bpd+ngram", help="a drafter variant, as benchmarks/drafters.py takes it")
    p.add_argument("--functions", nargs="+", default=list(LOOP_FUNCTIONS + DRAFTER_FUNCTIONS[:2]),
                   choices=LOOP_FUNCTIONS + DRAFTER_FUNCTIONS + GRAPH_FUNCTIONS)
    add_run_args(p, FOUR_CATEGORIES, "question 1 of each of these categories (default: four unlike ones)")
    args = p.parse_args(argv)
    check_variants(p, [args.variant])
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens: expected >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    questions, model, tokenizer = prepare(args, 1)
    counts = count_ops(model, tokenizer, questions, args.variant, args.functions, args.max_new_tokens)
    print(f"{args.variant}, {len(questions)} questions, {args.max_new_tokens} new tokens, {args.dtype} on "
          f"{model.device}: torch ops per call")
    for f, (calls, computing, other) in counts.items():
        per = max(calls, 1)
        print(f"{f}: {calls} calls; {sum(computing.values()) / per:.1f} computing, {sum(other.values()) / per:.1f} "
              f"other")
        print("  computing: " + ", ".join(f"{k} {v / per:.2f}" for k, v in computing.most_common()))
        print("  other:     " + ", ".join(f"{k} {v / per:.2f}" for k, v in other.most_common()))


if __name__ == "__main__":
    main()
