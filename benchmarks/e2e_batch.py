"""Batched end-to-end check: B mixed Spec-Bench questions per generate call (left padded), greedy, side by side.

Methods: plain ``generate`` (the reference), n-gram fastverify (``fastverify.patch(model)``), and the proposal-heads
drafters (bpd, bpd+ngram; checkpoint ``--heads``, default the shipped ``smollm2-bpd``), and the EAGLE drafters (eagle,
eagle+ngram; checkpoint folder ``--eagle``). Batches take one question
from each of B different categories in turn (mixed prompts), so requests finish and accept at different rates.
Reports per method: identical rows, tokens per request-step of the loop, tok/s (all requests' new tokens / wall
time), speedup over generate and over n-gram fastverify (geometric mean over batches); then the loop's figures per
decoding step (fastverify.hf.stats, summed over batches: steps, draft nodes of the whole batch, forward and
drafting milliseconds; the first step's forward, which runs the prompts, apart). Methods rotate per batch.
``--ngram`` / ``--bpd`` pass drafter options as in e2e.py (fresh drafters per generate call, as there).

  python benchmarks/e2e_batch.py --batch 4 --batches 4 --max-new-tokens 128
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import (DEFAULT_QUESTIONS, ROOT, _sync, heads_drafter, load_questions, machine_info,  # noqa: E402
                 parse_options)

METHODS = ["generate", "fastverify", "bpd", "bpd+ngram", "eagle", "eagle+ngram"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4, help="requests per generate call (mixed categories)")
    p.add_argument("--batches", type=int, default=4, help="generate calls per method")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--offset", type=int, default=0, help="skip the first OFFSET questions of each category")
    p.add_argument("--heads", default="smollm2-bpd", help="heads checkpoint of bpd / bpd+ngram: shipped name or folder")
    p.add_argument("--eagle", default=None, help="EAGLE checkpoint folder, for the methods eagle / eagle+ngram")
    p.add_argument("--methods", nargs="+", default=["generate", "fastverify", "bpd", "bpd+ngram"], choices=METHODS,
                   help="fastverify: the n-gram drafter; generate always runs (the reference)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the model's dtype")
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    p.add_argument("--ngram", nargs="+", default=[], metavar="KEY=NUMBER",
                   help="NGramDrafter arguments (fastverify and the n-gram drafter of the +ngram methods)")
    p.add_argument("--bpd", nargs="+", default=[], metavar="KEY=VALUE",
                   help="HeadsDrafter arguments of bpd / bpd+ngram, e.g. --bpd node_cost=0.08 agree=max")
    args = p.parse_args(argv)
    args.ngram = parse_options(p, "--ngram", args.ngram)
    args.bpd = parse_options(p, "--bpd", args.bpd, strings=True)
    for name in ("batch", "batches", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.offset < 0:
        p.error(f"--offset: expected >= 0, got {args.offset}")
    if "generate" not in args.methods:
        args.methods = ["generate"] + args.methods  # the reference every row is compared with
    if any(m.startswith("eagle") for m in args.methods) and not args.eagle:
        p.error("--eagle: the eagle methods need an EAGLE checkpoint folder (python -m fastverify.train eagle)")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    import fastverify
    from fastverify.models import load_smollm2

    info = machine_info()
    model, tok = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    qs = load_questions(os.path.normpath(os.path.join(ROOT, args.questions)), None, None, args.offset)
    by_cat = {}
    for q in qs:
        by_cat.setdefault(q["category"], []).append(q)
    cats = list(by_cat)
    # request k of the run: category k mod C, its question k div C (mixed categories in every batch)
    picks = [(cats[k % len(cats)], k // len(cats)) for k in range(args.batches * args.batch)]
    if not cats or any(i >= len(by_cat[c]) for c, i in picks):
        p.error(f"--batches x --batch: {args.batches} x {args.batch} requests, more than the question set has "
                f"after --offset {args.offset}")
    batches = [[by_cat[c][i] for c, i in picks[b * args.batch:(b + 1) * args.batch]] for b in range(args.batches)]

    def drafter(m):  # fresh per generate call, as e2e.py makes them
        if m == "fastverify":
            return fastverify.NGramDrafter(**args.ngram)
        return heads_drafter(model, m, args.ngram, {"heads": args.heads, "options": args.bpd, "eagle": args.eagle})

    tok.padding_side = "left"
    res = {m: {"seconds": [], "tokens": [], "identical": 0, "rows": 0, "tps": [], "loop": []} for m in args.methods}
    for i, qb in enumerate(batches):
        texts = [tok.apply_chat_template([{"role": "user", "content": q["prompt"]}], add_generation_prompt=True,
                                         tokenize=False) for q in qb]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        order = args.methods[i % len(args.methods):] + args.methods[:i % len(args.methods)]
        outs = {}
        for m in order:
            if m != "generate":
                fastverify.patch(model, drafter=drafter(m))
            try:
                _sync(model.device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
                _sync(model.device)
                dt = time.perf_counter() - t0
                st = fastverify.hf.stats(model) if m != "generate" else None
            finally:
                if m != "generate":
                    fastverify.unpatch(model)
            outs[m] = out
            new = out[:, enc["input_ids"].shape[1]:]
            ntok = int((new != tok.pad_token_id).sum()) + sum(1 for row in new.tolist() if tok.pad_token_id in row)
            res[m]["seconds"].append(dt)
            res[m]["tokens"].append(ntok)
            if st is not None:
                res[m]["tps"].append(st.tokens_per_step)
                res[m]["loop"].append((st.steps, st.drafted_tokens, st.time_forward, st.time_draft, st.time_prefill))
        for m in args.methods:
            same = (outs[m] == outs["generate"]).all(dim=1)
            res[m]["identical"] += int(same.sum())
            res[m]["rows"] += len(qb)
        print(f"batch {i + 1}/{len(batches)}: " + ", ".join(
            f"{m} {res[m]['tokens'][-1] / res[m]['seconds'][-1]:.1f} tok/s" for m in args.methods), flush=True)

    def geo(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else \
        f"{info['cpu']}, {info['cores']} cores, torch threads {info['torch_threads']}"
    print(f"\nmachine: {where}, {args.dtype}; batch {args.batch}, "
          f"{args.batches} batches of mixed categories, {args.max_new_tokens} new tokens, greedy")
    print("| method | identical rows | tokens per request-step | tok/s | vs generate | vs n-gram fastverify |")
    print("|---|---|---|---|---|---|")
    for m in args.methods:
        r = res[m]
        tps = sum(r["tokens"]) / sum(r["seconds"])
        rate = [t / s for t, s in zip(r["tokens"], r["seconds"])]
        base = [t / s for t, s in zip(res["generate"]["tokens"], res["generate"]["seconds"])]
        vs_g = geo([a / b for a, b in zip(rate, base)])
        if "fastverify" in res:
            fv = [t / s for t, s in zip(res["fastverify"]["tokens"], res["fastverify"]["seconds"])]
            vs_f = f"{geo([a / b for a, b in zip(rate, fv)]):.2f}x"
        else:
            vs_f = "-"
        step = f"{sum(r['tps']) / len(r['tps']):.2f}" if r["tps"] else "1.00"
        print(f"| {m} | {r['identical']}/{r['rows']} | {step} | {tps:.1f} | {vs_g:.2f}x | {vs_f} |")
    loops = [m for m in args.methods if res[m]["loop"]]
    if loops:
        print("\n| method | steps | draft nodes per step | forward ms per step | drafting ms per step | first step s |")
        print("|---|---|---|---|---|---|")
    for m in loops:
        steps, nodes, fwd, draft, first = (sum(x) for x in zip(*res[m]["loop"]))
        later = max(steps - len(res[m]["loop"]), 1)  # the steps after each batch's first
        print(f"| {m} | {steps} | {nodes / steps:.2f} | {1e3 * fwd / later:.2f} | {1e3 * draft / steps:.2f} | "
              f"{first:.2f} |")


if __name__ == "__main__":
    main()
