"""Shared test helpers: random ragged batches of draft chains / trees, a dtype tolerance table, backend
parametrisation that skips (with the reason) a backend whose code is not written, not built or not usable here.

Kept generic: any op test may use these. Random inputs come from an explicit torch.Generator so that every test
is reproducible from its seed.
"""

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastverify import _ext  # noqa: E402

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (atol, rtol) for comparing floating outputs of a fast backend with the float64-safe reference, by input dtype.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
    torch.float64: (1e-12, 1e-12),
}


def tolerance(dtype):
    """(atol, rtol) for outputs computed from inputs of ``dtype``."""
    return TOLERANCES[dtype]


def float_bits(t):
    """A float32 tensor's bit patterns (int32): equal bits, not equal values (NaN payloads, -0.0) for bit-exact
    checks."""
    return t.contiguous().view(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# Random batches


def random_parents(n, gen, shape="random"):
    """Local parents of an n-node tree (parents[j] < j, -1 = child of the root) as a Python list.

    shape: "chain", "star" (every node a child of the root) or "random" (each node's parent uniform among the root
    and the earlier nodes, which gives bushy trees with some deep paths)."""
    if shape == "chain":
        return [j - 1 for j in range(n)]
    if shape == "star":
        return [-1] * n
    return [int(torch.randint(-1, j, (), generator=gen)) if j > 0 else -1 for j in range(n)]


def random_batch(B, V, *, max_nodes=6, min_nodes=0, shape="random", dtype=torch.float32, gen=None, device="cpu",
                 scale=2.0, p_argmax=0.6, p_duplicate=0.15):
    """A random ragged batch in the verify layout (DESIGN.md "Batch layout").

    Returns a dict with logits [N + B, V] (dtype), draft_tokens int64 [N], cu_nodes int32 [B + 1], parents int32 [N]
    (``shape`` chain / star / random), counts (list of n_b). A fraction ``p_argmax`` of the nodes take the argmax of
    their parent's row (so that rules accept something), and a fraction ``p_duplicate`` copy the token of an
    earlier sibling (duplicates among siblings)."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    counts = torch.randint(min_nodes, max_nodes + 1, (B,), generator=gen).tolist()
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    N = cu[-1]
    parents = []
    for c in counts:
        parents += random_parents(c, gen, shape)
    logits = torch.randn(N + B, V, generator=gen, dtype=torch.float32) * scale
    tokens = torch.randint(0, V, (N,), generator=gen)
    for b, c in enumerate(counts):
        for j in range(c):
            g = cu[b] + j
            row = cu[b] + b + parents[g] + 1
            r = float(torch.rand((), generator=gen))
            if r < p_argmax:
                tokens[g] = logits[row].to(dtype).float().argmax()
            elif r < p_argmax + p_duplicate:
                sibs = [cu[b] + i for i in range(j) if parents[cu[b] + i] == parents[g]]
                if sibs:
                    tokens[g] = tokens[sibs[int(torch.randint(0, len(sibs), (), generator=gen))]]
    return {
        "logits": logits.to(dtype).to(device),
        "draft_tokens": tokens.to(device),
        "cu_nodes": torch.tensor(cu, dtype=torch.int32, device=device),
        "parents": torch.tensor(parents, dtype=torch.int32, device=device),
        "counts": counts,
    }


# ---------------------------------------------------------------------------------------------------------------
# Backends


def device_of(backend):
    """The device a backend's tests run on: cuda for "cuda" (and "triton" when a GPU exists), else cpu."""
    if backend == "cuda" or (backend == "triton" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def backend_skip_reason(backend, implemented):
    """None when ``backend`` can run here; otherwise why not. ``implemented``: the backends whose code exists for
    the op under test (e.g. fastverify.ops.verify.available_backends())."""
    if backend == "torch":
        return None
    if backend == "cuda" and not torch.cuda.is_available():
        return "cuda backend: no CUDA device on this machine"
    if backend not in implemented:
        why = {"cpp": "fastverify._C is not built or has no CPU kernel for this op",
               "cuda": "fastverify._C was built without CUDA kernels for this op",
               "triton": "the Triton kernel module of this op does not exist (yet) or is not importable"}[backend]
        return f"{backend} backend: {why}"
    device = device_of(backend)
    if not _ext.backends(device)[backend]:
        return f"{backend} backend is not usable on {device} here (TRITON_INTERPRET / triton / extension)"
    return None


def backend_params(implemented, backends=("torch", "cpp", "triton", "cuda")):
    """pytest.param per backend, each skipped with its reason when it cannot run here."""
    out = []
    for b in backends:
        reason = backend_skip_reason(b, implemented)
        out.append(pytest.param(b, marks=pytest.mark.skipif(reason is not None, reason=str(reason)), id=b))
    return out


def to_device(batch, device):
    """Copy every tensor of a dict to ``device`` (other values unchanged)."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def left_padded(prompts, pad: int):
    """Token lists -> (input_ids int64 [B, L], attention_mask int64 [B, L]): left padded with ``pad`` to the
    longest, as generate expects a batch."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.int64)
    mask = torch.zeros(len(prompts), L, dtype=torch.int64)
    for b, p in enumerate(prompts):
        if p:
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.int64)
            mask[b, L - len(p):] = 1
    return ids, mask


def gguf_blocks(x, kind: str):
    """float32 values [N, K] (K a multiple of 32) as a GGUF reader returns a weight of ``kind`` ("q4_1", "q4_0",
    "q8_0"): quantised per block of 32 along K the way ggml's reference quantisers do (scales stored in float16),
    then dequantised in float32 (d * q, or d * q + m), so that fastverify's ``pack_blocks`` packs it."""
    N, K = x.shape
    x = x.detach().float().reshape(N, K // 32, 32)
    if kind == "q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((x - lo) * inv + 0.5).floor().clamp(max=15)
        w = d.half().float() * q + lo.half().float()
    elif kind == "q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx) / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (x * inv + 8.5).floor().clamp(max=15)
        w = (q - 8) * d.half().float()
    elif kind == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (x * inv).round()
        w = q * d.half().float()
    else:
        raise ValueError(f"kind: expected 'q4_1', 'q4_0' or 'q8_0', got {kind!r}")
    return w.reshape(N, K).contiguous()


def letter_tokenizer(vocab: int):
    """A tokenizer of ``vocab`` tokens for tiny random models: token i is the i-th string of one to four letters of
    "abcdefgh" (shortest first), longest match first, tokens joined as they are; a stop string may lie within a
    token or span several."""
    import itertools

    import transformers
    from tokenizers import Tokenizer, decoders, models
    strings = [''.join(p) for n in range(1, 5) for p in itertools.product("abcdefgh", repeat=n)][:vocab]
    tk = Tokenizer(models.WordPiece({t: i for i, t in enumerate(strings)}, unk_token=strings[0],
                                    continuing_subword_prefix=""))
    tk.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module that decodes with a model: batch-1 decoding is bandwidth-bound, and intra-op
    threads only add contention (OpenMP spin-waits stall a step many times over when the machine is shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(vocab=64, hidden=64, seed=0, init=0.08, tie=False):
    """A frozen 2-layer random Llama of ``vocab`` tokens (no pad / eos, so generation runs its full length);
    ``tie``: its output projection is its input embedding."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=init, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    return model


def repetitive(length, vocab, seed):
    """A prompt of ``length`` tokens: a random 7-token motif (ids in [3, vocab)) repeated."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, vocab, (7,), generator=g).tolist()
    return (motif * (length // 7 + 1))[:length]


def patched_generate(model, drafter, input_ids, rule=None, options=None, **generate_kwargs):
    """(output, fastverify.hf.stats) of one ``generate`` of ``model`` patched with ``drafter`` (and ``rule`` /
    patch ``options``), without gradients; the model is unpatched afterwards, whatever happens."""
    from fastverify.hf import patch, stats, unpatch

    patch(model, drafter=drafter, rule=rule, **(options or {}))
    try:
        with torch.no_grad():
            out = model.generate(input_ids, **generate_kwargs)
        return out, stats(model)
    finally:
        unpatch(model)


def assert_greedy_exact(model, drafter, input_ids, **generate_kwargs):
    """Patched greedy ``generate`` with ``drafter`` equals the model's own ``generate(do_sample=False)``; returns
    the patched call's stats."""
    with torch.no_grad():
        ref = model.generate(input_ids, do_sample=False, **generate_kwargs)
    got, st = patched_generate(model, drafter, input_ids, do_sample=False, **generate_kwargs)
    assert torch.equal(got, ref)
    return st


def logits_equal(mine, ref, rows=None) -> bool:
    """generate's per-step logits (tuples of [B, V]) the same bit for bit; rows: mine's batch rows to compare."""
    return len(mine) == len(ref) and all(torch.equal(a if rows is None else a[rows], b) for a, b in zip(mine, ref))


def assert_drafts_change_no_bit(model, drafter, input_ids, **generate_kwargs):
    """The loop's row-invariance on the CPU: patched ``generate`` with ``drafter`` returns the undrafted loop's
    (``Drafter()``) tokens and every step's logits, bit for bit; returns the drafted call's stats (it drafted)."""
    from fastverify.hf import Drafter

    kw = dict(generate_kwargs, return_dict_in_generate=True, output_logits=True)
    plain, _ = patched_generate(model, Drafter(), input_ids, **kw)
    drafted, st = patched_generate(model, drafter, input_ids, **kw)
    assert st.drafted_tokens > 0 and torch.equal(drafted.sequences, plain.sequences)
    assert logits_equal(drafted.logits, plain.logits)
    return st


# Tiny configs of model types whose sizes go by names of their own (tests/test_hf_model_types.py and the fuzz's
# generic configs, tests/hf_fuzz.py, beside their common small sizes): construction keyword arguments by type
TYPE_CONFIGS = {
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"hidden_size": 64, "ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
                 tie_word_embeddings=False),  # (its config refuses tied embeddings)
    "dots1": dict(n_routed_experts=4, n_shared_experts=1),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]]),  # (one attention type per layer)
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=128, expert_ffn_hidden_size=32, n_routed_experts=4,
                          zero_expert_num=2, moe_topk=2),
}


def known_type(model_type: str) -> bool:
    """Whether the installed transformers has ``model_type`` (the registry names types added up to its newest
    release; an older supported release lacks some)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return model_type in CONFIG_MAPPING


def decay_keeps_inf() -> bool:
    """Whether the installed ExponentialDecayLengthPenalty leaves an eos score of -inf -inf (transformers 5.19 and
    later) rather than making it NaN (|-inf| times the factor, added to -inf): before, generate's argmax takes the
    NaN's token where a minimum length holds eos back, and the loop refuses the row (InvalidLogitsError)."""
    from transformers.generation.logits_process import ExponentialDecayLengthPenalty
    out = ExponentialDecayLengthPenalty((0, 2.0), 1, 0)(torch.zeros(1, 2, dtype=torch.int64),
                                                         torch.tensor([[0.0, float("-inf")]]))
    return not bool(out.isnan().any())


def latent_sizes(head_dim: int, heads: int) -> dict:
    """Multi-head latent attention's sizes (DeepSeek-V2 / V3 and their kin: configs with a kv_lora_rank) for a tiny
    config of ``heads`` query heads of ``head_dim``: one key / value head per query head, the rotary part of a head
    as wide as head_dim (the rotary embedding's width), low-rank queries and keys / values, four routed experts."""
    return dict(num_key_value_heads=heads, qk_rope_head_dim=head_dim, qk_nope_head_dim=head_dim,
                qk_head_dim=2 * head_dim, v_head_dim=head_dim, kv_lora_rank=16, q_lora_rank=32, n_routed_experts=4,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
