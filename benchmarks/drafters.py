"""Drafter variants side by side in one process: the same questions, the order of the variants rotating per
question, every output asserted identical to the first variant's (every variant here decodes greedily, so all are
the model's own greedy output), with the loop's step statistics per variant. What tunes a drafter's options (the
heads' cost model, a checkpoint against another) on a machine whose speed drifts between runs.

    python benchmarks/drafters.py --per-category 1 --passes 2 ngram bpd+ngram bpd+ngram:node_cost=0.06
    python benchmarks/drafters.py --device cuda ngram bpd+ngram bpd+ngram:node_cost=0.03,heads=DIR

A variant is ``none`` (the loop without drafts), ``ngram``, ``bpd`` or ``bpd+ngram``, optionally followed by
``:key=value,...``: HeadsDrafter keyword arguments for bpd / bpd+ngram (node_cost, fixed_cost, width, frontier,
max_nodes, max_depth, ngram_confident, ...; ``heads=NAME_OR_DIR`` picks the checkpoint), NGramDrafter keyword
arguments for ngram; ``processors=False`` keeps the generate options of ``--generate`` (a repetition penalty) from
the drafter. The first variant is the reference of the speed ratios. Tune on the tuning questions only
(``--per-category 1``: question 1 of each category) and keep questions 2-6 for the protocol's runs.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import (DEFAULT_QUESTIONS, ROOT, _loop_stats, _sync, encode, first_difference,  # noqa: E402
                 heads_drafter, load_questions, machine_info, parse_options)

KINDS = ("none", "ngram", "bpd", "bpd+ngram")
FOUR_CATEGORIES = ["writing", "coding", "extraction", "translation"]  # four unlike ones (profile_step, op_count)


def _value(text):
    """An option's value: int, float, None / True / False, or the string itself (a checkpoint path)."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(text, text)


def parse_variant(spec):
    """'bpd+ngram:node_cost=0.06,heads=DIR' -> ('bpd+ngram', {'node_cost': 0.06, 'heads': 'DIR'})."""
    kind, _, opts = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"variant {spec!r}: expected one of {KINDS}, optionally followed by :key=value,...")
    options = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"variant {spec!r}: expected key=value options, got {item!r}")
        options[key] = _value(value)
    if kind == "none" and options:
        raise ValueError(f"variant {spec!r}: none (the loop without drafts) takes no options")
    if kind == "ngram" and "heads" in options:
        raise ValueError(f"variant {spec!r}: heads= applies to bpd / bpd+ngram")
    return kind, options


def make_drafter(model, kind, options):
    """A fresh drafter of the variant (fresh per generate, as patch users get)."""
    import fastverify
    opts = dict(options)
    told = opts.pop("processors", True)
    if kind == "none":
        drafter = fastverify.Drafter()
    elif kind == "ngram":
        drafter = fastverify.NGramDrafter(**opts)
    else:
        name = opts.pop("heads", "smollm2-bpd")
        drafter = heads_drafter(model, kind, None, {"heads": name, "options": opts})
    if not told:  # the drafter drafts as if generate had no logits processor
        drafter.set_processors = lambda **processors: None
    return drafter


def patched_generate(model, ids, variant, kind, options, max_new_tokens, generate_options=None):
    """One greedy generate of ``ids`` with a fresh drafter of the variant (``kind``, ``options``: parse_variant's)
    patched in: (output ids, seconds of the generate call alone, the loop's stats). RuntimeError when the patched
    generate fell back to the original one."""
    return generate_with(model, ids, make_drafter(model, kind, options), max_new_tokens, generate_options, variant)


def generate_with(model, ids, drafter, max_new_tokens, generate_options=None, name="drafter"):
    """One greedy generate of ``ids`` with ``drafter`` patched in: (output ids, seconds of the generate call alone,
    the loop's stats). RuntimeError naming ``name`` when the patched generate fell back to the original one."""
    import fastverify
    fastverify.patch(model, drafter=drafter)
    try:
        _sync(ids.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, **(generate_options or {}))
        _sync(ids.device)
        seconds = time.perf_counter() - t0
        stats = _loop_stats(model)
    finally:
        fastverify.unpatch(model)
    if stats is None:
        raise RuntimeError(f"{name}: the patched generate fell back to the original one (see its warning)")
    return out, seconds, stats


def run(model, tokenizer, questions, variants, max_new_tokens=128, passes=1, log=print, generate_options=None):
    """generate_options: more generate keyword arguments (a repetition penalty, ...). Per variant: seconds, steps,
    new tokens and the loop's phase times summed over every question and pass, and seconds per category. Raises
    AssertionError when a variant's output differs from the first variant's."""
    parsed = [parse_variant(v) for v in variants]
    totals = {v: {"seconds": 0.0, "steps": 0, "new_tokens": 0, "draft_s": 0.0, "forward_s": 0.0, "by_category": {}}
              for v in variants}
    for p in range(passes):
        for i, q in enumerate(questions):
            ids = encode(tokenizer, q["prompt"]).to(model.device)
            k = (i + p) % len(variants)
            outputs = {}
            for v in variants[k:] + variants[:k]:
                out, seconds, stats = patched_generate(model, ids, v, *parsed[variants.index(v)], max_new_tokens,
                                                       generate_options)
                outputs[v] = out[0, ids.shape[1]:].tolist()
                s = stats.summary()
                t = totals[v]
                t["seconds"] += seconds
                t["steps"] += s["steps"]
                t["new_tokens"] += len(outputs[v])
                t["draft_s"] += s["draft_s"]
                t["forward_s"] += s["forward_s"]
                t["by_category"][q["category"]] = t["by_category"].get(q["category"], 0.0) + seconds
            ref = outputs[variants[0]]
            for v in variants[1:]:
                if outputs[v] != ref:
                    raise AssertionError(f"{v}: output differs from {variants[0]}'s on question {q['question_id']} "
                                         f"({q['category']}) at new token {first_difference(outputs[v], ref)}")
        log(f"pass {p + 1} of {passes} done")
    return totals


def report(totals, variants):
    """The results as markdown lines."""
    base = totals[variants[0]]
    lines = ["| variant | seconds | steps | tokens per step | drafting ms per step | forward ms per step | "
             f"speed vs {variants[0]} |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in variants:
        t = totals[v]
        n = max(t["steps"], 1)
        lines.append(f"| {v} | {t['seconds']:.2f} | {t['steps']} | {t['new_tokens'] / n:.3f} | "
                     f"{1e3 * t['draft_s'] / n:.2f} | {1e3 * t['forward_s'] / n:.2f} | "
                     f"{base['seconds'] / t['seconds']:.3f}x |")
    for v in variants[1:]:
        by = totals[v]["by_category"]
        lines.append(f"- {v} vs {variants[0]} per category: " + ", ".join(
            f"{c} {base['by_category'][c] / s:.2f}x" for c, s in by.items()))
    return lines


def check_variants(parser, variants):
    """Each variant parsed; a malformed one ends the run with the parser's error."""
    for v in variants:
        try:
            parse_variant(v)
        except ValueError as e:
            parser.error(str(e))


def prepare(args, per_category, offset=0):
    """A run's setup from its arguments (threads, questions, dtype, device): (questions, model, tokenizer)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    from fastverify.models import load_smollm2
    path = args.questions if os.path.isabs(args.questions) else os.path.join(ROOT, args.questions)
    questions = load_questions(path, per_category=per_category, categories=args.categories, offset=offset)
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    return questions, model, tokenizer


def add_run_args(p, categories=None, categories_help="only these categories"):
    """The arguments ``prepare`` reads (--questions, --categories, --threads, --device, --dtype) and
    --max-new-tokens, on parser ``p``."""
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl (relative to the "
                   "repository root when not absolute)")
    p.add_argument("--categories", nargs="+", default=categories, help=categories_help)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", help="none | ngram | bpd | bpd+ngram, each optionally :key=value,... (above)")
    add_run_args(p)
    p.add_argument("--per-category", type=int, default=1, help="questions per category (default 1: the tuning ones)")
    p.add_argument("--offset", type=int, default=0, help="skip this many questions of each category first")
    p.add_argument("--passes", type=int, default=1, help="passes over the questions (the order rotates each pass)")
    p.add_argument("--out", help="write the totals as JSON to this file")
    p.add_argument("--generate", nargs="+", default=[], metavar="KEY=NUMBER",
                   help="more generate arguments for every variant, e.g. repetition_penalty=1.2")
    args = p.parse_args(argv)
    args.generate = parse_options(p, "--generate", args.generate)
    if len(set(args.variants)) != len(args.variants):
        p.error("variants: each at most once")
    check_variants(p, args.variants)
    if args.passes < 1 or args.per_category < 1 or args.offset < 0 or args.max_new_tokens < 1:
        p.error("--passes, --per-category and --max-new-tokens: expected >= 1; --offset: expected >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    questions, model, tokenizer = prepare(args, args.per_category, args.offset)
    info = machine_info()
    if model.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(model.device)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"{len(questions)} questions x {args.passes} passes, {args.max_new_tokens} new tokens, greedy, batch 1, "
          f"{args.dtype} on {model.device}" + "".join(f", {k}={v}" for k, v in args.generate.items()))
    t0 = time.perf_counter()
    totals = run(model, tokenizer, questions, args.variants, args.max_new_tokens, args.passes,
                 generate_options=args.generate)
    print(f"every output identical to {args.variants[0]}'s; {time.perf_counter() - t0:.0f} s")
    print("\n".join(report(totals, args.variants)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "totals": totals}, f, indent=1)
    return totals


if __name__ == "__main__":
    main()
