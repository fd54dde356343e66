"""Random generate calls on random tiny models of registered architectures (eleven families with configs of their
own by default; ``--archs all``: every registered type, the others built generically): patched ``generate`` must
give exactly the unpatched output, or fall back with a warning (and then, too, give that output).

One case = a random config (architecture; sliding windows, chunk sizes, RoPE scaling type, tied or untied
embeddings, attention implementation; in about a third of the cases every linear layer's weight as a GGUF file's
blocks hold it, so that the loop streams it packed), a random batch (1-4 requests, left padding, random prompt
lengths, repetitive or random prompts; in about one case in seven repeated to 40-100 tokens within the position
table, which the loop prefills in chunks), random ``generate`` options (greedy or sampling, max_new_tokens /
max_length, eos, stop strings, min_new_tokens / min_length, repetition penalty, no_repeat_ngram_size, bad words,
suppressed tokens, sequence biases, forced eos tokens, options the loop does not run), a random drafter (n-gram,
the target itself as a draft model, none, GAD / LUD / PTP slots with random active adapters, which also checks
that verify rows stay the base model, proposal heads and an EAGLE layer with random weights, alone or merged with
the n-gram trie) and rule.
Checked:

- greedy: patched output == the model's own ``generate(do_sample=False)``, whether the loop ran or fell back;
- sampling with a seed: where the loop ran with the coupled rule, its output == the loop's own plain
  autoregressive sampling (a drafter that proposes nothing) with that seed; with the speculative rule (exact in
  distribution, not token for token: tests/test_verify_speculative_stats.py tests that; its draws depend on the
  draft), two calls with the seed and drafters in the same state agree; where it fell back, two calls with the
  seed agree;
- a fallback always comes with a warning, and the loop never warns without falling back unless it said why
  (a deterministic rule asked to sample).

``run_case(seed)`` returns a dict describing the case and its outcome; tests/test_hf_fuzz.py runs a bounded slice
in the test suite and the full sweep on demand (``FASTVERIFY_FUZZ_CASES``). Also runnable as a script:

    python tests/hf_fuzz.py --cases 600          # prints one line per failing case and a summary
    python tests/hf_fuzz.py --cases 600 --archs all --start 500000
    python tests/hf_fuzz.py --cases 300 --archs all --later-release   # every type checked before the loop runs it
"""

import copy
import random
import re
import warnings

import torch

from fastverify.eagle import EagleLayer
from fastverify.heads import ProposalHeads
from fastverify.hf import DraftModelDrafter, Drafter, NGramDrafter, patch, unpatch
from fastverify.hf import linear as hf_linear
from fastverify.hf.loop import InvalidLogitsError
from fastverify.hf.model_limits import _POSITION_TABLES
from fastverify.hf.bpd import HeadsDrafter
from fastverify.hf.eagle import EagleDrafter
from fastverify.hf.slots import BlockSlotDrafter, PTPSlotDrafter

from conftest import (TYPE_CONFIGS, decay_keeps_inf, gguf_blocks, known_type, latent_sizes, left_padded,
                      letter_tokenizer)

V = 384
PAD = 1
FALLBACK = "falling back to the original generate"
SWITCH = "does not sample"

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma", "phi3", "olmo2", "granite", "gemma2",
         "gemma3_text")
# the sweep's default draws from ARCHS (a seed's case stays the same); ``--archs all`` draws from every registered
# type, the others built generically (``_generic_config``)
EAGER_ONLY = ("gemma2", "gpt_oss", "vaultgemma")  # no sdpa path in transformers (others found when built)
ROPE_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "granite", "phi3")


def _rope(rng: random.Random, arch: str, max_pos: int, head_dim: int):
    kinds = ["default", "longrope"] if arch == "phi3" else ["default", "default", "linear", "dynamic", "yarn",
                                                             "llama3", "longrope"]
    kind = rng.choice(kinds)
    if kind == "default":
        return None
    factor = rng.choice([2.0, 4.0])
    if kind in ("linear", "dynamic"):
        return {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": max_pos // 2}
    if kind == "llama3":
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": max_pos // 2}
    half = head_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [factor] * half,
            "original_max_position_embeddings": max_pos // 2}


def _window(rng: random.Random):
    return rng.choice([None, rng.randint(4, 24), rng.randint(24, 80)])


def registered_archs():
    """Every registered type the fuzz builds (``--archs all``): all but Gemma 3's image-text model, whose config nests
    a text and a vision config (tests/test_hf_model_types.py covers it), and those the installed transformers does
    not have or the registry leaves to a later release (``ModelSpec.min_transformers``)."""
    from fastverify.hf import MODEL_REGISTRY
    return tuple(sorted(t for t in MODEL_REGISTRY
                        if t != "gemma3" and known_type(t) and MODEL_REGISTRY[t].supported()))


def _generic_config(arch, common, window):
    """A tiny config of a registered type without a branch of its own in ``build_model``: the common sizes under
    every name its config has for them, and the window where it has a sliding_window."""
    import transformers
    base = transformers.AutoConfig.for_model(arch)
    kw = {k: v for k, v in common.items() if hasattr(base, k)}
    kw.update({k: v for k, v in dict(head_dim=16, n_embd=64, n_layer=2, n_head=4, n_positions=128, ffn_dim=96,
                                     word_embed_proj_dim=64, num_local_experts=4, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=64, n_inner=96, rotary_dim=8).items()
               if hasattr(base, k) and not isinstance(getattr(type(base), k, None), property)})
    if hasattr(base, "sliding_window"):
        kw.update(sliding_window=window or 4096, use_sliding_window=window is not None)
    if arch in _POSITION_TABLES:  # a table of positions: the sequences must fit in it
        kw["max_position_embeddings"] = 128
    if arch == "diffllama" and kw.get("num_key_value_heads", 2) % 2:  # its differential attention splits KV heads
        kw["num_key_value_heads"] = 2
    if hasattr(base, "kv_lora_rank"):  # latent attention
        kw.update(latent_sizes(16, common["num_attention_heads"]))
    kw.update(TYPE_CONFIGS.get(arch, {}))
    return transformers.AutoConfig.for_model(arch, **kw)


def build_model(rng: random.Random, archs=ARCHS):
    """A random tiny causal LM of a type drawn from ``archs``; returns (model, description dict)."""
    import transformers

    arch = rng.choice(archs)
    max_pos = rng.choice([24, 48, 96, 128])
    head_dim = 16
    tied = rng.random() < 0.5
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=rng.choice([1, 2, 4]), max_position_embeddings=max_pos,
                  initializer_range=0.1, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=0, eos_token_id=2)
    desc = {"arch": arch, "tied": tied, "max_pos": max_pos}
    rope = _rope(rng, arch, max_pos, head_dim) if arch in ROPE_ARCHS else None
    if rope is not None:
        common["rope_parameters"] = dict(rope, rope_theta=10000.0)
        desc["rope"] = rope["rope_type"]
    window = _window(rng)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      initializer_range=0.1, tie_word_embeddings=tied, bos_token_id=0,
                                      eos_token_id=2)
        window = None
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**common, head_dim=head_dim)
        window = None
    elif arch in ("qwen2", "qwen3"):
        cls = transformers.Qwen2Config if arch == "qwen2" else transformers.Qwen3Config
        extra = {"head_dim": head_dim} if arch == "qwen3" else {}
        cfg = cls(**common, **extra, use_sliding_window=window is not None, sliding_window=window or 4096,
                  max_window_layers=rng.randint(0, 2))
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, head_dim=head_dim, sliding_window=window)
    elif arch == "phi3":
        cfg = transformers.Phi3Config(**common, sliding_window=window)
    elif arch == "gemma":
        cfg = transformers.GemmaConfig(**common, head_dim=head_dim)
        window = None
    elif arch == "olmo2":
        cfg = transformers.Olmo2Config(**common)
        window = None
    elif arch == "granite":
        cfg = transformers.GraniteConfig(**common, embedding_multiplier=2.0, logits_scaling=1.5,
                                         residual_multiplier=0.5, attention_multiplier=0.25)
        window = None
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=head_dim, sliding_window=window or 4096)
    elif arch == "gemma3_text":
        cfg = transformers.Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=window or 4096)
    else:
        cfg = _generic_config(arch, common, window)
        window = window if hasattr(cfg, "sliding_window") else None
    desc["window"] = window
    impl = "eager" if arch in EAGER_ONLY else rng.choice(["eager", "sdpa"])
    seed = rng.randint(0, 2 ** 31)
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    except ValueError as e:  # a type without an sdpa path in transformers, not in EAGER_ONLY
        if impl != "sdpa" or "does not support an attention implementation" not in str(e):
            raise
        impl = "eager"
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    desc["attn"] = impl
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model, desc


def quantise_weights(rng: random.Random, model):
    """Every ``nn.Linear`` weight of ``model`` (the output head too, and with it a tied embedding) replaced in
    place by its values as a GGUF file's Q4_1 / Q4_0 / Q8_0 blocks hold them (a kind per layer), as SmolLM2's
    weights are: ``patch`` then streams them packed (skinny_linear_packed, and in Llama-style layers the packed
    decoder ops). Returns the kinds used."""
    kinds = set()
    with torch.no_grad():
        for m in model.modules():
            if type(m) is torch.nn.Linear and m.weight.shape[1] % 32 == 0:
                kind = rng.choice(["q4_1", "q4_0", "q8_0"])
                m.weight.copy_(gguf_blocks(m.weight, kind))
                kinds.add(kind)
    return sorted(kinds)


_TOKENIZER = []


def _tokenizer():
    """The letter tokenizer of the V-token models (made once)."""
    if not _TOKENIZER:
        _TOKENIZER.append(letter_tokenizer(V))
    return _TOKENIZER[0]


def build_batch(rng: random.Random):
    """Left-padded prompts: (input_ids [B, L], attention_mask [B, L])."""
    B = rng.choice([1, 1, 2, 3, 4])
    lengths = [rng.randint(1, 24) for _ in range(B)]
    prompts = []
    for n in lengths:
        if rng.random() < 0.7:  # repetitive: the n-gram drafter finds something to draft
            motif = [rng.randint(3, V - 1) for _ in range(rng.randint(2, 6))]
            prompts.append((motif * (n // len(motif) + 1))[:n])
        else:
            prompts.append([rng.randint(3, V - 1) for _ in range(n)])
    return left_padded(prompts, PAD)


def lengthen_batch(rng: random.Random, ids, mask, limit: int):
    """The batch's prompts repeated to 40-100 tokens each, but at most ``limit`` - 4 (the model's table of positions:
    past it a tiny model's logits can be anything, and a sampled call of generate's own can then fail on its own
    draws): at batch size 2 and more, longer than one forward of the skinny kernels takes (``loop.MAX_ROWS`` rows),
    so that the loop runs the prompt ahead of the first step in chunks."""
    prompts = []
    for row, real in zip(ids.tolist(), mask.bool().tolist()):
        tokens = [t for t, r in zip(row, real) if r]
        n = max(len(tokens), min(rng.randint(40, 100), limit - 4))
        prompts.append((tokens * (n // len(tokens) + 1))[:n])
    return left_padded(prompts, PAD)


def build_options(rng: random.Random, ids):
    """Random generate keyword arguments (besides input_ids / attention_mask / pad_token_id)."""
    opts = {}
    if rng.random() < 0.85:
        opts["max_new_tokens"] = rng.randint(1, 24)
    else:
        opts["max_length"] = ids.shape[1] + rng.randint(1, 24)
    sampling = rng.random() < 0.3
    if sampling:
        opts.update(do_sample=True, seed=rng.randint(0, 2 ** 31))
        for name, values in (("temperature", [0.7, 1.0, 1.3]), ("top_k", [0, 5, 50]), ("top_p", [1.0, 0.9]),
                             ("min_p", [0.0, 0.1])):
            if rng.random() < 0.5:
                opts[name] = rng.choice(values)
    else:
        opts["do_sample"] = False
    if rng.random() < 0.3:  # eos: a token of the prompt, so that it may well be generated
        opts["eos_token_id"] = int(ids[0, -1]) if rng.random() < 0.5 else [int(ids[0, -1]), int(ids[-1, 0])]
    if rng.random() < 0.15:  # options the loop does not run: it must fall back (or, run since, checked)
        name, value = rng.choice([("repetition_penalty", 1.3), ("num_beams", 2), ("min_new_tokens", 3),
                                  ("no_repeat_ngram_size", 2), ("output_scores", True)])
        if not (name == "num_beams" and sampling):
            opts[name] = value
            if name == "output_scores":
                opts["return_dict_in_generate"] = True
    return opts


def _slot_drafter(rng: random.Random, model, ptp: bool = False):
    """A GAD / LUD slot drafter (ptp: a PTP slot drafter of a random variant, auxiliary input and draft rule,
    alone or with proposal heads and the n-gram trie) with random (untrained, but active) adapters and slot
    embeddings."""
    D = model.config.hidden_size
    if ptp:
        d = PTPSlotDrafter(D, num_slots=rng.randint(1, 4), attach=rng.choice(["path", "last"]),
                           aux_mode=rng.choice(["interp", "bits", "none"]), tree_topk=rng.choice([1, 2]),
                           variant=rng.choice(["o", "c"]), draft=rng.choice(PTPSlotDrafter.DRAFTS),
                           first_gate=rng.random() < 0.5,
                           heads=_heads_drafter(rng, model) if rng.random() < 0.3 else None, **_merge(rng, False))
    else:
        d = BlockSlotDrafter(D, num_slots=rng.randint(1, 4), method=rng.choice(["gad", "lud"]),
                             attach=rng.choice(["path", "last"]), tree_topk=rng.choice([1, 2]))
    d.init_adapters(model, rank=rng.choice([1, 4]), targets=_adapter_targets(model))
    g = torch.Generator().manual_seed(rng.randint(0, 2 ** 31))
    with torch.no_grad():
        for a in d.adapters.values():
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.1)
        d.slot_embed.copy_(torch.randn(d.slot_embed.shape, generator=g) * 0.1)
    if getattr(d, "aux", None) is not None:
        _randomise(rng, d.aux)
    return d


def _adapter_targets(model):
    """The default LoRA targets where the model has them, else every nn.Linear but the output projection (the
    projections of types named otherwise: GPT-NeoX's query_key_value, OPT's fc1, ...)."""
    from fastverify.lora import DEFAULT_TARGETS
    head = model.get_output_embeddings()
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear and m is not head}
    return None if names & set(DEFAULT_TARGETS) else tuple(sorted(names))


def _heads_drafter(rng: random.Random, model):
    """A HeadsDrafter with random (untrained, but active) proposal heads, parallel or sequential, one layer or a
    feed-forward block, over the whole vocabulary or a random subset, alone or merged with the n-gram trie."""
    D, V_model = model.config.hidden_size, model.get_output_embeddings().weight.shape[0]
    subset = None
    if rng.random() < 0.5:
        subset = sorted(rng.sample(range(V_model), rng.randint(1, V_model)))
    heads = ProposalHeads(D, num_heads=rng.randint(1, 4), vocab_subset=subset, sequential=rng.random() < 0.5,
                          ffn_size=rng.choice([0, 0, D, 2 * D]))
    _randomise(rng, heads)
    return HeadsDrafter(model, heads, width=rng.randint(1, 4), max_nodes=rng.randint(1, 16),
                        frontier=rng.randint(1, 4), node_cost=rng.choice([0.0, 0.06]), **_merge(rng))


def _eagle_drafter(rng: random.Random, model):
    """An EagleDrafter with a random (untrained, but active) draft layer."""
    D, V_model = model.config.hidden_size, model.get_output_embeddings().weight.shape[0]
    subset = sorted(rng.sample(range(V_model), rng.randint(1, V_model))) if rng.random() < 0.5 else None
    layer = EagleLayer(D, num_heads=rng.choice([2, 4]), intermediate_size=rng.randint(8, 96), vocab_subset=subset)
    _randomise(rng, layer)
    return EagleDrafter(model, layer, width=rng.randint(1, 4), max_nodes=rng.randint(1, 16),
                        frontier=rng.randint(1, 4), max_depth=rng.randint(1, 6), node_cost=rng.choice([0.0, 0.06]),
                        **_merge(rng))


def _randomise(rng: random.Random, module):
    g = torch.Generator().manual_seed(rng.randint(0, 2 ** 31))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _merge(rng: random.Random, confident: bool = True):
    """Half the time, an n-gram drafter to merge with (and the heads' ngram_confident threshold)."""
    if rng.random() < 0.5:
        return {}
    out = {"ngram": NGramDrafter(width=rng.randint(1, 3), max_width=4, depth=rng.randint(1, 6))}
    if confident:
        out["ngram_confident"] = rng.choice([None, 1.5])
    return out


DRAFTERS = ("ngram", "ngram", "self", "none", "slots", "heads", "eagle", "ptp")


def _drafter(rng: random.Random, model, kinds=DRAFTERS):
    kind = rng.choice(kinds)
    if kind in ("slots", "ptp"):
        if _adapter_targets(model) == ():  # no nn.Linear projections (GPT-2's Conv1D, FalconLinear): nothing to adapt
            kind = "ngram"
        else:
            return kind, _slot_drafter(rng, model, ptp=kind == "ptp")
    if kind == "heads":
        return kind, _heads_drafter(rng, model)
    if kind == "eagle":
        return kind, _eagle_drafter(rng, model)
    if kind == "ngram":
        return kind, NGramDrafter(width=rng.randint(1, 3), max_width=4, depth=rng.randint(1, 6))
    if kind == "self":
        return kind, DraftModelDrafter(model, k=rng.randint(1, 5), tree_topk=rng.choice([1, 2]))
    return kind, Drafter()


class _LastTokenIn:
    """A custom stopping criterion: a row ends when its last token is one of ``tokens`` (a function of input_ids)."""

    def __init__(self, tokens):
        self.tokens = sorted(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], torch.tensor(self.tokens, device=input_ids.device))

    def __repr__(self):
        return f"LastTokenIn({self.tokens})"


class _Shifted:
    """A custom logits processor, a function of input_ids: bans the token ``shift`` after each row's last one and,
    on every ``every``-th length, adds 5 to the token ``step`` times the length."""

    def __init__(self, shift, every, step):
        self.shift, self.every, self.step = shift, every, step

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        V = scores.shape[1]
        scores[torch.arange(scores.shape[0]), (input_ids[:, -1] + self.shift) % V] = float("-inf")
        if input_ids.shape[1] % self.every == 0:
            scores[:, (self.step * input_ids.shape[1]) % V] += 5.0
        return scores

    def __repr__(self):
        return f"Shifted({self.shift}, {self.every}, {self.step})"


class _AllowedBy:
    """A prefix_allowed_tokens_fn: the tokens t with (t + the last token + batch id) % mod != rem, and where the
    sequence is of even length only those below 2 * mod (which other processors may all ban)."""

    def __init__(self, mod, rem, vocab):
        self.mod, self.rem, self.vocab = mod, rem, vocab

    def __call__(self, batch_id, sent):
        last, n = int(sent[-1]), self.vocab if len(sent) % 2 else 2 * self.mod
        return [t for t in range(n) if (t + last + batch_id) % self.mod != self.rem]

    def __repr__(self):
        return f"AllowedBy({self.mod}, {self.rem})"


def _remember(rng: random.Random, drafter, ids, ref, desc) -> None:
    """Sometimes an n-gram drafter (the case's, or the one a drafter merges with) with a memory of earlier calls
    (``NGramDrafter(memory=N)``) given (``remember``) generate's own rows (a prompt asked again: its answer drafted
    whole), some with tokens changed, beside random sequences of the prompts' tokens."""
    ngram = drafter if isinstance(drafter, NGramDrafter) else getattr(drafter, "ngram", None)
    if not isinstance(ngram, NGramDrafter) or rng.random() < 0.6:
        return
    capacity = rng.choice([16, 200, 100_000])
    ngram.memory = NGramDrafter(memory=capacity).memory
    seen = sorted(set(ids.reshape(-1).tolist()) - {PAD})
    rows = [r for r in ref.tolist() if r] if isinstance(ref, torch.Tensor) else []
    given = []
    for _ in range(rng.randint(1, 6)):
        if rows and rng.random() < 0.6:
            row = [t for t in rng.choice(rows) if t != PAD]
            for _ in range(rng.choice([0, 0, 1, 3]) if row else 0):
                row[rng.randrange(len(row))] = rng.choice(seen)
        else:
            row = [rng.choice(seen) for _ in range(rng.randint(1, 40))]
        given.append(row)
    ngram.remember(given)
    desc["memory"] = capacity


def _sequences(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


def _generate(model, ids, mask, opts):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **opts)
    texts = [str(w.message) for w in record]
    return _sequences(out), [t for t in texts if FALLBACK in t], [t for t in texts if SWITCH in t]


@torch.no_grad()
def run_case(seed: int, kinds=DRAFTERS, archs=ARCHS) -> dict:
    """One random case. Returns a dict: the case's description and ``outcome``: "identical" (the loop ran and
    matched), "fallback" (it fell back with a warning and matched) or "DIFFERENT" / "NO-WARNING" (a defect),
    plus ``reason`` for fallbacks and ``detail`` for defects."""
    rng = random.Random(seed)
    model, desc = build_model(rng, archs)
    weights = random.Random(f"weights {seed}")  # a stream of its own: a seed's other draws are unchanged by it
    if weights.random() < 0.35:  # weights that pack, as a GGUF model's do
        desc["weights"] = quantise_weights(weights, model)
    ids, mask = build_batch(rng)
    longer = random.Random(f"long prompts {seed}")  # a stream of its own
    if longer.random() < 0.15:
        ids, mask = lengthen_batch(longer, ids, mask, desc["max_pos"])
    opts = build_options(rng, ids)
    held = random.Random(f"min tokens {seed}")  # eos held back for the first tokens; a stream of its own
    if held.random() < 0.2:
        key = held.choice(["min_new_tokens", "min_length"])
        opts[key] = held.randint(1, 12) + (ids.shape[1] if key == "min_length" else 0)
    penalty = random.Random(f"repetition penalty {seed}")
    if penalty.random() < 0.2:
        opts["repetition_penalty"] = penalty.choice([0.8, 1.1, 1.3, 2.0])
    if penalty.random() < 0.2:
        opts["no_repeat_ngram_size"] = penalty.choice([1, 2, 3, 4, 8])
    seen = sorted(set(ids.reshape(-1).tolist()) - {PAD})  # the prompts' tokens, which the n-gram drafter copies
    bans = random.Random(f"banned tokens {seed}")
    if bans.random() < 0.2:
        opts["bad_words_ids"] = [[bans.choice(seen) for _ in range(bans.randint(1, 3))]
                                 for _ in range(bans.randint(1, 3))]
    if bans.random() < 0.1:
        opts[bans.choice(["suppress_tokens", "begin_suppress_tokens"])] = bans.sample(range(V), 3)
    bias = random.Random(f"sequence bias {seed}")
    if bias.random() < 0.15:  # single tokens and sequences of the prompts' tokens, some sharing a last token
        seqs = {tuple(bias.choice(seen) for _ in range(bias.randint(1, 3))) for _ in range(bias.randint(1, 4))}
        opts["sequence_bias"] = [[list(q), bias.choice([-20.0, -2.5, 0.75, 3.0, 12.0])] for q in sorted(seqs)]
    if bias.random() < 0.1:
        opts["forced_eos_token_id"] = bias.sample(range(V), bias.randint(1, 2))
    decay = random.Random(f"length decay {seed}")
    if decay.random() < 0.1 and "eos_token_id" in opts:  # (generate refuses it without eos ids)
        opts["exponential_decay_length_penalty"] = (decay.randint(0, 6), decay.choice([0.5, 1.2, 2.0, 5.0]))
    stops = random.Random(f"stop strings {seed}")  # a stream of its own, as the weights'
    if stops.random() < 0.2:  # stop strings of one to three letters (tokens are strings of letters)
        opts["stop_strings"] = ["".join(stops.choice("abcdefgh") for _ in range(stops.randint(1, 3)))
                                for _ in range(stops.randint(1, 2))]
        opts["tokenizer"] = _tokenizer()
    edge = random.Random(f"edge values {seed}")  # values generate reads by `is not None` or by sign, not by truth
    if edge.random() < 0.12:
        name, value = edge.choice([("stop_strings", ""), ("stop_strings", [""]), ("eos_token_id", []),
                                   ("forced_bos_token_id", 0), ("min_new_tokens", 0), ("min_new_tokens", -1),
                                   ("no_repeat_ngram_size", 0), ("no_repeat_ngram_size", -1), ("suppress_tokens", []),
                                   ("begin_suppress_tokens", []), ("repetition_penalty", 1.0)])
        if name not in opts:
            opts[name] = value
            if name == "stop_strings":
                opts["tokenizer"] = _tokenizer()
    if edge.random() < 0.08:  # no length at all: generate's default, 20 new tokens (at most the model's positions)
        opts.pop("max_new_tokens", None)
        opts.pop("max_length", None)
    custom = random.Random(f"custom lists {seed}")
    if custom.random() < 0.12:  # a stopping criterion ending a row whose last token is one of a few
        opts["stopping_criteria"] = [_LastTokenIn(custom.sample(seen, min(len(seen), custom.randint(1, 4))))]
    row_wise = False
    if custom.random() < 0.12:  # a processor reading the sequence (at batch size > 1: declared row-wise, or not)
        opts["logits_processor"] = [_Shifted(custom.randint(1, 5), custom.randint(2, 4), custom.randint(1, V - 1))]
        row_wise = custom.random() < 0.5
    if custom.random() < 0.08:  # a constraint of the batch id and the sequence (some rows left all -inf)
        opts["prefix_allowed_tokens_fn"] = _AllowedBy(custom.randint(2, 5), custom.randint(0, 1), V)
    warp = random.Random(f"warpers {seed}")
    if opts.get("do_sample") and warp.random() < 0.2:  # a warper the verify op does not have: generate's own
        name, values = warp.choice([("typical_p", [0.5, 0.9]), ("epsilon_cutoff", [0.001, 0.05]),
                                    ("eta_cutoff", [0.01, 0.3]), ("top_h", [0.4, 0.8])])
        opts[name] = warp.choice(values)
    copies = random.Random(f"copies {seed}")
    if opts.get("do_sample") and copies.random() < 0.15:
        opts["num_return_sequences"] = copies.randint(2, 3)
    kind, drafter = _drafter(rng, model, kinds)
    rule = None
    if rng.random() < 0.2:  # an explicit exact rule (greedy also under do_sample: must switch, with a warning)
        rule = rng.choice(["greedy", "coupled", "speculative"])
    desc.update(seed=seed, batch=ids.shape[0], length=ids.shape[1], drafter=kind, rule=rule,
                options={k: v if k not in ("stopping_criteria", "logits_processor", "prefix_allowed_tokens_fn")
                         else repr(v)
                         for k, v in opts.items() if k not in ("seed", "tokenizer")})
    extra = {}
    if row_wise:
        extra["row_processors"] = desc["row_processors"] = True
    if rng.random() < 0.3:  # the loop's own options: draft budget, verify backend, torch's GEMM
        extra.update(max_draft=rng.choice([0, 1, 3, 32]), backend=rng.choice(["auto", "torch"]),
                     skinny_linear=rng.random() < 0.5)
        desc["loop"] = {k: extra[k] for k in ("max_draft", "backend", "skinny_linear")}
    sampling = opts.get("do_sample", False)

    unpatch(model)
    # until two calls agree: transformers' dynamic RoPE keeps the frequencies a call grew past its bound for the
    # next call whose first forward spans exactly the bound, so that call's output depends on the one before (and,
    # where a stop string ends the first call early, that one's on the one before it: seed 79830); the patched
    # call (or its fallback) then starts from the same state. Sampled calls, whose reference is another call after
    # the patched one, need the same first call (seed 30831: a sampled fallback).
    plain = {k: v for k, v in opts.items() if k != "seed"}  # the seed is the patched generate's argument
    ref = None
    try:
        for _ in range(1 if sampling else 4):
            prev, ref = ref, _sequences(model.generate(ids, attention_mask=mask, pad_token_id=PAD, **plain))
            if prev is not None and prev.shape == ref.shape and torch.equal(prev, ref):
                break
    except (RuntimeError, ValueError) as e:  # generate's own error (a sampled row left without any token)
        ref = e
    _remember(random.Random(f"memory {seed}"), drafter, ids, ref, desc)
    twin = copy.deepcopy(drafter) if sampling and rule == "speculative" else None  # drafters keep state
    patch(model, drafter=drafter, rule=rule, **extra)
    if "weights" in desc:  # how many layers the patch streams packed
        desc["packed"] = sum(hf_linear._PACKED.get(m, (None, None))[1] is not None for m in model.modules())
    if isinstance(ref, Exception) and not sampling:  # the patched call must fail too (it names the row)
        try:
            _generate(model, ids, mask, opts)
        except (RuntimeError, ValueError) as e:
            unpatch(model)
            return dict(desc, outcome="error", reason=f"{type(ref).__name__} / {type(e).__name__}: {str(e)[:80]}")
        unpatch(model)
        return dict(desc, outcome="NO-ERROR", detail=f"generate raised {ref!r}; the patched call returned")
    # a sampled call whose reference raised: generate's own draws reached a row with no token to sample (a
    # processor banning what another forces, say), which the seeded draws need not reach (seed 526352); the
    # patched call is then held to the loop's own autoregressive sampling below, raising or not as it does
    if isinstance(ref, Exception):
        desc["generate_raised"] = f"{type(ref).__name__}: {str(ref)[:80]}"
    try:
        out, fallback, switched = _generate(model, ids, mask, opts)
    except InvalidLogitsError as e:  # a defect: generate returned (a row all -inf: it takes token 0)
        unpatch(model)
        if "exponential_decay_length_penalty" in opts and not decay_keeps_inf():  # generate's NaN row
            return dict(desc, outcome="error", reason=f"the length decay's NaN, refused: {str(e)[:80]}")
        if sampling and rule != "speculative":
            # the seeded draws may reach a row the processors leave without any token to sample where generate's
            # own draws did not (seed 623724 on 5.17: a prefix constraint, no-repeat n-grams and typical_p): the
            # loop's own autoregressive sampling with that seed must then raise the same
            patch(model, drafter=Drafter(), rule=None if rule == "greedy" else rule, **extra)
            return _raised_again(desc, model, ids, mask, opts, e, InvalidLogitsError, "REFUSED")
        return dict(desc, outcome="REFUSED", detail=str(e)[:200])
    except (RuntimeError, ValueError) as e:
        # a sampled call draws from its seed, the reference from torch's stream: its own draws can reach a row
        # with no token to sample (past a tiny model's table of positions, say) where the reference's did not. Then
        # the seed must reproduce the same error (seed 155069: a fallback, generate's own sampler)
        if not sampling:
            raise
        return _raised_again(desc, model, ids, mask, opts, e, (RuntimeError, ValueError), "NOT-REPRODUCED")
    if fallback:
        desc["reason"] = fallback[0].split(FALLBACK + ": ", 1)[-1]
    if sampling:
        if fallback:  # the seed must make the fallback reproducible: a later call, from the same RoPE state
            ref, _, _ = _generate(model, ids, mask, opts)
            # (a dynamic RoPE's state after a sampled call is that call's; a prompt spanning exactly the bound keeps
            # it, so consecutive calls may differ until the state settles: seed 138507, as the greedy reference)
            for _ in range(3):
                if out.shape == ref.shape and torch.equal(out, ref):
                    break
                out, (ref, _, _) = ref, _generate(model, ids, mask, opts)
        else:
            if rule not in (None, "coupled", "speculative") and not switched:
                return dict(desc, outcome="NO-WARNING", detail="a deterministic rule sampled without a warning")
            if rule != "speculative":  # the loop's own autoregressive sampling with that seed
                patch(model, drafter=Drafter(), rule=None if rule == "greedy" else rule, **extra)
            else:  # the same drafts again
                patch(model, drafter=twin, rule=rule, **extra)
            ref, _, _ = _generate(model, ids, mask, opts)
    unpatch(model)
    if out.shape != ref.shape or not torch.equal(out, ref):
        first = None
        if out.shape == ref.shape:
            diff = (out != ref).nonzero()
            first = diff[0].tolist() if len(diff) else None
        return dict(desc, outcome="DIFFERENT", detail=f"shapes {tuple(out.shape)} / {tuple(ref.shape)}, first "
                                                      f"difference at {first}")
    return dict(desc, outcome="fallback" if fallback else "identical")


def _at_token(e) -> str:
    """An error's message without the loop's decoding step (what it names the row by is the new tokens before it)."""
    return re.sub(r" at decoding step \d+ ", " ", str(e))


def _raised_again(desc, model, ids, mask, opts, e, types, otherwise):
    """The outcome of a seeded call that raised ``e``, called again as the model is now patched (and then
    unpatched): "error" where it raises the same (``types``), else "NOT-REPRODUCED", or ``otherwise`` where it
    returns."""
    try:
        _generate(model, ids, mask, opts)
    except types as again:
        unpatch(model)
        # the same error at the same token; the loop's decoding step it names depends on the drafter (seed 633267
        # on 5.17: slot drafts accepted before it, so one step fewer than the drafterless loop's)
        if _at_token(again) == _at_token(e):
            return dict(desc, outcome="error", reason=f"seeded call / {type(e).__name__}: {str(e)[:80]}")
        return dict(desc, outcome="NOT-REPRODUCED", detail=f"{e!r}, then {again!r}")
    unpatch(model)
    return dict(desc, outcome=otherwise, detail=f"{e!r}, then no error")


def sweep(cases: int, start: int = 0, kinds=DRAFTERS, archs=ARCHS):
    """Run ``cases`` cases with seeds start .. start + cases - 1 (drafters drawn from ``kinds``, model types from
    ``archs``); returns the list of results."""
    return [run_case(seed, kinds, archs) for seed in range(start, start + cases)]


def summary(results) -> dict:
    out = {"cases": len(results)}
    for r in results:
        out[r["outcome"]] = out.get(r["outcome"], 0) + 1
    reasons = {}
    for r in results:
        if r["outcome"] == "fallback":
            reason = r["reason"]
            if " beyond " in reason:  # "sequence length L + n new tokens beyond <what>: ..."
                key = "beyond " + reason.split(" beyond ", 1)[1].split(" (")[0].split(":")[0]
            elif reason.startswith("generation option(s) "):
                key = "option " + reason[len("generation option(s) "):].split("=")[0]
            else:
                key = reason.split(";")[0][:60]
            key = re.sub(r"=\d+", "", key)
            reasons[key] = reasons.get(key, 0) + 1
    out["fallback_reasons"] = reasons
    drafters = {}
    for r in results:
        drafters[r["drafter"]] = drafters.get(r["drafter"], 0) + 1
    out["drafters"] = drafters
    # cases whose weights were GGUF blocks: how many ran the loop on weights it streamed packed
    out["packed_weights"] = {k: sum(1 for r in results if r.get("packed") and r["outcome"] == k)
                             for k in ("identical", "fallback")}
    for key, names in (("stop_strings", ("stop_strings",)), ("min_tokens", ("min_new_tokens", "min_length")),
                       ("repetition", ("repetition_penalty", "no_repeat_ngram_size")),
                       ("banned", ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens")),
                       ("bias", ("sequence_bias", "forced_eos_token_id", "exponential_decay_length_penalty")),
                       ("custom", ("stopping_criteria", "logits_processor", "prefix_allowed_tokens_fn")),
                       ("copies", ("num_return_sequences",)),
                       ("warpers", ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")),
                       ("edge values", ("forced_bos_token_id",))):
        out[key] = {k: sum(1 for r in results if any(n in r["options"] for n in names) and r["outcome"] == k)
                    for k in ("identical", "fallback")}
    return out


if __name__ == "__main__":
    import argparse
    import json
    import sys
    import time

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=600, help="how many cases to run")
    ap.add_argument("--start", type=int, default=0, help="the first case's seed (case i runs seed start + i)")
    ap.add_argument("--drafters", nargs="+", choices=sorted(set(DRAFTERS)), default=DRAFTERS,
                    help="the drafter kinds to draw from (default: all)")
    ap.add_argument("--archs", nargs="+", default=list(ARCHS),
                    help="the model types to draw from (default: the fuzz's own list; 'all': every registered type)")
    ap.add_argument("--later-release", action="store_true",
                    help="run as under a transformers release later than fastverify.hf.patch.TESTED_TRANSFORMERS: "
                         "every model checked by fastverify.hf.probe before the loop runs it (a check that fails "
                         "shows as a fallback)")
    args = ap.parse_args()
    if args.later_release:
        sys.modules["fastverify.hf.patch"]._untested_transformers = lambda: True
    if args.archs == ["all"]:
        args.archs = registered_archs()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    results = sweep(args.cases, args.start, tuple(args.drafters), tuple(args.archs))
    for r in results:
        if r["outcome"] not in ("identical", "fallback", "error"):
            print(json.dumps(r))
    print(json.dumps(summary(results), indent=1))
    print(f"{time.perf_counter() - t0:.0f} s")
