"""The check a model type outside the registry passes before the patched ``generate`` drives it
(``patch(model, allow_unknown_model=True)``), and a model of a registered type that holds module classes from
outside transformers and torch.nn or a forward bound over transformers' own (``patch._foreign_code``).

A registered type was checked by the tests (greedy through the loop equal to its own ``generate``); an unknown one
may compute something else under the loop's contract (one 4D mask for the whole forward, explicit position_ids, a
``DynamicCache`` cropped after a rejected draft): an encoder used as a language model, whose attention is
bidirectional (BERT-like models without ``is_decoder``), a cache whose state a crop cannot undo, an attention that
ignores the 4D mask or a forward that refuses it. So before the first call the loop runs, it decodes a small batch
with ``ProbeDrafter``, whose trees hold the model's own next tokens and wrong ones beside and after them (rows the
cache must drop, siblings the mask must keep apart), and compares the result with the original ``generate`` on that
batch: the tokens, and each new token's logits to within the model dtype's rounding (``TOLERANCE``). A verdict holds
for the patch under what it was made with (``check_key``: the model's dtype, device and attention implementation and
the call's computation options, which choose the loop's kernels and paths); a model moved, cast or switched to
another attention, or a call with other options, is checked again. A type that fails falls back to the original
``generate`` on every such call, the reason in its warning.

The probe's sequences are short (16 tokens at most). What only longer ones show escapes it: a window under a
config name the loop does not read (``model_limits.sequence_limit`` bounds a sequence by the ones it does), above
all one masked by the key's row in the cache rather than its position (a verify forward's tree rows stand past
their positions, so past such a window the model attends to fewer keys in the loop: GPT-Neo's local layers, safe
because their ``window_size`` bounds the sequence), a table of position embeddings the loop does not know the size
of (``model_limits.position_limit``). Registering a type is the stronger claim: its tests run sequences past its
windows and to the end of its tables.
"""

import torch

from fastverify.hf.drafters import Drafter, empty_tree
from fastverify.hf.loop import DecodeSettings, decode, embedding_rows, model_dtype, model_vocab_size
from fastverify.hf.model_limits import _text_config
from fastverify.tree import Tree

__all__ = ["check_key", "check_model", "check_rows", "ProbeDrafter", "TOLERANCE"]

# the largest difference between the loop's logits and generate's that counts as rounding, relative to the row's
# largest |logit| (at least 1): a verify forward's rows round differently from one-row decoding
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 5e-2, torch.bfloat16: 5e-2}
PROMPTS = (9, 6)  # the probe batch's prompt lengths (left padded)
NEW_TOKENS = 7  # steps of 3, 1 and 3 tokens (``ProbeDrafter``)
# check_rows's batches: three requests and more steps, so that more of the forwards' rows take both of the vector
# and scalar paths of torch's elementwise kernels where a layer's rounding depends on them (a tiny Laguna's router
# with a soft cap passes (9, 6) and 7 tokens and fails this batch); and one request alone, whose undrafted forwards
# have one row: a one-row slice of a wider output is contiguous where several rows are strided, and torch's GELU
# (erf) computes a strided input on another path (ModernBERT's decoder chunks its MLP's output before it), which
# only such a batch compares with the drafted forwards' rows
ROW_BATCHES, ROW_NEW_TOKENS = ((9, 6, 4), (7,)), 12
# the settings of the call that the probe decodes with too: how the loop computes, and the model's own limits
_KEPT = ("backend", "skinny_linear", "pack_weights", "lean_layers", "live_rows", "max_positions", "window")


def check_key(model, settings: DecodeSettings):
    """What a verdict of ``check_model`` or ``check_rows`` holds for: the model's dtype, device and attention
    implementation (its config's and its text config's: a model switched to another one between calls is checked
    again), and the call's ``_KEPT`` settings."""
    config = getattr(model, "config", None)
    attention = tuple(getattr(c, "_attn_implementation", None) for c in (config, _text_config(config)))
    return (model_dtype(model), model.get_input_embeddings().weight.device, attention,
            tuple(getattr(settings, k) for k in _KEPT))


class ProbeDrafter(Drafter):
    """Drafts from a known continuation ``reference`` (B lists of the tokens the model generates after each prompt,
    whose lengths ``prompt_lengths`` holds). On even steps a request's tree is [next, wrong sibling of next,
    the one after next, a wrong token after that] (parents [-1, -1, 0, 2]): two nodes accepted, a sibling and a
    deeper node rejected; on odd steps a single wrong token. A request whose output has left the reference (a tie
    resolved the other way) gets the same shapes with tokens that are simply wrong."""

    def __init__(self, reference, prompt_lengths, vocab_size: int):
        self.reference, self.prompt_lengths, self.V = reference, prompt_lengths, vocab_size
        self.steps = 0

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        self.steps = 0

    def _token(self, b: int, i: int) -> int:
        ref = self.reference[b]
        return ref[i] if i < len(ref) else 0

    def _wrong(self, token: int, shift: int) -> int:
        return (token + shift) % self.V

    def propose(self, contexts, budget):
        trees = []
        for b, (ctx, bud) in enumerate(zip(contexts, budget)):
            done = len(ctx) - self.prompt_lengths[b]  # tokens committed so far
            nxt, after = self._token(b, done), self._token(b, done + 1)
            if self.V < 2 or bud <= 0:
                trees.append(empty_tree())
            elif self.steps % 2 == 0:
                toks = [nxt, self._wrong(nxt, 1), after, self._wrong(self._token(b, done + 2), 2)]
                par = [-1, -1, 0, 2]
                keep = sorted([0, 2, 1, 3][:bud])  # within the budget, the chain first
                index = {j: i for i, j in enumerate(keep)}
                trees.append(Tree([toks[j] for j in keep], [index[par[j]] if par[j] >= 0 else -1 for j in keep]))
            else:
                trees.append(Tree([self._wrong(nxt, 1)], [-1]))
        self.steps += 1
        return trees


def _probe_batch(model, device, prompts=PROMPTS):
    """Left-padded prompts of random tokens (a fixed generator) of ``prompts``' lengths, and their attention mask."""
    high = max(1, min(n for n in (embedding_rows(model), model_vocab_size(model)) if n is not None))
    g = torch.Generator().manual_seed(0)
    L = max(prompts)
    ids = torch.zeros((len(prompts), L), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(prompts):
        ids[b, L - n:] = torch.randint(0, high, (n,), generator=g)
        mask[b, L - n:] = 1
    return ids.to(device), mask.to(device)


def _probe_settings(settings: DecodeSettings, new_tokens: int = NEW_TOKENS) -> DecodeSettings:
    """The probe batch's decoding: ``new_tokens`` greedy tokens without eos, their logits recorded, under the call's
    ``_KEPT`` settings."""
    return DecodeSettings(max_new_tokens=new_tokens, eos_token_ids=[], pad_token_id=0, output_logits=True,
                          pace_batch=False, **{k: getattr(settings, k) for k in _KEPT})


def _differs(loop_logits, ref_logits, loop_tokens, ref_tokens, tol: float):
    """Why the loop's output is not generate's (None when it is): per request, the logits of every new token up to
    the first token where they differ, within ``tol`` of each other relative to the row's scale, and that token a
    tie within ``tol`` (a near-tie may resolve the other way); beyond it the two decode different sequences."""
    for b in range(len(ref_tokens)):
        for t, (got, want) in enumerate(zip(loop_tokens[b], ref_tokens[b])):
            a, r = loop_logits[t][b].float(), ref_logits[t][b].float()
            scale = max(1.0, float(r.abs().max()))
            err = float((a - r).abs().max()) / scale
            if not err <= tol:  # (NaN included)
                return (f"request {b}'s logits for new token {t} differ from generate's by {err:.3g} of the row's "
                        f"scale (expected <= {tol:g})")
            if got != want:
                if float(r.max() - r[got]) / scale > tol:
                    return f"request {b}'s new token {t} is {got} where generate gives {want}"
                break  # a tie resolved the other way: the sequences differ from here on
    return None


def check_model(model, original_generate, settings: DecodeSettings):
    """Decode the probe batch through the loop and with ``original_generate``; None when the loop's output is
    generate's (to rounding), else the reason it is not (an exception in either counts). ``settings``: the call's,
    whose computation options and model limits the probe keeps."""
    from transformers import GenerationConfig
    device = model.get_input_embeddings().weight.device
    ids, mask = _probe_batch(model, device)
    saved = model.generation_config
    model.generation_config = GenerationConfig()  # transformers' defaults: no eos, no processors of the model's
    try:
        with torch.no_grad():
            ref = original_generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    num_beams=1, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    except Exception as e:  # noqa: BLE001 - any failure of the reference means no verdict for the loop
        return f"the original generate raised on the check's batch ({type(e).__name__}: {str(e)[:120]})"
    finally:
        model.generation_config = saved
    ref_tokens = ref.sequences[:, ids.shape[1]:].tolist()
    probe = _probe_settings(settings)
    drafter = ProbeDrafter(ref_tokens, list(PROMPTS), model_vocab_size(model))
    record = {}
    try:
        with torch.no_grad():
            out, _ = decode(model, ids, mask, drafter, probe, record=record)
    except Exception as e:  # noqa: BLE001 - a forward that refuses the loop's inputs
        return f"the loop raised {type(e).__name__}: {str(e)[:120]}"
    return _differs(record["logits"], ref.logits, out[:, ids.shape[1]:].tolist(), ref_tokens,
                    TOLERANCE.get(model_dtype(model), 5e-2))


def check_rows(model, settings: DecodeSettings):
    """Whether the loop's forwards on ``model`` are row-invariant, as seeded sampling with drafts needs (a sampled
    row's logits the bits of undrafted decoding's, so that each draw is the seeded stream's): decode each of
    ``ROW_BATCHES`` through the loop without drafts, then with ``ProbeDrafter``'s trees on those tokens, and compare
    every new token's logits bit for bit. None when they are the same, else the reason. Rows round differently beside
    draft rows where a layer's arithmetic depends on the number of rows: attention a modeling file computes itself
    with torch's matmul over the query rows (Falcon under eager attention), scores or gates a modeling file
    computes into new tensors, whose elementwise kernels take their scalar tail at a position that depends on the
    row count (a tiny Laguna's router with a soft cap on logits over four experts), an elementwise kernel whose path
    depends on a slice's layout (GELU; the loop's ``row_gelu`` makes transformers' and torch's GELU modules agree), on
    a GPU any of torch's GEMMs (docs/hf.md: "Exactness")."""
    device = model.get_input_embeddings().weight.device
    probe = _probe_settings(settings, ROW_NEW_TOKENS)
    for prompts in ROW_BATCHES:
        ids, mask = _probe_batch(model, device, prompts)
        plain, drafted = {}, {}
        try:
            with torch.no_grad():
                out, _ = decode(model, ids, mask, Drafter(), probe, record=plain)
                tokens = out[:, ids.shape[1]:].tolist()
                decode(model, ids, mask, ProbeDrafter(tokens, list(prompts), model_vocab_size(model)), probe,
                       record=drafted)
        except Exception as e:  # noqa: BLE001 - a forward that refuses the loop's inputs
            return f"the loop raised {type(e).__name__}: {str(e)[:120]}"
        for t, (a, b) in enumerate(zip(plain["logits"], drafted["logits"])):
            if not torch.equal(a, b):
                err = float((a.float() - b.float()).abs().max())
                return (f"with draft rows beside them, the logits of new token {t} (a batch of {len(prompts)}) "
                        f"differ from undrafted decoding's by up to {err:.3g}")
    return None
