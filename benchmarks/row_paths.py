"""The loop's row-invariant paths for GPT-2's Conv1D layers, mixture-of-experts layers and eager attention, on and
off, side by side. A model with random weights from a fixed seed (no such checkpoint ships with the project's packages) decodes
the same prompts with plain ``generate``, then patched with the n-gram drafter, the path on ("rows": what the loop
does) or off (the loop before it), alternating per prompt:

- ``--model gpt2``: GPT-2 small's shape (12 layers, 768 wide, vocabulary 50257); off: Conv1D's own ``torch.addmm``
  instead of ``skinny_linear_t`` (fastverify.hf.linear);
- ``--model qwen3-moe``: a Qwen3-MoE shape (8 layers, 512 wide, 8 experts of 512, top 2, vocabulary 32000); off:
  transformers' own experts implementation (grouped_mm) and routers instead of fastverify.hf.experts;
- ``--model gemma2``: a Gemma 2 shape (8 layers, 512 wide, 8 query heads on 4 key / value heads of 64, the soft cap,
  vocabulary 32000), whose attention transformers runs eager only; off: the modeling file's own eager attention
  (torch's matmul over the query rows) instead of masked_attention (fastverify.hf.attention.eager_attention).

Greedy and seeded sampling (``--temperature``, 0.2 by default: a random model's logits are nearly flat, so at 0.8
its draws are nearly uniform and no draft is accepted): greedy outputs are checked against ``generate``, sampled
ones against the loop's own undrafted sampling with the seed on the same setting.

    python benchmarks/row_paths.py --model gpt2 --prompts 4 --threads 2
    python benchmarks/row_paths.py --model qwen3-moe --prompts 4 --threads 2
    python benchmarks/row_paths.py --model gemma2 --prompts 4 --threads 2

A random model's greedy text soon repeats, which the n-gram drafter copies: its tokens per forward are not a real
model's. What the comparison shows is the cost of the same steps on one path or the other, and, under sampling,
whether the loop drafts at all (it samples without drafts where its forward is not row-invariant).
"""

import argparse
import contextlib
import time
import warnings

import torch

import fastverify
import fastverify.hf
import fastverify.hf.linear as hf_linear
import fastverify.hf.loop as hf_loop


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                                      attn_implementation="sdpa")).eval()


def _qwen3_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, attn_implementation="sdpa")).eval()


def _gemma2(seed: int):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1536, max_position_embeddings=1024, attn_implementation="eager")).eval()


MODELS = {"gpt2": _gpt2, "qwen3-moe": _qwen3_moe, "gemma2": _gemma2}


@contextlib.contextmanager
def _path_off(model_name: str):
    """The loop as it was before the model's row-invariant path."""
    if model_name == "gpt2":
        saved, hf_linear._conv1d_type = hf_linear._conv1d_type, (lambda: None)
        try:
            yield
        finally:
            hf_linear._conv1d_type = saved
    else:
        name = "skinny_experts" if model_name == "qwen3-moe" else "eager_attention"
        saved = getattr(hf_loop, name)
        setattr(hf_loop, name, lambda m: contextlib.nullcontext())
        try:
            yield
        finally:
            setattr(hf_loop, name, saved)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.2)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = MODELS[args.model](args.seed)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, vocab, (1, args.prompt_len), generator=g) for _ in range(args.prompts)]
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
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not sample:
                    fastverify.unpatch(model)
                    ref = timed(f"{mode} generate", lambda: model.generate(ids, attention_mask=mask, **kw))
                for which in (("rows", "off") if i % 2 == 0 else ("off", "rows")):
                    with _path_off(args.model) if which == "off" else contextlib.nullcontext():
                        if sample:  # the loop's own undrafted sampling with the seed, on the same path
                            fastverify.patch(model, drafter=fastverify.Drafter())
                            ref = model.generate(ids, attention_mask=mask, seed=i, **kw)
                        fastverify.patch(model, drafter=fastverify.NGramDrafter())
                        extra = {"seed": i} if sample else {}
                        out = timed(f"{mode} {which}", lambda: model.generate(ids, attention_mask=mask, **kw, **extra))
                        st = fastverify.hf.stats(model)
                    key = f"{mode} {which}"
                    same[key] = same.get(key, 0) + int(torch.equal(out, ref))
                    s = stats.setdefault(key, [0, 0, 0.0, 0])
                    s[0] += st.steps
                    s[1] += sum(st.new_tokens)
                    s[2] += st.time_forward
                    s[3] += st.drafted_tokens
            fastverify.unpatch(model)
    n = args.prompts
    print(f"{args.model} (random weights), {n} prompts of {args.prompt_len} tokens, {args.max_new_tokens} new tokens, "
          f"sampling at temperature {args.temperature}, {torch.get_num_threads()} threads")
    for key in sorted(totals):
        line = f"{key:18s} {totals[key]:7.2f} s"
        if key in stats:
            steps, tokens, fwd, drafted = stats[key]
            line += (f"  identical {same[key]}/{n}  {drafted / steps:.2f} draft nodes and {tokens / steps:.2f} "
                     f"tokens per forward, forward {1e3 * fwd / max(steps - n, 1):.2f} ms per decoding step")
        print(line)
    for mode in ("greedy", "sampled"):
        print(f"{mode}: off / rows time {totals[f'{mode} off'] / totals[f'{mode} rows']:.3f}x")


if __name__ == "__main__":
    main()
