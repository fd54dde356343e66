"""GPT-2's Conv1D layers through skinny_linear_t, on and off, side by side: a GPT-2-small-sized model (12 layers,
768 wide, vocabulary 50257; random weights from a fixed seed, since no GPT-2 checkpoint ships with the project's
packages) decodes the same prompts with plain ``generate``, then patched with the n-gram drafter, the Conv1D
layers rerouted ("t": what the loop does) or left to Conv1D's own ``torch.addmm`` ("addmm": the loop before
skinny_linear_t), alternating per prompt. Greedy and seeded sampling (``--temperature``, 0.2 by default: a random
model's logits are nearly flat, so at 0.8 its draws are nearly uniform and no draft is ever accepted): greedy
outputs are checked against ``generate``, sampled ones against the loop's own undrafted sampling with the seed.

    python benchmarks/gpt2_conv1d.py --prompts 4 --threads 2

A random model's greedy text soon repeats, which the n-gram drafter copies: its tokens per forward are not a real
GPT-2's. What the comparison shows is the cost of the same steps with the layers on one kernel or the other, and,
under sampling, whether the loop drafts at all (it samples without drafts where its forward is not row-invariant).
"""

import argparse
import time
import warnings

import torch

import fastverify
import fastverify.hf
import fastverify.hf.linear as hf_linear


def _model(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.2)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _model(args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, 50257, (1, args.prompt_len), generator=g) for _ in range(args.prompts)]
    conv1d = hf_linear._conv1d_type
    totals, same, stats = {}, {}, {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
        return out

    for sample in (False, True):
        kw = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, pad_token_id=0)
        kw.update(do_sample=True, temperature=args.temperature, top_k=0) if sample else kw.update(do_sample=False)
        mode = "sampled" if sample else "greedy"
        for i, ids in enumerate(prompts):
            mask = torch.ones_like(ids)
            with torch.no_grad():
                if not sample:
                    fastverify.unpatch(model)
                    ref = timed(f"{mode} generate", lambda: model.generate(ids, attention_mask=mask, **kw))
                order = ("t", "addmm") if i % 2 == 0 else ("addmm", "t")
                for which in order:
                    hf_linear._conv1d_type = conv1d if which == "t" else (lambda: None)
                    try:
                        if sample:  # the loop's own undrafted sampling with the seed, on the same kernels
                            fastverify.patch(model, drafter=fastverify.Drafter())
                            ref = model.generate(ids, attention_mask=mask, seed=i, **kw)
                        fastverify.patch(model, drafter=fastverify.NGramDrafter())
                        extra = {"seed": i} if sample else {}
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            out = timed(f"{mode} {which}", lambda: model.generate(ids, attention_mask=mask, **kw,
                                                                                   **extra))
                        st = fastverify.hf.stats(model)
                    finally:
                        hf_linear._conv1d_type = conv1d
                    key = f"{mode} {which}"
                    same[key] = same.get(key, 0) + int(torch.equal(out, ref))
                    s = stats.setdefault(key, [0, 0, 0.0, 0])
                    s[0] += st.steps
                    s[1] += sum(st.new_tokens)
                    s[2] += st.time_forward
                    s[3] += st.drafted_tokens
            fastverify.unpatch(model)
    n = args.prompts
    print(f"GPT-2-small-sized model (random weights), {n} prompts of {args.prompt_len} tokens, "
          f"{args.max_new_tokens} new tokens, sampling at temperature {args.temperature}, "
          f"{torch.get_num_threads()} threads")
    for key in sorted(totals):
        line = f"{key:18s} {totals[key]:7.2f} s"
        if key in stats:
            steps, tokens, fwd, drafted = stats[key]
            line += (f"  identical {same[key]}/{n}  {drafted / steps:.2f} draft nodes and {tokens / steps:.2f} "
                     f"tokens per forward, forward {1e3 * fwd / max(steps - n, 1):.2f} ms per decoding step")
        print(line)
    for mode in ("greedy", "sampled"):
        print(f"{mode}: addmm / t time {totals[f'{mode} addmm'] / totals[f'{mode} t']:.3f}x")


if __name__ == "__main__":
    main()
