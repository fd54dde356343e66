"""What slot rows cost a verify forward: SmolLM2-135M-Instruct, a chain draft of k nodes, with no slot blocks, one
block after the deepest node (attach "last") or a block after the root and every node (attach "path").

One forward over the rows of one step (root + k draft nodes + slot rows) against a 200-token cache, through the
loop's own input builder (fastverify.hf.attention.step_inputs), skinny linears on, gated adapters of the shipped GAD
drafter installed. Median of ``--repeats`` forwards per layout, layouts interleaved; times relative to a plain
one-token decoding step measured the same way.

    python benchmarks/slot_cost.py --threads 2
"""

import argparse
import copy
import statistics
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3, help="draft chain length (the slots drafted it: m = k)")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--torch-adapters", action="store_true",
                    help="the adapters' torch ops instead of the fused C++ update (for comparison)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import DynamicCache

    import fastverify
    from fastverify.hf.attention import cache_kwargs, prefill_inputs, step_inputs
    from fastverify.hf.linear import skinny_linears
    from fastverify.lora import slot_gate
    from fastverify.models import load_smollm2
    from fastverify.tree import Tree

    if args.torch_adapters:
        import fastverify.lora
        fastverify.lora._HAS_FUSED = False
    model, _ = load_smollm2()
    drafter = fastverify.load_drafter("smollm2-gad", model)
    m, k, L = drafter.block_size, args.k, args.context
    ids = torch.randint(10, 40000, (1, L + 1))
    tree = Tree(list(range(100, 100 + k)), list(range(-1, k - 1)))
    layouts = {"plain step (1 row)": (Tree([], []), None), f"chain of {k}, no slots": (tree, None),
               f"chain of {k}, attach last": (tree, [[k - 1]]),
               f"chain of {k}, attach path": (tree, [[-1] + list(range(k))])}
    times = {name: [] for name in layouts}
    with torch.no_grad(), drafter.installed(model), skinny_linears(model):
        cache = DynamicCache()
        mask, pos = prefill_inputs(torch.ones(1, L, dtype=torch.long), torch.float32)
        model(input_ids=ids[:, :L], attention_mask=mask, position_ids=pos, use_cache=True,
              **cache_kwargs(model, cache))
        rows = {}
        for _ in range(args.repeats):
            for name, (t, blocks) in layouts.items():
                inp = step_inputs([t], [int(ids[0, L])], [L], [0], torch.float32, "cpu", blocks=blocks,
                                  block_size=m, bidirectional=True)
                c = copy.copy(cache)
                c.layers = [copy.copy(layer) for layer in cache.layers]  # the step appends; keep the prefix
                embeds = model.get_input_embeddings()(inp.input_ids)
                t0 = time.perf_counter()
                with slot_gate(inp.slot_rows if blocks else None):
                    model(inputs_embeds=embeds, attention_mask=inp.mask, position_ids=inp.position_ids,
                          use_cache=True, **cache_kwargs(model, c))
                times[name].append(time.perf_counter() - t0)
                rows[name] = inp.input_ids.shape[1]
    base = statistics.median(times["plain step (1 row)"])
    print(f"SmolLM2-135M-Instruct fp32, {torch.get_num_threads()} threads, cache {L} tokens, GAD block of {m} slots; "
          f"median of {args.repeats}; adapters: {'torch ops' if args.torch_adapters else 'fused C++ update'}")
    print("| layout | rows | ms | x plain step |\n| --- | --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {rows[name]} | {1e3 * med:.1f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
