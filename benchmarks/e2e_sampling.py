"""End-to-end sampling benchmark: seeded sampling through fastverify's drafters on SmolLM2-135M-Instruct, side by side.

Every method samples the same Spec-Bench questions with the same seed and settings (default T = 0.7, top-k 50,
top-p 0.95: the settings the shipped PTP drafter was trained for):

  generate     plain Hugging Face ``generate(do_sample=True)`` (its own random stream: the time reference)
  ar           fastverify's loop with a drafter that proposes nothing: seeded autoregressive sampling, the
               reference every drafter's output must equal token for token
  ngram        fastverify.patch(model) (NGramDrafter), rule coupled
  bpd          the shipped proposal heads (smollm2-bpd), rule coupled
  bpd+ngram    the heads' tree and the n-gram trie merged into one tree
  ptp          a PTP slot drafter (``--ptp``, default the shipped smollm2-ptp; ``--ptp-option KEY=V`` for its
               options, e.g. tree_topk=2 or attach=last), rule coupled
  ptp+ngram    the PTP block's chain and the n-gram trie merged into one tree
  ptp+bpd+ngram  the PTP block's chain, the heads' tree and the n-gram trie merged into one tree
  ptp-none     a second slot checkpoint (``--ptp-none``: the same slots trained without auxiliary variables),
               drafting each slot's argmax

Reports per method: outputs identical to ``ar``, tokens per target forward (prefill included), tokens per
decoding step, tok/s, and the speedup over ``generate`` and over ``ngram`` (geometric mean over questions).
Methods rotate per question. Each patched method runs on its own copy of the model, patched once for the run and
called once untimed before the first question: a patch's one-time work (the first sampled call's row check) is
not timed.

Where the loop's rows are not row-invariant (on a GPU, whose GEMMs round by the number of rows; half precision),
the patched model's first sampled call finds it (fastverify.hf.probe.check_rows) and its sampled calls decode
without drafts, exact, at 1.00 tokens per step; ``--patch-option invariant_sampling=false`` drafts anyway (the
tokens may then part from ``ar``'s at a near-tie). Run both to see what each costs there.

  python benchmarks/e2e_sampling.py --per-category 1 --methods generate ar ngram bpd ptp
  python benchmarks/e2e_sampling.py --device cuda --methods generate ar ngram bpd+ngram \
      --patch-option invariant_sampling=false
"""

import argparse
import copy
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import DEFAULT_QUESTIONS, OUT_DIR, ROOT, ForwardCounter, encode, load_questions, machine_info  # noqa: E402

METHODS = ("generate", "ar", "ngram", "bpd", "bpd+ngram", "ptp", "ptp+ngram", "ptp+bpd+ngram", "ptp-none")


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", default=os.path.join(ROOT, DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--per-category", type=int, default=1, help="questions per category (0: all)")
    p.add_argument("--offset", type=int, default=0, help="skip the first OFFSET questions of each category")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per question")
    p.add_argument("--methods", nargs="+", default=["generate", "ar", "ngram", "bpd", "ptp"], choices=METHODS,
                   help="the methods above")
    p.add_argument("--ptp", default="smollm2-ptp", help="PTP checkpoint: shipped name or folder")
    p.add_argument("--ptp-option", nargs="*", default=[], metavar="KEY=V",
                   help="PTPSlotDrafter options for ptp and ptp+ngram (tree_topk=2, attach=last, first_gate=1)")
    p.add_argument("--ptp-none", default=None, help="checkpoint of the baseline slots without auxiliary input")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (> 0)")
    p.add_argument("--top-k", type=int, default=50, help="sampling top-k (0: off)")
    p.add_argument("--top-p", type=float, default=0.95, help="sampling top-p (1: off)")
    p.add_argument("--seed", type=int, default=0, help="question i samples with seed SEED + i")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the model's dtype")
    p.add_argument("--patch-option", nargs="*", default=[], metavar="KEY=V",
                   help="fastverify.patch options for every patched method (invariant_sampling=false)")
    p.add_argument("--out", default=os.path.join(OUT_DIR, "e2e_sampling.json"), help="JSON of every record")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.per_category < 0 or args.offset < 0:
        p.error(f"--max-new-tokens, --per-category, --offset: expected >= 1, >= 0, >= 0, got {args.max_new_tokens}, "
                f"{args.per_category}, {args.offset}")
    if not args.temperature > 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        p.error(f"--temperature, --top-k, --top-p: expected > 0, >= 0, in (0, 1], got {args.temperature}, "
                f"{args.top_k}, {args.top_p}")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    import fastverify
    from fastverify.models import load_smollm2

    patch_options = {}
    for a in args.patch_option:
        key, sep, value = a.partition("=")
        if not sep or value.lower() not in ("true", "false"):
            p.error(f"--patch-option: expected KEY=true or KEY=false, got {a!r}")
        patch_options[key] = value.lower() == "true"
    info = machine_info()
    model, tok = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    qs = load_questions(args.questions, args.per_category or None, None, args.offset)
    ptp_options = {}
    for a in args.ptp_option:
        key, _, value = a.partition("=")
        ptp_options[key] = int(value) if value.lstrip("-").isdigit() else value

    def make_drafter(m, target):
        if m == "ngram":
            return fastverify.NGramDrafter()
        if m in ("bpd", "bpd+ngram"):
            return fastverify.load_drafter("smollm2-bpd", target, ngram=m.endswith("+ngram"))
        if m in ("ptp", "ptp+ngram", "ptp+bpd+ngram"):
            return fastverify.load_drafter(args.ptp, target, ngram=m.endswith("+ngram"),
                                           heads="smollm2-bpd" if "+bpd" in m else None, **ptp_options)
        if m == "ptp-none":
            if not args.ptp_none:
                p.error("--methods ptp-none needs --ptp-none CHECKPOINT")
            # its argmax: the better of its two draft rules on held-out data (fastverify.train.ptp's evaluation)
            return fastverify.load_drafter(args.ptp_none, target, draft="argmax")
        return fastverify.Drafter()  # ar

    warp = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    # Each patched method samples with a copy of the model patched once for the whole run, so that what a patch
    # does once (the first sampled call's row check, fastverify.hf.probe.check_rows) is not timed again at every
    # question; one untimed call per method does it before the first question.
    models, counters = {}, {}
    for m in args.methods:
        target = model if m == "generate" else copy.deepcopy(model)
        if m != "generate":
            fastverify.patch(target, drafter=make_drafter(m, target), **patch_options)
        models[m], counters[m] = target, ForwardCounter(target)
    warm = encode(tok, qs[0]["prompt"]).to(model.device)
    with torch.inference_mode():
        for m, target in models.items():
            torch.manual_seed(args.seed)
            seeded = {} if m == "generate" else {"seed": args.seed}
            target.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=True, **warp,
                            **seeded)
    rec = {m: {"seconds": [], "tokens": [], "forwards": [], "steps": [], "identical": 0, "out": []}
           for m in args.methods}
    for i, q in enumerate(qs):
        ids = encode(tok, q["prompt"]).to(model.device)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=True, **warp)
        order = args.methods[i % len(args.methods):] + args.methods[:i % len(args.methods)]
        outs = {}
        for m in order:
            target, counter = models[m], counters[m]
            counter.count = 0
            t0 = time.perf_counter()
            with torch.inference_mode():
                if m == "generate":
                    torch.manual_seed(args.seed + i)
                    out = target.generate(ids, **kw)
                else:
                    out = target.generate(ids, seed=args.seed + i, **kw)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            dt = time.perf_counter() - t0
            st = fastverify.hf.stats(target) if m != "generate" else None
            new = out[0, ids.shape[1]:].tolist()
            outs[m] = new
            r = rec[m]
            r["seconds"].append(dt)
            r["tokens"].append(len(new))
            r["forwards"].append(counter.count)
            r["steps"].append(st.steps if st is not None else None)
        for m in args.methods:
            if "ar" in outs and m != "generate":
                rec[m]["identical"] += outs[m] == outs["ar"]
        line = " ".join(f"{m} {rec[m]['tokens'][-1] / rec[m]['seconds'][-1]:.1f}" for m in args.methods)
        print(f"[{i + 1}/{len(qs)}] {q['category']}: tok/s {line}", flush=True)
    for m, target in models.items():
        counters[m].close()
        if m != "generate":
            fastverify.unpatch(target)

    summary = {}
    for m in args.methods:
        r = rec[m]
        row = {"tok_per_fwd": sum(r["tokens"]) / max(1, sum(r["forwards"])),
               "tok_per_s": sum(r["tokens"]) / sum(r["seconds"]), "new_tokens": sum(r["tokens"])}
        if m != "generate":
            row["identical_to_ar"] = f"{r['identical']}/{len(qs)}" if "ar" in rec else "n/a"
            row["tok_per_step"] = sum(r["tokens"]) / max(1, sum(s for s in r["steps"] if s))
        for base in ("generate", "ngram"):
            if base in rec and base != m:
                row[f"speedup_vs_{base}"] = geomean([(a / s) / (b / t) for a, s, b, t in zip(
                    r["tokens"], r["seconds"], rec[base]["tokens"], rec[base]["seconds"]) if a and b])
        summary[m] = row
    head = ["method", "identical to ar", "tok/fwd", "tok/step", "tok/s", "x generate", "x ngram"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for m, row in summary.items():
        cells = [m, row.get("identical_to_ar", "-"), f"{row['tok_per_fwd']:.2f}",
                 f"{row['tok_per_step']:.2f}" if "tok_per_step" in row else "-", f"{row['tok_per_s']:.1f}",
                 f"{row['speedup_vs_generate']:.2f}x" if "speedup_vs_generate" in row else "-",
                 f"{row['speedup_vs_ngram']:.2f}x" if "speedup_vs_ngram" in row else "-"]
        print("| " + " | ".join(cells) + " |")
    print(f"{len(qs)} questions, max_new_tokens {args.max_new_tokens}, {warp}, seed {args.seed}, {args.device} "
          f"{args.dtype}, patch options {patch_options or 'none'}; {info}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": info, "summary": summary, "records": rec}, f, indent=1)


if __name__ == "__main__":
    main()
