"""Training recipe: an EAGLE draft layer (fastverify.eagle) by self-distillation.

``python -m fastverify.train eagle --model smollm2 --out DIR``. The data stage is the proposal heads' recipe's
(fastverify.train.heads: the same prompts, filter, shards and cache folder, so the two recipes share their
data): the target's greedy continuations with the final hidden states that produced them. Each request's rows
form one sequence; the layer is trained on batches of whole sequences, unrolled ``--passes`` times (EAGLE-3's
training-time test, fastverify.eagle), with the loss sum_d decay^(d-1) [CE(pass d) + reg * SmoothL1(u, F_next)].
AdamW, warmup then cosine, a tqdm bar with the loss and the per-pass top-1, a training state every
``--save-every`` steps that ``--resume`` (default) continues from exactly. The evaluation gives per pass (draft
depth) the top-1 / top-5 agreement with the target's greedy tokens on held-out prompts, with the path above right
(teacher forcing: what the drafter's tree needs), and the calibration table the drafter scores candidates with.
"""

import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastverify.eagle import EagleLayer, save_eagle
from fastverify.heads import WEIGHT_DTYPES, fingerprint, output_projection
from fastverify.train.cli import run_recipe, start_run
from fastverify.train.heads import (CALIBRATION_BINS, RecipeOptions, _above, _at_least, _eval_targets,
                                    _input_embedding, _projection, _remap, _round_to, build_vocab_subset, recipe_shards,
                                    run_training)

__all__ = ["EagleConfig", "train_eagle", "build_sequences", "main"]


@dataclass(kw_only=True)
class EagleConfig(RecipeOptions):
    num_prompts: int = 5000                    # the heads recipe's data (same prompts and cache), more of it
    num_heads: int = 9                         # attention heads of the draft layer
    intermediate_size: int = 1536              # the draft layer's MLP width
    vocab_subset: int = 8192                   # the layer's output vocabulary: the most frequent tokens of the
                                               #   training targets (0 = the full vocabulary)
    passes: int = 3                            # unrolled draft depths in training
    # training
    epochs: float = 2.0                        # passes over the training sequences
    batch_size: int = 16                       # sequences per step
    lr: float = 1e-3                           # AdamW's peak learning rate (linear warmup, then cosine to 0)
    weight_decay: float = 0.0                  # AdamW's weight decay
    warmup: int = 30                           # steps of linear warmup
    decay: float = 0.8                         # pass d weighs decay^(d-1)
    reg: float = 0.1                           # weight of the feature regression (smooth L1)
    save_dtype: str = "float16"                # of the checkpoint's weights

    def check(self) -> None:
        super().check()
        if self.save_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"save_dtype: expected one of {list(WEIGHT_DTYPES)}, got {self.save_dtype!r}")
        for name in ("num_heads", "intermediate_size", "passes", "batch_size"):
            _at_least(self, name, 1)
        for name in ("vocab_subset", "warmup", "weight_decay", "decay", "reg"):
            _at_least(self, name, 0)
        for name in ("epochs", "lr"):
            _above(self, name, 0)


def build_sequences(paths, T: int = None):
    """Shards -> (features fp16 [N, T, D], tokens int64 [N, T], lengths int64 [N]): one sequence per request
    (rows past its length zero)."""
    fs, ts, ls = [], [], []
    for p in paths:
        s = torch.load(p)
        tok, lens, hid = s["tokens"].long(), s["lengths"].long(), s["hidden"]
        keep = lens > 1
        fs.append(hid[keep])
        ts.append(tok[keep])
        ls.append(lens[keep])
    T = T or max(f.shape[1] for f in fs)
    fs = [F.pad(f, (0, 0, 0, T - f.shape[1])) for f in fs]
    ts = [F.pad(t, (0, T - t.shape[1])) for t in ts]
    feats, toks, lens = torch.cat(fs), torch.cat(ts), torch.cat(ls)
    row = torch.arange(T)[None]
    feats[row.expand(len(lens), -1) >= lens[:, None]] = 0
    toks = toks.masked_fill(row >= lens[:, None], 0)
    return feats, toks, lens


def _targets(toks, lens, passes, subset, V, eval_mode=False):
    """[passes, N, T] targets (remapped into the subset; -100 none): pass d's row j predicts g_{j+1}, for
    d - 1 <= j < len - 1. eval_mode: tokens outside the subset are -101 (a miss), else skipped (-100)."""
    N, T = toks.shape
    nxt = F.pad(toks[:, 1:], (0, 1))
    j = torch.arange(T)[None]
    out = []
    for d in range(1, passes + 1):
        valid = (j >= d - 1) & (j < lens[:, None] - 1)
        t = torch.where(valid, nxt, torch.full_like(nxt, -100))
        out.append(_eval_targets(t, subset, V) if eval_mode else _remap(t, subset, V))
    return torch.stack(out)


def _pass_losses(layer, feats, toks, targets, w, b, embed, passes, reg):
    """(per-pass loss list, per-pass top-1 list, outputs). The loss: CE(the target's greedy token) + reg
    SmoothL1(u, F_next)."""
    x = feats.float()
    outs = layer.unrolled(x, embed[toks], passes)
    nxt_feat = F.pad(x[:, 1:], (0, 0, 0, 1))
    losses, acc = [], []
    for d, u in enumerate(outs):
        t = targets[d]
        valid = t >= 0
        if not valid.any():
            losses.append(u.sum() * 0)
            acc.append(float("nan"))
            continue
        uv = u[valid]
        logits = uv @ w.t()
        if b is not None:
            logits = logits + b
        loss = F.cross_entropy(logits, t[valid])
        if reg > 0:
            loss = loss + reg * F.smooth_l1_loss(uv, nxt_feat[valid])
        losses.append(loss)
        acc.append((logits.argmax(-1) == t[valid]).float().mean().item())
    return losses, acc, outs


def train_loop(layer, feats, toks, targets, w, b, embed, cfg: EagleConfig, state_path: str, log=print):
    """Train in place on sequences (feats fp16 [N, T, D], toks [N, T], targets [passes, N, T]: ``_targets``);
    the loss sums the passes with weights decay^(d-1). fastverify.train.heads.run_training's loop, state and
    resume. Returns the history."""

    def batch_loss(idx):
        losses, acc, _ = _pass_losses(layer, feats[idx], toks[idx], targets[:, idx], w, b, embed, cfg.passes,
                                      cfg.reg)
        return sum(cfg.decay ** d * l for d, l in enumerate(losses)), acc

    return run_training(layer, "layer", feats.shape[0], batch_loss, cfg, state_path, log, desc="train eagle")


@torch.no_grad()
def evaluate(layer, feats, toks, targets, w, b, embed, passes, ranks: int = 10, chunk: int = 32):
    """Per pass (draft depth): top-1 / top-5 agreement with the target's greedy token with the path above right,
    the rank histogram and the calibration table (fastverify.train.heads.evaluate's format)."""
    hits, n = torch.zeros(passes, ranks), torch.zeros(passes)
    edges = torch.tensor(CALIBRATION_BINS, dtype=torch.float32)
    nb = len(CALIBRATION_BINS) - 1
    bin_n, bin_hit = torch.zeros(passes, nb), torch.zeros(passes, nb)
    for s in range(0, feats.shape[0], chunk):
        outs = layer.unrolled(feats[s:s + chunk].float(), embed[toks[s:s + chunk]], passes)
        for d, u in enumerate(outs):
            t = targets[d, s:s + chunk]
            valid = t != -100
            logits = u[valid] @ w.t()
            if b is not None:
                logits = logits + b
            top = logits.topk(ranks, dim=-1)
            prob = (top.values - torch.logsumexp(logits, -1, keepdim=True)).exp()
            eq = (top.indices == t[valid][:, None]).float()
            n[d] += valid.sum()
            hits[d] += eq.sum(0)
            k = torch.bucketize(prob.reshape(-1), edges[1:-1], right=True)
            bin_n[d] += torch.bincount(k, minlength=nb).float()
            bin_hit[d] += torch.bincount(k, weights=eq.reshape(-1), minlength=nb).float()
    rank_p = hits / n.clamp(min=1)[:, None]
    calib = ((bin_hit + 1) / (bin_n + 2)).cummax(dim=1).values
    return {"positions": [int(x) for x in n.tolist()], "top1": rank_p[:, 0].tolist(),
            "top5": rank_p[:, :5].sum(-1).tolist(), "rank_acceptance": rank_p.tolist(),
            "calibration": {"bins": list(CALIBRATION_BINS), "acceptance": calib.tolist(),
                            "counts": bin_n.long().tolist()}}


def format_eval(ev) -> str:
    lines = ["| draft depth (predicts) | top-1 | top-5 |", "| --- | --- | --- |"]
    for d, (a1, a5) in enumerate(zip(ev["top1"], ev["top5"])):
        lines.append(f"| {d + 1} (t+{d + 2}) | {a1:.3f} | {a5:.3f} |")
    return "\n".join(lines)


def train_eagle(model, tokenizer, cfg: EagleConfig, base_name: str = None, prompts=None, log=print):
    """The Python API: train an EAGLE draft layer for any Hugging Face causal LM ``model`` and its ``tokenizer``.
    Writes cfg.out/{eagle.safetensors, config.json, train_state.pt}; returns (layer, config dict)."""
    t_start = time.perf_counter()
    base_name = start_run(model, cfg, base_name)
    os.makedirs(cfg.out, exist_ok=True)

    t0 = time.perf_counter()
    eval_p, train_p, dropped, eval_paths, train_paths = recipe_shards(model, tokenizer, cfg, prompts, log)
    feats, toks, lens = build_sequences(train_paths)
    ev_feats, ev_toks, ev_lens = build_sequences(eval_paths)
    t_data = time.perf_counter() - t0
    log(f"data: {len(train_paths)} train shards, {feats.shape[0]} sequences, {int(lens.sum())} positions; "
        f"{len(eval_paths)} held-out shards, {int(ev_lens.sum())} positions ({t_data:.0f} s)")

    weight = output_projection(model)[0]
    V = weight.shape[0]
    nxt = toks[:, 1:][torch.arange(toks.shape[1] - 1)[None] < lens[:, None] - 1]
    subset = build_vocab_subset(nxt[:, None], cfg.vocab_subset, V)
    w, b = _projection(model, subset)
    dev = w.device
    embed = _input_embedding(model, dev)
    layer = EagleLayer(feats.shape[-1], cfg.num_heads, cfg.intermediate_size, subset).to(dev)
    targets = _targets(toks, lens, cfg.passes, subset, V)
    history = train_loop(layer, feats.to(dev), toks.to(dev), targets.to(dev), w, b, embed, cfg,
                         os.path.join(cfg.out, "train_state.pt"), log=log)
    t_train = history[-1]["seconds"] if history else 0.0

    _round_to(layer, cfg.save_dtype)
    ev = evaluate(layer, ev_feats.to(dev), ev_toks.to(dev), _targets(ev_toks, ev_lens, cfg.passes, subset, V, True).to(
        dev), w, b, embed, cfg.passes)
    log("held-out evaluation (agreement with the target's greedy tokens, the path above right):\n" + format_eval(ev))
    config = {
        "base_model": base_name, "base_fingerprint": fingerprint(model), "calibration": ev["calibration"],
        "rank_acceptance": ev["rank_acceptance"],
        "training": {"options": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "data_dir")},
                     "prompts_dropped_8gram": dropped, "train_prompts": len(train_p), "eval_prompts": len(eval_p),
                     "train_sequences": int(feats.shape[0]), "train_positions": int(lens.sum()),
                     "eval_positions": int(ev_lens.sum()), "steps": len(history),
                     "final_loss": history[-1]["loss"] if history else None, "data_seconds": round(t_data, 1),
                     "train_seconds": round(t_train, 1), "total_seconds": round(time.perf_counter() - t_start, 1)},
        "eval": {k: ev[k] for k in ("positions", "top1", "top5")},
    }
    save_eagle(layer, cfg.out, config, dtype=cfg.save_dtype)
    log(f"wrote {cfg.out}/eagle.safetensors and config.json ({time.perf_counter() - t_start:.0f} s in all)")
    return layer, config


DESCRIPTION = "Train an EAGLE draft layer on a frozen causal LM by self-distillation."


def main(argv=None):
    run_recipe(EagleConfig, train_eagle, argv, "python -m fastverify.train eagle", DESCRIPTION)


if __name__ == "__main__":
    main(sys.argv[1:])
