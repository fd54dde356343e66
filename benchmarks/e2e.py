"""End-to-end benchmark: fastverify.patch(model) against plain ``generate`` and transformers' prompt lookup.

On SmolLM2-135M-Instruct (``fastverify.models.load_smollm2``), Spec-Bench questions (first turn, the model's chat
template, greedy, batch 1), side by side in one run. For every question three methods run, in an order that
rotates from question to question (so slow drift of the machine does not favour one method):

  generate        the model's own ``generate(do_sample=False)``, unpatched: the reference output and time
  prompt_lookup   transformers' prompt lookup decoding, ``generate(prompt_lookup_num_tokens=10)``
  fastverify      ``fastverify.patch(model)``: NGramDrafter trees + greedy verification
  bpd             ``--drafter bpd``: proposal heads on the target's hidden state (HeadsDrafter, checkpoint
                  ``--heads``, default the shipped ``smollm2-bpd``) + greedy verification
  bpd+ngram       ``--drafter bpd+ngram``: the heads' tree and the n-gram trie merged into one tree
  eagle           ``--drafter eagle``: the EAGLE draft layer over the target's features (fastverify.hf.eagle,
                  checkpoint ``--eagle``); eagle+ngram: its tree merged with the n-gram trie
  gad, lud        ``--drafter gad lud``: slot drafters in the verify forward (fastverify.hf.slots; checkpoints
                  ``--gad`` / ``--lud``), with ``--rule`` (default greedy: exact; gad / confidence: lossy, their
                  quality cost is reported: outputs identical to greedy, mean common prefix, math answers kept)
  gad+ngram, lud+ngram   the slot drafter and the n-gram trie merged into one tree

Reported per category and overall:

  tok/fwd    mean accepted tokens per step = new tokens / target forward passes (the prefill counts as one
             step that commits one token, so plain decoding scores 1.00; counted by a hook on the model, the
             same way for every method)
  tok/s      new tokens / wall time of the generate call (summed over the category's questions)
  speedup    geometric mean over questions of tok/s(method) / tok/s(reference); also the worst question
  identical  how many outputs equal plain greedy token for token (mismatches are counted, never hidden)

Usage (from the repository root):

  python benchmarks/e2e.py --quick                       # ~2 minutes: our 12 prompts, 64 new tokens
  python benchmarks/e2e.py --per-category 3              # Spec-Bench, every category, 128 new tokens
  python benchmarks/e2e.py --per-category 3 --max-new-tokens 96 --out e2e.json
  python benchmarks/e2e.py --per-category 2 --methods generate fastverify --ngram min_n=2 width=1
  python benchmarks/e2e.py --per-category 3 --drafter ngram bpd bpd+ngram   # heads beside n-gram, one run

A run writes only under ``--out-dir`` (default benchmarks/out/, ignored by git): the results as a markdown section
with the machine, the command line and the numbers (e2e.md or e2e_quick.md), and a bar plot (e2e.png or
e2e_quick.png) when matplotlib is importable. ``--update-results`` also puts the section into
benchmarks/RESULTS.md, in place of the previous figures of the same benchmark, and the plot next to it: the
deliberate step that changes tracked files.
"""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections import OrderedDict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_QUESTIONS = "../shared/data/spec_bench/question.jsonl"  # relative to the repository root
QUICK_PROMPTS = os.path.join(ROOT, "benchmarks", "quick_prompts.jsonl")
OUT_DIR = os.path.join(ROOT, "benchmarks", "out")  # run outputs; ignored by git, so a run leaves the checkout clean
# no_draft (opt-in): fastverify's loop with a drafter that proposes nothing, i.e. what the loop's kernels
# (skinny linears) give without any drafting; it separates the two sources of speed-up.
METHODS = ("generate", "prompt_lookup", "fastverify", "no_draft", "bpd", "bpd+ngram", "eagle", "eagle+ngram", "gad",
           "lud", "gad+ngram", "lud+ngram")
DEFAULT_METHODS = ("generate", "prompt_lookup", "fastverify")
BASELINES = ("generate", "prompt_lookup")
# drafters that read the target (proposal heads) are also compared with today's n-gram fastverify
HEAD_METHODS = ("bpd", "bpd+ngram", "eagle", "eagle+ngram")
SLOT_METHODS = ("gad", "lud", "gad+ngram", "lud+ngram")  # slot drafters, compared with n-gram and the heads too
DRAFTER_METHODS = {"ngram": "fastverify", "bpd": "bpd", "bpd+ngram": "bpd+ngram", "eagle": "eagle",
                   "eagle+ngram": "eagle+ngram", "gad": "gad", "lud": "lud", "gad+ngram": "gad+ngram",
                   "lud+ngram": "lud+ngram"}


def baselines(method, methods):
    """The methods ``method`` is compared with (speedup columns)."""
    if method == "generate":
        return []
    extra = ("fastverify",) if method in HEAD_METHODS else ("fastverify", "bpd") if method in SLOT_METHODS else ()
    return [b for b in BASELINES + extra if b != method and b in methods]


# ----------------------------------------------------------------------------------------------- questions

def load_questions(path, per_category=None, categories=None, offset=0):
    """Spec-Bench style jsonl (``question_id``, ``category``, ``turns``): ``per_category`` questions of each category
    in file order (all when None) after skipping its first ``offset``, restricted to ``categories`` when given.
    Returns a list of dicts with ``question_id``, ``category`` and ``prompt`` (the first turn)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--questions: no such file {path!r} (Spec-Bench's question.jsonl is expected at "
                                f"{DEFAULT_QUESTIONS} relative to the repository root)")
    wanted = None if categories is None else set(categories)
    taken, seen, out = {}, {}, []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = json.loads(line)
            if not q.get("turns") or "category" not in q:
                raise ValueError(f"{path}:{lineno}: expected an object with 'category' and non-empty 'turns'")
            cat = q["category"]
            if wanted is not None and cat not in wanted:
                continue
            seen[cat] = seen.get(cat, 0) + 1
            if seen[cat] <= offset:
                continue
            if per_category is not None and taken.get(cat, 0) >= per_category:
                continue
            taken[cat] = taken.get(cat, 0) + 1
            out.append({"question_id": q.get("question_id", lineno), "category": cat, "prompt": q["turns"][0]})
    if wanted is not None and wanted - set(taken):
        raise ValueError(f"--categories: not found in {path}: {sorted(wanted - set(taken))}")
    return out


def encode(tokenizer, prompt):
    """The prompt as a single-user-turn chat with the generation prompt: input_ids int64 [1, L]."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    return enc["input_ids"]


# ----------------------------------------------------------------------------------------------- running

class ForwardCounter:
    """Counts forward calls of the target model (a pre-hook on the top-level module: a recorder, so the patched
    methods declare it with ``row_hooks=True``, else the patched generate would fall back)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def close(self):
        self._handle.remove()


_HEADS = {}


def heads_drafter(model, method, ngram=None, bpd=None):
    """A fresh HeadsDrafter for ``method`` (bpd / bpd+ngram); the checkpoint is read and checked once per run.
    ``bpd``: {"heads": name or path, "options": HeadsDrafter keyword arguments}."""
    import fastverify
    from fastverify.heads import load_heads
    bpd = bpd or {}
    extra = fastverify.NGramDrafter(**(ngram or {})) if method.endswith("+ngram") else None
    if method.startswith("eagle"):  # the EAGLE draft layer (fastverify.hf.eagle), checkpoint bpd["eagle"]
        from fastverify.eagle import load_eagle
        from fastverify.hf.eagle import EagleDrafter
        name = bpd["eagle"]
        if name not in _HEADS:
            _HEADS[name] = load_eagle(name, model)
        layer, cfg = _HEADS[name]
        return EagleDrafter(model, layer, ngram=extra, calibration=cfg.get("calibration"))
    name = bpd.get("heads", "smollm2-bpd")
    if name not in _HEADS:
        _HEADS[name] = load_heads(name, model)
    heads, cfg = _HEADS[name]
    opts = dict(bpd.get("options", {}))
    opts.setdefault("head_acceptance", cfg.get("head_acceptance"))
    opts.setdefault("calibration", cfg.get("calibration"))
    return fastverify.HeadsDrafter(model, heads, ngram=extra, **opts)


_SLOTS = {}


def slot_drafter(model, method, slots, ngram=None):
    """A slot drafter for ``method`` (gad / lud, or either +ngram: merged with a fresh NGramDrafter(**ngram) per
    call, as the other methods get) from ``slots[method]`` (a checkpoint folder or shipped name), read and checked
    once per run; its block state is reset by the loop at every generate."""
    import fastverify
    from fastverify.hf.bpd import load_drafter
    base = method.split("+")[0]
    name = slots.get(base) or f"smollm2-{base}"
    if (name, method) not in _SLOTS:
        _SLOTS[name, method] = load_drafter(name, model, **slots.get("options", {}))
    drafter = _SLOTS[name, method]
    drafter.ngram = fastverify.NGramDrafter(**(ngram or {})) if method.endswith("+ngram") else None
    return drafter


def run_method(model, method, input_ids, max_new_tokens, counter, ngram=None, bpd=None, slots=None, options=None):
    """One greedy generation with ``method``. Returns (new tokens list, seconds, forwards, loop stats or None).
    ``ngram``: keyword arguments of fastverify's NGramDrafter (None: its defaults); ``bpd``: see heads_drafter;
    ``slots``: {"gad" / "lud": checkpoint, "rule": verify rule, "params": its parameters} for the slot drafters;
    ``options``: more generate keyword arguments, for every method (e.g. repetition_penalty)."""
    import fastverify

    input_ids = input_ids.to(model.device)
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
                  **(options or {}))
    stats = None
    patched = method in ("fastverify", "no_draft") + HEAD_METHODS + SLOT_METHODS
    if method in SLOT_METHODS:
        slots = slots or {}
        fastverify.patch(model, drafter=slot_drafter(model, method, slots, ngram), rule=slots.get("rule"),
                         row_hooks=True, **slots.get("params", {}))
    elif method in HEAD_METHODS:
        fastverify.patch(model, drafter=heads_drafter(model, method, ngram, bpd), row_hooks=True)
    elif method == "fastverify":
        fastverify.patch(model, drafter=fastverify.NGramDrafter(**ngram) if ngram else None, row_hooks=True)
    elif method == "no_draft":
        fastverify.patch(model, drafter=fastverify.Drafter(), row_hooks=True)
    try:
        if method == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        counter.count = 0
        _sync(input_ids.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, **kwargs)
        _sync(input_ids.device)
        seconds = time.perf_counter() - t0
        forwards = counter.count
        if patched:
            stats = _loop_stats(model)
            if stats is None:
                raise RuntimeError("fastverify.patch(model).generate fell back to the original generate "
                                   "(no loop statistics); see its warning")
    finally:
        if patched:
            fastverify.unpatch(model)
    return out[0, input_ids.shape[1]:].tolist(), seconds, forwards, stats


def _sync(device):
    """Wait for the device's queued work (a CUDA generate returns before its last kernels finish)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_stats(model):
    """The patched loop's LoopStats of the last generate (``fastverify.hf.stats``), or None."""
    try:
        from fastverify.hf import stats
    except ImportError:
        from fastverify.hf.patch import stats
    return stats(model)


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _number(text):
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


# categories whose answers end in a number (Spec-Bench's MT-Bench math and GSM8K questions): the quality cost of a
# lossy rule includes whether that number (the last one in the output) is the greedy output's
ANSWER_CATEGORIES = ("math", "math_reasoning")


def final_number(text):
    """The last number in a text (a math answer's result), or None."""
    import re
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return found[-1].replace(",", "") if found else None


def _loop(stats):
    """A record's loop figures (fastverify.hf.stats summary, less new_tokens): {"loop": ...}, or {} for a method
    without the loop."""
    if stats is None:
        return {}
    return {"loop": {k: v for k, v in stats.summary().items() if k != "new_tokens"}}


def run_benchmark(model, tokenizer, questions, max_new_tokens, methods=DEFAULT_METHODS, progress=True, log=print,
                  ngram=None, bpd=None, slots=None, repeats=1, options=None):
    """Run every method on every question. Returns a list of per-question records. repeats: rounds of every method
    per question (the order rotating each round); a method's time is its fastest round (on a shared machine the
    noise only ever adds time), with that round's forwards and loop figures; every round's output must be the
    same."""
    counter = ForwardCounter(model)
    try:
        # Warm-up (not timed): every method once on the first question, short.
        warm = encode(tokenizer, questions[0]["prompt"])
        for m in methods:
            run_method(model, m, warm, min(16, max_new_tokens), counter, ngram, bpd, slots, options)
        bar = _progress(len(questions) * len(methods) * repeats, progress)
        records = []
        for i, q in enumerate(questions):
            ids = encode(tokenizer, q["prompt"])
            order = [methods[(i + j) % len(methods)] for j in range(len(methods))]
            rec = {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": ids.shape[1],
                   "order": order, "methods": {}}
            for rnd in range(repeats):
                for m in order[rnd % len(order):] + order[:rnd % len(order)]:
                    tokens, seconds, forwards, stats = run_method(model, m, ids, max_new_tokens, counter, ngram, bpd,
                                                                  slots, options)
                    bar.update(1)
                    if rnd:
                        r = rec["methods"][m]
                        if tokens != r["tokens"]:
                            raise RuntimeError(f"{m}: question {q['question_id']} gave another output in round "
                                               f"{rnd + 1} (first differs at new token "
                                               f"{first_difference(tokens, r['tokens'])})")
                        r["rounds"].append(seconds)
                        if seconds < r["seconds"]:  # forwards and loop figures: those of the round timed
                            r.update(seconds=seconds, forwards=forwards, **_loop(stats))
                        continue
                    r = {"tokens": tokens, "new_tokens": len(tokens), "seconds": seconds, "forwards": forwards,
                         "rounds": [seconds], **_loop(stats)}
                    if q["category"] in ANSWER_CATEGORIES:
                        r["answer"] = final_number(tokenizer.decode(tokens))
                    rec["methods"][m] = r
            ref = rec["methods"]["generate"]["tokens"] if "generate" in rec["methods"] else None
            for m, r in rec["methods"].items():
                r["identical"] = ref is None or r["tokens"] == ref
                if not r["identical"]:
                    d = first_difference(r["tokens"], ref)
                    r["first_difference"] = d
                    r["text"] = tokenizer.decode(r["tokens"])
                    r["off_argmax"] = off_argmax(model, ids, r["tokens"])
                    rec.setdefault("reference_text", tokenizer.decode(ref))
                    log(f"\n  MISMATCH q{q['question_id']} ({q['category']}) {m}: first differs at new token {d}")
            records.append(rec)
            if not progress:  # one line per question, so that a run cut short still shows what it measured
                log(f"q{q['question_id']} {q['category']}: " + "; ".join(
                    f"{m} {r['new_tokens']} tok {r['seconds']:.2f} s {r['forwards']} fwd"
                    + ("" if r["identical"] else " DIFFERS") for m, r in rec["methods"].items()))
        bar.close()
    finally:
        counter.close()
    return records


@torch.no_grad()
def off_argmax(model, input_ids, tokens):
    """How many emitted tokens are not the model's own argmax given the prompt and the emitted tokens before them
    (one plain forward over the whole sequence): the tokens a lossy rule chose against the model."""
    if not tokens:
        return 0
    seq = torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype)], 1).to(model.device)
    logits = model(seq).logits[0, input_ids.shape[1] - 1:-1]
    return int((logits.argmax(-1).cpu() != torch.tensor(tokens)).sum())


class _Counter:
    """Printed-counter fallback when tqdm is not importable (silent when not ``enabled``)."""

    def __init__(self, total, enabled=True):
        self.total, self.n, self.enabled = total, 0, enabled

    def update(self, k):
        self.n += k
        if self.enabled:
            print(f"\r  {self.n}/{self.total} generations", end="", file=sys.stderr, flush=True)

    def close(self):
        if self.enabled:
            print(file=sys.stderr)


def _progress(total, enabled):
    if not enabled:
        return _Counter(total, enabled=False)
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="generations", unit="gen", file=sys.stderr)
    except ImportError:
        return _Counter(total)


# ----------------------------------------------------------------------------------------------- summary

def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarise(records, methods=DEFAULT_METHODS):
    """Per category (in order of first appearance) and overall: for each method tok/fwd, tok/s, identical count;
    for fastverify and prompt_lookup, speedups (geometric mean and worst question) over each baseline."""
    groups = OrderedDict()
    for rec in records:
        groups.setdefault(rec["category"], []).append(rec)
    groups["overall"] = list(records)
    out = OrderedDict()
    for cat, recs in groups.items():
        row = {"questions": len(recs)}
        for m in methods:
            rs = [r["methods"][m] for r in recs]
            tokens = sum(r["new_tokens"] for r in rs)
            row[m] = {
                "tok_per_fwd": tokens / max(1, sum(r["forwards"] for r in rs)),
                "tok_per_s": tokens / max(1e-12, sum(r["seconds"] for r in rs)),
                "identical": sum(r["identical"] for r in rs),
                "new_tokens": tokens,
            }
            if m in ("fastverify",) + HEAD_METHODS + SLOT_METHODS and all("loop" in r for r in rs):
                steps = sum(r["loop"]["steps"] for r in rs)
                row[m]["loop_tokens_per_step"] = (sum(r["loop"]["accepted"] for r in rs) + steps) / max(1, steps)
            if m != "generate":  # the quality cost of a lossy rule: how much of the greedy output survives
                prefix = [r.get("first_difference", r["new_tokens"]) for r in rs]
                row[m]["mean_common_prefix"] = sum(prefix) / max(1, len(prefix))
                row[m]["off_argmax_rate"] = sum(r.get("off_argmax", 0) for r in rs) / max(1, tokens)
                if all("answer" in r for r in rs):  # math questions: the final number of the answer
                    row[m]["answer_kept"] = sum(r["answer"] == rec["methods"]["generate"]["answer"]
                                                for r, rec in zip(rs, recs))
            for base in baselines(m, methods):
                # Per-question speedup = time(base) / time(m) for the same question (tokens are equal when the
                # outputs are identical; with a mismatch, tokens/s ratios keep it fair).
                ratios = [(r["methods"][m]["new_tokens"] / r["methods"][m]["seconds"])
                          / (r["methods"][base]["new_tokens"] / r["methods"][base]["seconds"])
                          for r in recs if r["methods"][m]["new_tokens"] and r["methods"][base]["new_tokens"]]
                row[m][f"speedup_vs_{base}"] = geomean(ratios)
                row[m][f"min_speedup_vs_{base}"] = min(ratios) if ratios else float("nan")
        out[cat] = row
    return out


def format_table(summary, methods=DEFAULT_METHODS):
    """A markdown table: one row per category, then overall."""
    head = ["category", "n"]
    for m in methods:
        head += [f"{m} tok/fwd", f"{m} tok/s"]
    spd = [(m, b) for m in methods for b in baselines(m, methods)]
    for m, b in spd:
        head += [f"{m}/{b} (geo, min)"]
    head += ["identical to greedy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for cat, row in summary.items():
        cells = [f"**{cat}**" if cat == "overall" else cat, str(row["questions"])]
        for m in methods:
            cells += [f"{row[m]['tok_per_fwd']:.2f}", f"{row[m]['tok_per_s']:.1f}"]
        for m, b in spd:
            cells += [f"{row[m][f'speedup_vs_{b}']:.2f}x ({row[m][f'min_speedup_vs_{b}']:.2f}x)"]
        ident = [f"{m} {row[m]['identical']}/{row['questions']}" for m in methods if m != "generate"]
        cells += [", ".join(ident)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _target(x, at_least):
    """'target >= T: met' / 'missed', judged on the unrounded value (a printed 2.00 may be 1.996)."""
    return f"target >= {at_least}: {'met' if x >= at_least else 'missed'}"


def verdict(summary):
    """One line per target (context from the issue; reported, never asserted)."""
    o = summary["overall"]
    if "fastverify" not in o:
        return []
    cats = {c: r for c, r in summary.items() if c != "overall"}
    fv = o["fastverify"]
    lines = []
    n = o["questions"]
    lines.append(f"outputs identical to plain greedy: fastverify {fv['identical']}/{n}"
                 + (f", prompt_lookup {o['prompt_lookup']['identical']}/{n}" if "prompt_lookup" in o else ""))
    if "speedup_vs_generate" in fv:
        worst = min(cats.items(), key=lambda kv: kv[1]["fastverify"]["speedup_vs_generate"])
        w = worst[1]["fastverify"]["speedup_vs_generate"]
        lines.append(f"fastverify vs generate: {fv['speedup_vs_generate']:.3f}x geometric mean "
                     f"({_target(fv['speedup_vs_generate'], 1.3)}); worst category {worst[0]} {w:.3f}x "
                     f"({_target(w, 0.95)})")
    if "speedup_vs_prompt_lookup" in fv:
        lines.append(f"fastverify vs prompt lookup: {fv['speedup_vs_prompt_lookup']:.3f}x geometric mean "
                     f"({_target(fv['speedup_vs_prompt_lookup'], 1.3)})")
    for m in HEAD_METHODS:  # proposal heads: targets of blockwise parallel decoding
        if m not in o:
            continue
        r = o[m]
        lines.append(f"{m}: identical {r['identical']}/{n} (target all); {r['tok_per_fwd']:.3f} tokens per target "
                     f"forward ({_target(r['tok_per_fwd'], 2.0)})")
        if "speedup_vs_fastverify" in r:
            worst = min(cats.items(), key=lambda kv: kv[1][m]["speedup_vs_fastverify"])
            w = worst[1][m]["speedup_vs_fastverify"]
            lines.append(f"{m} vs n-gram fastverify: {r['speedup_vs_fastverify']:.3f}x "
                         f"({_target(r['speedup_vs_fastverify'], 1.3)}); worst category {worst[0]} {w:.3f}x "
                         f"({_target(w, 1.0)})")
        if "speedup_vs_generate" in r:
            lines.append(f"{m} vs generate: {r['speedup_vs_generate']:.3f}x ({_target(r['speedup_vs_generate'], 2.5)})")
    return lines


# ----------------------------------------------------------------------------------------------- machine, files

def machine_info():
    cpu = platform.processor() or platform.machine()
    vm = False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    vm = "hypervisor" in line.split()  # the CPU flag a virtual machine's guest sees
                    break
    except OSError:
        pass
    import transformers
    info = {
        "cpu": cpu, "vm": vm, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    }
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    try:
        info["load_before"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def results_section(info, command, args, table, notes):
    """The run as a markdown section of RESULTS.md: heading, machine, date, how to reproduce, table, notes."""
    drafter_args = ", ".join(f"{k}={v}" for k, v in args.ngram.items())
    lines = [
        f"## e2e {'quick' if args.quick else 'Spec-Bench'}",
        "",
        f"- machine: {info['gpu'] + ' GPU with a ' if info.get('gpu') else ''}"
        f"{info['cores']}-core {info['cpu']}{' VM' if info.get('vm') else ''}, torch threads "
        f"{info['torch_threads']}; "
        f"torch {info['torch']}, transformers {info['transformers']}, Python {info['python']}",
        f"- date: {info['date']}, commit {info.get('commit')}; load average (1 min) before / after: "
        f"{info.get('load_before')} / {info.get('load_after')} (other processes on the machine make timings noisy)",
        f"- model: SmolLM2-135M-Instruct (GGUF Q4_1 dequantised), {args.dtype}; greedy, batch 1, "
        f"max_new_tokens {args.max_new_tokens}",
        f"- fastverify: fastverify.patch(model), NGramDrafter({drafter_args}), greedy, skinny linears on"
        + ("; no_draft: the same loop with a drafter that proposes nothing" if "no_draft" in args.methods else "")
        + ("".join((f"; {m}: EagleDrafter from `{args.eagle}`" if m.startswith("eagle") else
                    f"; {m}: HeadsDrafter from `{args.heads}`"
                    + (f" ({', '.join(f'{k}={v}' for k, v in args.bpd.items())})" if args.bpd else ""))
                   + (" merged with NGramDrafter" if m.endswith("+ngram") else "")
                   for m in HEAD_METHODS if m in args.methods)),
        f"- how to reproduce: `{command}`",
        "",
        table,
        "",
    ]
    lines += [f"- {line}" for line in notes]
    return "\n".join(lines) + "\n"


def update_results(path, key, section):
    """Put ``section`` into the markdown file ``path`` between the markers of ``key``, in place of the previous
    figures of that benchmark (they stay in git history), or at the end when the markers are absent."""
    begin, end = f"<!-- {key}: begin -->", f"<!-- {key}: end -->"
    block = f"{begin}\n{section.rstrip()}\n{end}"
    text = open(path).read() if os.path.exists(path) else "# fastverify benchmark results\n"
    i, j = text.find(begin), text.find(end)
    if 0 <= i < j:
        text = text[:i] + block + text[j + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def plot(summary, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot: matplotlib is not installed; skipping {path} (pip install matplotlib to get it)")
        return None
    cats = list(summary)
    series = [("fastverify", "generate"), ("prompt_lookup", "generate"), ("fastverify", "prompt_lookup"),
              ("no_draft", "generate")]
    series = [(m, b) for m, b in series if m in summary["overall"] and f"speedup_vs_{b}" in summary["overall"][m]]
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(cats) + 2), 4))
    for i, (m, b) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [summary[c][m][f"speedup_vs_{b}"] for c in cats], width, label=f"{m} / {b}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=35, ha="right")
    ax.set_ylabel("speedup (geometric mean over questions)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- main

def _is_float(v):
    try:
        float(v)
        return True
    except ValueError:
        return False


def parse_options(p, flag, items, strings=False):
    """KEY=VALUE items of ``flag`` -> {key: int or float (or, with strings, the text itself)}; a parser error
    naming the flag otherwise."""
    try:
        pairs = [a.split("=", 1) for a in items]
        return {k: (int(v) if v.lstrip("-").isdigit() else float(v) if not strings or _is_float(v) else v)
                for k, v in pairs}
    except ValueError:
        p.error(f"{flag}: expected KEY={'VALUE' if strings else 'NUMBER'} pairs, got {items}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", default=DEFAULT_QUESTIONS,
                   help="Spec-Bench question.jsonl; a relative path is resolved against the repository root "
                        f"(default {DEFAULT_QUESTIONS})")
    p.add_argument("--per-category", type=int, default=3, help="questions per category (default 3; 0 = all)")
    p.add_argument("--categories", nargs="+", help="only these categories")
    p.add_argument("--offset", type=int, default=0,
                   help="skip the first OFFSET questions of each category (e.g. 3: questions the NGramDrafter's "
                        "acceptance priors were not fitted on)")
    p.add_argument("--quick", action="store_true",
                   help="our 12 prompts (benchmarks/quick_prompts.jsonl), 64 new tokens unless given: ~2 minutes")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (64 with --quick)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the model's dtype")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS),
                   help="subset of methods (generate is always run: it is the reference)")
    p.add_argument("--ngram", nargs="+", default=[], metavar="KEY=NUMBER",
                   help="NGramDrafter arguments for fastverify, e.g. --ngram min_n=2 width=1 (default: its defaults)")
    p.add_argument("--drafter", nargs="+", default=[], choices=list(DRAFTER_METHODS),
                   help="fastverify drafters to run beside generate and prompt lookup: ngram (method fastverify), "
                        "bpd (proposal heads), bpd+ngram (both, one tree), eagle / eagle+ngram (the EAGLE draft "
                        "layer); n-gram fastverify always runs with bpd* and eagle*")
    p.add_argument("--heads", default="smollm2-bpd", help="heads checkpoint for bpd: shipped name or folder")
    p.add_argument("--eagle", default=None, help="EAGLE checkpoint folder for eagle / eagle+ngram (written by "
                   "python -m fastverify.train eagle; none is shipped)")
    p.add_argument("--gad", default="smollm2-gad", help="slot checkpoint for gad: shipped name or folder")
    p.add_argument("--lud", default="smollm2-lud", help="slot checkpoint for lud: shipped name or folder")
    p.add_argument("--rule", default=None, help="verify rule of the slot drafters (default greedy: exact); e.g. "
                   "--rule gad --rule-params beta=3 tau=1.0, or --rule confidence --rule-params beta=0.9")
    p.add_argument("--rule-params", nargs="+", default=[], metavar="KEY=NUMBER", help="parameters of --rule")
    p.add_argument("--slot-attach", default="path", choices=["path", "last"],
                   help="where the slot drafters attach their blocks (fastverify.hf.slots)")
    p.add_argument("--generate", nargs="+", default=[], metavar="KEY=NUMBER",
                   help="more generate arguments for every method, e.g. repetition_penalty=1.2 no_repeat_ngram_size=3")
    p.add_argument("--bpd", nargs="+", default=[], metavar="KEY=VALUE",
                   help="HeadsDrafter arguments, e.g. --bpd width=3 max_nodes=12 score=rank")
    p.add_argument("--out", help="write every per-question record and the summary to this JSON file")
    p.add_argument("--out-dir", default=OUT_DIR,
                   help="folder of the run's outputs: the results section (e2e.md / e2e_quick.md) and the plot "
                        "(default benchmarks/out, ignored by git)")
    p.add_argument("--plot", default=None, help="PNG path (default OUT_DIR/e2e.png, or OUT_DIR/e2e_quick.png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    p.add_argument("--no-results", action="store_true", help="do not write the results section")
    p.add_argument("--update-results", action="store_true",
                   help="also put the results section into --results in place of the benchmark's previous figures, "
                        "and copy the plot to benchmarks/ (changes tracked files)")
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"),
                   help="the markdown file --update-results writes (default benchmarks/RESULTS.md)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every method per question (the order rotating); a method's time is its fastest "
                        "round, its output must be the same in every round (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--cache-dir", default=None, help="load_smollm2's cache folder")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    args = p.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if args.quick else 128
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens: expected >= 1")
    if args.per_category < 0:
        p.error("--per-category: expected >= 0")
    if args.offset < 0:
        p.error("--offset: expected >= 0")
    if args.repeats < 1:
        p.error(f"--repeats: expected >= 1, got {args.repeats}")
    if args.drafter:
        if "--methods" not in (sys.argv[1:] if argv is None else list(argv)):
            args.methods = [m for m in args.methods if m != "fastverify"]
        args.methods += [DRAFTER_METHODS[d] for d in args.drafter]
        if any(m in HEAD_METHODS + SLOT_METHODS for m in args.methods):
            args.methods.append("fastverify")  # the n-gram drafter they are compared with
    if "generate" not in args.methods:
        args.methods = ["generate"] + args.methods
    args.methods = [m for m in METHODS if m in args.methods]
    args.ngram = parse_options(p, "--ngram", args.ngram)
    args.bpd = parse_options(p, "--bpd", args.bpd, strings=True)
    args.generate = parse_options(p, "--generate", args.generate)
    if any(m.startswith("eagle") for m in args.methods) and not args.eagle:
        p.error("--eagle: the eagle methods need an EAGLE checkpoint folder (python -m fastverify.train eagle)")
    args.name = "e2e_quick" if args.quick else "e2e"
    if args.plot is None:
        args.plot = os.path.join(args.out_dir, args.name + ".png")
    return args


def main(argv=None):
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ([os.path.relpath(__file__, ROOT)]
                                                             + (sys.argv[1:] if argv is None else list(argv))))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        questions = load_questions(QUICK_PROMPTS, None, args.categories)
    else:
        path = args.questions if os.path.isabs(args.questions) else os.path.join(ROOT, args.questions)
        questions = load_questions(os.path.normpath(path), args.per_category or None, args.categories, args.offset)
    if not questions:
        raise SystemExit("no questions selected")

    import transformers
    transformers.logging.set_verbosity_error()  # generate's per-call notices would drown the progress bar
    import fastverify  # noqa: F401  (loads the compiled extension)
    from fastverify.models import load_smollm2

    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
          f"transformers {info['transformers']}; load average {info.get('load_before')}")
    if info.get("load_before", 0) > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {info['load_before']} on {os.cpu_count()} cores: other processes are running, "
              "timings will be noisy" + ("" if args.threads == 1 else
                                          " (--threads 1 suffers least from oversubscription)"))
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), cache_dir=args.cache_dir, device=args.device)
    if model.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(model.device)
        print(f"gpu: {info['gpu']}")
    print(f"model: SmolLM2-135M-Instruct, {args.dtype}, loaded in {time.perf_counter() - t0:.1f} s; "
          f"{len(questions)} questions, {len(set(q['category'] for q in questions))} categories, "
          f"max_new_tokens {args.max_new_tokens}, methods {', '.join(args.methods)}")

    t0 = time.perf_counter()
    records = run_benchmark(model, tokenizer, questions, args.max_new_tokens, tuple(args.methods),
                            progress=not args.no_progress, ngram=args.ngram or None,
                            bpd={"heads": args.heads, "options": args.bpd, "eagle": args.eagle},
                            slots={"gad": args.gad, "lud": args.lud, "rule": args.rule,
                                   "params": {k: _number(v) for k, v in (a.split("=", 1) for a in args.rule_params)},
                                   "options": {"attach": args.slot_attach}}, repeats=args.repeats,
                            options=args.generate)
    elapsed = time.perf_counter() - t0
    try:
        info["load_after"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    summary = summarise(records, tuple(args.methods))
    table = format_table(summary, tuple(args.methods))
    notes = verdict(summary)
    notes.append("tok/fwd: new tokens per target forward (prefill included; plain decoding = 1.00). "
                 "speedup: geometric mean over questions of tok/s ratios (worst question in brackets)"
                 + (f"; each method's time the fastest of {args.repeats} rounds per question" if args.repeats > 1
                    else "") + f". Wall time of the run: {elapsed / 60:.1f} min.")
    for m in SLOT_METHODS:
        if m in summary["overall"]:
            o = summary["overall"][m]
            notes.append(f"{m} (rule {args.rule or 'greedy'}, attach {args.slot_attach}): "
                         f"{o.get('loop_tokens_per_step', float('nan')):.2f} tokens per step; identical to greedy "
                         f"{o['identical']}/{summary['overall']['questions']}; mean common prefix with greedy "
                         f"{o['mean_common_prefix']:.1f} tokens (greedy's mean length "
                         f"{summary['overall']['generate']['new_tokens'] / summary['overall']['questions']:.1f}); "
                         f"tokens not the model's argmax given the output before them {100 * o['off_argmax_rate']:.1f}%"
                         + "".join(f"; {c} answers kept {summary[c][m]['answer_kept']}/{summary[c]['questions']}"
                                   for c in ANSWER_CATEGORIES if c in summary and "answer_kept" in summary[c][m]))
    if "fastverify" in summary["overall"] and "loop_tokens_per_step" in summary["overall"]["fastverify"]:
        notes.append(f"fastverify loop: {summary['overall']['fastverify']['loop_tokens_per_step']:.2f} tokens "
                     "per decoding step (prefill excluded)")
    print()
    print(table)
    print()
    for line in notes:
        print(line)

    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "command": command, "args": vars(args), "summary": summary,
                       "records": records}, f, indent=1)
        print(f"wrote {args.out}")
    if not args.no_plot or not args.no_results:
        os.makedirs(args.out_dir, exist_ok=True)
    plotted = None
    if not args.no_plot:
        title = (f"SmolLM2-135M-Instruct {args.dtype}, {'quick prompts' if args.quick else 'Spec-Bench'}, "
                 f"{args.max_new_tokens} new tokens; "
                 + (info["gpu"] if info.get("gpu") else f"{info['cpu']}, {info['torch_threads']} threads"))
        plotted = plot(summary, args.plot, title)
        if plotted:
            print(f"wrote {args.plot}")
    if not args.no_results:
        section = results_section(info, command, args, table, notes)
        path = os.path.join(args.out_dir, args.name + ".md")
        with open(path, "w") as f:
            f.write(section)
        print(f"wrote {path}")
        if args.update_results:
            update_results(args.results, args.name, section)
            print(f"updated the {args.name} section of {args.results}")
            if plotted:
                shutil.copyfile(plotted, os.path.join(ROOT, "benchmarks", args.name + ".png"))
    return summary


if __name__ == "__main__":
    main()
