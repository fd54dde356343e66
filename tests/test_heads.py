"""Proposal heads (fastverify.heads, fastverify.hf.bpd, fastverify.train.heads) on tiny random models.

- training learns a synthetic pattern within seconds (the loss falls, the per-head top-1 rises);
- the recipe runs end to end (data from token-id prompts, shards, resume, checkpoint);
- a checkpoint round-trips; a mismatched base model, a missing file, a corrupt checkpoint are refused clearly;
- the hidden state the loop hands a drafter equals the one a plain forward computes at that row;
- greedy output with heads (alone and merged with n-gram trees) equals the model's own generate, batch 1 and 3.
"""

import contextlib
import dataclasses
import json
import math
import os

import pytest
import torch

import fastverify
from fastverify.heads import (BaseModelMismatch, CheckpointError, ProposalHeads, fingerprint, load_heads,
                              save_heads)
from fastverify.hf import Drafter, NGramDrafter, patch, stats, unpatch
from fastverify.hf.bpd import HeadsDrafter, load_drafter
from fastverify.hf.drafters import empty_tree
from fastverify.train import heads as recipe

from conftest import assert_greedy_exact, left_padded, patched_generate, repetitive, tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 256, 64
PAD = 1


def _tiny(seed=0, vocab=V, tie=True):
    return tiny_llama(vocab, D, seed=seed, tie=tie)


@pytest.fixture(scope="module")
def model():
    return _tiny()


def _random_heads(num_heads=3, seed=1, subset=None, sequential=False, ffn_size=0):
    g = torch.Generator().manual_seed(seed)
    h = ProposalHeads(D, num_heads, subset, sequential=sequential, ffn_size=ffn_size)
    F_ = ffn_size or D
    with torch.no_grad():
        h.weight.copy_(torch.randn(num_heads, F_, D, generator=g) * 0.3)
        h.bias.copy_(torch.randn(num_heads, F_, generator=g) * 0.1)
        if sequential:
            h.token_weight.copy_(torch.randn(num_heads, F_, D, generator=g) * 0.3)
        if ffn_size:
            h.out_weight.copy_(torch.randn(num_heads, D, F_, generator=g) * 0.3)
    return h.eval()


def _repetitive(length, seed):
    return repetitive(length, V, seed)


def _batch(lengths, seed=0):
    return left_padded([_repetitive(n, seed + b) for b, n in enumerate(lengths)], PAD)


# ----------------------------------------------------------------------------------------------- training

def test_training_learns_a_synthetic_pattern(tmp_path):
    """Hidden states near embedding row c; head p_i must propose token (c + i) mod V': a permutation the residual
    block has to learn. Within a few hundred small steps the loss falls and every head's top-1 exceeds 0.9."""
    torch.manual_seed(0)
    Vs, Dm, N, H = 32, 48, 4096, 3
    E = torch.nn.functional.normalize(torch.randn(Vs, Dm), dim=-1) * 4
    c = torch.randint(0, Vs, (N,))
    hidden = (E[c] + 0.3 * torch.randn(N, Dm)).half()
    targets = torch.stack([(c + i + 1) % Vs for i in range(H)], dim=1)
    heads = ProposalHeads(Dm, H)
    cfg = recipe.HeadsConfig(out="unused", epochs=12, batch_size=256, lr=3e-3, warmup=10, save_every=10 ** 9,
                             resume=False, progress=False)
    before = recipe.evaluate(heads, hidden, targets, E, None)
    hist = recipe.train_loop(heads, hidden, targets, E, None, cfg, state_path=str(tmp_path / "state.pt"),
                             log=lambda *a: 0)
    after = recipe.evaluate(heads, hidden, targets, E, None)
    assert hist[-1]["loss"] < 0.3 * hist[0]["loss"]
    assert max(before["top1"]) < 0.2
    assert min(after["top1"]) > 0.9, after["top1"]


def test_sequential_heads_learn_what_parallel_heads_cannot(tmp_path):
    """Tokens that follow a fixed permutation of the previous token, from a next token the hidden state does not
    tell: parallel heads stay near chance, sequential heads (which read the draft's previous token) learn it."""
    torch.manual_seed(0)
    Vs, Dm, N, H = 32, 48, 4096, 3
    E, E_in = torch.nn.functional.normalize(torch.randn(Vs, Dm), dim=-1) * 4, torch.randn(Vs, Dm)
    perm = torch.randperm(Vs)
    hidden = (torch.randn(N, Dm)).half()
    toks = [torch.randint(0, Vs, (N,))]  # x_{r+1}: the root, known to the drafter, not to parallel heads
    for _ in range(H):
        toks.append(perm[toks[-1]])
    targets, inputs = torch.stack(toks[1:], 1), torch.stack(toks[:H], 1)
    cfg = recipe.HeadsConfig(out="unused", epochs=12, batch_size=256, lr=3e-3, warmup=10, save_every=10 ** 9,
                             resume=False, progress=False)
    top1 = {}
    for seq, ffn in ((False, 0), (True, 0), (False, 2 * Dm), (True, 2 * Dm)):
        torch.manual_seed(1)
        heads = ProposalHeads(Dm, H, sequential=seq, ffn_size=ffn)
        recipe.train_loop(heads, hidden, targets, E, None, cfg, state_path=str(tmp_path / f"s{seq}{ffn}.pt"),
                          log=lambda *a: 0, inputs=inputs, embed=E_in)
        top1[seq, ffn] = recipe.evaluate(heads, hidden, targets, E, None, inputs=inputs, embed=E_in)["top1"]
    assert max(top1[False, 0]) < 0.2 and min(top1[True, 0]) > 0.9, top1
    assert max(top1[False, 2 * Dm]) < 0.2 and min(top1[True, 2 * Dm]) > 0.9, top1  # feed-forward heads alike


def test_feed_forward_heads_start_as_the_identity():
    """ffn_size > 0: the output projection starts at zero, so an untrained head passes the state through (and
    proposes what the target predicts), while its hidden layer starts random so that it gets a gradient."""
    torch.manual_seed(0)
    for seq in (False, True):
        heads = ProposalHeads(D, 2, sequential=seq, ffn_size=3 * D)
        assert heads.weight.shape == (2, 3 * D, D) and heads.out_weight.shape == (2, D, 3 * D)
        assert heads.weight.abs().sum() > 0 and heads.out_weight.abs().sum() == 0
        h = torch.randn(5, D)
        out = heads(h, torch.randn(5, 2, D) if seq else None)
        assert torch.equal(out, h[None].expand(2, -1, -1))
        out.sum().backward()
        assert heads.out_weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="ffn_size"):
        ProposalHeads(D, 2, ffn_size=-1)


def test_build_examples_inputs_are_the_tokens_before_each_target(tmp_path):
    g = torch.tensor([[10, 11, 12, 13, 99]], dtype=torch.int32)
    torch.save({"tokens": g, "lengths": torch.tensor([4], dtype=torch.int32),
                "hidden": torch.zeros(1, 5, 4, dtype=torch.float16)}, tmp_path / "shard_00000.pt")
    hidden, targets, inputs = recipe.build_examples([str(tmp_path / "shard_00000.pt")], 3, with_inputs=True)
    assert hidden.shape == (4, 4)
    assert targets.tolist() == [[11, 12, 13], [12, 13, -100], [13, -100, -100], [-100, -100, -100]]
    assert inputs.tolist() == [[10, 11, 12], [11, 12, 13], [12, 13, 0], [13, 0, 0]]


def test_teacher_rows_are_the_rows_that_gave_each_target(tmp_path):
    """--soft-targets: head h's teacher at example n is the target's distribution at row n + h + 1 of the cached
    shards, whose greedy token is head h's target. On shards a tiny model (untied, so that its continuations do
    not just repeat) generated from random prompts, the argmax of those logits is the target wherever one exists,
    and that of the rows one off is far less often."""
    model = _tiny(tie=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (10 + i % 4,), generator=g).tolist() for i in range(12)]
    paths = recipe.generate_data(model, None, prompts, str(tmp_path / "d"), batch=4, max_new_tokens=12,
                                 progress=False)
    H = 3
    hidden, targets = recipe.build_examples(paths, H)
    weight = model.get_output_embeddings().weight.detach().float()
    idx = torch.arange(hidden.shape[0])
    for h in range(H):
        valid = targets[:, h] >= 0
        assert valid.sum() >= 12 * (12 - H - 1)
        hit = lambda off: (recipe.teacher_logits(hidden, idx, off, weight, None).argmax(-1)[valid]  # noqa: E731
                           == targets[valid, h]).float().mean().item()
        assert hit(h) >= 0.99, (h, hit(h))  # fp16 rows: a near tie may round the other way
        assert max(hit(h + 1), hit(h - 1)) < hit(h) - 0.3, (h, hit(h - 1), hit(h), hit(h + 1))


def test_soft_target_loss_mixes_ce_and_kl_to_the_target():
    """soft = 1 against a one-hot teacher is the CE to its token; soft = w is (1 - w) CE + w KL; soft = 0 never
    reads the teacher; rows without a target are skipped by both."""
    torch.manual_seed(0)
    H, N, Vs = 2, 12, 9
    logits = torch.randn(H, N, Vs)
    targets = torch.randint(0, Vs, (N, H))
    targets[-3:, 1] = -100
    onehot = lambda h: 1e4 * torch.nn.functional.one_hot(targets[:, h].clamp(min=0), Vs).float()  # noqa: E731
    ce, acc = recipe._loss(logits, targets, 0.5)
    hard, acc1 = recipe._loss(logits, targets, 0.5, onehot, soft=1.0)
    assert torch.allclose(hard, ce, atol=1e-4) and acc1 == acc
    teach = torch.randn(H, N, Vs)
    kl = sum(0.5 ** h * torch.nn.functional.kl_div(
        logits[h][targets[:, h] >= 0].log_softmax(-1), teach[h][targets[:, h] >= 0].log_softmax(-1),
        log_target=True, reduction="batchmean") for h in range(H))
    mixed, _ = recipe._loss(logits, targets, 0.5, lambda h: teach[h], soft=0.25)
    assert torch.allclose(mixed, 0.75 * ce + 0.25 * kl, atol=1e-5)
    assert torch.equal(recipe._loss(logits, targets, 0.5, lambda h: 1 / 0, soft=0.0)[0], ce)
    with pytest.raises(ValueError, match="soft_targets"):
        recipe.HeadsConfig(out="unused", soft_targets=1.5)


@pytest.mark.parametrize("arch,ffn,dtype,soft", [("parallel", 2.0, "float16", 0.0), ("sequential", 2.0, "float16", 0.0),
                                                 ("sequential", 0.0, "float16", 0.5), ("sequential", 2.0, "q8_0", 0.0)])
def test_recipe_end_to_end_resume_and_checkpoint(model, tmp_path, arch, ffn, dtype, soft):
    """train_heads on token-id prompts: data shards, a trained checkpoint that loads onto the model, and a
    second call that resumes (no new shards, the training state's last step) instead of starting over."""
    prompts = [_repetitive(12 + i % 5, i) for i in range(20)]
    cfg = recipe.HeadsConfig(out=str(tmp_path / "ckpt"), data_dir=str(tmp_path / "data"), num_heads=2,
                             vocab_subset=64, exclude="", num_prompts=16, eval_prompts=4, max_new_tokens=12,
                             gen_batch=4, epochs=2, batch_size=32, save_every=3, progress=False, arch=arch, ffn=ffn,
                             save_dtype=dtype, soft_targets=soft)
    logs = []
    heads, config = recipe.train_heads(model, None, cfg, base_name="tiny-llama", prompts=prompts, log=logs.append)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "heads.safetensors", "train_state.pt"]
    assert len([f for f in os.listdir(tmp_path / "data" / "train") if f.startswith("shard_")]) == 4
    assert config["training"]["train_positions"] == 16 * 12 and config["base_model"] == "tiny-llama"
    loaded, cfg2 = load_heads(str(tmp_path / "ckpt"), model)
    assert torch.equal(loaded.weight, heads.weight.detach()) and loaded.vocab_subset.numel() == 64
    assert loaded.sequential == (arch == "sequential") and cfg2["arch"] == arch
    assert loaded.ffn_size == cfg2["ffn_size"] == round(ffn * D) and cfg2["weights_dtype"] == dtype
    assert len(cfg2["head_acceptance"]) == 2
    assert len(cfg2["calibration"]["acceptance"]) == 2
    # the trained checkpoint drafts (calibrated scores) and greedy output stays the model's own
    ids, mask = _batch([20, 14])
    drafter = load_drafter(str(tmp_path / "ckpt"), model, min_gain=0.5)
    assert drafter.score == "calibrated"
    assert_greedy_exact(model, drafter, ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD)
    steps = config["training"]["steps"]
    logs.clear()
    _, config2 = recipe.train_heads(model, None, cfg, base_name="tiny-llama", prompts=prompts, log=logs.append)
    assert any("resumed from" in m and f"at step {steps}/{steps}" in m for m in logs)
    assert config2["training"]["steps"] == steps
    # the wall time recorded is the training's, summed over runs, not the resumed call's (which trained nothing)
    elapsed = torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)["elapsed"]
    assert config2["training"]["train_seconds"] == config["training"]["train_seconds"] == round(elapsed, 1)
    # resuming under another recipe is refused, naming what changed, before any step
    with pytest.raises(ValueError, match=r"resume: .*\(decay 0\.8 -> 0\.5\)"):
        recipe.train_heads(model, None, dataclasses.replace(cfg, decay=0.5), base_name="tiny-llama", prompts=prompts,
                           log=logs.append)
    assert torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)["elapsed"] == elapsed


def test_resume_checks_the_training_options_not_the_run_options():
    """check_resumable: every option that changes what is trained must match the saved config (one it predates
    counts as its default); the run options (RUN_OPTIONS: threads, saves, output folder, ...) may change."""
    cfg = recipe.HeadsConfig(out="a", exclude="")
    saved = dataclasses.asdict(cfg)
    recipe.check_resumable(dataclasses.replace(cfg, out="b", threads=1, save_every=7, data_minutes=3.0), saved, "s")
    with pytest.raises(ValueError, match=r"ffn 0\.0 -> 2\.0, lr 0\.001 -> 0\.002") as err:
        recipe.check_resumable(dataclasses.replace(cfg, lr=2e-3, ffn=2.0), saved, "s")
    assert "threads" not in str(err.value) and "--no-resume" in str(err.value)
    older = {k: v for k, v in saved.items() if k != "soft_targets"}  # saved before the option existed
    recipe.check_resumable(cfg, older, "s")
    with pytest.raises(ValueError, match=r"soft_targets 0\.0 -> 0\.5"):
        recipe.check_resumable(dataclasses.replace(cfg, soft_targets=0.5), older, "s")


def test_data_shards_are_remade_for_another_prompt_selection(model, tmp_path):
    """A data folder reused by a run with other prompts keeps the shards cut from the same prompts and makes the
    others again (never reads them as the new selection's); another model or other generation settings are
    refused."""
    folder = str(tmp_path / "data")
    first = [_repetitive(10 + i % 3, i) for i in range(8)]
    paths = recipe.generate_data(model, None, first, folder, batch=4, max_new_tokens=6, progress=False)
    assert len(paths) == 2
    stamps = [os.stat(p).st_mtime_ns for p in paths]
    longer = first + [_repetitive(14, 100 + i) for i in range(4)]  # the same first two chunks, one more
    paths = recipe.generate_data(model, None, longer, folder, batch=4, max_new_tokens=6, progress=False)
    assert len(paths) == 3 and [os.stat(p).st_mtime_ns for p in paths[:2]] == stamps
    shorter = [_repetitive(8, 200 + i) for i in range(4)] + first  # every chunk shifts
    paths = recipe.generate_data(model, None, shorter, folder, batch=4, max_new_tokens=6, progress=False)
    enc = recipe.encode_prompts(None, shorter)
    assert [torch.load(p)["prompts"] for p in paths] == [enc[i:i + 4] for i in range(0, 12, 4)]
    assert [os.stat(p).st_mtime_ns for p in paths[:2]] != stamps
    with pytest.raises(ValueError, match="model"):  # same architecture, other weights
        recipe.generate_data(_tiny(seed=5), None, shorter, folder, batch=4, max_new_tokens=6, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        recipe.generate_data(model, None, shorter, folder, batch=4, max_new_tokens=8, progress=False)
    with pytest.raises(ValueError, match="sample"):
        recipe.generate_data(model, None, shorter, folder, batch=4, max_new_tokens=6, progress=False,
                             sample={"temperature": 0.7})


def test_model_digest_samples_both_ends_of_large_parameters():
    """The data folder's model digest indexes exactly (a float linspace over 2^24+ elements rounds past the
    end) and sees a change in the last element of a parameter."""
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(2 ** 24 + 1), requires_grad=False)
    before = recipe._model_digest(m)
    m.w[-1] = 1.0
    assert recipe._model_digest(m) != before


def test_held_out_prompts_do_not_depend_on_the_training_size():
    """Runs on more or less training data are evaluated on the same held-out prompts, never trained on."""
    prompts = [f"prompt number {i} about topic {i % 37}" for i in range(3 * recipe.HELD_OUT_POOL)]
    # a run on more data reads more prompts (load_prompts' limit grows with num_prompts)
    small = recipe.select_prompts(recipe.HeadsConfig(out="", exclude="", num_prompts=100), prompts[:4000], print)
    large = recipe.select_prompts(recipe.HeadsConfig(out="", exclude="", num_prompts=5000), list(prompts), print)
    assert small[0] == large[0] and len(small[0]) == 48
    assert len(small[1]) == 100 and len(large[1]) == 5000 and small[1] == large[1][:100]
    assert not set(large[0]) & set(large[1])


def test_ngram_filter_drops_prompts_sharing_eight_words(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"turns": ["Please write a short poem about the sea at night for my friend."]}) + "\n")
    prompts = ["write a short poem about the sea at night, please",  # 8 words in a row shared
               "a poem about the sea",                                 # too short to share an 8-gram
               "Write a SHORT poem: about the sea at night!"]          # case and punctuation do not matter
    kept, dropped = recipe.ngram_filter(prompts, str(q))
    assert kept == ["a poem about the sea"] and dropped == 2


def test_a_prompt_file_a_recipe_cannot_use_is_named(model, tmp_path):
    """A prompt file that is not JSON lines names its line; a selection that leaves nothing to train on, or prompts
    all longer than max_prompt_tokens, name what is missing (before: a JSONDecodeError without the file, an
    AttributeError, or torch.cat's 'expected a non-empty list' after the data stage)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:3: not JSON"):
        recipe.load_prompts(str(bad))
    bad.write_text('"a bare string is a prompt"\n[1, 2]\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: expected a string or an object"):
        recipe.load_prompts(str(bad))
    cfg = recipe.HeadsConfig(out="", exclude="", eval_prompts=3)
    with pytest.raises(ValueError, match=r"3 left; need more than eval_prompts=3"):
        recipe.select_prompts(cfg, ["one", "two", "three"], print)
    with pytest.raises(ValueError, match="none of the 2 prompts fits in max_prompt_tokens=8"):
        recipe.generate_data(model, None, [_repetitive(9, 0), _repetitive(12, 1)], str(tmp_path / "d"),
                             max_prompt_tokens=8, max_new_tokens=4, progress=False)
    with pytest.raises(ValueError, match="no continuation token in the 0 shard"):
        recipe.build_examples([], 3)


def test_sharegpt_reader_tolerates_a_truncated_tail():
    text = '[\n {"id": 1, "conversations": [{"from": "human", "value": "hi"}]},\n {"id": 2, "conv'
    assert [o["id"] for o in recipe._iter_json_array(text)] == [1]


# ----------------------------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16], ids=str)
def test_torchs_default_dtype_changes_nothing(tmp_path, default):
    """Under ``torch.set_default_dtype`` (a float32 model built before), heads and an EAGLE layer are still float32,
    a checkpoint loads onto its base (the fingerprint's probe rows of a 512-token vocabulary: row 511 rounded to 512
    in bfloat16, an IndexError), ``patch`` checks its rule (it raised on float64 logits), and the patched call gives
    generate's tokens with the drafts the float32 default gives."""
    from fastverify.eagle import EagleLayer
    vocab = 512
    model = tiny_llama(vocab, D, seed=2, tie=True)
    path = str(tmp_path / "h")
    save_heads(_random_heads(), path, {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    ids, mask = left_padded([repetitive(n, vocab, b) for b, n in enumerate((20, 13))], PAD)
    kw = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=False)
    want = model.generate(ids, **kw)
    runs = []
    for dtype in (torch.float32, default):
        torch.set_default_dtype(dtype)
        try:
            assert {p.dtype for p in (*ProposalHeads(D, 2).parameters(), *EagleLayer(D, 4, 128).parameters())} \
                == {torch.float32}
            patch(model)
            got = model.generate(ids, **kw)
            unpatch(model)
            patch(model, drafter=load_drafter(path, model))
            runs.append((got, model.generate(ids, **kw), stats(model).accepted))
        finally:
            torch.set_default_dtype(torch.float32)
            unpatch(model)
    for got, with_heads, _ in runs:
        assert torch.equal(got, want) and torch.equal(with_heads, want)
    assert runs[1][2] == runs[0][2]


def test_checkpoint_round_trip_and_refusals(model, tmp_path):
    heads = _random_heads(subset=torch.arange(0, V, 2))
    path = str(tmp_path / "h")
    save_heads(heads, path, {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    loaded, cfg = load_heads(path, model)
    assert torch.equal(loaded.weight, heads.weight) and torch.equal(loaded.bias, heads.bias)
    assert torch.equal(loaded.vocab_subset, heads.vocab_subset) and cfg["num_heads"] == 3
    # the same base in bf16 is accepted (the fingerprint compares probe sums with a tolerance)
    load_heads(path, _tiny().to(torch.bfloat16))
    with pytest.raises(BaseModelMismatch, match="does not match the one the heads were trained on"):
        load_heads(path, _tiny(seed=5))
    with pytest.raises(BaseModelMismatch, match="vocabulary size mismatch"):
        load_heads(path, _tiny(vocab=V + 8))
    with pytest.raises(BaseModelMismatch, match="mismatch"):
        load_drafter(path, _tiny(seed=5))


@pytest.mark.parametrize("sequential", [False, True], ids=["parallel", "sequential"])
def test_feed_forward_checkpoint_round_trip_and_refusals(model, tmp_path, sequential):
    heads = _random_heads(subset=torch.arange(0, V, 2), sequential=sequential, ffn_size=2 * D + 3)
    path = str(tmp_path / "h")
    save_heads(heads, path, {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    loaded, cfg = load_heads(path, model)
    assert cfg["ffn_size"] == 2 * D + 3 and loaded.ffn_size == 2 * D + 3
    for name in ("weight", "bias", "token_weight", "out_weight"):
        a, b = getattr(loaded, name), getattr(heads, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    h = torch.randn(4, D)
    emb = torch.randn(4, 3, D) if sequential else None
    assert torch.equal(loaded(h, emb), heads(h, emb))
    # a config whose ffn_size disagrees with the weights is refused, as is one without the output projection
    with open(os.path.join(path, "config.json")) as f:
        good = json.load(f)
    for bad in ({"ffn_size": 2 * D}, {"ffn_size": 0}, {"ffn_size": -1}, {"ffn_size": "wide"}):
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**good, **bad}, f)
        with pytest.raises(CheckpointError, match="ffn_size|weight"):
            load_heads(path, model)
    from safetensors.torch import load_file, save_file
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(good, f)
    tensors = load_file(os.path.join(path, "heads.safetensors"))
    del tensors["out_weight"]
    save_file(tensors, os.path.join(path, "heads.safetensors"))
    with pytest.raises(CheckpointError, match="out_weight"):
        load_heads(path, model)


def test_sequential_checkpoint_round_trip(model, tmp_path):
    heads = _random_heads(subset=torch.arange(0, V, 2), sequential=True)
    path = str(tmp_path / "h")
    save_heads(heads, path, {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    loaded, cfg = load_heads(path, model)
    assert loaded.sequential and cfg["arch"] == "sequential"
    assert torch.equal(loaded.token_weight, heads.token_weight) and torch.equal(loaded.weight, heads.weight)
    # half the file in float16; loading gives the fp16-rounded weights back as fp32
    save_heads(heads, str(tmp_path / "h16"), {"base_model": "tiny", "base_fingerprint": fingerprint(model)},
               dtype="float16")
    half, cfg16 = load_heads(str(tmp_path / "h16"), model)
    assert cfg16["weights_dtype"] == "float16" and half.token_weight.dtype == torch.float32
    assert torch.equal(half.token_weight, heads.token_weight.detach().half().float())
    size = os.path.getsize
    assert size(tmp_path / "h16" / "heads.safetensors") < 0.6 * size(tmp_path / "h" / "heads.safetensors")
    with pytest.raises(ValueError, match="dtype"):
        save_heads(heads, str(tmp_path / "h8"), {}, dtype="int8")
    # a config that says parallel over weights that hold a token_weight (or the reverse) is refused
    cfg["arch"] = "parallel"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="token_weight"):
        load_heads(path, model)
    cfg["arch"] = "hydra++"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="arch 'hydra\\+\\+'"):
        load_heads(path, model)
    with pytest.raises(ValueError, match="token_emb"):
        heads(torch.zeros(2, D))


def test_checkpoint_bad_input_errors(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_heads(str(tmp_path / "nope"), model)
    path = tmp_path / "h"
    save_heads(_random_heads(), str(path), {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    (path / "heads.safetensors").write_bytes(b"\x00garbage, not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_heads(str(path), model)
    os.remove(path / "heads.safetensors")
    with pytest.raises(FileNotFoundError, match="missing heads.safetensors"):
        load_heads(str(path), model)
    save_heads(_random_heads(), str(path), {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    (path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_heads(str(path), model)
    (path / "config.json").write_text(json.dumps({"method": "lora"}))
    with pytest.raises(CheckpointError, match="does not describe proposal heads"):
        load_heads(str(path), model)
    for key, value in (("num_heads", "five"), ("num_heads", 0), ("hidden_size", 64.0), ("hidden_size", True)):
        save_heads(_random_heads(), str(path), {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
        cfg = json.loads((path / "config.json").read_text())
        cfg[key] = value
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=f"{key} {value!r}, expected an int >= 1"):
            load_heads(str(path), model)


def test_shipped_checkpoint_is_found_by_name():
    from fastverify.heads import resolve_checkpoint
    path = resolve_checkpoint("smollm2-bpd")
    assert sorted(os.listdir(path))[:2] == ["config.json", "heads.safetensors"]
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["method"] == "bpd" and cfg["base_fingerprint"]["shape"] == [49152, 576]
    with pytest.raises(BaseModelMismatch, match="vocabulary size mismatch"):
        load_drafter("smollm2-bpd", _tiny())


# ----------------------------------------------------------------------------------------------- the loop

class _Recorder(Drafter):
    """n-gram trees (so accepted paths end at draft rows too) and a record of every hidden state handed over."""

    wants_hidden = True

    def __init__(self, silent=()):
        self.ngram = NGramDrafter(fixed_cost=0, node_cost=0)
        self.log = []
        self.silent = silent  # requests that draft nothing (their rows then pad to the others' trees)

    def reset(self, batch_size):
        super().reset(batch_size)
        self.ngram.reset(batch_size)

    def propose(self, contexts, budget):
        self.contexts = [list(c) for c in contexts]
        trees = self.ngram.propose(contexts, budget)
        return [empty_tree() if b in self.silent else t for b, t in enumerate(trees)]

    def update(self, accepted):
        self.ngram.update(accepted)

    def observe_hidden(self, hidden, active):
        self.log.append((hidden.clone(), list(active)))


@pytest.mark.parametrize("lengths,silent", [([30, 22, 26], ()), ([30, 22, 26], (1,)), ([30], ())],
                         ids=["all-draft", "one-silent", "batch1"])
def test_hidden_state_handed_to_drafter_equals_plain_forward(model, lengths, silent):
    """Also where request 1 drafts nothing: its rows pad to the others' trees and the loop computes the verify rows
    only (fastverify.hf.layers.LiveRows); the hidden states are read in the padded layout all the same."""
    ids, mask = _batch(lengths)
    drafter = _Recorder(silent)
    out, st = patched_generate(model, drafter, ids, attention_mask=mask,
                               max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    assert st.accepted_tokens > 0 and len(drafter.log) == st.steps
    if silent:
        assert any(step[1] == 0 and max(step) > 0 for step in st.drafted)  # padded steps
    # after step s, request b's committed sequence is prompt + generated[:n]; the hidden state handed over is
    # the one at the position of its second-to-last token (the row whose logits gave the last token)
    captured = {}
    h = model.get_output_embeddings().register_forward_hook(lambda m, a, o: captured.__setitem__("h", a[0]))
    L = ids.shape[1]
    try:
        new_counts = [0] * len(lengths)
        for s, (hidden, active) in enumerate(drafter.log):
            for b in range(len(lengths)):
                if not active[b]:
                    continue
                acc = st.accepted[s][b]
                new_counts[b] += acc + 1
                seq = out[b, :L + new_counts[b]][mask[b].bool().tolist() + [True] * new_counts[b]]
                with torch.no_grad():
                    model(seq[None, :-1])
                torch.testing.assert_close(hidden[b], captured["h"][0, -1], atol=1e-4, rtol=1e-4)
    finally:
        h.remove()


class _ScoredNodes(NGramDrafter):
    """An n-gram drafter with the same scored candidate nodes for every request (its own cost cut)."""

    def __init__(self, nodes, fixed_cost=0.05, node_cost=0.01, min_gain=1.0):
        super().__init__(fixed_cost=fixed_cost, node_cost=node_cost, min_gain=min_gain)
        self.nodes = nodes

    def scored_nodes(self, contexts, budget):
        return [list(self.nodes) for _ in contexts]


def test_bpd_ngram_is_one_trie_cut_by_one_cost_model(model):
    # heads: depth 1 tokens 5 / 8 (p 0.5 / 0.3), depth 2 tokens 6 / 9 (0.4 / 0.1); n-gram: 5 -> 6 (0.9, 0.8), 7 (0.05)
    d = HeadsDrafter(model, _random_heads(subset=torch.arange(3, V)), ngram=_ScoredNodes(
        [((5,), 0.9), ((5, 6), 0.8), ((7,), 0.05)]), fixed_cost=0.1, node_cost=0.06, min_gain=1.0,
        ngram_confident=None)  # the n-gram nodes expect 1.75 tokens: by default the heads would be skipped
    d.reset(1)
    d.candidates[0] = ([[5, 8], [6, 9]], torch.tensor([[0.5, 0.3], [0.4, 0.1]], dtype=torch.float64).log())
    tree = d.propose([[1, 2, 3]], [16])[0]
    # merged, best first: 5 (0.9), 5-6 (0.8), 8 (0.3), 8-6 (0.12), ...; expected tokens per cost peaks at three
    # nodes (3.0 / 1.28), and the path both proposed appears once
    assert tree.tokens.tolist() == [5, 6, 8] and tree.parents.tolist() == [-1, 0, -1]
    # no heads' candidates (the first step): the n-gram drafter's own step, its own cost model (node_cost 0.01:
    # 2.75 / 1.08 beats 2.7 / 1.07; under the heads' it would not: 2.7 / 1.22 beats 2.75 / 1.28)
    d.candidates[0] = None
    tree = d.propose([[1, 2, 3]], [16])[0]
    assert tree.tokens.tolist() == [5, 6, 7] and tree.parents.tolist() == [-1, 0, -1]
    assert len(d.propose([[1, 2, 3]], [0])[0]) == 0  # no budget: no draft


def test_heads_skipped_where_the_ngram_candidates_are_confident(model):
    """A request whose n-gram candidates expect >= ngram_confident accepted tokens gets the n-gram drafter's nodes
    alone (the heads' pass skipped for it); another request of the batch still gets the heads' nodes."""
    cand = ([[8], [9]], torch.tensor([[0.6], [0.5]], dtype=torch.float64).log())
    ngram = _ScoredNodes([((5,), 0.9), ((5, 6), 0.8)])  # 1.7 expected tokens

    def trees(confident, contexts):
        d = HeadsDrafter(model, _random_heads(subset=torch.arange(3, V)), ngram=ngram, fixed_cost=0.1,
                         node_cost=0.02, min_gain=1.0, ngram_confident=confident)
        d.reset(len(contexts))
        d.candidates = [cand] * len(contexts)
        return [t.tokens.tolist() for t in d.propose(contexts, [16] * len(contexts))]

    assert trees(None, [[1, 2, 3]]) == [[5, 6, 8, 9]]
    assert trees(2.0, [[1, 2, 3]]) == [[5, 6, 8, 9]]  # 1.7 < 2.0: the heads run
    assert trees(1.5, [[1, 2, 3]]) == [[5, 6]]
    per_request = _ScoredNodes(None)
    per_request.scored_nodes = lambda c, b: [[((5,), 0.9), ((5, 6), 0.8)], [((5,), 0.5)]]
    mixed = HeadsDrafter(model, _random_heads(subset=torch.arange(3, V)), fixed_cost=0.1, node_cost=0.02,
                         min_gain=1.0, ngram=per_request)
    mixed.reset(2)
    mixed.candidates = [cand, cand]
    got = [t.tokens.tolist() for t in mixed.propose([[1, 2, 3], [1, 2, 4]], [16, 16])]
    assert got[0] == [5, 6] and 8 in got[1]
    with pytest.raises(ValueError, match="ngram_confident"):
        HeadsDrafter(model, _random_heads(subset=torch.arange(3, V)), ngram_confident=0)


def test_batched_cut_charges_each_node_to_the_shared_step(model):
    # R drafting requests share one forward: each request's cut uses node_cost * R (batch_drafting)
    d = HeadsDrafter(model, _random_heads(subset=torch.arange(3, V)), ngram=_ScoredNodes(
        [((5,), 0.9), ((5, 6), 0.8), ((7,), 0.05)]), fixed_cost=0.1, node_cost=0.08, min_gain=1.0,
        ngram_confident=None)
    cand = ([[5, 8], [6, 9]], torch.tensor([[0.5, 0.3], [0.4, 0.1]], dtype=torch.float64).log())

    def cut(budget):
        d.reset(len(budget))
        d.candidates = [cand] * len(budget)
        return [t.tokens.tolist() for t in d.propose([[1, 2, 3]] * len(budget), budget)]

    assert cut([16]) == [[5, 6, 8]]  # 3.0 / 1.34 beats 2.7 / 1.26
    assert cut([16, 16]) == [[5, 6], [5, 6]]  # at node cost 0.16: 2.7 / 1.42 beats 3.0 / 1.58
    assert cut([16, 0]) == [[5, 6, 8], []]  # a request that cannot draft does not share the cost


@pytest.mark.parametrize("ffn_size", [0, 2 * D + 3], ids=["block", "ffn"])
def test_sequential_tree_scores_each_path_by_the_heads_run_along_it(model, ffn_size):
    """Level-by-level expansion: every node's estimate (score="prob") is the product over its path of the heads'
    softmax probabilities computed by a plain teacher-forced forward of the heads along that path (the root is
    the context's last token), parents come first, and only ``frontier`` nodes per depth are expanded."""
    heads = _random_heads(num_heads=3, subset=torch.arange(3, V), sequential=True,
                          ffn_size=ffn_size).requires_grad_(False)
    d = HeadsDrafter(model, heads, score="prob", width=3, frontier=2, node_cost=0.0, max_nodes=64)
    d.reset(2)
    hidden = torch.randn(2, D)
    d.observe_hidden(hidden, [True, True])
    contexts = [[4, 5, 17], [9, 23]]
    nodes = d._sequential_nodes(contexts, [64, 64], drafting=2)
    embed, sub = model.get_input_embeddings().weight, torch.arange(3, V)
    # the drafter's copy of the subset's rows: streamed in float16 by skinny_linear on the CPU
    assert torch.equal(d.weight.float(), model.lm_head.weight[sub].to(d.weight.dtype).float())
    for b in range(2):
        assert len(nodes[b]) == 3 + 2 * 3 + 2 * 3  # width 3 at depth 1; 2 expanded per depth after that
        seen = set()
        for path, prob in nodes[b]:
            assert path[:-1] in seen or len(path) == 1
            seen.add(path)
            toks = [contexts[b][-1], *path]
            emb = embed[torch.tensor(toks[:-1])][None]  # [1, depth, D]
            states = heads.forward(hidden[b:b + 1], torch.cat([emb, emb.new_zeros(1, 3 - emb.shape[1], D)], 1)
                                   if emb.shape[1] < 3 else emb)
            logp = 0.0
            for i, t in enumerate(path):
                logits = states[i, 0] @ d.weight.float().t()  # the subset's rows (float16 on the CPU)
                logp += float(torch.log_softmax(logits, -1)[t - 3])
            assert abs(prob - math.exp(logp)) < 1e-4 * max(prob, 1e-3), (path, prob, math.exp(logp))
    # a node estimated below what it costs is neither proposed nor expanded
    d2 = HeadsDrafter(model, heads, score="prob", width=3, frontier=2, node_cost=0.05, max_nodes=64)
    d2.reset(1)
    d2.observe_hidden(hidden[:1], [True])
    assert all(p > 0.05 for _, p in d2._sequential_nodes(contexts[:1], [64], drafting=1)[0])


def test_a_level_runs_only_where_its_best_child_can_join_the_cut(model):
    """A node is expanded only when its estimate times the next head's measured top-candidate acceptance
    (head_acceptance[d][0]) beats the least estimate that still joins the request's cut: with that acceptance near 0
    no second level runs; near 1 the tree grows to the heads' depth; without a table a child is expanded when it
    could join the cut itself."""
    heads = _random_heads(num_heads=3, subset=torch.arange(3, V), sequential=True).requires_grad_(False)
    hidden, contexts = torch.randn(1, D, generator=torch.Generator().manual_seed(3)), [[4, 5, 17]]

    def grow(acceptance):
        table = None if acceptance is None else [[acceptance, 0.1, 0.05]] * 3
        d = HeadsDrafter(model, heads, score="prob", width=3, frontier=2, node_cost=1e-3, fixed_cost=0.0,
                         max_nodes=64, head_acceptance=table)
        levels = []
        level = d._grow_level
        d._grow_level = lambda depth, *a: levels.append(depth) or level(depth, *a)
        d.reset(1)
        d.observe_hidden(hidden, [True])
        return d._sequential_nodes(contexts, [64], drafting=1)[0], levels

    nodes, levels = grow(1e-6)
    assert levels == [0] and nodes and all(len(path) == 1 for path, _ in nodes)
    nodes, levels = grow(1.0)
    assert levels == [0, 1, 2] and max(len(path) for path, _ in nodes) == 3
    nodes, levels = grow(None)
    assert levels == [0, 1, 2] and max(len(path) for path, _ in nodes) == 3


def _level_trees(model, graphs, device="cpu", steps=8, **options):
    """The sequential heads' nodes over ``steps`` calls of a batch of 3 in which the drafting requests and their
    frontiers change from call to call (a request with no hidden state, a budget of 0), and the drafter."""
    heads = _random_heads(num_heads=3, subset=torch.arange(3, V), sequential=True, ffn_size=2 * D + 3)
    d = HeadsDrafter(model, heads.requires_grad_(False), width=3, frontier=2, node_cost=1e-3, max_nodes=64,
                     graphs=graphs, **options)
    g = torch.Generator().manual_seed(7)
    out = []
    d.reset(3)
    for step in range(steps):
        hidden = torch.randn(3, D, generator=g).to(device) * (1 + step)
        active = [step != 1, True, step != 2]
        d.observe_hidden(hidden, active)
        contexts = [[4, 5, 17 + step], [9, 23 + step], [30 + step]]
        out.append(d._sequential_nodes(contexts, [64, 64 if step != 3 else 0, 5], drafting=2))
        d.candidates = [None] * 3
    return out, d


@pytest.mark.parametrize("score", ["prob", "calibrated"])
def test_tree_levels_on_fixed_buffers_give_the_eager_trees(model, score):
    """graphs=True (on a CPU: the levels over the fixed buffers, run eagerly; on a GPU each a CUDA graph) gives every
    node and estimate of the plain levels, over calls whose drafting requests and frontiers change; the buffers are
    kept across calls and not captured on a CPU."""
    calibration = {"bins": [0.0, 0.1, 0.3, 0.6, 1.0], "acceptance": [[0.05, 0.2, 0.5, 0.8]] * 3}
    options = {"score": score, "calibration": calibration if score == "calibrated" else None}
    plain, d0 = _level_trees(model, False, **options)
    fixed, d1 = _level_trees(model, True, **options)
    assert fixed == plain
    assert d0._levels is None and d1._levels is not None and not d1._levels.capture
    # frontier x batch rows; levels past the first ran
    assert d1._levels.rows == 2 * 3 and sum(x is not None for x in d1._levels.state) >= 2
    assert any(len(path) >= 2 for nodes in plain for req in nodes for path, _ in req)
    assert HeadsDrafter(model, _random_heads(sequential=True)).level_graphs is False  # default on a CPU: eager
    assert HeadsDrafter(model, _random_heads(), graphs=True).level_graphs is False  # parallel heads: one pass
    with pytest.raises(ValueError, match="graphs"):
        HeadsDrafter(model, _random_heads(sequential=True), graphs="yes")


def test_greedy_exact_with_level_buffers_across_batch_sizes(model):
    """One drafter on the fixed buffers (graphs=True) through generates of batch 1, 3 and 1 again: the buffers follow
    the batch size, the outputs are the model's own."""
    drafter = HeadsDrafter(model, _random_heads(subset=torch.arange(3, V), sequential=True, ffn_size=2 * D),
                           min_gain=0.5, node_cost=0.0, ngram=NGramDrafter(), graphs=True)
    for lengths in ([30], [30, 18, 25], [22]):
        ids, mask = _batch(lengths, seed=5)
        st = assert_greedy_exact(model, drafter, ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD)
        assert st.drafted_tokens > 0 and drafter._levels.rows == drafter.frontier * len(lengths)


class _StandInGraph:
    """torch.cuda.CUDAGraph's part that _LevelGraphs uses, on the CPU: between capture_begin and capture_end it
    records the level that runs and the output tensors it made; replay runs that level again and writes its results
    into those tensors in place, as a CUDA graph writes its static outputs."""

    recording = None

    def capture_begin(self, pool=None):
        _StandInGraph.recording = self

    def capture_end(self):
        _StandInGraph.recording = None

    def replay(self):
        state, out = self.level(self.levels, self.depth)
        self.outputs[0].copy_(state)
        self.outputs[1].copy_(out)


def test_tree_levels_capture_path_with_a_stand_in_graph(model, monkeypatch):
    """The capture path's own code on the CPU (what a GPU run would otherwise be the first to execute), with
    torch.cuda's stream and graph calls stood in for: each depth is captured once, at its third use, then replayed
    in place, each level reading the buffers the previous replay wrote; the nodes equal the plain levels'."""
    from fastverify.hf import bpd

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    level = bpd._LevelGraphs._level

    def recorded(self, d):
        outputs = level(self, d)
        graph = _StandInGraph.recording
        if graph is not None:
            graph.level, graph.levels, graph.depth, graph.outputs = level, self, d, outputs
        return outputs

    monkeypatch.setattr(bpd._LevelGraphs, "_level", recorded)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _StandInGraph)
    buffers = bpd.HeadsDrafter._level_buffers

    def captured(self, batch_size):
        levels = buffers(self, batch_size)
        levels.capture = True
        return levels
    monkeypatch.setattr(bpd.HeadsDrafter, "_level_buffers", captured)
    plain, _ = _level_trees(model, False)
    replayed, d = _level_trees(model, True)
    assert replayed == plain
    levels = d._levels
    assert levels.capture and all(isinstance(g, _StandInGraph) for g in levels.graphs)
    # a depth is captured at its third use (its first two run eagerly), and only then
    assert len(levels.graphs) == sum(u > levels.EAGER_USES for u in levels.uses) >= 2
    assert sum(x is not None for x in levels.state) == sum(u > 0 for u in levels.uses)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tree_levels_replayed_as_cuda_graphs():
    """On a GPU (the default there) each depth's level is captured once and replayed: the nodes equal the same
    levels run eagerly on the same buffers, and greedy output with the heads stays the target's."""
    model = _tiny().cuda()
    calibration = {"bins": [0.0, 0.1, 0.3, 0.6, 1.0], "acceptance": [[0.05, 0.2, 0.5, 0.8]] * 3}
    replayed, d = _level_trees(model, None, device="cuda", score="calibrated", calibration=calibration)
    assert d.level_graphs and d._levels.capture
    assert len(d._levels.graphs) == sum(u > d._levels.EAGER_USES for u in d._levels.uses) >= 2
    eager = HeadsDrafter.__dict__["_level_buffers"]

    def uncaptured(self, batch_size):
        levels = eager(self, batch_size)
        levels.capture = False
        return levels
    HeadsDrafter._level_buffers = uncaptured
    try:
        plain, _ = _level_trees(model, None, device="cuda", score="calibrated", calibration=calibration)
    finally:
        HeadsDrafter._level_buffers = eager
    # the same kernels on the same shapes: the same nodes (estimates compared to float32's precision)
    assert [[[path for path, _ in req] for req in step] for step in replayed] == \
        [[[path for path, _ in req] for req in step] for step in plain]
    for a, b in zip(replayed, plain):
        for ra, rb in zip(a, b):
            assert all(math.isclose(pa, pb, rel_tol=1e-5) for (_, pa), (_, pb) in zip(ra, rb))
    ids, mask = _batch([30], seed=3)
    drafter = HeadsDrafter(model, _random_heads(subset=torch.arange(3, V), sequential=True, ffn_size=2 * D),
                           min_gain=0.5, node_cost=0.0, ngram=NGramDrafter())
    st = assert_greedy_exact(model, drafter, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40,
                             pad_token_id=PAD)
    assert drafter._levels.capture and st.drafted_tokens > 0


@pytest.mark.parametrize("sequential,ffn_size", [(False, 0), (True, 0), (False, 2 * D), (True, 2 * D)],
                         ids=["parallel", "sequential", "parallel-ffn", "sequential-ffn"])
@pytest.mark.parametrize("with_ngram", [False, True], ids=["bpd", "bpd+ngram"])
@pytest.mark.parametrize("lengths", [[30], [30, 18, 25]], ids=["batch1", "batch3"])
def test_greedy_exact_with_heads(model, with_ngram, lengths, sequential, ffn_size):
    ids, mask = _batch(lengths, seed=3)
    drafter = HeadsDrafter(model, _random_heads(subset=torch.arange(3, V), sequential=sequential, ffn_size=ffn_size),
                           min_gain=0.5,
                           node_cost=0.0 if sequential else 0.025, ngram=NGramDrafter() if with_ngram else None)
    st = assert_greedy_exact(model, drafter, ids, attention_mask=mask, max_new_tokens=40, pad_token_id=PAD)
    assert st.drafted_tokens > 0


def test_a_block_quantised_projection_streams_packed_and_alone():
    """An output projection of exactly block-quantised values (a GGUF model's head) is streamed packed on the CPU,
    with no float16 copy beside it; the heads' logits are the float32 projection's, and greedy output stays exact."""
    from fastverify.hf.linear import skinny_available
    if not skinny_available():
        pytest.skip("the C++ extension is not built")
    m = _tiny(seed=4)
    with torch.no_grad():  # Q8_0: a float16 scale per 32 weights times an integer in [-127, 127]
        w = m.lm_head.weight.reshape(V, D // 32, 32)
        d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
        m.lm_head.weight.copy_((d * torch.round(w / d)).reshape(V, D))
    drafter = HeadsDrafter(m, _random_heads(subset=torch.arange(3, V), sequential=True), min_gain=0.5, node_cost=0.0)
    assert drafter.packed is not None and drafter.weight is None
    x = torch.randn(3, D)
    ref = torch.nn.functional.linear(x.double(), m.lm_head.weight[3:].double()).float()
    torch.testing.assert_close(drafter._project(x), ref, rtol=1e-5, atol=1e-5)
    ids, mask = _batch([24, 17], seed=5)
    st = assert_greedy_exact(m, drafter, ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD)
    assert st.drafted_tokens > 0


def test_heads_that_copy_the_target_are_accepted(model):
    """Heads trained to the target's own continuations on a repetitive sequence draft what greedy decoding emits:
    with zero heads (each proposes the target's next-token distribution for the row) on a sequence that repeats
    one token, every draft is accepted. Checks rows, roots and the heads' vocabulary mapping end to end."""
    # a model whose greedy output repeats a token forever: the output projection dominated by one row
    m = _tiny(seed=2)
    with torch.no_grad():
        m.lm_head.weight[7] += 5.0 * torch.nn.functional.normalize(m.model.norm.weight, dim=0)
    ids = torch.tensor([[5, 9, 11, 7]])
    with torch.no_grad():
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                         pad_token_id=PAD)
    if not bool((ref[0, 4:] == 7).all()):
        pytest.skip("the perturbed model does not repeat one token")
    drafter = HeadsDrafter(m, ProposalHeads(D, 3, torch.tensor([1, 7, 9])), fixed_cost=0, node_cost=0, width=1)
    patch(m, drafter=drafter)
    try:
        with torch.no_grad():
            got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             pad_token_id=PAD)
        st = stats(m)
    finally:
        unpatch(m)
    assert torch.equal(got, ref)
    assert all(a == d for step in zip(st.accepted, st.drafted) for a, d in zip(*step) if a is not None)
    assert st.tokens_per_step > 3


@pytest.mark.parametrize("score", ["prob", "calibrated", "rank"])
def test_top_candidates_scored_by_definition(model, score):
    """HeadsDrafter._top (one log_softmax, the bins looked up in log space) against each score's definition on fresh
    rows: the top ``width`` columns of the rows; "prob": the candidate's softmax log-probability at the temperature;
    "calibrated": the table's log acceptance of the bin its probability (temperature 1) falls in; "rank": the table's log acceptance of its rank (as many ranks as the
    table has). Per row one depth (an int) or one depth per head (a broadcast tensor)."""
    heads = _random_heads()
    levels, width = heads.num_heads, 4
    calibration = {"bins": [0.0, 0.05, 0.1, 0.2, 0.4, 1.0],
                   "acceptance": [[0.01, 0.05, 0.15, 0.3, 0.6], [0.02, 0.04, 0.1, 0.25, 0.5],
                                  [0.01, 0.03, 0.08, 0.2, 0.45]]}
    acceptance = [[0.5, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.05]]
    d = HeadsDrafter(model, heads, width=width, score=score, calibration=calibration, head_acceptance=acceptance,
                     temperature=0.7)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(levels, 5, 40, generator=g) * 3
    edges = torch.tensor(calibration["bins"], dtype=torch.float64)
    for depth in (0, 2, None):
        rows = logits if depth is None else logits[depth]
        cols, got = d._top(rows, torch.arange(levels)[:, None, None] if depth is None else depth)
        k = min(width, 3) if score == "rank" else width
        assert cols.shape == got.shape == rows.shape[:-1] + (k,) and got.dtype == torch.float64
        t = 0.7 if score == "prob" else 1.0
        logp = torch.log_softmax(rows.double() / t, -1)
        top = logp.topk(k, dim=-1)
        assert torch.equal(torch.gather(logp, -1, cols).float(), top.values.float())  # the k best columns
        cand = torch.gather(logp, -1, cols)
        dep = (torch.arange(levels)[:, None, None] if depth is None else torch.tensor(depth)).expand(cols.shape)
        if score == "prob":
            want = cand
        elif score == "calibrated":
            bins = torch.bucketize(cand.exp(), edges[1:-1], right=True)
            want = torch.log(torch.tensor(calibration["acceptance"], dtype=torch.float64))[dep, bins]
        else:
            want = torch.log(torch.tensor(acceptance, dtype=torch.float64))[dep, torch.arange(k).expand(cols.shape)]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rule,params", [("topk", {"k": 32}), ("distance", {"eps": 4}),
                                         ("greedy", {"min_accept": 1})])
def test_lossy_rules_run_with_heads(model, rule, params):
    """BPD's approximate rules (Stern §5) with heads' drafts: every emitted token satisfies the rule against the
    target's own scores given the emitted prefix (top-k, k = V / 8 so that random heads' drafts qualify: rank < k;
    distance: |x - argmax| <= eps; the correction token is the argmax), min_accept forces a drafted node into every
    step that has a draft, and the lossy rules do accept tokens the target would not have chosen (the output is not
    greedy's)."""
    ids, mask = _batch([20, 16])
    drafter = HeadsDrafter(model, _random_heads(), min_gain=0.5)
    got, st = patched_generate(model, drafter, ids, attention_mask=mask,
                               max_new_tokens=16, do_sample=False, pad_token_id=PAD, rule=rule, options=params)
    assert got.shape == (2, ids.shape[1] + 16)
    off_greedy = 0
    for b in range(2):
        seq = got[b][torch.cat([mask[b].bool(), torch.ones(16, dtype=torch.bool)])]
        with torch.no_grad():
            logits = model(seq[None]).logits[0, -17:-1].float()  # the scores of each emitted token's position
        new = seq[-16:]
        best = logits.argmax(-1)
        rank = (logits > logits.gather(1, new[:, None])).sum(-1)
        if rule == "topk":
            assert bool((rank < params["k"]).all()), (b, rank.tolist())
        elif rule == "distance":
            assert bool(((new - best).abs() <= params["eps"]).all()), (b, (new - best).tolist())
        off_greedy += int((new != best).sum())
    if rule == "greedy":  # min_accept 1: a step with a draft accepts at least its first node
        steps = [(d, a) for ds, acs in zip(st.drafted, st.accepted) for d, a in zip(ds, acs) if d]
        assert steps and all(a >= 1 for d, a in steps), steps
    else:
        assert off_greedy > 0, "the lossy rule accepted nothing the target would not have chosen"


def test_heads_node_cost_follows_the_device_and_tells_the_ngram_drafter(model):
    from fastverify.hf.drafters import GPU_NODE_COST
    d = HeadsDrafter(model, _random_heads(), ngram=NGramDrafter())
    assert (d.node_cost, d.ngram.node_cost) == (HeadsDrafter.CPU_NODE_COST, NGramDrafter.CPU_NODE_COST) == (0.11, 0.025)
    d.set_device(torch.device("cuda"))  # the loop calls it with the model's device; no GPU needed here
    assert (d.node_cost, d.ngram.node_cost) == (GPU_NODE_COST, GPU_NODE_COST)
    d.set_device(torch.device("cpu"))
    assert (d.node_cost, d.ngram.node_cost) == (0.11, 0.025)
    fixed = HeadsDrafter(model, _random_heads(), ngram=NGramDrafter(), node_cost=0.05)
    fixed.set_device(torch.device("cuda"))
    assert (fixed.node_cost, fixed.ngram.node_cost) == (0.05, GPU_NODE_COST)
    with pytest.raises(ValueError, match="node_cost"):
        HeadsDrafter(model, _random_heads(), node_cost=-1.0)


def test_hidden_hook_only_for_drafters_that_want_it(model):
    ids = torch.tensor([_repetitive(20, 0)])
    lm_head = model.get_output_embeddings()
    for drafter in (NGramDrafter(), HeadsDrafter(model, _random_heads())):
        patch(model, drafter=drafter)
        try:
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               pad_token_id=PAD)
        finally:
            unpatch(model)
        assert not lm_head._forward_hooks  # never installed (n-gram), or removed when generate returned (heads)


@pytest.mark.slow
def test_greedy_exact_with_shipped_heads_on_the_real_model():
    """SmolLM2-135M-Instruct with the shipped heads, alone and merged with n-gram trees: the patched greedy output
    equals plain generate, and the heads draft (and get drafts accepted) from the second step on."""
    from fastverify.models import load_smollm2
    model, tok = load_smollm2()
    prompts = ["Write a short paragraph about why people enjoy walking in the mountains.",
               "List three ways to save water at home, one sentence each."]
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        for ngram in (False, True):
            patch(model, drafter=fastverify.load_drafter("smollm2-bpd", model, ngram=ngram))
            try:
                with torch.no_grad():
                    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                         do_sample=False)
                st = stats(model)
            finally:
                unpatch(model)
            assert torch.equal(got, ref), (prompt, ngram)
            assert st.drafted_tokens > 0


def test_merged_cut_tells_the_ngram_drafter_what_it_kept(model):
    """bpd+ngram: after the one cut of the merged trie, the n-gram drafter's depth adaptation reads the depth of its
    own kept candidates (what its own cut would have kept), not of every candidate it offered."""
    ngram = NGramDrafter()
    drafter = HeadsDrafter(model, _random_heads(), ngram=ngram, node_cost=1.0, fixed_cost=0.0, min_gain=0.0,
                           ngram_confident=None)
    ctx = [_repetitive(40, 3)]
    drafter.reset(1)
    # a heads' candidate (one unlikely node per depth, a token absent from the context), so that the merged trie is
    # cut by the heads' cost model (without one the request takes the n-gram drafter's own step)
    absent = next(t for t in range(V) if t not in ctx[0])
    drafter.candidates[0] = ([[absent]] * 3, torch.full((3, 1), 1e-3, dtype=torch.float64).log())
    tree = drafter.propose(ctx, [16])[0]
    st = ngram.states[0]
    offered = max(len(p) for _, p in st.pending[2])
    assert len(tree) > 0 and st.last_depth == tree.max_depth < offered, (len(tree), st.last_depth, offered)


def test_step_without_heads_candidates_is_the_ngram_drafters_own(model):
    """bpd+ngram: a request the heads propose nothing for (the first step; a confident copy) gets the tree the
    n-gram drafter alone proposes (its own cost model), step after step; one with heads' candidates gets the merged
    cut. An ngram without a cost model is refused."""
    ctx = _repetitive(40, 3)
    for confident in (None, 1.5):
        alone, inner = NGramDrafter(), NGramDrafter()
        drafter = HeadsDrafter(model, _random_heads(), ngram=inner, node_cost=1.0, fixed_cost=0.0, min_gain=0.0,
                               ngram_confident=confident)
        alone.reset(1)
        drafter.reset(1)
        for L in (20, 24, 31, 40):  # candidates None at every step: no hidden state was handed
            want = alone.propose([ctx[:L]], [16])[0]
            got = drafter.propose([ctx[:L]], [16])[0]
            assert len(want) > 0 and got.tokens.tolist() == want.tokens.tolist(), (L, confident)
            assert got.parents.tolist() == want.parents.tolist()
            acc = min(2, len(want))
            alone.update([acc])
            drafter.update([acc])
    drafter.candidates[0] = ([[ctx[0]]] * 3, torch.full((3, 1), 1e-3, dtype=torch.float64).log())
    drafter.ngram_confident = None
    assert len(drafter.propose([ctx], [16])[0]) == 1  # merged and cut at node_cost 1.0: one node
    with pytest.raises(TypeError, match="ngram"):
        HeadsDrafter(model, _random_heads(), ngram=type("NoCost", (Drafter,), {"scored_nodes": lambda s, c, b: []})())


def test_merge_scored_agreement(model):
    """merge_scored: "max" keeps the larger estimate of a shared path; "noisy_or" combines the two conditionals of a
    shared node, 1 - (1 - a)(1 - b), and carries the rise to its subtree; parents before children either way."""
    from fastverify.hf.drafters import merge_scored
    own = [((1,), 0.5), ((1, 2), 0.25), ((3,), 0.2)]
    other = [((1,), 0.4), ((1, 2), 0.2), ((1, 2, 7), 0.1), ((4,), 0.3)]
    got = dict(merge_scored(own, other, 10))
    assert got == {(1,): 0.5, (1, 2): 0.25, (1, 2, 7): 0.1, (3,): 0.2, (4,): 0.3}
    nodes = merge_scored(own, other, 10, agree="noisy_or")
    got = dict(nodes)
    c1 = 1 - 0.5 * 0.6  # (1,): 0.5 and 0.4
    c2 = 1 - 0.5 * 0.5  # (1, 2) given (1,): 0.5 and 0.5
    assert got[(1,)] == pytest.approx(c1) and got[(1, 2)] == pytest.approx(c1 * c2)
    assert got[(1, 2, 7)] == pytest.approx(c1 * c2 * 0.5)  # one source's conditional below the agreed nodes
    assert got[(3,)] == pytest.approx(0.2) and got[(4,)] == pytest.approx(0.3)
    seen = set()
    for path, _ in nodes:
        assert len(path) == 1 or path[:-1] in seen
        seen.add(path)
    assert [p for p, _ in merge_scored(own, other, 2, agree="noisy_or")] == [(1,), (1, 2)]
    assert merge_scored([], other, 10, agree="noisy_or") == sorted(other, key=lambda x: (-x[1], len(x[0])))
    with pytest.raises(ValueError, match="agree"):
        merge_scored(own, other, 10, agree="mean")
    with pytest.raises(ValueError, match="agree"):
        HeadsDrafter(model, _random_heads(), agree="min")


def test_q8_0_blocks_pack_exactly():
    """quantize_q8_0's blocks are what pack_blocks packs (zero blocks and tiny magnitudes included), each weight
    within half a step of its float32 value."""
    from fastverify.heads import dequantize_q8_0, quantize_q8_0
    from fastverify.ops.linear import pack_blocks, unpack_blocks
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 96, generator=g) * torch.logspace(-1.5, 1, 37)[:, None]
    w[3, 32:64] = 0.0
    w[4] *= 1e-6  # d underflows float16: the block rounds to zeros, as in GGUF
    q, d = quantize_q8_0(w)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and tuple(d.shape) == (37, 3)
    back = dequantize_q8_0(q, d)
    step = d.float().repeat_interleave(32, dim=1)
    normal = torch.ones(37, dtype=torch.bool)
    normal[4] = False
    assert bool(((back - w).abs()[normal] <= 0.5 * step[normal] * (1 + 1e-3)).all())
    assert not back[3, 32:64].any() and bool(((back[4] - w[4]).abs() <= w[4].abs().max()).all())
    packed = pack_blocks(back)
    assert packed is not None and torch.equal(unpack_blocks(*packed), back)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(4, 40))


@pytest.mark.parametrize("ffn_size", [0, 2 * D], ids=["one-layer", "ffn"])
def test_q8_0_checkpoint_round_trip_streams_packed(model, tmp_path, ffn_size):
    """A checkpoint saved in q8_0 loads as the heads rounded by round_heads (the bias exact), in about a quarter of
    the float32 file; on the CPU the drafter streams its weights packed, and greedy output stays exact."""
    import copy
    from fastverify.heads import round_heads
    from fastverify.hf.linear import skinny_available
    from fastverify.ops.linear import PackedWeight
    heads = _random_heads(subset=torch.arange(0, V, 2), sequential=True, ffn_size=ffn_size)
    meta = {"base_model": "tiny", "base_fingerprint": fingerprint(model)}
    save_heads(heads, str(tmp_path / "f32"), meta)
    save_heads(heads, str(tmp_path / "q8"), meta, dtype="q8_0")
    loaded, cfg = load_heads(str(tmp_path / "q8"), model)
    assert cfg["weights_dtype"] == "q8_0"
    rounded = copy.deepcopy(heads)
    round_heads(rounded, "q8_0")
    for name in ("weight", "bias", "token_weight", "out_weight"):
        a, b = getattr(loaded, name), getattr(rounded, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert torch.equal(loaded.bias, heads.bias) and not torch.equal(loaded.weight, heads.weight)
    size = os.path.getsize
    assert size(tmp_path / "q8" / "heads.safetensors") < 0.3 * size(tmp_path / "f32" / "heads.safetensors")
    drafter = load_drafter(str(tmp_path / "q8"), model, min_gain=0.5, node_cost=0.0)
    if skinny_available():
        assert all(isinstance(w, PackedWeight) for w in drafter.step_weight + (drafter.out_weight or []))
    x = torch.randn(3, 2 * D)
    ref = torch.nn.functional.linear(x.double(), torch.cat([loaded.weight[1], loaded.token_weight[1]], 1).double(),
                                     loaded.bias[1].double()).float()
    torch.testing.assert_close(drafter._linear(x, drafter.step_weight[1], drafter.heads.bias[1]), ref,
                               rtol=1e-5, atol=1e-5)
    ids, mask = _batch([26, 19], seed=7)
    st = assert_greedy_exact(model, drafter, ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD)
    assert st.drafted_tokens > 0


def test_heads_drafter_rejects_bad_options(model):
    heads = _random_heads(subset=torch.arange(3, V))
    with pytest.raises(ValueError, match=r"max_depth: expected >= 1 .the most tree levels the heads grow. or None, "
                                         r"got 0"):
        HeadsDrafter(model, heads, max_depth=0)
    with pytest.raises(TypeError, match="width: expected an int, got '4'"):
        HeadsDrafter(model, heads, width="4")
    with pytest.raises(ValueError, match="width, max_nodes, frontier: expected >= 1"):
        HeadsDrafter(model, heads, frontier=0)
    assert HeadsDrafter(model, heads, max_depth=2).depth == 2


def test_q8_0_checkpoint_refusals(model, tmp_path):
    from safetensors.torch import load_file, save_file
    path = tmp_path / "q8"
    meta = {"base_model": "tiny", "base_fingerprint": fingerprint(model)}
    with pytest.raises(ValueError, match="out_weight has input size 131"):
        save_heads(_random_heads(sequential=True, ffn_size=131), str(path), meta, dtype="q8_0")
    save_heads(_random_heads(sequential=True), str(path), meta, dtype="q8_0")
    good = load_file(str(path / "heads.safetensors"))
    for bad in ({"weight_scale": None}, {"token_weight_scale": good["token_weight_scale"][..., :1].contiguous()},
                {"weight": good["weight"].float()}):
        tensors = {k: v for k, v in {**good, **bad}.items() if v is not None}
        save_file(tensors, str(path / "heads.safetensors"))
        with pytest.raises(CheckpointError, match="Q8_0"):
            load_heads(str(path), model)
