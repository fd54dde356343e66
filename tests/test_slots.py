"""Slot rows in the verify forward (fastverify.hf.slots) and gated LoRA (fastverify.lora): the layout of slot
blocks, verify rows untouched by slots and adapters, greedy exactness with a slot drafter on tiny models."""

import copy
import threading

import pytest
import torch

from fastverify.hf import patch, stats, unpatch
from fastverify.hf.attention import cache_kwargs, prefill_inputs, step_inputs
from fastverify.hf.linear import skinny_linears
from fastverify.hf.drafters import Drafter, NGramDrafter, cut_scored, empty_tree
from fastverify.hf.slots import BlockSlotDrafter, first_path
from fastverify.lora import GatedLoRALinear, add_gated_lora, gated_lora_layers, remove_gated_lora, slot_gate
from fastverify.tree import Tree

from conftest import assert_drafts_change_no_bit, left_padded

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

V = 512
PAD = 1


def _tiny(arch="llama", attn="eager"):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.08)
    cfg = transformers.LlamaConfig(**common) if arch == "llama" else transformers.Qwen2Config(**common)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    return model


def _drafter(model, method="gad", attach="path", slots=3, seed=1):
    """A slot drafter with random (not trained) embeddings and adapters that do act on the slot rows."""
    d = BlockSlotDrafter(model.config.hidden_size, num_slots=slots, method=method, attach=attach)
    return _randomise(d.init_adapters(model, rank=4), seed)


def _randomise(d, seed):
    """Random slot embeddings and non-zero adapters (a fresh adapter's lora_B is zero: a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in d.adapters.values():
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.1)
        d.slot_embed.copy_(torch.randn(d.slot_embed.shape, generator=g) * 0.1)
    return d


# ------------------------------------------------------------------------------------------------ layout

@pytest.mark.parametrize("bidirectional", [False, True])
def test_slot_layout_matches_a_hand_built_example(bidirectional):
    # prefix of 3 committed slots (1 of them left padding), root token 9 at position 2; a draft chain 5 -> 6
    # and a sibling 7; blocks of 2 slots after the root and after node 0 (the first path is [0, 1])
    tree = Tree([5, 6, 7], [-1, 0, -1])
    assert first_path(tree) == [0, 1]
    inp = step_inputs([tree], [9], [3], [1], torch.float32, "cpu", blocks=[[-1, 0]], block_size=2,
                      bidirectional=bidirectional, slot_token=0)
    # rows: root, n0, n1, n2, slots (root block) r4 r5, slots (n0 block) r6 r7
    assert inp.input_ids.tolist() == [[9, 5, 6, 7, 0, 0, 0, 0]]
    assert inp.position_ids.tolist() == [[2, 3, 4, 3, 3, 4, 4, 5]]
    assert inp.slot_local == [[[4, 5], [6, 7]]]
    assert inp.slot_rows.tolist() == [[False] * 4 + [True] * 4]
    # verify's layout holds the root and the draft nodes only
    assert inp.draft_tokens.tolist() == [5, 6, 7] and inp.cu_nodes.tolist() == [0, 3]
    assert inp.row_local.tolist() == [0, 1, 2, 3]
    visible = (inp.mask[0, 0] == 0).int()
    prefix = [0, 1, 1]  # slot 0 is padding
    rows = {  # query row -> visible step rows (0..7), besides the prefix
        0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 3],
        4: [0, 4] + ([5] if bidirectional else []), 5: [0, 4, 5],
        6: [0, 1, 6] + ([7] if bidirectional else []), 7: [0, 1, 6, 7],
    }
    for r, seen in rows.items():
        assert visible[r, :3].tolist() == prefix, r
        assert [c for c in range(8) if visible[r, 3 + c]] == seen, r


def test_slot_layout_rejects_a_bad_attachment():
    with pytest.raises(ValueError, match="blocks: request 0 attaches slots to node 3"):
        step_inputs([Tree([5, 6], [-1, 0])], [9], [3], [0], torch.float32, "cpu", blocks=[[3]], block_size=2)


# ------------------------------------------------------------------------------------------------ gated LoRA

def test_gated_lora_touches_only_the_gated_rows():
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 8)
    layer = GatedLoRALinear(base, rank=2, alpha=4.0)
    x = torch.randn(2, 5, 16)
    assert torch.equal(layer(x), base(x))  # zero-initialised B: a no-op even when gated
    with torch.no_grad():
        layer.lora_B.normal_()
    gate = torch.zeros(2, 5, dtype=torch.bool)
    gate[0, 3:] = True
    gate[1, 0] = True
    assert torch.equal(layer(x), base(x))  # no gate set: the base layer, bit for bit
    with slot_gate(gate):
        y = layer(x)
    ref = base(x)
    assert torch.equal(y[~gate], ref[~gate])
    delta = layer.scale * (x[gate] @ layer.lora_A.t()) @ layer.lora_B.t()
    torch.testing.assert_close(y[gate], ref[gate] + delta)
    # the gate is the thread's own: another thread's forward of the layer meanwhile is the base layer's
    other = {}
    with slot_gate(gate):
        thread = threading.Thread(target=lambda: other.setdefault("y", layer(x)))
        thread.start()
        thread.join()
        assert torch.equal(layer(x), y)
    assert torch.equal(other["y"], ref)


def test_add_and_remove_gated_lora_restore_the_model():
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = add_gated_lora(model, rank=2)
    assert len(names) == 2 * 7 and len(gated_lora_layers(model)) == 14
    with pytest.raises(ValueError, match="already holds"):
        add_gated_lora(model)
    remove_gated_lora(model)
    assert not gated_lora_layers(model)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="rank"):
        GatedLoRALinear(torch.nn.Linear(4, 4), rank=0, alpha=1.0)


def test_installed_adapters_leave_the_model_untouched():
    model = _tiny()
    d = _drafter(model)
    keys = set(model.state_dict())
    with d.installed(model):
        assert len(gated_lora_layers(model)) == 14
    assert not gated_lora_layers(model) and set(model.state_dict()) == keys


# ------------------------------------------------------------------------------------------------ exactness

def test_verify_rows_bit_identical_with_and_without_slots():
    """Eager attention and the skinny linears (a row's result does not depend on the other rows): the root and
    draft rows' logits do not change by one bit when slot rows with active adapters join the forward."""
    from transformers import DynamicCache
    model = _tiny(attn="eager")
    d = _drafter(model)
    ids = torch.tensor([[11, 12, 13, 14] * 4])
    L = ids.shape[1]
    tree = Tree([13, 14, 11, 99], [-1, 0, 1, 0])
    with torch.no_grad(), skinny_linears(model) as rerouted, d.installed(model):
        assert rerouted > 0
        cache = DynamicCache()
        mask, pos = prefill_inputs(torch.ones(1, L - 1, dtype=torch.long), torch.float32)
        model(input_ids=ids[:, :-1], attention_mask=mask, position_ids=pos, use_cache=True,
              **cache_kwargs(model, cache))
        logits = []
        for blocks in (None, [[-1, 0, 1, 2]]):
            inp = step_inputs([tree], [int(ids[0, -1])], [L - 1], [0], torch.float32, "cpu", blocks=blocks,
                              block_size=3, bidirectional=True)
            embeds = model.get_input_embeddings()(inp.input_ids)
            if blocks is not None:
                embeds[inp.slot_rows] = torch.randn(int(inp.slot_rows.sum()), 64)
                assert inp.input_ids.shape[1] == 17  # within the skinny linears' row bound
            with slot_gate(inp.slot_rows):
                out = model(inputs_embeds=embeds, attention_mask=inp.mask, position_ids=inp.position_ids,
                            use_cache=True, **cache_kwargs(model, copy.deepcopy(cache)))
            logits.append(out.logits[inp.row_batch, inp.row_local])
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method, attach", [("gad", "path"), ("lud", "path"), ("gad", "last"), ("lud", "last")])
@pytest.mark.parametrize("B", [1, 3])
def test_greedy_exact_with_a_slot_drafter(arch, method, attach, B):
    model = _tiny(arch, attn="sdpa")
    g = torch.Generator().manual_seed(B)
    L = 16
    ids, mask = left_padded([(torch.randint(3, V, (4,), generator=g).tolist() * L)[:L - 4 * b] for b in range(B)],
                            PAD)
    assert ids.shape == (B, L)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=20, do_sample=False)
    keys = set(model.state_dict())
    patch(model, drafter=_drafter(model, method, attach))
    out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=20, do_sample=False)
    st = stats(model)
    unpatch(model)
    assert torch.equal(out, ref)
    assert st.drafted_tokens > 0 and set(model.state_dict()) == keys and not gated_lora_layers(model)


@pytest.mark.parametrize("method", ["gad", "lud"])
def test_slot_blocks_keep_a_batch_within_the_kernels_rows(method):
    """Eight requests with blocks of 6 slot rows along their paths would make forwards of over 128 rows (torch's
    GEMM, whose rounding depends on the rows): the loop keeps the blocks that fit a request's MAX_ROWS // B rows
    (``Decoder.row_cap``), so every forward runs the row-invariant kernels and the logits are the undrafted loop's,
    bit for bit."""
    model = _tiny("llama", attn="sdpa")
    g = torch.Generator().manual_seed(8)
    ids, mask = left_padded([(torch.randint(3, V, (4,), generator=g).tolist() * 20)[:20 - b] for b in range(8)], PAD)
    assert_drafts_change_no_bit(model, _drafter(model, method, "path", slots=6), ids, attention_mask=mask,
                                pad_token_id=PAD, max_new_tokens=16, do_sample=False)


def test_slot_drafter_drafts_what_its_block_predicts():
    """The proposal is the argmax chain of the block observed at the previous step, with the second-best token
    of each slot as a sibling leaf when tree_topk = 2; a request without a block proposes nothing."""
    d = BlockSlotDrafter(8, num_slots=3, tree_topk=2)
    d.reset(2)
    block = torch.full((3, 10), -1.0)
    block[0, 4], block[0, 5] = 3.0, 2.0
    block[1, 6], block[1, 1] = 3.0, 2.0
    block[2, 2], block[2, 7] = 3.0, 2.0
    d.observe_slots([block, None])
    trees = d.propose([[1], [1]], [6, 6])
    assert trees[0].tokens.tolist() == [4, 5, 6, 1, 2, 7] and trees[0].parents.tolist() == [-1, -1, 0, 0, 2, 2]
    assert len(trees[1]) == 0
    assert len(d.propose([[1], [1]], [6, 6])[0]) == 0  # a block drafts once


class _Nodes(NGramDrafter):
    """An n-gram drafter with fixed scored nodes (its own cost cut) that records what the merged cut kept and what
    was accepted."""

    def __init__(self, nodes, fixed_cost=0.0, node_cost=0.0, min_gain=1.0):
        super().__init__(fixed_cost=fixed_cost, node_cost=node_cost, min_gain=min_gain)
        self.nodes = nodes
        self.kept = self.accepted = None

    def scored_nodes(self, contexts, budget):
        return [list(self.nodes) if int(bud) > 0 else [] for bud in budget]

    def kept_nodes(self, paths):
        self.kept = paths

    def update(self, accepted):
        self.accepted = accepted


def test_slot_drafter_hands_the_device_to_its_ngram_and_heads_drafters():
    from fastverify.hf.drafters import GPU_NODE_COST
    seen = []

    class Heads(Drafter):
        def set_device(self, device):
            seen.append(device)

    d = BlockSlotDrafter(8, num_slots=2, method="lud", ngram=NGramDrafter())
    d.heads = Heads()
    d.set_device(torch.device("cuda"))
    assert d.ngram.node_cost == GPU_NODE_COST and seen == [torch.device("cuda")]


def test_slot_drafter_merges_ngram_nodes_into_one_trie():
    """lud+ngram: the block's chain (estimates: products of slot probabilities) and the n-gram nodes form one
    trie, a shared path once; siblings in decreasing estimate, so the first path (where the next blocks attach)
    follows the best estimates; the n-gram drafter hears what was kept and accepted; a request without a block
    gets the n-gram nodes alone."""
    ngram = _Nodes([((4,), 0.9), ((4, 9), 0.8), ((3,), 0.05)])
    d = BlockSlotDrafter(8, num_slots=2, method="lud", ngram=ngram)
    d.reset(2)
    block = torch.full((2, 10), -30.0)
    block[0, 4] = 0.0            # slot 1: token 4, probability ~1
    block[1, 6] = block[1, 7] = 0.0  # slot 2: 6 or 7, ~1/2 each (6 first: the lower index on a tie)
    d.observe_slots([block, None])
    trees = d.propose([[1], [1]], [6, 6])
    # nodes best first: (4,) 1.0, (4, 9) 0.8, (4, 6) 0.5, (3,) 0.05
    assert trees[0].tokens.tolist() == [4, 9, 6, 3] and trees[0].parents.tolist() == [-1, 0, 0, -1]
    assert first_path(trees[0]) == [0, 1]
    assert trees[1].tokens.tolist() == [4, 9, 3] and trees[1].parents.tolist() == [-1, 0, -1]
    assert ngram.kept == [[(4,), (4, 9), (4, 6), (3,)], [(4,), (4, 9), (3,)]]
    d.update([2, 0])
    assert ngram.accepted == [2, 0]
    # the cost model cuts the union: at a node cost of 0.3 only nodes of estimate > ~0.3 x ratio pay
    d = BlockSlotDrafter(8, num_slots=2, method="lud", ngram=_Nodes(ngram.nodes, node_cost=0.3, min_gain=1.0))
    d.reset(1)
    d.observe_slots([block])
    assert d.propose([[1]], [6])[0].tokens.tolist() == [4, 9]
    with pytest.raises(TypeError, match="ngram"):
        BlockSlotDrafter(8, ngram=object())


class _HeadsNodes(Drafter):
    """A heads stand-in: fixed scored nodes, a cost cut (free nodes), and the hidden states it was handed."""
    wants_hidden = True

    def __init__(self, nodes):
        self.nodes = nodes

    def scored_nodes(self, contexts, budget):
        return [list(self.nodes) if int(bud) > 0 else [] for bud in budget]

    def cut(self, nodes, drafting=1):
        return cut_scored(nodes, 0.0, 0.0, 1.0, drafting)

    def observe_hidden(self, hidden, active=None):
        self.hidden = hidden


def test_slot_drafter_merges_heads_nodes_and_hands_them_the_hidden_state():
    heads = _HeadsNodes([((4,), 0.9), ((5,), 0.6), ((5, 8), 0.5)])
    d = BlockSlotDrafter(8, num_slots=2, method="lud", heads=heads)
    assert d.wants_hidden and not BlockSlotDrafter(8).wants_hidden
    d.reset(1)
    d.observe_hidden(torch.ones(1, 8), [True])
    assert torch.equal(heads.hidden, torch.ones(1, 8))
    block = torch.full((2, 10), -30.0)
    block[0, 4] = block[1, 6] = 0.0
    d.observe_slots([block])
    tree = d.propose([[1]], [6])[0]
    # nodes best first: (4,) 1.0, (4, 6) 1.0, (5,) 0.6, (5, 8) 0.5
    assert tree.tokens.tolist() == [4, 6, 5, 8] and tree.parents.tolist() == [-1, 0, -1, 2]
    with pytest.raises(TypeError, match="heads"):
        BlockSlotDrafter(8, heads=_Nodes([]))
    with pytest.raises(TypeError, match="heads"):  # no cost cut of its own
        BlockSlotDrafter(8, heads=type("NoCut", (Drafter,), {"wants_hidden": True,
                                                              "scored_nodes": lambda s, c, b: []})())


@pytest.mark.parametrize("method", ["gad", "lud"])
@pytest.mark.parametrize("B", [1, 3])
def test_greedy_exact_with_a_slot_drafter_and_ngram(method, B):
    from fastverify.hf import NGramDrafter
    model = _tiny("llama", attn="sdpa")
    g = torch.Generator().manual_seed(B + 7)
    L = 16
    ids, mask = left_padded([(torch.randint(3, V, (3,), generator=g).tolist() * L)[:L - 3 * b] for b in range(B)],
                            PAD)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=24, do_sample=False)
    d = _drafter(model, method)
    d.ngram = NGramDrafter(fixed_cost=0.0, node_cost=0.0)
    patch(model, drafter=d)
    out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=24, do_sample=False)
    st = stats(model)
    unpatch(model)
    assert torch.equal(out, ref) and st.drafted_tokens > 0


def test_confident_prefix_is_the_blocks_confident_chain():
    """LUD's lookahead span: the leading first-path nodes that are the block's chain with slot probability >= beta,
    stopping before a repeated token (the first compared with the last committed one)."""
    d = BlockSlotDrafter(8, num_slots=3, method="lud")
    d.reset(3)
    block = torch.full((3, 10), -30.0)
    block[0, 4] = block[1, 6] = 0.0    # slots 1, 2: tokens 4, 6 at probability ~1
    block[2, 2] = block[2, 7] = 0.0    # slot 3: 2 or 7 at ~1/2
    repeat = block.clone()
    repeat[1, 6], repeat[1, 4] = -30.0, 0.0  # slot 2 repeats slot 1's token
    d.observe_slots([block, repeat, block])
    trees = d.propose([[1], [1], [4]], [6, 6, 6])
    assert d.confident_prefix(trees, [1, 1, 4], 0.9) == [2, 1, 0]
    assert d.confident_prefix(trees, [1, 1, 4], 0.4) == [3, 1, 0]
    assert d.confident_prefix([empty_tree()] * 3, [1, 1, 4], 0.9) == [0, 0, 0]
    # calibrated slots (temperature 4 on slot 2): the same drafts, but slot 2 is no longer sure of its token
    d.temperature = torch.tensor([1.0, 4.0, 1.0])
    block[1, 6], block[1, 3] = 5.0, 0.0  # p(6) = 0.993 raw, 0.78 at temperature 4
    d.observe_slots([block, repeat, block])
    trees = d.propose([[1], [1], [4]], [6, 6, 6])
    assert trees[0].tokens.tolist()[:3] == [4, 6, 2] and d.confident_prefix(trees, [1, 1, 4], 0.9) == [1, 1, 0]


class _Asserting:
    """Drafts one fixed tree at the first step and asserts its first two first-path nodes at any beta."""

    def __init__(self, tokens, parents):
        self.tree = Tree(torch.tensor(tokens), torch.tensor(parents))

    def reset(self, batch_size):
        self.steps = 0

    def propose(self, contexts, budget):
        self.steps += 1
        return [self.tree if self.steps == 1 else empty_tree() for _ in contexts]

    def update(self, accepted):
        pass

    def confident_prefix(self, trees, roots, beta):
        return [2 if len(t) else 5 for t in trees]  # 5 on an empty tree: more than it has, clamped by the loop


@pytest.mark.parametrize("B", [1, 2])
def test_confidence_rule_accepts_the_asserted_prefix_and_argmax_below_it(B):
    """LUD under rule "confidence": the loop accepts the drafter's asserted nodes unchecked (lossy), drops their
    siblings, and below them accepts the target's argmax only (LUD's normal-position token); under greedy it
    asserts nothing (exact)."""
    model = _tiny("llama", attn="sdpa")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(20, V, (1, 9), generator=g).repeat(B, 1)
    a, c = 11, 12
    y = model.generate(torch.cat([ids[:1], torch.tensor([[a, a]])], 1), max_new_tokens=2, do_sample=False)[0, -2:]
    x = int(y[0]) + 1  # not the argmax
    # nodes: 0 a, 1 c (a sibling of the asserted chain: dropped), 2 a (under 0), 3 x, 4 y0 (under 2), 5 y1 (under 4)
    tokens, parents = [a, c, a, x, int(y[0]), int(y[1])], [-1, -1, 0, 2, 2, 4]
    N = 12
    patch(model, drafter=_Asserting(tokens, parents), rule="confidence", beta=0.9)
    out = model.generate(ids, max_new_tokens=N, do_sample=False)
    st = stats(model)
    unpatch(model)
    assert st.accepted[0] == [4] * B  # a, a (asserted: the target's argmax would not have been both), y0, y1
    forced = torch.cat([ids, torch.tensor([[a, a]] * B)], 1)
    assert torch.equal(out, model.generate(forced, max_new_tokens=N - 2, do_sample=False))
    patch(model, drafter=_Asserting(tokens, parents))
    out = model.generate(ids, max_new_tokens=N, do_sample=False)
    st = stats(model)
    unpatch(model)
    assert torch.equal(out, model.generate(ids, max_new_tokens=N, do_sample=False)) and st.accepted[0] != [4] * B


# ------------------------------------------------------------------------------------------------ PTP slots

def _heads(model, seed=3):
    """A HeadsDrafter with random sequential heads that propose every candidate (no cost cut)."""
    from fastverify.heads import ProposalHeads
    from fastverify.hf.bpd import HeadsDrafter
    D = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    h = ProposalHeads(D, 3, sequential=True)
    with torch.no_grad():
        for t in (h.weight, h.token_weight):
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return HeadsDrafter(model, h.eval(), width=2, fixed_cost=0.0, node_cost=0.0)


def _ptp(model, slots=3, seed=2, aux_mode="interp", ngram=False, heads=False, **options):
    """A PTP slot drafter with random active adapters (no slot-0 gate: an untrained drafter drafts anyway);
    ngram / heads: merge an n-gram drafter's / random heads' proposals into its trie."""
    from fastverify.hf import NGramDrafter
    from fastverify.hf.slots import PTPSlotDrafter
    d = PTPSlotDrafter(model.config.hidden_size, num_slots=slots, aux_mode=aux_mode,
                       ngram=NGramDrafter(fixed_cost=0.0, node_cost=0.0) if ngram else None,
                       heads=_heads(model) if heads else None, **options)
    return _randomise(d.init_adapters(model, rank=4), seed)


@pytest.mark.parametrize("aux_mode, options", [("interp", {}), ("bits", {}), ("interp", {"ngram": True}),
                                               ("none", {"ngram": True, "tree_topk": 2}),
                                               ("interp", {"heads": True}), ("interp", {"ngram": True, "heads": True})])
@pytest.mark.parametrize("B", [1, 3])
def test_ptp_slots_keep_seeded_sampling_and_greedy_exact(aux_mode, options, B):
    """With the coupled rule, PTP slot drafts never change the sampled tokens: the output equals the loop's own
    autoregressive sampling with the same seed; greedy output equals generate (also merged with the n-gram
    drafter and / or proposal heads on the verify forward's hidden state, and with inverse-CDF drafts and sibling
    leaves)."""
    model = _tiny("llama", attn="sdpa")
    ids = torch.tensor([[11, 12, 13, 14] * 4] * B)
    kw = dict(max_new_tokens=16, pad_token_id=PAD)
    for seed, temperature in ((1, 1.0), (2, 0.7)):
        patch(model, drafter=Drafter())
        ref = model.generate(ids, do_sample=True, seed=seed, temperature=temperature, **kw)
        patch(model, drafter=_ptp(model, aux_mode=aux_mode, **options))
        out = model.generate(ids, do_sample=True, seed=seed, temperature=temperature, **kw)
        assert torch.equal(out, ref) and stats(model).drafted_tokens > 0
    unpatch(model)
    ref = model.generate(ids, do_sample=False, **kw)
    patch(model, drafter=_ptp(model, aux_mode=aux_mode, **options))
    assert torch.equal(model.generate(ids, do_sample=False, **kw), ref) and stats(model).drafted_tokens > 0
    unpatch(model)


def test_ptp_slot_inputs_are_the_coupled_rules_uniforms():
    from fastverify import uniform
    d = _ptp(_tiny())
    request, slot, position = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), torch.tensor([5, 6, 9])
    seed = torch.tensor([7, 7, 8])
    got = d.slot_embeddings(request, slot, position, seed)
    want = d.slot_embed[slot] + d.aux(uniform(seed, position))
    assert torch.equal(got, want)
    half = d.slot_embeddings(request, slot, position, None)
    assert torch.equal(half, d.slot_embed[slot] + d.aux(torch.full((3,), 0.5)))


@pytest.mark.parametrize("first_gate", [True, False])
def test_ptp_block_drafts_after_its_first_slot_with_the_gate_only_when_it_agrees(first_gate):
    from fastverify.hf.slots import PTPSlotDrafter
    d = PTPSlotDrafter(8, num_slots=2, first_gate=first_gate)
    d.reset(2)
    block = torch.zeros(3, 10)
    block[0, 4] = block[1, 6] = block[2, 7] = 1.0
    d.observe_slots([block, block])
    trees = d.propose([[1, 4], [1, 5]], [4, 4])  # request 0 committed 4 (agrees), request 1 committed 5
    assert trees[0].tokens.tolist() == [6, 7]
    assert trees[1].tokens.tolist() == ([] if first_gate else [6, 7])


def test_ptp_sampled_drafts_come_first_with_the_slot_probabilities():
    """Inverse-CDF drafts (C-PTP / no auxiliary input): each slot's draft is F^-1(u) at its position's u, ranked
    first whatever its rank in the slot's distribution, then the slot's best other tokens as leaves; every node is
    scored with the slot's own probability (no infinite logits)."""
    from fastverify import uniform
    from fastverify.ops.sampling import cdf_sample
    from fastverify.hf.slots import PTPSlotDrafter
    d = PTPSlotDrafter(8, num_slots=2, aux_mode="none", tree_topk=2)
    d.reset(1)
    torch.manual_seed(0)
    block = torch.randn(3, 10)
    request, slot, pos = torch.zeros(3, dtype=torch.int64), torch.arange(3), torch.arange(5, 8)
    d.slot_embeddings(request, slot, pos, torch.full((3,), 11))  # the loop tells the drafter the seed
    d.observe_slots([block])
    ctx = list(range(6))  # slot 0 stands at position 5, the last committed token's
    nodes_seen = {}
    d._block_nodes_orig, d._block_nodes = d._block_nodes, lambda b, bud: nodes_seen.setdefault(
        b, d._block_nodes_orig(b, bud))
    tree = d.propose([ctx], [4])[0]
    draft = cdf_sample(block, uniform(11, pos))[1:]
    probs = block.softmax(-1)
    assert tree.tokens[[0, 2]].tolist() == draft.tolist() and tree.parents.tolist() == [-1, -1, 0, 0]
    second = probs[1].scatter(0, draft[:1], -1.0).argmax()
    assert int(tree.tokens[1]) == int(second)
    (p0, e0), (_, e1), (p2, e2), _ = nodes_seen[0]
    assert p0 == (int(draft[0]),) and e0 == pytest.approx(float(probs[1, draft[0]]), rel=1e-5)
    assert e1 == pytest.approx(float(probs[1, second]), rel=1e-5)
    assert e2 == pytest.approx(float(probs[1, draft[0]] * probs[2, draft[1]]), rel=1e-5)


def test_ptp_checkpoint_round_trip(tmp_path):
    from fastverify.heads import fingerprint
    from fastverify.hf.slots import PTPSlotDrafter, load_slot_drafter, save_slot_drafter
    model = _tiny()
    d = _ptp(model, aux_mode="bits")
    save_slot_drafter(d, str(tmp_path), {"base_model": "tiny", "base_fingerprint": fingerprint(model)})
    loaded = load_slot_drafter(str(tmp_path), model)
    assert isinstance(loaded, PTPSlotDrafter) and loaded.block_size == 4 and loaded.aux.mode == "bits"
    assert torch.equal(loaded.aux.proj.weight, d.aux.proj.weight.detach().half().float())
