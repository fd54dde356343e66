"""Every generation-config field at edge values: the patched generate against the plain one.

Each field of ``transformers.GenerationConfig`` is set in turn to None, 0, False, "", [], 1, True, -1, 0.5 and 2 on
a tiny Llama (batch 1 and 2, greedy; batch 2 sampled), and each of generate's other arguments (``ARGUMENTS``: its
lists, its assisted decoding's, the model inputs it passes on) to those values and empty lists of processors and
criteria (batch 1 and 2, greedy); the patched call is held to the plain one: both raise, or both return the same
sequences (sampled calls: both return, the loop's sampler being its own), having given the same warnings and log
lines. Prints each pair that differs as a JSON line; the prompt lookup at batch size > 1 (which the loop decodes,
where generate's assisted decoding refuses it) is expected, and so is generate's deprecation warning for
``past_key_values=None`` (5.24 deprecates the argument; 5.17 does not), which the loop reads as not given.
``assistant_early_exit`` is left out: generate's early-exit assistant leaves the model changed when its call raises,
so the calls after it would not compare.

    python tests/hf_option_sweep.py [--fields a,b,...]
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_hf_reliability import PAD, _llama, _prompts, said  # noqa: E402

from fastverify.hf import patch, unpatch  # noqa: E402

VALUES = (None, 0, False, "", [], 1, True, -1, 0.5, 2)
LEFT_OUT = {"max_new_tokens", "max_length", "max_time", "do_sample", "assistant_early_exit"}
ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
             "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "tokenizer", "custom_generate",
             "assistant_tokenizer", "generation_config", "inputs_embeds", "past_key_values", "cache", "position_ids",
             "token_type_ids", "logits_to_keep", "return_dict")


def _call(model, ids, mask, kw):
    """(sequences, None, what it said) or (None, the exception's type name, what it said): its warnings other than
    fastverify's and transformers' log lines (``said``)."""
    with said() as lines:
        try:
            out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6, **kw)
            result = getattr(out, "sequences", out), None
        except Exception as e:  # any error generate raises is the reference here
            result = None, type(e).__name__
    return (*result, [line[:120] for line in lines])


def sweep(fields=None):
    import transformers
    transformers.logging.set_verbosity_warning()
    model = _llama()
    fields = fields or sorted(k for k in vars(transformers.GenerationConfig()) if not k.startswith("_"))
    fields = [f for f in fields if f not in LEFT_OUT]
    lists = (transformers.LogitsProcessorList(), transformers.StoppingCriteriaList())
    differing, calls = [], 0
    for B, sampled, names, values in ((1, False, fields, VALUES), (2, False, fields, VALUES), (2, True, fields, VALUES),
                                      (1, False, ARGUMENTS, VALUES + lists), (2, False, ARGUMENTS, VALUES + lists)):
        ids, mask = _prompts(B)
        for name in names:
            for value in values:
                kw = {name: value, **({"do_sample": True} if sampled else {})}
                unpatch(model)
                want, want_error, want_said = _call(model, ids, mask, kw)
                patch(model)
                got, got_error, got_said = _call(model, ids, mask, kw)
                calls += 1
                same = (want_error is not None) == (got_error is not None) and (
                    want_error is not None or (want.shape == got.shape and (sampled or torch.equal(want, got))))
                if not same:
                    differing.append({"batch": B, "sampled": sampled, "field": name, "value": repr(value),
                                      "generate": want_error or "decodes", "patched": got_error or "decodes"})
                elif want_said != got_said:
                    differing.append({"batch": B, "sampled": sampled, "field": name, "value": repr(value),
                                      "generate said": want_said, "patched said": got_said})
    unpatch(model)
    return differing, calls


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fields", default=None, help="comma-separated field names (default: every field)")
    args = ap.parse_args()
    differing, calls = sweep(args.fields.split(",") if args.fields else None)
    for d in differing:
        print(json.dumps(d))
    print(f"{calls} option values, {len(differing)} differing")
