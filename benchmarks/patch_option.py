"""One boolean ``fastverify.patch`` option on and off, side by side: patched greedy generate on Spec-Bench
questions with SmolLM2-135M-Instruct, the two settings alternating per question (off, on, off, on), every output
checked against plain ``generate``.

    python benchmarks/patch_option.py lean_layers --questions 4 --threads 2
    python benchmarks/patch_option.py pack_weights --drafter bpd+ngram
    python benchmarks/patch_option.py lean_layers --device cuda      # the lean (and dense C++) layers on a GPU

Prints, per setting: outputs identical to ``generate``, total seconds, and the model forward's milliseconds per
decoding step (fastverify.hf.stats; the drafts do not depend on the option, so both settings run the same steps).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e  # noqa: E402
import fastverify  # noqa: E402
import fastverify.hf  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("option", help="a boolean fastverify.patch option, e.g. lean_layers, pack_weights")
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "bpd+ngram"])
    ap.add_argument("--questions", type=int, default=4, help="Spec-Bench question 1 of the first N categories")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from fastverify.models import load_smollm2
    model, tok = load_smollm2(device=args.device)
    model.eval()
    path = os.path.join(e2e.ROOT, e2e.DEFAULT_QUESTIONS)
    questions = e2e.load_questions(path, per_category=1, offset=args.offset)[:args.questions]
    seconds, forward, identical = {False: 0.0, True: 0.0}, {False: 0.0, True: 0.0}, {False: 0, True: 0}
    for q in questions:
        ids = e2e.encode(tok, q["prompt"]).to(model.device)
        with torch.inference_mode():
            want = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        for on in (False, True, False, True):
            drafter = (fastverify.NGramDrafter() if args.drafter == "ngram"
                       else e2e.heads_drafter(model, args.drafter))
            fastverify.patch(model, drafter=drafter, **{args.option: on})
            try:
                e2e._sync(ids.device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                e2e._sync(ids.device)
                seconds[on] += time.perf_counter() - t0
                st = fastverify.hf.stats(model)
            finally:
                fastverify.unpatch(model)
            forward[on] += st.time_forward / st.steps / 2
            identical[on] += int(torch.equal(out, want))
    n = len(questions)
    print(f"{args.option}, {args.drafter}, {n} questions x 2 runs per setting, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    for on in (False, True):
        print(f"  {args.option}={on}: identical to generate {identical[on]}/{2 * n}, {seconds[on]:.2f} s, "
              f"forward {forward[on] / n * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
