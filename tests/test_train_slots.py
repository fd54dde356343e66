"""The slot-drafter training recipe (fastverify.train.slots) and slot checkpoints (fastverify.hf.slots)."""

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch

from fastverify.heads import BaseModelMismatch, CheckpointError
from fastverify.hf import patch, unpatch
from fastverify.hf.slots import BlockSlotDrafter, load_slot_drafter
from fastverify.train import slots as recipe

transformers = pytest.importorskip("transformers")

from conftest import tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 64, 64
PAD = 1


def _tiny(seed=0):
    return tiny_llama(V, D, seed=seed, init=0.08)


def test_slot_batch_layout():
    pos, mask, offset, p = recipe.slot_batch(6, 2, [2, 4], 2, bidirectional=False, dtype=torch.float32,
                                             device="cpu")
    assert pos.tolist() == [[3, 4, 5, 6]] and offset.tolist() == [0, 1, 0, 1] and p.tolist() == [2, 2, 4, 4]
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [[1, 1, 1, 0, 0, 0, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0, 0, 1, 1, 0, 0],
                       [1, 1, 1, 1, 1, 0, 0, 0, 1, 0],
                       [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]]
    _, mask, _, _ = recipe.slot_batch(6, 2, [2], 2, bidirectional=True, dtype=torch.float32, device="cpu")
    assert (mask[0, 0, :, 6:] == 0).all()


@pytest.mark.parametrize("method", ["gad", "lud"])
def test_slots_learn_a_synthetic_pattern(method):
    """Counting sequences (x[j + 1] = x[j] + 1 mod V): slot i after position p must output x[p] + 2 + i, which
    the adapters learn from the slot rows' view of the prefix. The loss falls within 120 small steps."""
    model = _tiny()
    cfg = recipe.SlotsConfig(out="unused", method=method, num_slots=3, attach_every=2, unit_alpha=0.0)
    drafter = BlockSlotDrafter(D, 3, method).init_adapters(model, rank=8, alpha=16.0)
    params = recipe._trainables(drafter)
    opt = torch.optim.AdamW(params, lr=1e-2)
    rng = random.Random(0)
    losses = []
    with drafter.installed(model):
        for _ in range(120):
            start = rng.randrange(V)
            ids = torch.tensor([(start + j) % V for j in range(24)])
            loss, _ = recipe._slot_loss(model, drafter, ids, 4, cfg, rng, check=False)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    first, last = sum(losses[:15]) / 15, sum(losses[-15:]) / 15
    assert last < 0.8 * first, (first, last)


def test_recipe_end_to_end_checkpoint_and_refusals(tmp_path):
    model = _tiny()
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(3, V, (4,), generator=g).tolist() * 5)[:10 + i % 4] for i in range(12)]
    cfg = recipe.SlotsConfig(out=str(tmp_path / "ckpt"), data_dir=str(tmp_path / "data"), method="lud",
                             num_slots=2, rank=4, exclude="", num_prompts=8, eval_prompts=4, max_new_tokens=10,
                             gen_batch=4, minutes=0, save_every=3, progress=False, unit_alpha=0.0, curve_every=4,
                             curve_sequences=2)
    logs = []
    drafter, config = recipe.train_slots(model, None, cfg, base_name="tiny-llama", prompts=prompts, log=logs.append)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "slots.safetensors", "train_state.pt"]
    assert config["training"]["train_sequences"] == 8 and config["training"]["sequences_seen"] == 8
    # --curve-every: a held-out point every 4 steps, kept apart from the loss curve
    curve = config["training"]["accepted_curve"]
    assert [p["step"] for p in curve] == [4, 8] and all(p["mean_accepted"] >= 0 for p in curve)
    assert all("loss" in h for h in config["training"]["curve"])
    assert config["eval"]["blocks"] > 0 and len(config["eval"]["top1"]) == 2
    loaded = load_slot_drafter(str(tmp_path / "ckpt"), model)
    assert loaded.method == "lud" and not loaded.bidirectional and loaded.block_size == 2
    temps = config["slot_temperature"]
    assert len(temps) == 2 and all(t > 0 for t in temps) and loaded.temperature.tolist() == pytest.approx(temps)
    assert torch.equal(loaded.slot_embed, drafter.slot_embed.detach().half().float())  # stored as float16
    for key, a in drafter.adapters.items():
        assert torch.equal(loaded.adapters[key].lora_B, a.lora_B.detach().half().float())
    # greedy output stays the model's own with the trained drafter
    ids = torch.tensor([prompts[0]])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    patch(model, drafter=loaded)
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD), ref)
    finally:
        unpatch(model)
    # --calibrate alone: refits the temperatures of the checkpoint in --out, on the last eval_prompts prompts
    cal = recipe.train_slots(model, None, dataclasses.replace(cfg, calibrate=True), prompts=prompts,
                             log=logs.append)[1]
    assert cal["calibration"]["sequences"] > 0 and len(cal["slot_temperature"]) == 2
    assert load_slot_drafter(str(tmp_path / "ckpt"), model).temperature.tolist() == pytest.approx(
        cal["slot_temperature"])
    # resuming: a changed recipe option is refused before any step, naming each (a changed rank is this error, not
    # a size mismatch loading the saved adapters); a longer budget or another curve trains on from the saved step
    with pytest.raises(ValueError, match=r"other options \(rank 4 -> 8, lr 0.001 -> 0.002\)"):
        recipe.train_slots(model, None, dataclasses.replace(cfg, rank=8, lr=2e-3), prompts=prompts, log=logs.append)
    longer = recipe.train_slots(model, None, dataclasses.replace(cfg, steps=10, curve_every=0), prompts=prompts,
                                log=logs.append)[1]
    assert sum(line.startswith("resumed at step 8 ") for line in logs) == 1
    assert longer["training"]["sequences_seen"] == 10
    # another base model is refused; missing and corrupt files get clear errors
    with pytest.raises(BaseModelMismatch):
        load_slot_drafter(str(tmp_path / "ckpt"), _tiny(seed=1))
    with open(tmp_path / "ckpt" / "config.json") as f:
        bad = json.load(f)
    os.makedirs(tmp_path / "bad")
    shutil.copy(tmp_path / "ckpt" / "slots.safetensors", tmp_path / "bad")
    with open(tmp_path / "bad" / "config.json", "w") as f:
        json.dump({**bad, "slot_temperature": [1.0, -2.0]}, f)
    with pytest.raises(CheckpointError, match="slot_temperature"):
        load_slot_drafter(str(tmp_path / "bad"), model)
    for key, value, match in (("num_slots", "three", "num_slots 'three', expected an int >= 1"),
                              ("rank", 0, "rank 0, expected an int >= 1"),
                              ("hidden_size", 32.0, "hidden_size 32.0, expected an int >= 1"),
                              ("layers", "all", "expected a list of layers")):
        with open(tmp_path / "bad" / "config.json", "w") as f:  # before: a TypeError of the drafter's constructor
            json.dump({**bad, key: value}, f)
        with pytest.raises(CheckpointError, match=match):
            load_slot_drafter(str(tmp_path / "bad"), model)
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_slot_drafter(str(tmp_path / "data"), model)
    with open(tmp_path / "ckpt" / "slots.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_slot_drafter(str(tmp_path / "ckpt"), model)


def test_inverse_temperature_minimises_the_held_out_nll():
    """Labels drawn from softmax(l / 3): the fitted inverse temperature is near 1/3 and no point of a fine grid
    has a lower NLL; the ranking of every row is unchanged by construction (one positive scalar)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 50, generator=g, dtype=torch.float64) * 4
    y = torch.multinomial(torch.softmax(logits / 3, -1), 1, generator=g)[:, 0]
    s = recipe.inverse_temperature(logits, y)
    assert 0.28 < s < 0.39, s
    best = min(recipe._nll(logits, y, x / 200) for x in range(10, 400))
    assert recipe._nll(logits, y, s) <= best + 1e-9


def test_shipped_slot_checkpoints_are_found_by_name_and_refuse_another_base():
    from fastverify.heads import resolve_checkpoint
    from fastverify.hf.bpd import load_drafter
    for name in ("smollm2-gad", "smollm2-lud"):
        assert os.path.isfile(os.path.join(resolve_checkpoint(name), "slots.safetensors"))
        with pytest.raises(BaseModelMismatch):
            load_drafter(name, _tiny())


@pytest.mark.slow
def test_greedy_exact_and_seeded_sampling_with_shipped_slot_drafters_on_the_real_model():
    """SmolLM2-135M-Instruct with the shipped GAD and LUD slot drafters: greedy output equals plain generate and
    the blocks draft; seeded sampling equals the loop's own autoregressive sampling with the seed."""
    import fastverify
    from fastverify.hf import Drafter, stats
    from fastverify.models import load_smollm2
    model, tok = load_smollm2()
    ids = tok.apply_chat_template([{"role": "user", "content": "List three ways to save water at home."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32)
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, **kw)
    patch(model, drafter=Drafter())
    sampled = model.generate(ids, do_sample=True, seed=5, temperature=0.7, **kw)
    for name in ("smollm2-gad", "smollm2-lud"):
        patch(model, drafter=fastverify.load_drafter(name, model))
        try:
            got = model.generate(ids, do_sample=False, **kw)
            drafted = stats(model).drafted_tokens
            assert torch.equal(model.generate(ids, do_sample=True, seed=5, temperature=0.7, **kw), sampled), name
        finally:
            unpatch(model)
        assert torch.equal(got, ref), name
        assert drafted > 0, name


def test_resumed_order_survives_added_shards():
    """A resumed run whose data grew (a data budget makes more shards on resume): the saved sequences keep their
    order by (shard, request) key wherever the new shards sort in, and the new ones follow; a state saved before
    keys were kept resumes only on unchanged data."""
    seqs = [(s, r, [1], [2, 3]) for s in (0, 2) for r in range(3)]
    order = [4, 0, 5, 1, 3, 2]
    state = {"order_keys": [seqs[i][:2] for i in order]}  # as fit saves it
    grown = sorted(seqs + [(1, r, [1], [2, 3]) for r in range(2)])  # shard 1 sorts between the two
    got = recipe._resumed_order(state, grown, 0, lambda *a: None)
    assert [grown[i][:2] for i in got[:6]] == [seqs[i][:2] for i in order]
    assert sorted(grown[i][:2] for i in got[6:]) == [(1, 0), (1, 1)] and sorted(got) == list(range(8))
    assert recipe._resumed_order({"order": order}, seqs, 0, print) == order
    with pytest.raises(ValueError, match="covers 6 sequences, the data now has 8"):
        recipe._resumed_order({"order": order}, grown, 0, print)
