"""Training recipe: Parallel Token Prediction slot drafters (Draxler et al.; O-PTP and C-PTP) on the target itself.

``python -m fastverify.train ptp --model smollm2 --out DIR``; ``train_ptp(model, tokenizer, cfg)`` is the Python API
for any Hugging Face causal LM. The stages are those of the slot recipe (fastverify.train.slots), with sampled
data and PTP's targets:

  1. setup   load the target, freeze it, seed; a PTPSlotDrafter (fastverify.hf.slots) of m + 1 causal slots with
             zero-initialised gated LoRA adapters and an auxiliary embedding (``--aux-mode interp|bits``, or
             ``none``: the independent per-slot baseline, the same slots without auxiliary variables)
  2. data    the teacher (the target) samples continuations of the training prompts at generation settings
             (``--temperature 0.7 --top-k 50 --top-p 0.95``; cached shards, resumable; Spec-Bench-overlapping
             prompts dropped). A no-grad forward over each sequence gives the cache the slots attend to and the
             teacher's logits; each sampled token x_q gets its auxiliary variable u_q = cdf_invert(warped teacher
             logits at q - 1, x_q, v), v ~ Beta(a, a) inside the token's bin (PTP Appendix D; ``--beta-a 0``:
             uniform), so that cdf_sample(warped teacher logits, u_q) = x_q: the u the coupled rule would have
             drawn. A sequence where more than 5% of the tokens have no bin under these settings is skipped.
  3. train   blocks of m + 1 slots attached every ``attach_every`` positions p of the continuation; slot i sits at
             position q = p + 1 + i, sees the sequence up to p and the earlier slots of its block, and learns
               O-PTP (``--variant o``): input u_q, CE on x_q (the slot computes t = F^-1(u));
               C-PTP (``--variant c``): input u_(q-1), cross-entropy against the teacher's warped distribution
                 of x_q (the slot learns the distribution; the draft is its inverse CDF at u_q);
               no auxiliary input: CE on x_q (the slot learns the marginal; the draft is its inverse CDF at u_q).
             Slots after a token without a bin get no target. The rest as the slot recipe (fit: AdamW, warmup and
             cosine, progress bar, checkpoint and resume).
  4. eval    on held-out sampled sequences with uniform v (the distribution u has at decode time): per slot, how
             often its draft is the teacher's token, and the accepted draft tokens per block as the coupled rule
             counts them (the leading run of slots 1..m whose drafts match; with the drafter's ``first_gate``,
             0 unless slot 0 re-predicted the step's token): tokens per step = 1 + that; also for both draft
             rules (argmax, inverse CDF) with and without the gate
  5. output  DIR/slots.safetensors + DIR/config.json (fastverify.hf.slots.save_slot_drafter), loaded by
             fastverify.load_drafter(DIR, model); the sampling settings are recorded: the drafter is trained for
             them, and under other settings it stays exact but drafts worse
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastverify.hf.attention import cache_kwargs
from fastverify.hf.slots import PTPSlotDrafter
from fastverify.train.cli import parse_config, run_recipe, start_run
from fastverify.train.slots import (SlotsConfig, _evaluate, curve_evaluator, fit, gated_slot_logits, load_data,
                                    slot_batch, write_checkpoint)

__all__ = ["PTPConfig", "train_ptp", "ptp_targets", "main"]



@dataclass(kw_only=True)
class PTPConfig(SlotsConfig):
    method: str = "ptp"                        # Parallel Token Prediction (the only method of this recipe)
    variant: str = "o"                         # "o" (O-PTP: one-hot targets) or "c" (C-PTP: the distribution)
    aux_mode: str = "interp"                   # "interp", "bits", or "none" (the independent baseline)
    temperature: float = 0.7                   # the teacher's sampling settings (data and u)
    top_k: int = 50                            # the teacher's top-k
    top_p: float = 0.95                        # the teacher's top-p
    beta_a: float = 2.0                        # v ~ Beta(a, a) inside a token's bin; 0: uniform
    lr: float = 2e-3                           # AdamW's peak learning rate (warmup, then cosine to 0)

    METHODS = ("ptp",)

    def check(self) -> None:
        super().check()
        if self.variant not in PTPSlotDrafter.VARIANTS:
            raise ValueError(f"variant: expected one of {PTPSlotDrafter.VARIANTS}, got {self.variant!r}")
        if self.calibrate:
            raise ValueError("calibrate: slot temperatures are for the gad / lud slot drafters; a PTP slot drafts the "
                             "token its auxiliary variable selects, not by its confidence")
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected > 0 (the teacher samples), got {self.temperature}")
        if not self.top_k >= 0:
            raise ValueError(f"top_k: expected >= 0 (0: no top-k), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected 0 < top_p <= 1, got {self.top_p}")
        if not self.beta_a >= 0:
            raise ValueError(f"beta_a: expected >= 0 (0: uniform), got {self.beta_a}")

    @property
    def warp(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def ptp_targets(teacher_logits, ids, prompt_len, warp, v):
    """Auxiliary variables of a sampled sequence: float64 [T], u[q] = cdf_invert(teacher_logits[q - 1], ids[q],
    v[q - prompt_len], warp) for the continuation q >= prompt_len (NaN where ids[q] has no bin under ``warp``;
    NaN for the prompt). teacher_logits [T, V] (row j scores token j + 1); v float [T - prompt_len] in (0, 1)."""
    from fastverify.ops.sampling import cdf_invert
    T = ids.shape[0]
    u = torch.full((T,), float("nan"), dtype=torch.float64, device=ids.device)
    if T > prompt_len:
        rows = teacher_logits[prompt_len - 1:T - 1].float()
        u[prompt_len:] = cdf_invert(rows, ids[prompt_len:], v, **warp)
    return u


def _ptp_loss(model, drafter, ids, prompt_len, cfg, rng, evaluate=False):
    """("skip", None) for a sequence without usable blocks; else (loss, or None when evaluating; stats as
    fastverify.train.slots._slot_loss: per-slot hits of the draft, and the accepted draft tokens per block)."""
    from fastverify.ops.sampling import cdf_sample, normalise_warp, sample_v
    from fastverify.reference.sampling import warp_weights
    from transformers import DynamicCache
    m1, T, dev = drafter.block_size, ids.shape[0], ids.device
    with torch.no_grad():
        cache = DynamicCache()
        teacher = model(input_ids=ids[None], use_cache=True, **cache_kwargs(model, cache)).logits[0].float()
        g = torch.Generator().manual_seed(rng.randrange(2**62))
        a = None if evaluate or not cfg.beta_a else cfg.beta_a
        v = sample_v(T - prompt_len, a=a, generator=g).to(dev)
        u = ptp_targets(teacher, ids, prompt_len, cfg.warp, v)
    known = ~torch.isnan(u)
    if float(known[prompt_len:].float().mean()) < 0.95:
        return "skip", None
    first = prompt_len - 1 + (0 if evaluate else rng.randrange(cfg.attach_every))
    attach = list(range(first, T - 1, cfg.attach_every))
    if not attach:
        return "skip", None
    pos, mask, offset, p = slot_batch(T, prompt_len, attach, m1, False, model.dtype, dev)
    q = pos[0]                                           # the position of each slot's token
    inside = q < T
    qc = q.clamp(max=T - 1)
    # a slot's target exists while its token and every earlier token of its block have a bin
    ok = (inside & known[qc]).view(len(attach), m1).int().cumprod(-1).bool().view(-1)
    target = torch.where(ok, ids[qc], torch.full_like(q, -100))
    embeds = drafter.slot_embed[offset]
    if drafter.aux is not None:
        u_in = u[(q - 1).clamp(min=0, max=T - 1)] if drafter.variant == "c" else u[qc]
        embeds = embeds + drafter.aux(torch.nan_to_num(u_in, nan=0.5).float()).to(embeds.dtype)
    logits = gated_slot_logits(model, cache, embeds, mask, pos, grad=not evaluate)
    valid = target >= 0
    if not bool(valid.any()):
        return "skip", None
    loss = None
    if not evaluate:
        if drafter.variant == "c":  # the teacher's warped distribution of each slot's token
            rows = teacher[(q - 1).clamp(max=T - 2)[valid]]
            w = warp_weights(rows, normalise_warp(rows.shape[0], dev, **cfg.warp))
            soft = w / w.sum(-1, keepdim=True)
            loss = -(soft * logits[valid].log_softmax(-1)).sum(-1).mean()
        else:
            loss = F.cross_entropy(logits[valid], target[valid])
    with torch.no_grad():
        # drafts by both rules: the slot's argmax, and the inverse CDF of its distribution at u_q
        drafts = {"argmax": logits.argmax(-1), "inverse_cdf": cdf_sample(logits, torch.nan_to_num(u[qc], nan=0.5))}
        hit = (drafts["inverse_cdf" if drafter.samples else "argmax"] == target) & valid
        top5 = (logits.topk(5, -1).indices == target[:, None]).any(-1) & valid
        cnt = lambda x: torch.zeros(m1).index_add_(0, offset.cpu(), x.float().cpu())  # noqa: E731
        stats = {"hit1": cnt(hit), "hit5": cnt(top5), "count": cnt(valid)}
        hits = hit.view(len(attach), m1).cpu()
        full = valid.view(len(attach), m1).all(-1).cpu()
        stats["accepted"] = _accepted(hits, full, drafter.first_gate)
        for name, draft in drafts.items():  # both draft rules, with and without the slot-0 gate
            h = ((draft == target) & valid).view(len(attach), m1).cpu()
            stats["accepted_" + name] = _accepted(h, full, False)
            stats["accepted_" + name + "_gated"] = _accepted(h, full, True)
    return loss, stats


def _accepted(hits, full, gated):
    """Accepted draft tokens of each complete block: the leading run of slots 1..m whose drafts are right (none
    when ``gated`` and slot 0 did not re-predict the step's token: the drafter then proposes nothing)."""
    return [int(h[1:].int().cumprod(0).sum()) if h[0] or not gated else 0 for h, f in zip(hits, full) if f]


def train_ptp(model, tokenizer, cfg: PTPConfig, base_name: str = None, prompts=None, log=print):
    """The Python API: train a PTP slot drafter for ``model`` and its ``tokenizer``. Writes cfg.out/
    {slots.safetensors, config.json, train_state.pt}; returns (PTPSlotDrafter, config dict)."""
    t_start = time.perf_counter()
    base_name = start_run(model, cfg, base_name)
    drafter = PTPSlotDrafter(model.config.hidden_size, cfg.num_slots, aux_mode=cfg.aux_mode, variant=cfg.variant)
    drafter.init_adapters(model, cfg.rank, cfg.alpha).to(next(model.parameters()).device)

    train_seqs, eval_seqs, dropped = load_data(model, tokenizer, cfg, prompts, log, sample=cfg.warp)
    loss_fn = lambda ids, n, rng: _ptp_loss(model, drafter, ids, n, cfg, rng)  # noqa: E731
    name = f"train ptp-{cfg.variant}" + ("" if cfg.aux_mode != "none" else " (no aux)")
    step, history, t_train = fit(model, drafter, train_seqs, loss_fn, cfg, desc=name, log=log,
                                 evaluate=curve_evaluator(model, drafter, eval_seqs, cfg, loss_fn=_ptp_loss))
    with drafter.installed(model):
        ev = _evaluate(model, drafter, eval_seqs, cfg, log, loss_fn=_ptp_loss)

    config = write_checkpoint(drafter, model, cfg, base_name, history, ev, t_start, log, top={"sampling": cfg.warp},
                              prompts_dropped_8gram=dropped, train_sequences=len(train_seqs), sequences_seen=step,
                              train_seconds=round(t_train, 1))
    return drafter, config


def parse_args(argv=None) -> PTPConfig:
    return parse_config(PTPConfig, argv, "python -m fastverify.train ptp", __doc__.split("\n\n")[0])


def main(argv=None):
    run_recipe(PTPConfig, train_ptp, argv, "python -m fastverify.train ptp", __doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
