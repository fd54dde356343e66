"""Where the time of a draft-and-verify step goes: forward vs drafting vs masks/positions vs verify vs
committing (Python) vs cache compaction, from the loop's own LoopStats (fastverify.hf.stats).

    python benchmarks/profile_loop.py                 # tiny random Llama (always) + SmolLM2-135M if loadable
    python benchmarks/profile_loop.py --tiny-only --threads 1 --new-tokens 64 --repeats 3
    python benchmarks/profile_loop.py --cprofile      # also the top functions by cumulative time

For each model and drafter it prints one row per configuration: steps, tokens per step, ms per step, and the
share of the step spent in each phase (medians over --repeats runs), then tokens/s of the patched and the
unpatched generate. Target: everything but the forward < 10% of a step on the real model.
"""

import argparse
import platform
import statistics
import time

import torch

import fastverify
from fastverify.hf import DraftModelDrafter, Drafter, NGramDrafter, patch, stats, unpatch

PHASES = ("draft", "inputs", "forward", "verify", "commit", "cache")

TEXT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again, "
        "and then the quick brown fox rests. def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n")


def tiny_llama(vocab=2048):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.08)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    motif = torch.randint(3, vocab, (7,)).tolist()
    prompt = torch.tensor([(motif * 12)[:80]])
    return "tiny-llama(64x2)", model, prompt


def smollm2():
    try:
        from fastverify.models import load_smollm2
        model, tok = load_smollm2()
    except Exception as e:  # not available offline / not written yet
        print(f"# SmolLM2 skipped: {type(e).__name__}: {e}")
        return None
    model.eval()
    prompt = tok(TEXT, return_tensors="pt").input_ids
    return "smollm2-135m", model, prompt


def run(model, prompt, drafter, new_tokens, repeats, sample=False):
    rows = []
    for _ in range(repeats):
        patch(model, drafter=drafter, backend="auto")
        kw = dict(do_sample=True, seed=0) if sample else dict(do_sample=False)
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=None, **kw)
        wall = time.perf_counter() - t
        st = stats(model)
        unpatch(model)
        step_time = st.time_total - st.time_prefill
        rows.append({"wall": wall, "steps": st.steps, "tps": st.tokens_per_step, "ms_step": 1e3 * step_time / st.steps,
                     **{p: getattr(st, f"time_{p}") / step_time for p in PHASES},
                     "other": 1 - sum(getattr(st, f"time_{p}") for p in PHASES) / step_time})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def plain(model, prompt, new_tokens, repeats):
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--tiny-only", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, backends {fastverify.backends()}")
    models = [tiny_llama()] + ([] if args.tiny_only else [m for m in [smollm2()] if m is not None])
    header = f"{'model':16} {'drafter':22} {'steps':>5} {'tok/step':>8} {'ms/step':>8} " + \
             " ".join(f"{p:>7}" for p in PHASES + ("other",)) + f" {'tok/s':>7} {'HF tok/s':>8} {'speedup':>7}"
    print(header)
    for name, model, prompt in models:
        base = plain(model, prompt, args.new_tokens, args.repeats)
        drafters = [("none (AR)", Drafter()), ("ngram", NGramDrafter()),
                    ("self k=4 (upper bound)", DraftModelDrafter(model, k=4))]
        for dname, drafter in drafters:
            r = run(model, prompt, drafter, args.new_tokens, args.repeats)
            print(f"{name:16} {dname:22} {r['steps']:5.0f} {r['tps']:8.2f} {r['ms_step']:8.2f} " +
                  " ".join(f"{100 * r[p]:6.1f}%" for p in PHASES + ("other",)) +
                  f" {args.new_tokens / r['wall']:7.1f} {args.new_tokens / base:8.1f} {base / r['wall']:7.2f}x")
        if args.cprofile:
            import cProfile
            import pstats
            patch(model, drafter=NGramDrafter())
            prof = cProfile.Profile()
            prof.enable()
            model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
            prof.disable()
            unpatch(model)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
