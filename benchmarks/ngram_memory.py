"""The n-gram drafter's memory of earlier calls (``NGramDrafter(memory=N)``) against a fresh drafter per call: the
questions in file order, then the same questions again (a prompt asked again), the two drafters alternating first
per question, every output asserted identical.

    python benchmarks/ngram_memory.py --per-category 3 --threads 2
    python benchmarks/ngram_memory.py --per-category 1 --drafter bpd+ngram    # the heads' n-gram drafter remembers
    python benchmarks/ngram_memory.py --remember DIR    # its memory first given the target's outputs on other prompts

One drafter with a memory serves the whole run, as it serves every generate of a model patched with it; the fresh
one is made for each call, as ``fastverify.patch(model)``'s default drafter knows nothing of earlier calls. With
``--drafter bpd+ngram`` both are the shipped proposal heads merged with an n-gram drafter, one with a memory. With
``--remember DIR`` the memory is given a corpus before the first question (``NGramDrafter.remember``): the target's
greedy continuations of other prompts, as ``python -m fastverify.train heads --data-only --data-dir DIR`` caches them
(ShareGPT prompts, those sharing a word 8-gram with Spec-Bench dropped).
"""

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafters import add_run_args, generate_with, prepare  # noqa: E402
from e2e import encode, first_difference, heads_drafter, machine_info  # noqa: E402

DRAFTERS = ("fresh", "memory")


def generate(model, ids, drafter, max_new_tokens):
    """(new tokens, seconds, steps) of one greedy generate of ``model`` patched with ``drafter``."""
    out, seconds, stats = generate_with(model, ids, drafter, max_new_tokens)
    return out[0, ids.shape[1]:].tolist(), seconds, stats.steps


def make(model, kind, memory=0):
    """A drafter of ``kind`` (ngram, bpd+ngram) whose n-gram drafter keeps ``memory`` tokens of earlier calls."""
    import fastverify
    if kind == "ngram":
        return fastverify.NGramDrafter(memory=memory)
    return heads_drafter(model, kind, {"memory": memory})


def corpus(folder):
    """The greedy continuations cached by the heads' data stage under ``folder`` (its train/ shards, or the shards
    in ``folder`` itself): a list of token id lists."""
    import torch
    paths = sorted(glob.glob(os.path.join(folder, "train", "shard_*.pt"))) or sorted(
        glob.glob(os.path.join(folder, "shard_*.pt")))
    if not paths:
        raise FileNotFoundError(f"--remember: no shard_*.pt under {folder!r} or its train/ folder (written by "
                                f"python -m fastverify.train heads --data-only --data-dir {folder})")
    seqs = []
    for path in paths:
        shard = torch.load(path)
        seqs += [t[:int(n)].tolist() for t, n in zip(shard["tokens"], shard["lengths"])]
    return seqs


def run(model, tokenizer, questions, memory, max_new_tokens, log=print, kind="ngram", remember=None):
    """Per pass (the questions, then the same again), per drafter: [steps, new tokens, seconds]; the tokens the
    memory held at the end. remember: token sequences given to the memory before the first question."""
    import fastverify
    remembering = make(model, kind, memory)
    memory_of = remembering if kind == "ngram" else remembering.ngram  # the n-gram drafter that keeps the memory
    if remember:
        memory_of.remember(remember)
    ids = [encode(tokenizer, q["prompt"]).to(model.device) for q in questions]
    generate(model, ids[0][:, :8], fastverify.NGramDrafter(), 8)  # warm-up: first calls load kernels
    passes = []
    for p in range(2):
        totals = {d: [0, 0, 0.0] for d in DRAFTERS}
        for i, (q, x) in enumerate(zip(questions, ids)):
            outputs = {}
            for d in (DRAFTERS if (i + p) % 2 == 0 else DRAFTERS[::-1]):
                drafter = remembering if d == "memory" else make(model, kind)
                outputs[d], seconds, steps = generate(model, x, drafter, max_new_tokens)
                t = totals[d]
                t[0] += steps
                t[1] += len(outputs[d])
                t[2] += seconds
            if outputs["memory"] != outputs["fresh"]:
                raise AssertionError(f"question {q['question_id']}: the output with a memory differs at new token "
                                     f"{first_difference(outputs['memory'], outputs['fresh'])}")
        passes.append(totals)
        log(f"pass {p + 1} of 2 done")
    return passes, len(memory_of.memory)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p)
    p.add_argument("--per-category", type=int, default=3, help="questions per category")
    p.add_argument("--memory", type=int, default=200_000, help="NGramDrafter(memory=...): tokens kept")
    p.add_argument("--drafter", default="ngram", choices=["ngram", "bpd+ngram"],
                   help="the n-gram drafter alone, or merged with the shipped proposal heads")
    p.add_argument("--remember", metavar="DIR", help="first give the memory the continuations cached under DIR by "
                   "python -m fastverify.train heads --data-only --data-dir DIR")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    questions, model, tokenizer = prepare(args, args.per_category)
    remember = corpus(args.remember) if args.remember else None
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    if remember:
        print(f"the memory first given {len(remember)} sequences, {sum(map(len, remember))} tokens, from "
              f"{args.remember}")
    print(f"{len(questions)} questions, then the same again; {args.max_new_tokens} new tokens, greedy, batch 1, "
          f"{args.dtype} on {model.device}; {args.drafter} with NGramDrafter(memory={args.memory}) against a fresh "
          f"{args.drafter} per call")
    passes, held = run(model, tokenizer, questions, args.memory, args.max_new_tokens, kind=args.drafter,
                       remember=remember)
    print("every output identical")
    print("| pass | drafter | steps | tokens per step | seconds | speed |\n| --- | --- | --- | --- | --- | --- |")
    for name, totals in zip(("the questions", "asked again"), passes):
        for d in DRAFTERS:
            steps, tokens, seconds = totals[d]
            print(f"| {name} | {d} | {steps} | {tokens / max(steps, 1):.3f} | {seconds:.1f} | "
                  f"{totals['fresh'][2] / seconds:.3f}x |")
    print(f"the memory held {held} tokens at the end")
    return passes


if __name__ == "__main__":
    main()
