"""Wall time of small op calls on CPU tensors, where the Python wrapper (argument checks, normalisation, backend
choice) costs as much as the kernel: the overhead a decoding step pays per call.

  python benchmarks/wrapper_overhead.py [--repeat 7] [--number 500] [--threads 1] [--cpu-time] [-k TEXT]

Prints one line per call: the best of --repeat runs of --number calls, in microseconds per call. The best (not
the mean) because other processes on the machine only ever add time. --cpu-time counts the process's CPU time
instead of wall time: on a machine shared with other jobs it leaves out the time spent waiting for a core.

For each call the script also times the compiled ops the wrapper ends in (torch.ops.fastverify.*, called with
the arguments the wrapper built, captured once) and prints the difference: the Python the wrapper adds per call
(argument checks, normalisation, backend choice, and the small torch ops that build the seeded uniforms' indices).
"""

import argparse
import time
import timeit

import torch


def cases():
    import fastverify as fv

    g = torch.Generator().manual_seed(0)
    B, K, V = 4, 8, 16
    logits = torch.randn(B, K + 1, V, generator=g)
    draft = torch.randint(0, V, (B, K), generator=g)
    seed = torch.arange(B, dtype=torch.int64)
    position = torch.full((B,), 100, dtype=torch.int64)
    row = torch.randn(1, 32000, generator=g)
    u = torch.full((1,), 0.3)
    token = torch.tensor([5])
    parents = torch.tensor([-1, 0, 0, 1, 1, -1, 0, 1], dtype=torch.int32)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    pos8 = torch.arange(8, dtype=torch.int64)
    tiny = torch.randn(2, 16, generator=g)
    u2 = torch.full((2,), 0.3)
    k2, p2 = torch.tensor([5.0, 3.0]), torch.tensor([0.9, 0.8])
    return {
        "verify greedy (B 4, K 8, V 16)": lambda: fv.verify(logits, draft),
        "verify greedy, validate=False": lambda: fv.verify(logits, draft, validate=False),
        "verify gad, validate=False": lambda: fv.verify(logits, draft, rule="gad", beta=3, tau=2.0, validate=False),
        "verify speculative, seed + position": lambda: fv.verify(logits, draft, rule="speculative", seed=seed,
                                                                 position=position),
        "verify coupled, seed + position, validate=False": lambda: fv.verify(
            logits, draft, rule="coupled", seed=seed, position=position, validate=False),
        "verify speculative, seed + position, validate=False": lambda: fv.verify(
            logits, draft, rule="speculative", seed=seed, position=position, validate=False),
        "cdf_sample (2, 16), validate=False": lambda: fv.cdf_sample(tiny, u2, validate=False),
        "cdf_sample (2, 16), tensor top_k / top_p, validate=False": lambda: fv.cdf_sample(
            tiny, u2, top_k=k2, top_p=p2, validate=False),
        "cdf_sample (1, 32000)": lambda: fv.cdf_sample(row, u),
        "cdf_sample (1, 32000), top_k 50, top_p 0.9": lambda: fv.cdf_sample(row, u, top_k=50, top_p=0.9),
        "cdf_invert (1, 32000)": lambda: fv.cdf_invert(row, token, u),
        "uniform, 8 positions": lambda: fv.uniform(7, pos8),
        "tree_mask bool (2 trees, 8 nodes, prefix 4)": lambda: fv.tree_mask(parents, cu, 4),
        "tree_mask packed (2 trees, 8 nodes)": lambda: fv.tree_mask(parents, cu, 0, format="packed"),
        "tree_positions (2 trees, 8 nodes)": lambda: fv.tree_positions(parents, cu, 4),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-time", action="store_true", help="time.process_time instead of wall time")
    ap.add_argument("-k", dest="only", default="", help="only the calls whose name contains this text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    timer = time.process_time if args.cpu_time else time.perf_counter

    def best(fn):
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeat, timer=timer)) / args.number * 1e6

    print(f"{'call':58s} {'total us':>9s} {'ops us':>8s} {'python us':>10s}")
    for name, fn in cases().items():
        if args.only not in name:
            continue
        fn()  # first call: imports, backend resolution
        ops = captured_ops(fn)
        total, alone = best(fn), best(lambda: [op(*a) for op, a in ops])
        print(f"{name:58s} {total:9.1f} {alone:8.1f} {total - alone:10.1f}")


def captured_ops(fn):
    """[(op, args)] of the compiled-op calls one call of ``fn`` makes, in order (through fastverify's dispatch)."""
    from fastverify.ops import dispatch

    calls, real = [], dispatch.call

    def spy(op, backend, device, *a):
        calls.append((dispatch._lookup(op, backend, device)[1], a))
        return real(op, backend, device, *a)

    dispatch.call = spy
    try:
        fn()
    finally:
        dispatch.call = real
    return calls


if __name__ == "__main__":
    main()
