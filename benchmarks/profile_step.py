"""Where a patched generate's host time goes, per drafter variant: the Python functions (cProfile, over a few
questions after one warm-up call) and the torch ops (torch.profiler, over one short call: each op's host time, and on
a GPU its device time). What a change to the loop's or a drafter's host work is measured against, on the CPU and
where a GPU is lent.

    python benchmarks/profile_step.py ngram bpd+ngram
    python benchmarks/profile_step.py --device cuda --questions Q.jsonl --out-dir OUT ngram bpd+ngram

A variant is one of benchmarks/drafters.py's (``ngram``, ``bpd+ngram:node_cost=0.11``, ...). Writes, per variant,
<out-dir>/profile_<variant>.log: the loop's phases per step, the top functions of fastverify by own time and by
cumulative time, and the top torch ops by host time; prints the phases and the ten costliest functions. Profiling
slows the calls down, so its times are for attribution only, never for speed: speed is benchmarks/e2e.py's.
"""

import argparse
import cProfile
import io
import os
import pstats
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafters import (FOUR_CATEGORIES, add_run_args, check_variants, parse_variant, patched_generate,  # noqa: E402
                      prepare)
from e2e import ROOT, encode  # noqa: E402


def profile_variant(model, tokenizer, questions, variant, max_new_tokens, torch_tokens):
    """(phases per step in ms, steps, cProfile stats, torch.profiler table) of a variant: cProfile over every
    question, then torch.profiler over question 1's first ``torch_tokens`` new tokens (0: none), after a warm-up
    call. The two passes are apart: torch.profiler's events (with a GPU's, each kernel's) over a long run took
    minutes to summarise, and its overhead would land in cProfile's figures."""
    from torch.profiler import ProfilerActivity, profile
    kind, options = parse_variant(variant)
    ids = [encode(tokenizer, q["prompt"]).to(model.device) for q in questions]
    totals, steps = {}, 0

    def call(x, tokens=max_new_tokens):
        return patched_generate(model, x, variant, kind, options, tokens)[2]

    start = time.perf_counter()
    call(ids[0])  # warm-up: first calls load kernels and fill caches
    prof = cProfile.Profile()
    for x in ids:
        prof.enable()
        s = call(x).summary()
        prof.disable()
        steps += s["steps"]
        for k, v in s.items():
            if k.endswith("_s") and k != "prefill_s":
                totals[k] = totals.get(k, 0.0) + v
    _progress(f"{variant}: warm-up and cProfile over {len(ids)} questions", start)
    phases = {k[:-2]: 1e3 * v / max(steps, 1) for k, v in totals.items()}
    table = ""
    if torch_tokens:
        start = time.perf_counter()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
        with profile(activities=activities) as tp:
            call(ids[0], torch_tokens)
        sort = "self_cuda_time_total" if model.device.type == "cuda" else "self_cpu_time_total"
        table = tp.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60)
        _progress(f"{variant}: torch.profiler over {torch_tokens} new tokens of question 1", start)
    return phases, steps, prof, table


def _progress(what, start):
    print(f"  {what}: {time.perf_counter() - start:.1f} s", flush=True)


def top_functions(prof, key, n, pattern=r"fastverify"):
    """The top ``n`` functions of files matching ``pattern``, by ``key`` (tottime / cumulative), as text."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(pattern, n)
    text = out.getvalue()
    return text[text.index("   ncalls"):] if "   ncalls" in text else text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", help="drafter variants, as benchmarks/drafters.py takes them")
    add_run_args(p, FOUR_CATEGORIES, "question 1 of each of these categories (default: four unlike ones)")
    p.add_argument("--torch-tokens", type=int, default=32, help="new tokens of the torch.profiler call (question 1; "
                   "0: none)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "out"))
    args = p.parse_args(argv)
    check_variants(p, args.variants)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens: expected >= 1")
    if args.torch_tokens < 0:
        p.error("--torch-tokens: expected >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    questions, model, tokenizer = prepare(args, 1)
    os.makedirs(args.out_dir, exist_ok=True)
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    print(f"{len(questions)} questions ({', '.join(q['category'] for q in questions)}), {args.max_new_tokens} new "
          f"tokens, greedy, batch 1, {args.dtype} on {where}")
    for variant in args.variants:
        phases, steps, prof, table = profile_variant(model, tokenizer, questions, variant, args.max_new_tokens,
                                                     args.torch_tokens)
        line = f"{variant}: {steps} steps; ms per step (profiled): " + ", ".join(
            f"{k} {v:.3f}" for k, v in phases.items())
        print(line)
        print(top_functions(prof, "tottime", 10))
        name = re.sub(r"[^A-Za-z0-9_.+=-]", "_", variant)
        with open(os.path.join(args.out_dir, f"profile_{name}.log"), "w") as f:
            f.write(line + "\n\nfastverify functions by own time\n" + top_functions(prof, "tottime", 40))
            f.write("\nfastverify functions by cumulative time\n" + top_functions(prof, "cumulative", 40))
            if table:
                f.write(f"\ntorch ops (question 1, {args.torch_tokens} new tokens)\n" + table + "\n")


if __name__ == "__main__":
    main()
