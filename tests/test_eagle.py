"""EAGLE draft layer (fastverify.eagle), its drafter (fastverify.hf.eagle) and its training recipe."""

import json
import os

import pytest
import torch

from fastverify.eagle import EagleLayer, load_eagle, save_eagle
from fastverify.heads import BaseModelMismatch, CheckpointError, fingerprint
from fastverify.hf import Drafter, NGramDrafter
from fastverify.hf.eagle import EagleDrafter, load_eagle_drafter
from fastverify.train import eagle as recipe

from conftest import assert_greedy_exact, left_padded, patched_generate, repetitive, tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 256, 64
PAD = 1


def _tiny(seed=0, vocab=V):
    return tiny_llama(vocab, D, seed=seed, tie=True)


@pytest.fixture(scope="module")
def model():
    return _tiny()


def _random_layer(seed=1, subset=None, heads=4, inter=96):
    g = torch.Generator().manual_seed(seed)
    layer = EagleLayer(D, heads, inter, subset)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0))
    return layer.eval()


def _repetitive(length, seed):
    return repetitive(length, V, seed)


def _batch(lengths, seed=0):
    return left_padded([_repetitive(n, seed + b) for b, n in enumerate(lengths)], PAD)


# ----------------------------------------------------------------------------------------------- the layer

@pytest.mark.parametrize("rows", [1, 5, 11])
def test_drafter_rows_are_the_training_passes(model, rows):
    """The drafter's incremental rows (cache ingest, then one row per tree level reading its parent's output and
    attending to the cache and its ancestors) compute exactly what the unrolled training passes do for a node
    whose path is right: pass 1 at the root row, pass d at the row of a depth-(d - 1) node."""
    layer = _random_layer()
    torch.manual_seed(rows)
    T, P = rows + 3, rows
    feats, toks = torch.randn(1, T, D), torch.randint(0, V, (1, T))
    emb = model.get_input_embeddings().weight.detach()[toks]
    with torch.no_grad():
        ref = layer.unrolled(feats, emb, 3)
    d = EagleDrafter(model, layer, score="prob")
    d.reset(1)
    # the committed rows arrive in two handoffs, as two verify steps would hand them
    d.observe_path([feats[0, :P // 2 + 1]], [True])
    d.observe_path([feats[0, P // 2 + 1:P]], [True])
    ctx = [toks[0, :P].tolist()]
    with torch.no_grad():
        u = d._ingest(ctx, [0])[0]
        torch.testing.assert_close(u, ref[0][0, P - 1], atol=1e-4, rtol=1e-4)
        d.candidates = [u]
        state = d._grow_start([0])
        state, _ = d._grow_level(0, state, [ctx[0][-1]], [0])
        state, _ = d._grow_level(1, state, [int(toks[0, P])], [0])
        torch.testing.assert_close(state[0][0], ref[1][0, P], atol=1e-4, rtol=1e-4)
        state, _ = d._grow_level(2, state, [int(toks[0, P + 1])], [0])
        torch.testing.assert_close(state[0][0], ref[2][0, P + 1], atol=1e-4, rtol=1e-4)


def test_unrolled_pass_one_is_causal_attention():
    """Pass 1 is a plain causal block: a row's output does not depend on later rows."""
    layer = _random_layer()
    x, e = torch.randn(2, 9, D), torch.randn(2, 9, D)
    with torch.no_grad():
        full = layer.unrolled(x, e, 2)
        cut = layer.unrolled(x[:, :5], e[:, :5], 2)
    torch.testing.assert_close(full[0][:, :5], cut[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full[1][:, :5], cut[1], atol=1e-5, rtol=1e-5)


def test_layer_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        EagleLayer(60, 7, 32)


# ----------------------------------------------------------------------------------------------- training

def test_training_learns_a_synthetic_pattern(tmp_path):
    """Sequences whose next token is a fixed permutation of the current one, features that carry nothing: the
    layer must read the token, and deeper passes must read their own predicted rows. Within a few hundred small
    steps the loss falls and every pass's top-1 exceeds 0.9."""
    torch.manual_seed(0)
    Vs, Dm, N, T = 32, 48, 256, 16
    E = torch.nn.functional.normalize(torch.randn(Vs, Dm), dim=-1) * 4
    E_in, perm = torch.randn(Vs, Dm), torch.randperm(Vs)
    toks = [torch.randint(0, Vs, (N,))]
    for _ in range(T - 1):
        toks.append(perm[toks[-1]])
    toks = torch.stack(toks, 1)
    feats = torch.randn(N, T, Dm).half()
    lens = torch.full((N,), T)
    targets = recipe._targets(toks, lens, 3, None, Vs)
    layer = EagleLayer(Dm, 4, 64)
    cfg = recipe.EagleConfig(out="unused", epochs=30, batch_size=32, lr=3e-3, warmup=10, save_every=10 ** 9,
                             resume=False, progress=False, passes=3, reg=0.0)
    before = recipe.evaluate(layer, feats, toks, targets, E, None, E_in, 3)
    hist = recipe.train_loop(layer, feats, toks, targets, E, None, E_in, cfg, str(tmp_path / "s.pt"))
    after = recipe.evaluate(layer, feats, toks, targets, E, None, E_in, 3)
    assert hist[-1]["loss"] < 0.3 * hist[0]["loss"]
    assert max(before["top1"]) < 0.2
    assert min(after["top1"]) > 0.9, after["top1"]


def test_recipe_rejects_bad_options(model, tmp_path):
    """Out-of-range options are refused as the config is made, and again by the recipe (a config changed since)."""
    for bad, match in (({"passes": 0}, "passes"), ({"save_dtype": "int8"}, "save_dtype")):
        with pytest.raises(ValueError, match=match):
            recipe.EagleConfig(out=str(tmp_path / "o"), data_dir=str(tmp_path / "d"), progress=False, **bad)
        cfg = recipe.EagleConfig(out=str(tmp_path / "o"), data_dir=str(tmp_path / "d"), progress=False, exclude="")
        for key, value in bad.items():
            setattr(cfg, key, value)
        with pytest.raises(ValueError, match=match):
            recipe.train_eagle(model, None, cfg, prompts=[[3, 4, 5]])


def test_build_sequences_and_targets(tmp_path):
    g = torch.tensor([[10, 11, 12, 13, 99]], dtype=torch.int32)
    torch.save({"tokens": g, "lengths": torch.tensor([4], dtype=torch.int32),
                "hidden": torch.ones(1, 5, 4, dtype=torch.float16)}, tmp_path / "shard_00000.pt")
    feats, toks, lens = recipe.build_sequences([str(tmp_path / "shard_00000.pt")])
    assert toks.tolist() == [[10, 11, 12, 13, 0]] and lens.tolist() == [4]
    assert feats[0, :4].eq(1).all() and feats[0, 4].eq(0).all()
    t = recipe._targets(toks, lens, 2, None, 100)
    assert t[0].tolist() == [[11, 12, 13, -100, -100]]
    assert t[1].tolist() == [[-100, 12, 13, -100, -100]]


def test_recipe_end_to_end_resume_and_checkpoint(model, tmp_path):
    prompts = [_repetitive(12 + i % 5, i) for i in range(20)]
    cfg = recipe.EagleConfig(out=str(tmp_path / "ckpt"), data_dir=str(tmp_path / "data"), num_heads=4,
                             intermediate_size=64, vocab_subset=64, exclude="", num_prompts=16, eval_prompts=4,
                             max_new_tokens=12, gen_batch=4, epochs=2, batch_size=4, save_every=3, progress=False)
    logs = []
    layer, config = recipe.train_eagle(model, None, cfg, base_name="tiny-llama", prompts=prompts, log=logs.append)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "eagle.safetensors", "train_state.pt"]
    assert config["training"]["train_positions"] == 16 * 12 and config["base_model"] == "tiny-llama"
    loaded, cfg2 = load_eagle(str(tmp_path / "ckpt"), model)
    assert torch.equal(loaded.qkv, layer.qkv.detach()) and loaded.vocab_subset.numel() == 64
    assert len(cfg2["calibration"]["acceptance"]) == cfg.passes
    ids, mask = _batch([20, 14])
    drafter = load_eagle_drafter(str(tmp_path / "ckpt"), model, min_gain=0.5)
    assert drafter.score == "calibrated"
    assert_greedy_exact(model, drafter, ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD)
    steps = config["training"]["steps"]
    logs.clear()
    _, config2 = recipe.train_eagle(model, None, cfg, base_name="tiny-llama", prompts=prompts, log=logs.append)
    assert any("resumed from" in m and f"at step {steps}/{steps}" in m for m in logs)


# ----------------------------------------------------------------------------------------------- checkpoints

def test_checkpoint_round_trip_and_refusals(model, tmp_path):
    layer = _random_layer(subset=torch.arange(0, V, 2))
    path = str(tmp_path / "e")
    save_eagle(layer, path, {"base_model": "tiny", "base_fingerprint": fingerprint(model)}, dtype="float32")
    loaded, cfg = load_eagle(path, model)
    for n in ("fc", "qkv", "o", "gate_up", "down", "norm1", "norm2"):
        assert torch.equal(getattr(loaded, n), getattr(layer, n))
    assert torch.equal(loaded.vocab_subset, layer.vocab_subset) and cfg["method"] == "eagle"
    half_path = str(tmp_path / "e16")
    save_eagle(layer, half_path, {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    half, _ = load_eagle(half_path, model)
    assert torch.equal(half.fc, layer.fc.detach().half().float())
    import fastverify
    d = fastverify.load_drafter(path, model, ngram=True)
    assert isinstance(d, EagleDrafter) and isinstance(d.ngram, NGramDrafter)
    with pytest.raises(BaseModelMismatch, match="does not match"):
        load_eagle(path, _tiny(seed=5))
    with pytest.raises(BaseModelMismatch, match="vocabulary size mismatch"):
        load_eagle_drafter(path, _tiny(vocab=V + 8))


def test_checkpoint_bad_input_errors(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_eagle(str(tmp_path / "nope"), model)
    path = tmp_path / "e"
    save_eagle(_random_layer(), str(path), {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    good = (path / "config.json").read_text()
    (path / "eagle.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_eagle(str(path), model)
    os.remove(path / "eagle.safetensors")
    with pytest.raises(FileNotFoundError, match="missing eagle.safetensors"):
        load_eagle(str(path), model)
    save_eagle(_random_layer(), str(path), {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    cfg = json.loads(good)
    cfg["intermediate_size"] = 50
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gate_up: expected"):
        load_eagle(str(path), model)
    for key, value in (("num_heads", "4"), ("hidden_size", 32.5), ("intermediate_size", 0)):
        (path / "config.json").write_text(json.dumps({**json.loads(good), key: value}))
        with pytest.raises(CheckpointError, match=f"{key} {value!r}, expected an int >= 1"):  # (was read by int())
            load_eagle(str(path), model)
    (path / "config.json").write_text(json.dumps({"method": "bpd", "format": 1}))
    with pytest.raises(CheckpointError, match="does not describe an EAGLE draft layer"):
        load_eagle(str(path), model)


# ----------------------------------------------------------------------------------------------- decoding

class _PathRecorder(Drafter):
    wants_hidden = True
    wants_path_hidden = True

    def __init__(self):
        self.log = []

    def observe_path(self, rows, active):
        self.log.append(([r.clone() for r in rows], list(active)))


def test_path_hidden_states_equal_a_plain_forward(model):
    """observe_path hands, per request, the hidden states of the rows that produced the committed tokens: the
    plain forward over the committed sequence gives the same rows."""
    ids, mask = _batch([30, 22])
    drafter = _PathRecorder()
    ngram = NGramDrafter()
    drafter.propose = ngram.propose  # drafts (and accepts) several tokens a step
    drafter.reset = lambda B: ngram.reset(B)
    drafter.update = ngram.update
    out, st = patched_generate(model, drafter, ids, attention_mask=mask,
                               max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    assert st.accepted_tokens > 0 and len(drafter.log) == st.steps
    L = ids.shape[1]
    for b in range(2):
        seq = out[b][torch.cat([mask[b].bool(), torch.ones(out.shape[1] - L, dtype=torch.bool)])]
        rows = torch.cat([r[b] for r, active in drafter.log if active[b]])
        captured = {}
        h = model.get_output_embeddings().register_forward_hook(lambda m, a, o: captured.__setitem__("h", a[0]))
        try:
            with torch.no_grad():
                model(seq[None, :-1])
        finally:
            h.remove()
        plen = int(mask[b].sum())
        torch.testing.assert_close(rows, captured["h"][0, plen - 1:plen - 1 + rows.shape[0]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_ngram", [False, True], ids=["eagle", "eagle+ngram"])
@pytest.mark.parametrize("lengths", [[30], [30, 18, 25]], ids=["batch1", "batch3"])
def test_greedy_exact_with_eagle(model, with_ngram, lengths):
    ids, mask = _batch(lengths, seed=3)
    drafter = EagleDrafter(model, _random_layer(subset=torch.arange(3, V)), score="prob", min_gain=0.5,
                           node_cost=0.0, ngram=NGramDrafter() if with_ngram else None)
    st = assert_greedy_exact(model, drafter, ids, attention_mask=mask, max_new_tokens=40, pad_token_id=PAD)
    assert st.drafted_tokens > 0


def test_eagle_drafter_rejects_bad_options(model):
    with pytest.raises(ValueError, match="max_depth"):
        EagleDrafter(model, _random_layer(), max_depth=0)
    with pytest.raises(ValueError, match="hidden size"):
        EagleDrafter(model, EagleLayer(32, 4, 16))
    with pytest.raises(ValueError, match="score"):
        EagleDrafter(model, _random_layer(), score="bogus")


def test_slot_drafters_refuse_an_eagle_drafter_as_heads(model):
    """A slot drafter hands its heads one hidden row per request; the EAGLE drafter needs the whole path."""
    from fastverify.hf.slots import BlockSlotDrafter
    with pytest.raises(TypeError, match="reads the hidden state at one row"):
        BlockSlotDrafter(D, num_slots=2, method="lud", heads=EagleDrafter(model, _random_layer()))
