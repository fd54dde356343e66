"""The Parallel Token Prediction recipe (fastverify.train.ptp) and PTP slot drafting (fastverify.hf.slots)."""

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch

from fastverify.heads import BaseModelMismatch, CheckpointError
from fastverify.hf import Drafter, patch, stats, unpatch
from fastverify.hf.slots import PTPSlotDrafter, load_slot_drafter
from fastverify.ops.sampling import cdf_sample, uniform
from fastverify.train import ptp as recipe
from fastverify.train.slots import _trainables

transformers = pytest.importorskip("transformers")

from conftest import tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 64, 64
PAD = 1
WARP = {"temperature": 0.5, "top_k": 4, "top_p": 1.0}  # four tokens per position: a small synthetic distribution


def _tiny(seed=0):
    return tiny_llama(V, D, seed=seed, init=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ptp_targets_round_trip(dtype):
    """u = cdf_invert(teacher, x, v) maps back to x under the same warping; a token outside the warped support
    (beyond top-k) has no bin (NaN); the prompt gets none."""
    g = torch.Generator().manual_seed(3)
    T, P = 40, 7
    logits = (torch.randn(T, 101, generator=g) * 3).to(dtype)
    warp = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    inside = logits.float().topk(2, -1).indices[:, 0]                  # the argmax is always kept
    ids = torch.cat([torch.zeros(1, dtype=torch.long), inside[:-1]])  # ids[q] scored by row q - 1
    outside = logits.float().topk(30, -1).indices[:, -1]               # rank 30 > top_k: no bin
    ids[P + 5] = outside[P + 4]
    v = torch.rand(T - P, generator=g).clamp(1e-6, 1 - 1e-6)
    u = recipe.ptp_targets(logits, ids, P, warp, v)
    assert torch.isnan(u[:P]).all() and torch.isnan(u[P + 5])
    ok = ~torch.isnan(u)
    rows = logits[:-1][ok[1:]]
    back = cdf_sample(rows, u[ok], **warp)
    assert torch.equal(back, ids[ok]) and int(ok.sum()) == T - P - 1


def _iid_teacher():
    """A tiny model whose next-token distribution is one fixed distribution whatever the context: every token
    has the same input embedding, so every row computes the same hidden state, and a scaled-down output
    projection makes its top 4 tokens similarly likely (the synthetic distribution)."""
    model = _tiny()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(emb[3].expand_as(emb))
        model.get_output_embeddings().weight.mul_(0.1)
    return model


def _sampled(model, n, length, seed, warp):
    """n sequences sampled from ``model`` under ``warp``: a prompt of 4 tokens and a continuation of ``length``."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (n, 4), generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model.generate(prompts, do_sample=True, max_new_tokens=length, pad_token_id=PAD, **warp)


def test_ptp_slots_learn_u_to_token_on_a_synthetic_distribution():
    """Tokens drawn from one fixed distribution over 4 tokens: O-PTP slots, given u, learn to output
    t = F^-1(u). A prediction that does not see u is right at best as often as the most frequent token; the
    trained slots beat that clearly on held-out sequences (both slots of each block: slot 1 sees slot 0's u)."""
    model = _iid_teacher()
    warp = {"temperature": 1.0, "top_k": 4, "top_p": 1.0}
    train, held = _sampled(model, 32, 16, 0, warp), _sampled(model, 16, 16, 1, warp)
    cont = held[:, 4:].reshape(-1)
    mode_freq = float(torch.bincount(cont).max()) / cont.numel()
    cfg = recipe.PTPConfig(out="unused", num_slots=1, attach_every=1, beta_a=2.0, **warp)
    torch.manual_seed(0)  # the auxiliary embedding's initialisation (seeds 0, 1, 2 all learn: 0.79 / 0.69 / 0.84)
    drafter = PTPSlotDrafter(D, 1, aux_mode="interp").init_adapters(model, rank=8, alpha=16.0)
    opt = torch.optim.AdamW(_trainables(drafter), lr=1e-2)
    rng = random.Random(0)
    hits = count = 0
    with drafter.installed(model):
        for step in range(100):
            loss, _ = recipe._ptp_loss(model, drafter, train[step % len(train)], 4, cfg, rng)
            opt.zero_grad()
            loss.backward()
            opt.step()
        for ids in held:
            _, st = recipe._ptp_loss(model, drafter, ids, 4, cfg, rng, evaluate=True)
            hits, count = hits + st["hit1"].sum(), count + st["count"].sum()
    acc = float(hits / count)
    assert 0.2 < mode_freq < 0.6 and acc > mode_freq + 0.2, (acc, mode_freq)


@pytest.mark.parametrize("variant,aux_mode", [("o", "interp"), ("c", "bits"), ("o", "none")])
def test_recipe_end_to_end_checkpoint_resume_and_refusal(tmp_path, variant, aux_mode):
    model = _tiny()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (6 + i % 3,), generator=g).tolist() for i in range(12)]
    cfg = recipe.PTPConfig(out=str(tmp_path / "ckpt"), data_dir=str(tmp_path / "data"), variant=variant,
                           aux_mode=aux_mode, num_slots=2, rank=4, exclude="", num_prompts=8, eval_prompts=4,
                           max_new_tokens=10, gen_batch=4, minutes=0, save_every=3, progress=False,
                           curve_every=4, curve_sequences=2, **WARP)
    logs = []
    drafter, config = recipe.train_ptp(model, None, cfg, base_name="tiny-llama", prompts=prompts, log=logs.append)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "slots.safetensors", "train_state.pt"]
    assert config["sampling"] == {k: WARP[k] for k in ("temperature", "top_k", "top_p")}
    assert config["training"]["sequences_seen"] == 8 and [p["step"] for p in config["training"][
        "accepted_curve"]] == [4, 8]
    assert config["eval"]["blocks"] > 0 and len(config["eval"]["top1"]) == 3  # m + 1 slots
    # the sampled data lives in a folder named by its sampling settings, beside (not in) the greedy shards
    assert os.listdir(tmp_path / "data") == ["sampled-temperature0.5-top_k4-top_p1.0"]
    # resume: a second run with the same options continues from the state (no steps left), same checkpoint
    _, again = recipe.train_ptp(model, None, cfg, base_name="tiny-llama", prompts=prompts, log=logs.append)
    assert any(line.startswith("resumed at step 8") for line in logs) and again["training"]["sequences_seen"] == 8
    with pytest.raises(ValueError, match=r"other options \(beta_a 2.0 -> 1.0\)"):  # another recipe: refused
        recipe.train_ptp(model, None, dataclasses.replace(cfg, beta_a=1.0), base_name="tiny-llama", prompts=prompts,
                         log=logs.append)
    loaded = load_slot_drafter(str(tmp_path / "ckpt"), model)
    assert isinstance(loaded, PTPSlotDrafter) and (loaded.variant, loaded.aux_mode) == (variant, aux_mode)
    assert loaded.samples == (variant == "c" or aux_mode == "none")
    # seeded sampling through the trained drafter is the loop's own autoregressive sampling; greedy is exact
    ids = torch.tensor([prompts[0]])
    kw = dict(max_new_tokens=16, pad_token_id=PAD)
    patch(model, drafter=Drafter())
    ref = model.generate(ids, do_sample=True, seed=9, **WARP, **kw)
    patch(model, drafter=loaded)
    try:
        assert torch.equal(model.generate(ids, do_sample=True, seed=9, **WARP, **kw), ref)
    finally:
        unpatch(model)
    with pytest.raises(BaseModelMismatch):
        load_slot_drafter(str(tmp_path / "ckpt"), _tiny(seed=1))
    with open(tmp_path / "ckpt" / "config.json") as f:
        saved = json.load(f)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "bad")
    for key, value, match in (("variant", "z", "variant 'z', expected one of"), ("aux_mode", "bytes", "aux_mode"),
                              ("num_slots", 1, "num_slots 1, expected an int >= 2")):
        with open(tmp_path / "bad" / "config.json", "w") as f:  # the checkpoint named, not a constructor's error
            json.dump({**saved, key: value}, f)
        with pytest.raises(CheckpointError, match=match):
            load_slot_drafter(str(tmp_path / "bad"), model)
    with pytest.raises(ValueError, match="calibrate"):
        recipe.train_ptp(model, None, dataclasses.replace(cfg, calibrate=True), prompts=prompts, log=logs.append)


def test_sampling_drafters_draft_the_inverse_cdf_of_their_slots_at_the_coupled_rules_uniforms():
    """C-PTP and the no-auxiliary baseline draft slot i's inverse CDF at u = uniform(seed, position of slot i),
    after slot 0 re-predicted the committed token."""
    d = PTPSlotDrafter(8, num_slots=3, variant="c")
    d.reset(1)
    g = torch.Generator().manual_seed(0)
    block = torch.randn(4, 10, generator=g)
    context = [5, 6, 7]                     # slot 0 stands at position 2, the committed token's
    pos = torch.arange(2, 6)
    d.slot_embeddings(torch.zeros(4, dtype=torch.long), torch.arange(4), pos, torch.full((4,), 11))
    draft = cdf_sample(block, uniform(11, pos))
    context[-1] = int(draft[0])
    d.observe_slots([block])
    tree = d.propose([context], [3])[0]
    assert tree.tokens.tolist() == draft[1:].tolist() and tree.parents.tolist() == [-1, 0, 1]
    # C-PTP's auxiliary input is the previous position's u
    assert torch.equal(d.slot_u(pos, torch.full((4,), 11)), uniform(11, pos - 1))
    with pytest.raises(ValueError, match="variant"):
        PTPSlotDrafter(8, variant="x")
    with pytest.raises(ValueError, match="aux_mode"):
        PTPSlotDrafter(8, aux_mode="bytes")


@pytest.mark.parametrize("variant,aux_mode", [("c", "interp"), ("o", "none")])
def test_sampling_drafters_keep_seeded_sampling_exact_in_batches(variant, aux_mode):
    """Random (untrained, active) C-PTP / no-aux drafters in a ragged batch: output equals the loop's own
    autoregressive sampling with the same seeds, and drafts are made."""
    model = _tiny()
    d = PTPSlotDrafter(D, num_slots=3, variant=variant, aux_mode=aux_mode).init_adapters(model, rank=4)
    ids = torch.tensor([[PAD, PAD, 11, 12, 13], [14, 15, 16, 17, 18]])
    mask = (ids != PAD).long()
    kw = dict(attention_mask=mask, max_new_tokens=24, pad_token_id=PAD, **WARP)
    patch(model, drafter=Drafter())
    ref = model.generate(ids, do_sample=True, seed=4, **kw)
    patch(model, drafter=d)
    try:
        out = model.generate(ids, do_sample=True, seed=4, **kw)
        assert torch.equal(out, ref) and stats(model).drafted_tokens > 0
    finally:
        unpatch(model)


def test_shipped_ptp_checkpoint_is_found_by_name_and_refuses_another_base():
    from fastverify.heads import resolve_checkpoint
    from fastverify.hf.bpd import load_drafter
    assert os.path.isfile(os.path.join(resolve_checkpoint("smollm2-ptp"), "slots.safetensors"))
    with pytest.raises(BaseModelMismatch):
        load_drafter("smollm2-ptp", _tiny())


@pytest.mark.slow
def test_seeded_sampling_with_the_shipped_ptp_drafter_on_the_real_model():
    """SmolLM2-135M-Instruct with the shipped PTP drafter: for several seeds and temperatures, seeded sampling
    equals the loop's own autoregressive sampling with that seed, and the blocks draft; greedy equals generate."""
    import fastverify
    from fastverify.models import load_smollm2
    model, tok = load_smollm2()
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32)
    ptp = fastverify.load_drafter("smollm2-ptp", model)
    drafted = {}
    for seed, temperature in ((1, 0.7), (2, 0.7), (3, 1.0), (4, 0.3)):
        sampling = dict(do_sample=True, seed=seed, temperature=temperature, top_k=50, top_p=0.95, **kw)
        patch(model, drafter=Drafter())
        ref = model.generate(ids, **sampling)
        patch(model, drafter=ptp)
        try:
            assert torch.equal(model.generate(ids, **sampling), ref), (seed, temperature)
            drafted[seed] = stats(model).drafted_tokens
        finally:
            unpatch(model)
    assert drafted[1] > 0 and drafted[2] > 0, drafted
    # merged with the shipped heads and the n-gram trie (ptp+bpd+ngram): still the same samples
    merged = fastverify.load_drafter("smollm2-ptp", model, ngram=True, heads="smollm2-bpd", tree_topk=2)
    sampling = dict(do_sample=True, seed=5, temperature=0.7, top_k=50, top_p=0.95, **kw)
    patch(model, drafter=Drafter())
    ref = model.generate(ids, **sampling)
    patch(model, drafter=merged)
    try:
        assert torch.equal(model.generate(ids, **sampling), ref) and stats(model).drafted_tokens > 0
    finally:
        unpatch(model)
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, **kw)
    for drafter in (ptp, merged):
        patch(model, drafter=drafter)
        try:
            assert torch.equal(model.generate(ids, do_sample=False, **kw), ref)
        finally:
            unpatch(model)
