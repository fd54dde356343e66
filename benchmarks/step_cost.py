"""What a drafted step's forward costs, by the size of its draft: the data behind the drafters' cost model.

Runs the patched SmolLM2-135M-Instruct on the quick prompts with the shipped proposal heads merged with the n-gram
drafter, at several node costs so that trees of every size from 0 to 16 nodes occur, times each verify forward
of the loop (a hook on the model: the forward alone, not drafting or verification) and prints the median per
draft size, in units of the median undrafted forward (k = 0: first steps and finished drafts).

    python benchmarks/step_cost.py --threads 2
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import QUICK_PROMPTS, machine_info  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="passes over the prompts (the first one warms up)")
    p.add_argument("--node-costs", type=float, nargs="+", default=[0.0, 0.02, 0.06, 0.2])
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    import fastverify
    from fastverify.hf import NGramDrafter
    from fastverify.models import load_smollm2

    model, tok = load_smollm2()
    with open(QUICK_PROMPTS) as f:
        prompts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"] for q in prompts]
    times, state = {}, {"k": None, "t": 0.0, "record": False}

    def pre(module, args, kwargs):
        state["t"] = time.perf_counter()

    def post(module, args, kwargs, out):
        if state["record"] and state["k"] is not None:
            times.setdefault(state["k"], []).append(time.perf_counter() - state["t"])
        state["k"] = None  # anything not preceded by a proposal is not recorded

    class Recording(fastverify.HeadsDrafter):
        def reset(self, batch_size):
            super().reset(batch_size)
            self.first = True

        def propose(self, contexts, budget):
            trees = super().propose(contexts, budget)
            # the first step's forward also runs the prompt: not a step's cost
            state["k"] = None if self.first else len(trees[0])
            self.first = False
            return trees

    hooks = [model.register_forward_pre_hook(pre, with_kwargs=True),
             model.register_forward_hook(post, with_kwargs=True)]
    from fastverify.heads import load_heads
    heads, cfg = load_heads("smollm2-bpd", model)
    for rep in range(args.repeats):
        state["record"] = rep > 0
        for node_cost in args.node_costs:
            for ids in prompts:
                drafter = Recording(model, heads, ngram=NGramDrafter(), calibration=cfg.get("calibration"),
                                    node_cost=node_cost, min_gain=0.0)
                fastverify.patch(model, drafter=drafter, row_hooks=True)  # its hooks record
                try:
                    with torch.no_grad():
                        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                       do_sample=False)
                finally:
                    fastverify.unpatch(model)
    for h in hooks:
        h.remove()
    info = machine_info()
    print("; ".join(f"{k} {v}" for k, v in info.items()))
    if 0 not in times:
        raise SystemExit("no undrafted step was timed; nothing to compare with")
    base = statistics.median(times[0])
    print("| draft nodes k | forwards timed | median ms | x undrafted forward |\n|---|---|---|---|")
    for k in sorted(times):
        med = statistics.median(times[k])
        print(f"| {k} | {len(times[k])} | {1e3 * med:.2f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
