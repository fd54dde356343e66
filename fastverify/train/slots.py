"""Training recipe: slot drafters (GAD's [MASK] block, Lexical Unit Decoding's [PAD] lookahead) on the target itself.

``python -m fastverify.train slots --method gad|lud --model smollm2 --out DIR``; ``train_slots(model, tokenizer,
cfg)`` is the Python API for any Hugging Face causal LM. One file, five stages, driven by ``SlotsConfig``:

  1. setup   load the target, freeze it, seed; a BlockSlotDrafter with zero-initialised gated LoRA adapters
  2. data    the self-distillation shards of the proposal-heads recipe (fastverify.train.heads: the target's
             greedy continuations of the training prompts, Spec-Bench-overlapping prompts dropped), shared: made
             once, by either recipe. Each sequence is prompt + continuation; a no-grad forward over it gives the
             key/value cache the slots attend to and the target's own probabilities (a consistency check: a
             sequence whose continuation is not the forward's argmax in >= 95% of positions is skipped, so a
             shard can never be paired with the wrong prompts; and LUD's unit confidences)
  3. train   per sequence, blocks of m slot rows attached every ``attach_every`` positions p of the
             continuation (from a seeded random offset): slot i (1..m) sits at position p + i, sees the sequence
             up to p and its block (GAD: all of it, bidirectional; LUD: the slots before it), and is trained to
             output the target's greedy token x[p + 1 + i], the token i positions after the one the target itself
             predicts at p (exactly what the loop asks of a block at decode time). Loss: mean CE over the slot
             rows. GAD: every slot. LUD (its data reconfiguration): slot i counts only while x[p + 1 .. p + 1 + i]
             all have target confidence >= ``unit_alpha`` (the lexical unit that starts after p), so the
             block learns to continue units and the rest of each block is left as [PAD].
             Only the adapters and the slot embeddings train (AdamW, warmup then cosine); a tqdm bar shows the
             loss and slot-1 accuracy; a checkpoint (trainables, optimiser, scheduler, step, sequence order,
             RNG states, options) every ``save_every`` steps; ``--resume`` (default) continues from it, with the
             options it was saved with (only the budget, the measurements and the run options may change).
  4. eval    on the held-out shards: per-slot top-1 / top-5 agreement with the target's greedy tokens, and the
             mean accepted prefix of a block's argmax chain (the draft tokens a block would get accepted
             under greedy verification, per block)
  5. calibrate  one softmax temperature per slot (temperature scaling, Guo et al. 2017), fitted on the held-out
             sequences to the target's greedy token at every block position (the loss of stage 3 masks LUD's
             non-unit positions, but the loop reads a block wherever it attaches): the slots' probabilities then
             mean what they say, which LUD's confidence acceptance and the n-gram merge's estimates rely on.
             ``--calibrate`` does this stage alone for the checkpoint in --out, on held-out prompts taken from
             the end of the prompt set (see ``calibration_prompts``)
  6. output  DIR/slots.safetensors + DIR/config.json (fastverify.hf.slots.save_slot_drafter: method, sizes,
             base model, fingerprint of its output projection, training options, evaluation and temperatures)
"""

import dataclasses
import math
import os
import random
import re
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastverify.heads import fingerprint
from fastverify.hf.attention import cache_kwargs
from fastverify.hf.slots import BlockSlotDrafter, save_slot_drafter
from fastverify.lora import slot_gate
from fastverify.train.cli import parse_config, run_recipe, start_run
from fastverify.train.heads import (RUN_OPTIONS, RecipeOptions, _above, _at_least, _rng_state, _set_rng_state,
                                    check_resumable, data_folder, generate_data, recipe_shards, shard_prompts)

__all__ = ["SlotsConfig", "train_slots", "slot_batch", "main"]


@dataclass(kw_only=True)
class SlotsConfig(RecipeOptions):
    num_prompts: int = 1500                    # the proposal-heads recipe's shards (same options, same cache)
    method: str = "gad"                        # "gad" (bidirectional blocks) or "lud" (causal, unit-masked loss)
    num_slots: int = 4                         # m: slots per block
    rank: int = 8                              # LoRA rank on every projection of every decoder layer
    alpha: float = 16.0                        # LoRA scale: the update is alpha / rank x B A
    unit_alpha: float = 0.6                    # LUD: confidence threshold of a lexical unit
    attach_every: int = 3                      # a block every this many continuation positions
    # training
    minutes: float = 60.0                      # time budget of the training stage (0: one epoch)
    steps: int = 0                             # > 0: exactly this many sequences instead (minutes ignored)
    lr: float = 1e-3                           # AdamW's peak learning rate (warmup, then cosine to 0)
    warmup: int = 20                           # steps of linear warmup
    save_every: int = 50                       # steps between saves of the training state
    eval_sequences: int = 48                   # held-out sequences of the final evaluation
    curve_every: int = 0                       # > 0: held-out mean accepted every this many steps (a curve)
    curve_sequences: int = 12                  # held-out sequences per curve point
    calibrate: bool = False                    # only fit the slot temperatures of the checkpoint in --out

    METHODS = ("gad", "lud")  # what ``method`` may be (a subclass's recipe: its own)

    def check(self) -> None:
        super().check()
        if self.method not in self.METHODS:
            raise ValueError(f"method: expected {' or '.join(map(repr, self.METHODS))}, got {self.method!r}")
        for name in ("num_slots", "rank", "attach_every", "eval_sequences", "curve_sequences"):
            _at_least(self, name, 1)
        for name in ("minutes", "steps", "warmup", "curve_every"):
            _at_least(self, name, 0)
        for name in ("alpha", "lr"):
            _above(self, name, 0)
        if not 0 <= self.unit_alpha <= 1:
            raise ValueError(f"unit_alpha: expected a confidence in [0, 1], got {self.unit_alpha}")


# ----------------------------------------------------------------------------------------------- 3. train

def _sequences(paths, tokenizer, prompts, cfg):
    """[(shard index, request, prompt ids, continuation ids)] of the shards."""
    out = []
    for path in paths:
        index = int(re.search(r"shard_(\d+)", path).group(1))
        shard = torch.load(path)
        plist = shard_prompts(shard, index, tokenizer, prompts, cfg.max_prompt_tokens, cfg.gen_batch)
        tokens, lengths = shard["tokens"].tolist(), shard["lengths"].tolist()
        if len(plist) != len(tokens):
            continue  # the prompts cannot be reconstructed for this shard
        for b, n in enumerate(lengths):
            if n > cfg.num_slots + 2:
                out.append((index, b, plist[b], tokens[b][:n]))
    return out


def load_data(model, tokenizer, cfg, prompts=None, log=print, sample=None):
    """(training sequences, held-out sequences, prompts dropped by the 8-gram filter) of a recipe config: the
    proposal-heads recipe's shards of the target's greedy continuations (fastverify.train.heads.recipe_shards),
    made here if missing; with ``sample`` (generate's sampling options), sampled continuations in a folder of
    their own named by those options."""
    eval_p, train_p, dropped, eval_paths, train_paths = recipe_shards(model, tokenizer, cfg, prompts, log, sample)
    train_seqs = _sequences(train_paths, tokenizer, train_p, cfg)
    eval_seqs = _sequences(eval_paths, tokenizer, eval_p, cfg)
    log(f"data: {len(train_seqs)} training sequences ({sum(len(s[3]) for s in train_seqs)} continuation tokens) "
        f"from {len(train_paths)} shards; {len(eval_seqs)} held-out sequences")
    return train_seqs, eval_seqs, dropped


@torch.no_grad()
def _prefix(model, ids):
    """The key/value cache of the whole sequence and the target's probabilities of each next token.
    Returns (cache, argmax int64 [T], prob of the actual next token float [T - 1])."""
    from transformers import DynamicCache
    cache = DynamicCache()
    out = model(input_ids=ids[None], use_cache=True, **cache_kwargs(model, cache))
    logp = out.logits[0].float().log_softmax(-1)
    return cache, logp.argmax(-1), logp[:-1].gather(-1, ids[1:, None])[:, 0].exp()


def slot_batch(seq_len, prompt_len, attach, m, bidirectional, dtype, device):
    """Model inputs of the slot rows of one training sequence: blocks of m slots attached at positions ``attach``
    (the block at p sees positions 0..p and its own slots). Returns (position_ids int64 [1, R], additive mask
    [1, 1, R, seq_len + R], slot offsets int64 [R], attachment of each row int64 [R]) with R = len(attach) * m."""
    R = len(attach) * m
    p = torch.tensor(attach, device=device).repeat_interleave(m)
    offset = torch.arange(m, device=device).repeat(len(attach))
    visible = torch.zeros(R, seq_len + R, dtype=torch.bool, device=device)
    visible[:, :seq_len] = torch.arange(seq_len, device=device)[None, :] <= p[:, None]
    block = torch.arange(R, device=device) // m
    same = block[:, None] == block[None, :]
    if not bidirectional:
        same &= offset[None, :] <= offset[:, None]
    visible[:, seq_len:] = same
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return (p + 1 + offset)[None], mask[None, None], offset, p


def _slot_forward(model, drafter, ids, prompt_len, first, attach_every, check=True, grad=False):
    """The slot rows of one training sequence: blocks of the drafter's m slots attached every ``attach_every``
    positions from ``first``, run through the target (adapters gated on for them) against the sequence's cache.
    None for a sequence that fails the consistency check (``check``) or has no block; else (logits [R, V] float,
    slot offsets [R], attachments p [R], target positions p + 2 + offset [R], the target's probability of each
    next token [T - 1])."""
    cache, argmax, conf = _prefix(model, ids)
    T = ids.shape[0]
    if check and (argmax[prompt_len - 1:T - 1] == ids[prompt_len:]).float().mean().item() < 0.95:
        return None
    attach = list(range(first, T - 2, attach_every))
    if not attach:
        return None
    dev = ids.device
    pos, mask, offset, p = slot_batch(T, prompt_len, attach, drafter.block_size, drafter.bidirectional, model.dtype,
                                      dev)
    logits = gated_slot_logits(model, cache, drafter.slot_embed[offset], mask, pos, grad)
    return logits, offset, p, p + 2 + offset, conf


def gated_slot_logits(model, cache, embeds, mask, pos, grad):
    """Logits [R, V] (float) of R slot rows: ``embeds`` [R, D] through the target against the sequence's ``cache``,
    with the drafter's adapters gated on for every row (the slot recipes' one forward with gradients)."""
    gate = torch.ones(1, embeds.shape[0], dtype=torch.bool, device=embeds.device)
    with slot_gate(gate), torch.set_grad_enabled(grad):
        return model(inputs_embeds=embeds.to(model.dtype)[None], attention_mask=mask, position_ids=pos,
                     use_cache=True, **cache_kwargs(model, cache)).logits[0].float()


def _slot_loss(model, drafter, ids, prompt_len, cfg, rng, evaluate=False, check=True):
    """("skip", None) for a sequence that fails the consistency check (``check``) or has no slot target; else
    (loss, or None when evaluating; stats: per-slot top-1 hits / top-5 hits / counted [m], and the accepted
    prefix length of each block whose slots all have targets)."""
    m = cfg.num_slots
    first = prompt_len - 1 + (0 if evaluate else rng.randrange(cfg.attach_every))
    rows = _slot_forward(model, drafter, ids, prompt_len, first, cfg.attach_every, check, grad=not evaluate)
    if rows is None:
        return "skip", None
    logits, offset, p, target_pos, conf = rows
    T, dev = ids.shape[0], ids.device
    target = torch.where(target_pos < T, ids[target_pos.clamp(max=T - 1)], torch.full_like(target_pos, -100))
    if drafter.method == "lud":  # the unit after p: every token from p + 1 up to the target at or above unit_alpha
        ok = conf >= cfg.unit_alpha                      # ok[j]: token j + 1 is confident
        run = torch.zeros(T + 1, dtype=torch.long, device=dev)  # run[j]: confident tokens from j + 1 on
        for j in range(T - 2, -1, -1):
            run[j] = run[j + 1] + 1 if ok[j] else 0
        # slot i targets token p + 2 + i; the unit must cover p + 1 .. p + 2 + i, i.e. i + 2 tokens from p + 1
        in_unit = run[p] >= offset + 2
        target = torch.where(in_unit, target, torch.full_like(target, -100))
    valid = target >= 0
    if not bool(valid.any()):
        return "skip", None
    loss = F.cross_entropy(logits[valid], target[valid]) if not evaluate else None
    with torch.no_grad():
        top5 = logits.topk(5, -1).indices
        hit1 = (top5[:, 0] == target) & valid
        hit5 = (top5 == target[:, None]).any(-1) & valid
        stats = {"hit1": torch.zeros(m).index_add_(0, offset.cpu(), hit1.float().cpu()),
                 "hit5": torch.zeros(m).index_add_(0, offset.cpu(), hit5.float().cpu()),
                 "count": torch.zeros(m).index_add_(0, offset.cpu(), valid.float().cpu())}
        # accepted prefix of each block's argmax chain (greedy verification accepts while the chain matches)
        chain = (top5[:, 0] == target).view(-1, m).cpu()
        full = (target >= 0).view(-1, m).all(-1).cpu()
        stats["accepted"] = [int(c.int().cumprod(0).sum()) for c, f in zip(chain, full) if f]
    return loss, stats


def _evaluate(model, drafter, seqs, cfg, log, loss_fn=None):
    """Held-out statistics: per-slot top-1 / top-5 of ``loss_fn`` (default ``_slot_loss``) in evaluation mode
    over cfg.eval_sequences sequences, and the mean accepted draft tokens per block."""
    loss_fn = loss_fn or _slot_loss
    m = drafter.block_size
    agg = {"hit1": torch.zeros(m), "hit5": torch.zeros(m), "count": torch.zeros(m)}
    skipped = 0
    rng = random.Random(0)
    for _, _, prompt, cont in seqs[:cfg.eval_sequences]:
        ids = torch.tensor(prompt + cont, device=next(model.parameters()).device)
        _, st = loss_fn(model, drafter, ids, len(prompt), cfg, rng, evaluate=True)
        if st is None:
            skipped += 1
            continue
        for k, x in st.items():  # per-slot tensors add up; per-block lists ("accepted", ...) concatenate
            agg[k] = agg.get(k, []) + x if isinstance(x, list) else agg[k] + x
    n = agg["count"].clamp(min=1)
    ev = {"top1": [round(x, 4) for x in (agg["hit1"] / n).tolist()],
          "top5": [round(x, 4) for x in (agg["hit5"] / n).tolist()],
          "slots_counted": agg["count"].long().tolist(), "blocks": len(agg.get("accepted", [])),
          "sequences_skipped": skipped}
    for k, x in agg.items():
        if isinstance(x, list):
            ev["mean_" + k] = round(sum(x) / max(len(x), 1), 4)
    log("held-out: slot top-1 " + " ".join(f"{x:.3f}" for x in ev["top1"]) + " | top-5 "
        + " ".join(f"{x:.3f}" for x in ev["top5"]) + f" | mean accepted per block {ev['mean_accepted']:.3f} over "
        f"{ev['blocks']} blocks")
    return ev


def _nll(logits, y, s):
    return float((torch.logsumexp(s * logits, -1) - s * logits.gather(1, y[:, None])[:, 0]).mean())


def inverse_temperature(logits: torch.Tensor, y: torch.Tensor, iters: int = 12) -> float:
    """The s in [0.05, 20] minimising the mean NLL of labels y [N] under softmax(s * logits) ([N, V] float64):
    Newton's method from s = 1 (the NLL is convex in s: NLL'(s) = mean(E_p[l] - l_y), NLL''(s) = mean(Var_p[l]))."""
    ly = logits.gather(1, y[:, None])[:, 0]
    s = 1.0
    for _ in range(iters):
        p = torch.softmax(s * logits, -1)
        mean = (p * logits).sum(-1)
        var = (p * logits * logits).sum(-1) - mean * mean
        grad, hess = float((mean - ly).sum()), float(var.sum())
        if hess <= 0:
            break
        s = min(max(s - grad / hess, 0.05), 20.0)
    return s


@torch.no_grad()
def fit_temperature(model, drafter, seqs, cfg, log=print, iters: int = 12):
    """Per-slot softmax temperatures minimising the held-out negative log-likelihood of the target's greedy
    token at every slot of blocks attached every ``cfg.attach_every`` positions of each continuation
    (temperature scaling, Guo et al. 2017: one scalar per slot; the ranking, so every argmax draft, is
    unchanged; ``inverse_temperature``). Returns (temperatures [m] list, stats dict: rows counted, NLL and the mean
    top-1 probability against top-1 accuracy, before and after)."""
    m = drafter.block_size
    rows = [[] for _ in range(m)]
    dev = next(model.parameters()).device
    for _, _, prompt, cont in seqs[:cfg.eval_sequences]:
        ids = torch.tensor(prompt + cont, device=dev)
        out = _slot_forward(model, drafter, ids, len(prompt), len(prompt) - 1, cfg.attach_every)
        if out is None:
            continue
        logits, offset, _, target_pos, _ = out
        for i in range(m):
            keep = (offset == i) & (target_pos < ids.shape[0])
            if bool(keep.any()):
                rows[i].append((logits[keep].cpu(), ids[target_pos[keep]].cpu()))
    temps, stats = [], {"rows": [], "nll": [], "top1_prob": [], "top1_acc": []}
    for i in range(m):
        if not rows[i]:
            temps.append(1.0)
            continue
        logits = torch.cat([r[0] for r in rows[i]]).double()
        y = torch.cat([r[1] for r in rows[i]])
        s = inverse_temperature(logits, y, iters)
        acc = float((logits.argmax(-1) == y).double().mean())
        stats["rows"].append(len(y))
        stats["nll"].append([round(_nll(logits, y, 1.0), 4), round(_nll(logits, y, s), 4)])
        stats["top1_prob"].append([round(float(torch.softmax(x * logits, -1).max(-1).values.mean()), 4)
                                   for x in (1.0, s)])
        stats["top1_acc"].append(round(acc, 4))
        temps.append(round(1.0 / s, 4))
    log("slot temperatures " + " ".join(f"{t:.3f}" for t in temps) + " | mean top-1 probability before / after "
        + " ".join(f"{a:.3f}/{b:.3f}" for a, b in stats["top1_prob"]) + " against top-1 accuracy "
        + " ".join(f"{a:.3f}" for a in stats["top1_acc"]))
    return temps, stats


def calibration_prompts(cfg, prompts=None, log=print):
    """Held-out prompts for ``--calibrate``: the last ``eval_prompts`` of the whole prompt set after duplicates
    and the 8-gram filter. A training run reads at most max(4 x (num_prompts + eval_prompts), 4000) prompts from
    the start of the set, so for checkpoints trained on fewer than ~4000 prompts of the default set (17k) these
    are prompts they never saw, whichever selection they were trained with."""
    from fastverify.train.heads import load_prompts, ngram_filter
    if prompts is None:
        prompts = load_prompts(cfg.prompts, limit=10 ** 9)
    dropped = 0
    if all(isinstance(p, str) for p in prompts):
        prompts = list(dict.fromkeys(prompts))
        prompts, dropped = ngram_filter(prompts, cfg.exclude)
    log(f"calibration prompts: the last {cfg.eval_prompts} of {len(prompts)} ({dropped} dropped for sharing a word "
        f"8-gram with {cfg.exclude or '(nothing)'})")
    return prompts[-cfg.eval_prompts:]


def calibrate_checkpoint(model, tokenizer, cfg, prompts=None, log=print):
    """``--calibrate``: fit the slot temperatures of the checkpoint in cfg.out (``fit_temperature``) on the target's
    greedy continuations of ``calibration_prompts`` and write them, with their statistics, into its config.json.
    Returns the updated config."""
    from fastverify.hf.slots import load_slot_drafter
    drafter = load_slot_drafter(cfg.out, model)
    prompts = calibration_prompts(cfg, prompts, log)
    folder = os.path.join(data_folder(cfg), "calibration")
    paths = generate_data(model, tokenizer, prompts, folder, batch=cfg.gen_batch, max_new_tokens=cfg.max_new_tokens,
                          max_prompt_tokens=cfg.max_prompt_tokens, progress=cfg.progress, desc="data (calibration)")
    seqs = _sequences(paths, tokenizer, prompts, cfg)
    with drafter.installed(model):
        temps, stats = fit_temperature(model, drafter, seqs, cfg, log)
    config = dict(drafter.config)
    config["slot_temperature"] = temps
    config["calibration"] = {"prompts": "last %d of the prompt set" % cfg.eval_prompts, "sequences": len(seqs),
                             "attach_every": cfg.attach_every, **stats}
    drafter.temperature = torch.tensor(temps)
    save_slot_drafter(drafter, cfg.out, config)
    log(f"wrote the slot temperatures into {cfg.out}/config.json")
    return config


def curve_evaluator(model, drafter, eval_seqs, cfg, loss_fn=None):
    """``evaluate(n)`` for ``fit``'s curve points: the mean accepted per block on the first n held-out sequences."""
    return lambda n: _evaluate(model, drafter, eval_seqs[:n], cfg, lambda *a: None, loss_fn=loss_fn)["mean_accepted"]


def _trainables(drafter, named=False):
    """The parameters a recipe trains: slot embeddings, adapters, and PTP's auxiliary embedding."""
    out = [(n, p) for n, p in drafter.named_parameters()
           if n == "slot_embed" or n.startswith("aux.") or n.endswith(("lora_A", "lora_B"))]
    return out if named else [p for _, p in out]


def _resumed_order(state, seqs, seed, log):
    """The saved sequence order, by (shard, request) key, so that it survives shards added since (a resumed run
    with a data budget makes more): the saved sequences in their saved order, then any new ones, shuffled."""
    keys = state.get("order_keys")
    if keys is None:  # a state from before keys were saved: "order", indices valid while the data is unchanged
        if len(state["order"]) != len(seqs):
            raise ValueError(f"resume: the training state's sequence order covers {len(state['order'])} sequences, "
                             f"the data now has {len(seqs)}; resume with the data it was trained on or start a new "
                             f"--out")
        return state["order"]
    where = {tuple(s[:2]): i for i, s in enumerate(seqs)}
    order = [where[tuple(k)] for k in keys if tuple(k) in where]
    new = sorted(set(range(len(seqs))) - set(order))
    random.Random(seed + len(order)).shuffle(new)
    if new or len(order) != len(keys):
        log(f"resume: {len(keys) - len(order)} saved sequences no longer in the data, {len(new)} new ones appended")
    return order + new


# What may change when a slot / PTP run resumes: the heads recipe's run options, the training budget (a resumed run
# with a longer one trains on, its cosine stretched to the new end) and what is only measured (the curve, the
# final evaluation). Anything else (the method, rank, learning rate, ...) must be what the state was saved with.
SLOT_RUN_OPTIONS = RUN_OPTIONS | {"minutes", "steps", "eval_sequences", "curve_every", "curve_sequences", "calibrate"}


def fit(model, drafter, seqs, loss_fn, cfg, desc="train", log=print, evaluate=None):
    """Train ``drafter``'s slot embeddings and adapters (``_trainables``) on ``seqs`` [(shard, request, prompt ids,
    continuation ids)] for cfg.steps sequences, or cfg.minutes (0: one pass over seqs). ``loss_fn(ids,
    prompt_len, rng)`` -> (loss, stats with "hit1" / "count" per slot) or ("skip", None). AdamW, warmup then
    cosine; a tqdm bar with the loss and slot-1 accuracy; cfg.out/train_state.pt (trainables, optimiser, step,
    sequence order, RNG states, the config) every cfg.save_every steps and at the end, continued from when
    cfg.resume (a ValueError, before any step, for an option outside SLOT_RUN_OPTIONS that changed). With
    cfg.curve_every > 0 and ``evaluate(n)`` (mean accepted per block on n held-out sequences), a curve point every
    cfg.curve_every steps in the history. Returns (steps, history, seconds)."""
    from tqdm.auto import tqdm
    params = _trainables(drafter)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    order = list(range(len(seqs)))
    random.Random(cfg.seed).shuffle(order)
    total = cfg.steps if cfg.steps > 0 else len(order) if cfg.minutes <= 0 else None
    os.makedirs(cfg.out, exist_ok=True)
    state_path = os.path.join(cfg.out, "train_state.pt")
    step, history, elapsed, seen = 0, [], 0.0, 0
    if cfg.resume and os.path.isfile(state_path):
        st = torch.load(state_path, weights_only=False)
        if "config" in st:
            check_resumable(cfg, st["config"], state_path, SLOT_RUN_OPTIONS)
        drafter.load_state_dict(st["trainables"], strict=False)
        opt.load_state_dict(st["optimizer"])
        step, history, elapsed = st["step"], st["history"], st["elapsed"]
        order = _resumed_order(st, seqs, cfg.seed, log)
        seen = max((h["targets"] for h in history), default=0)
        _set_rng_state(st["rng"])
        log(f"resumed at step {step} ({elapsed:.0f} s trained)")
    rng = random.Random(cfg.seed + step)

    def lr_at(s):
        warm = min(1.0, (s + 1) / max(cfg.warmup, 1))
        horizon = total or max(step + 1, int(cfg.minutes * 60 / max(elapsed / max(step, 1), 0.5)))
        return cfg.lr * warm * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(horizon, 1))))

    def save():
        torch.save({"trainables": {n: p.detach() for n, p in _trainables(drafter, named=True)},
                    "optimizer": opt.state_dict(), "step": step, "history": history, "elapsed": elapsed,
                    "order_keys": [seqs[i][:2] for i in order], "rng": _rng_state(),
                    "config": dataclasses.asdict(cfg)}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)

    bar = tqdm(desc=desc, total=total, initial=step, disable=not cfg.progress, unit="seq")
    device = next(model.parameters()).device
    t_last = time.perf_counter()
    with drafter.installed(model):
        drafter.train()
        while (total is None and elapsed < cfg.minutes * 60) or (total is not None and step < total):
            _, _, prompt, cont = seqs[order[step % len(order)]]
            ids = torch.tensor(prompt + cont, device=device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, st = loss_fn(ids, len(prompt), rng)
            if st is not None:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                acc1 = (st["hit1"][0] / st["count"][0].clamp(min=1)).item()
                seen += int(st["count"].sum())
                history.append({"step": step, "loss": round(loss.item(), 4), "acc1": round(acc1, 4),
                                "targets": seen, "seconds": round(elapsed, 1)})
                bar.set_postfix(loss=f"{loss.item():.3f}", slot1=f"{acc1:.2f}")
            step += 1
            now = time.perf_counter()
            elapsed += now - t_last
            t_last = now
            bar.update(1)
            if evaluate is not None and cfg.curve_every > 0 and step % cfg.curve_every == 0:
                drafter.eval()
                point = {"step": step, "targets": seen, "mean_accepted": evaluate(cfg.curve_sequences)}
                history.append(point)
                log(f"curve: {point}")
                drafter.train()
                t_last = time.perf_counter()  # evaluation time is not training time
            if step % cfg.save_every == 0:
                save()
        save()
        bar.close()
        drafter.eval()
    return step, history, elapsed


def train_slots(model, tokenizer, cfg: SlotsConfig, base_name: str = None, prompts=None, log=print):
    """The Python API: train a GAD / LUD slot drafter for ``model`` and its ``tokenizer``. Writes cfg.out/
    {slots.safetensors, config.json, train_state.pt}; returns (BlockSlotDrafter, config dict)."""
    t_start = time.perf_counter()
    base_name = start_run(model, cfg, base_name)
    if cfg.calibrate:
        return None, calibrate_checkpoint(model, tokenizer, cfg, prompts, log=log)
    os.makedirs(cfg.out, exist_ok=True)
    drafter = BlockSlotDrafter(model.config.hidden_size, cfg.num_slots, cfg.method).init_adapters(
        model, cfg.rank, cfg.alpha)
    drafter.to(next(model.parameters()).device)

    # 2. data: the shared self-distillation shards
    train_seqs, eval_seqs, dropped = load_data(model, tokenizer, cfg, prompts, log)

    # 3. train (with --curve-every, the held-out mean accepted per block every that many steps: a curve)
    step, history, t_train = fit(model, drafter, train_seqs, lambda ids, n, rng: _slot_loss(
        model, drafter, ids, n, cfg, rng), cfg, desc=f"train {cfg.method}", log=log,
        evaluate=curve_evaluator(model, drafter, eval_seqs, cfg))

    # 4. eval, 5. calibrate
    with drafter.installed(model):
        ev = _evaluate(model, drafter, eval_seqs, cfg, log)
        temps, cal = fit_temperature(model, drafter, eval_seqs, cfg, log)
    drafter.temperature = torch.tensor(temps)

    # 6. output
    config = write_checkpoint(drafter, model, cfg, base_name, history, ev, t_start, log,
                              top={"slot_temperature": temps, "calibration": {"sequences": "held-out", **cal}},
                              prompts_dropped_8gram=dropped, train_sequences=len(train_seqs), sequences_seen=step,
                              train_seconds=round(t_train, 1))
    return drafter, config


def write_checkpoint(drafter, model, cfg, base_name, history, ev, t_start, log, top=None, **training):
    """Save a trained slot drafter (safetensors + config.json in cfg.out) with its config: the base model and its
    fingerprint, ``top`` (extra top-level entries), the training options, ``training`` figures, the final loss
    (mean of the last 50 steps of ``history``), a thinned loss curve, the held-out curve points of ``history``
    (``accepted_curve``, from --curve-every), and the evaluation ``ev``. Returns the config."""
    curve = [h for h in history if "mean_accepted" in h]
    history = [h for h in history if "loss" in h]
    recent = history[-50:]
    config = {
        "base_model": base_name, "base_fingerprint": fingerprint(model), **(top or {}),
        "training": {"options": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "data_dir")},
                     **training, "accepted_curve": curve,
                     "final_loss": round(sum(h["loss"] for h in recent) / max(len(recent), 1), 4),
                     "curve": history[::max(1, len(history) // 40)],
                     "total_seconds": round(time.perf_counter() - t_start, 1)},
        "eval": ev,
    }
    save_slot_drafter(drafter, cfg.out, config)
    log(f"wrote {cfg.out}/slots.safetensors and config.json ({time.perf_counter() - t_start:.0f} s in all)")
    return config


# ----------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> SlotsConfig:
    return parse_config(SlotsConfig, argv, "python -m fastverify.train slots", __doc__.split("\n\n")[0])


def main(argv=None):
    run_recipe(SlotsConfig, train_slots, argv, "python -m fastverify.train slots", __doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
