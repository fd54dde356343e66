"""The proposal heads' tree alone (``HeadsDrafter._sequential_nodes``: every level's heads and the host's choice of the
nodes to expand), its levels launched op by op (``graphs=False``) against the same levels over fixed buffers
(``graphs=True``: on a GPU each depth's level a CUDA graph, replayed; on a CPU the buffers run eagerly), side by side
on the same calls. The calls are recorded from patched greedy generates of SmolLM2 with the shipped heads merged
with the n-gram drafter (the hidden rows handed to the heads, the contexts and budgets), then replayed to a fresh
drafter per variant, each call timed to its nodes on the host (a level's candidates reach the host before the next
level, so nothing is left in flight).

    python benchmarks/heads_levels.py                    # the four unlike categories' question 1, on the CPU
    python benchmarks/heads_levels.py --device cuda      # on a GPU: eager against captured levels

Prints, per variant, ms per call and per level, levels per call, and whether each call's nodes equal the first
variant's (the same paths; estimates within float32's precision).
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafters import FOUR_CATEGORIES, add_run_args, patched_generate, prepare  # noqa: E402
from e2e import encode, heads_drafter  # noqa: E402


def record_calls(model, tokenizer, questions, max_new_tokens, node_cost):
    """[(contexts, budgets, drafting, hidden rows)] of every ``_sequential_nodes`` call with a drafting request in
    patched greedy generates of ``questions`` (bpd+ngram, the given node cost; None: the device's default)."""
    from fastverify.hf.bpd import HeadsDrafter
    calls = []
    level_calls = HeadsDrafter._sequential_nodes

    def recorded(self, contexts, buds, drafting):
        if any(bud > 0 and c is not None for bud, c in zip(buds, self.candidates)):
            calls.append(([list(c) for c in contexts], list(buds), drafting,
                          [None if c is None else c.clone() for c in self.candidates]))
        return level_calls(self, contexts, buds, drafting)

    HeadsDrafter._sequential_nodes = recorded
    options = {} if node_cost is None else {"node_cost": node_cost}
    try:
        for q in questions:
            patched_generate(model, encode(tokenizer, q["prompt"]).to(model.device), "bpd+ngram", "bpd+ngram",
                             options, max_new_tokens)
    finally:
        HeadsDrafter._sequential_nodes = level_calls
    return calls


def replay(drafter, calls, passes):
    """(seconds per call, levels per call, each call's nodes) of ``drafter`` over the recorded calls, ``passes`` times
    after one untimed pass (in which a depth used three times is captured on a GPU)."""
    levels = [0]
    from_host = drafter._from_host

    def counted(both):  # each level's candidates reach the host once, by either path
        levels[0] += 1
        return from_host(both)

    drafter._from_host = counted
    nodes, elapsed = [], 0.0
    with torch.no_grad():
        for p in range(passes + 1):
            levels[0] = 0
            start = time.perf_counter()
            for contexts, buds, drafting, hidden in calls:
                drafter.reset(len(contexts))
                drafter.candidates = list(hidden)
                out = drafter._sequential_nodes(contexts, buds, drafting)
                if p == 0:
                    nodes.append(out)
            if p:
                elapsed += time.perf_counter() - start
    n = max(len(calls), 1)
    return elapsed / (passes * n), levels[0] / n, nodes


def same_nodes(a, b) -> bool:
    """The same paths, request by request, with estimates within float32's precision."""
    return len(a) == len(b) and all(
        [p for p, _ in ra] == [p for p, _ in rb] and all(math.isclose(x, y, rel_tol=1e-5) for (_, x), (_, y) in
                                                      zip(ra, rb)) for ra, rb in zip(a, b))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, FOUR_CATEGORIES, "question 1 of each of these categories (default: four unlike ones)")
    p.add_argument("--node-cost", type=float, default=None,
                   help="the drafter's node cost (default: the device's, fastverify.hf.drafters.GPU_NODE_COST on a GPU)")
    p.add_argument("--passes", type=int, default=3, help="timed passes over the recorded calls")
    args = p.parse_args(argv)
    if args.passes < 1 or args.max_new_tokens < 1:
        p.error("--passes, --max-new-tokens: expected >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    questions, model, tokenizer = prepare(args, 1)
    calls = record_calls(model, tokenizer, questions, args.max_new_tokens, args.node_cost)
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    print(f"{len(calls)} drafting calls of the heads recorded from {len(questions)} questions ({args.max_new_tokens} "
          f"new tokens, bpd+ngram, node cost {args.node_cost if args.node_cost is not None else 'default'}), "
          f"replayed on {where}, {args.passes} timed passes")
    print("| levels | ms per call | levels per call | ms per level | nodes as graphs=False's |")
    print("| --- | --- | --- | --- | --- |")
    first = None
    for graphs in (False, True):
        options = {} if args.node_cost is None else {"node_cost": args.node_cost}
        drafter = heads_drafter(model, "bpd+ngram", None, {"options": dict(options, graphs=graphs)})
        drafter.set_device(model.device)
        seconds, levels, nodes = replay(drafter, calls, args.passes)
        first = nodes if first is None else first
        same = sum(same_nodes(a, b) for a, b in zip(nodes, first))
        name = "graphs=False (op by op)" if not graphs else (
            "graphs=True (CUDA graphs)" if model.device.type == "cuda" else "graphs=True (buffers, eager)")
        print(f"| {name} | {1e3 * seconds:.3f} | {levels:.2f} | {1e3 * seconds / max(levels, 1e-9):.3f} | "
              f"{same}/{len(nodes)} |")


if __name__ == "__main__":
    main()
