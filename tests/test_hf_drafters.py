"""Drafters: NGramDrafter (trie of earlier continuations, incremental index, adaptation) and DraftModelDrafter
(greedy chain / top-k tree, cache rolled back)."""

import random

import pytest
import torch

from fastverify.hf.attention import cache_length
from fastverify.hf.drafters import GPU_NODE_COST, DraftModelDrafter, Drafter, NGramDrafter

transformers = pytest.importorskip("transformers")

# the cost-aware selection turned off: the structure tests below check the candidate trie itself
OFF = dict(fixed_cost=0, node_cost=0)


def _paths(tree):
    """Root-to-leaf token sequences of a tree."""
    toks = tree.tokens.tolist()
    return [[toks[j] for j in path if j >= 0] for path in tree.paths().tolist()]


def test_base_drafter_proposes_nothing():
    d = Drafter()
    d.reset(2)
    trees = d.propose([[1, 2, 3], [4]], [8, 8])
    assert [len(t) for t in trees] == [0, 0]


def test_ngram_no_match_no_draft():
    d = NGramDrafter()
    d.reset(1)
    assert len(d.propose([[1, 2, 3, 4, 5]], [16])[0]) == 0


def test_ngram_chain_from_prompt_lookup():
    d = NGramDrafter(max_n=3, depth=4, width=1, **OFF)
    d.reset(1)
    ctx = [7, 8, 9, 10, 11, 12, 50, 7, 8, 9]
    (tree,) = d.propose([ctx], [16])
    assert _paths(tree) == [[10, 11, 12, 50]]


def test_ngram_tree_of_continuations_best_first():
    d = NGramDrafter(max_n=2, depth=3, width=3, **OFF)
    d.reset(1)
    # "5 6" was followed by 1 2 3, then 1 2 4, then 9 9 9: a trie with the shared prefix 1 2 merged
    ctx = [5, 6, 1, 2, 3, 0, 5, 6, 1, 2, 4, 0, 5, 6, 9, 9, 9, 0, 5, 6]
    (tree,) = d.propose([ctx], [16])
    paths = _paths(tree)
    assert paths[0][:2] == [1, 2]  # nodes best first: 1 2 continues two of the three matches, 9 one
    assert sorted(paths) == sorted([[9, 9, 9], [1, 2, 4], [1, 2, 3]])
    assert len(tree) == 3 + 3 + 1  # 9 9 9 | 1 2 4 | 3 (prefix 1 2 shared)
    assert tree.max_depth == 3


@pytest.mark.parametrize("costs", [dict(node_cost=0.1), dict(fixed_cost=0.3, node_cost=0.05), OFF],
                         ids=["node", "fixed+node", "off"])
def test_ngram_propose_is_its_cut_of_its_scored_nodes(costs):
    """propose = cut(scored_nodes): one cost cut, the one a drafter merging the n-gram nodes with its own calls
    (fastverify.hf.bpd, fastverify.hf.slots); with fixed_cost = node_cost = 0 it keeps every scored node."""
    ctx = [1, 2, 3, 4, 5, 6, 7, 0] * 3 + [1, 2, 3, 9, 8, 0, 1, 2, 3]  # 1 2 3 -> 4 5 6 7 0 1 (x3), 9 8 0 (x1)
    a, b = NGramDrafter(depth=6, width=4, **costs), NGramDrafter(depth=6, width=4, **costs)
    a.reset(2)
    b.reset(2)
    ctxs = [ctx, ctx + [4, 5, 6, 7, 0, 11, 12, 1, 2, 3]]
    got = a.propose(ctxs, [16, 16])
    nodes = b.scored_nodes(ctxs, [16, 16])
    for tree, own in zip(got, nodes):
        want, kept = b.cut(own, 2)
        assert tree.tokens.tolist() == want.tokens.tolist() and tree.parents.tolist() == want.parents.tolist()
        assert len(kept) == len(want) and (len(kept) == len(own) or costs != OFF)
    assert any(len(t) > 1 for t in got) and (costs == OFF or any(len(t) < len(o) for t, o in zip(got, nodes)))


def test_ngram_batched_cut_charges_each_node_to_the_shared_step():
    # a 3-gram seen once: path probabilities 0.71, 0.58, 0.50, 0.44 (the priors); at node_cost 0.3 one request
    # drafts all four, two drafting requests (node cost 0.6 each) one node each; a request with no budget does
    # not share the step
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert [len(t) for t in NGramDrafter(node_cost=0.3).propose([ctx], [16])] == [4]
    assert [len(t) for t in NGramDrafter(node_cost=0.3).propose([ctx, ctx], [16, 16])] == [1, 1]
    assert [len(t) for t in NGramDrafter(node_cost=0.3).propose([ctx, ctx], [16, 0])] == [4, 0]


def test_ngram_node_cost_follows_the_device():
    # without an explicit node_cost: the CPU fit on a CPU, GPU_NODE_COST on a GPU (set_device, which the loop calls
    # with the model's device; a torch.device needs no GPU to exist). 16 drafting requests of the 3-gram above:
    # node cost 16 x 0.025 on the CPU cuts each to 3 nodes, 16 x 0.01 keeps all four.
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    d = NGramDrafter()
    assert d.node_cost == NGramDrafter.CPU_NODE_COST == 0.025
    assert [len(t) for t in d.propose([ctx] * 16, [16] * 16)] == [3] * 16
    d.set_device(torch.device("cuda"))
    assert d.node_cost == GPU_NODE_COST
    assert [len(t) for t in d.propose([ctx] * 16, [16] * 16)] == [4] * 16
    d.set_device("cpu")
    assert d.node_cost == 0.025
    fixed = NGramDrafter(node_cost=0.3)  # an explicit node_cost is kept on every device
    fixed.set_device(torch.device("cuda"))
    assert fixed.node_cost == 0.3


def test_loop_hands_the_drafter_the_models_device_before_reset(tiny):
    import fastverify

    class Recording(NGramDrafter):
        calls = []

        def set_device(self, device):
            self.calls.append(("set_device", device))
            super().set_device(device)

        def reset(self, batch_size):
            self.calls.append(("reset", batch_size))
            super().reset(batch_size)

    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    fastverify.patch(tiny, drafter=Recording())
    try:
        with torch.no_grad():
            tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        fastverify.unpatch(tiny)
    assert Recording.calls[:2] == [("set_device", torch.device("cpu")), ("reset", 1)]


def test_ngram_longest_ngram_wins():
    d = NGramDrafter(min_n=1, max_n=3, depth=2, width=1, **OFF)
    d.reset(1)
    ctx = [1, 2, 3, 40, 41, 9, 3, 50, 51, 2, 3]  # "2 3" -> 40 41 (n=2) beats "3" -> 50 51 (most recent n=1)
    assert _paths(d.propose([ctx], [16])[0]) == [[40, 41]]


def test_ngram_budget_and_finished_requests():
    d = NGramDrafter(max_n=2, depth=8, width=4, **OFF)
    d.reset(2)
    ctx = [1, 2] + list(range(10, 20)) + [1, 2] + list(range(30, 40)) + [1, 2]
    trees = d.propose([ctx, ctx], [5, 0])
    assert len(trees[0]) == 5 and len(trees[1]) == 0


def test_ngram_index_is_incremental_and_matches_a_fresh_scan():
    rng = random.Random(0)
    ctx = [rng.randrange(6) for _ in range(40)]
    inc = NGramDrafter(max_n=3, depth=4, width=3, **OFF)
    inc.reset(1)
    for _ in range(60):
        inc.propose([ctx], [12])
        inc.states[0].depth, inc.states[0].width = 4, 3  # compare at fixed sizes
        ctx = ctx + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        fresh = NGramDrafter(max_n=3, depth=4, width=3, **OFF)
        fresh.reset(1)
        a, b = inc.propose([ctx], [12])[0], fresh.propose([ctx], [12])[0]
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert inc.states[0].indexed == len(ctx)
        inc.states[0].depth, inc.states[0].width = 4, 3


def test_ngram_adapts_depth_and_width():
    d = NGramDrafter(max_n=2, depth=4, max_depth=12, min_depth=1, width=2, max_width=4, **OFF)
    d.reset(1)
    ctx = list(range(1, 30)) + [1, 2]
    d.propose([ctx], [32])
    d.update([0])  # everything rejected: shallower, narrower
    assert d.states[0].depth == 2 and d.states[0].width == 1
    d.propose([ctx], [32])
    d.update([2])  # the whole path accepted: deeper
    assert d.states[0].depth == 4
    d.propose([ctx], [32])
    d.update([4])
    assert d.states[0].depth == 8
    d.propose([ctx], [32])
    d.update([3])  # partial: just past what was accepted, wider
    assert d.states[0].depth == 5 and d.states[0].width == 2
    d.update([None])  # finished request: unchanged
    assert d.states[0].depth == 5


def test_ngram_bad_arguments():
    with pytest.raises(ValueError, match="min_n"):
        NGramDrafter(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="depth"):
        NGramDrafter(depth=0)
    with pytest.raises(ValueError, match="width"):
        NGramDrafter(width=5, max_width=4)
    with pytest.raises(ValueError, match="fixed_cost"):
        NGramDrafter(node_cost=-0.1)
    with pytest.raises(ValueError, match="min_gain"):
        NGramDrafter(min_gain=0)
    for name, value in (("depth", "4"), ("max_nodes", 2.0), ("scan", True)):
        with pytest.raises(TypeError, match=f"{name}: expected an int, got {value!r}"):
            NGramDrafter(**{name: value})


def test_ngram_cost_aware_drafts_only_when_it_pays():
    # a single earlier occurrence of a 1-gram: P(accept) ~ 0.2 does not pay for a forward that costs ~1.6x a plain
    # step (torch's small-M GEMM, no skinny linears)
    d = NGramDrafter(fixed_cost=0.55, node_cost=0.065)
    d.reset(1)
    assert len(d.propose([[1, 2, 3, 4, 5, 6, 7, 8, 3]], [16])[0]) == 0
    # a 3-gram repeated several times with the same continuation: drafted, deep
    ctx = [1, 2, 3, 4, 5, 6, 7, 0] * 3 + [1, 2, 3]
    (tree,) = d.propose([ctx], [16])
    assert len(tree) >= 2 and _paths(tree)[0][:2] == [4, 5]
    # with a free forward every candidate is proposed, also the weak 1-gram one
    free = NGramDrafter(**OFF)
    free.reset(1)
    assert _paths(free.propose([[1, 2, 3, 4, 5, 6, 7, 8, 3]], [16])[0]) == [[4, 5, 6, 7]]


def test_ngram_cost_aware_keeps_the_most_probable_nodes_with_their_parents():
    d = NGramDrafter(max_n=2, depth=6, width=4, fixed_cost=0, node_cost=0.2)
    d.reset(1)
    # "5 6" -> 1 2 3 4 5 (three times), -> 9 8 7 (once): the minority branch goes first as cost rises
    ctx = [5, 6, 1, 2, 3, 4, 5, 0] * 3 + [5, 6, 9, 8, 7, 0, 5, 6]
    (tree,) = d.propose([ctx], [16])
    tree.validate()
    paths = _paths(tree)
    assert len(paths) == 1 and paths[0][0] == 1  # 9 (1 of 4 matches) dropped
    assert 1 <= len(tree) <= 6


def test_ngram_running_acceptance_statistics():
    d = NGramDrafter(max_n=2, depth=4, width=1, **OFF)
    d.reset(1)
    ctx = [1, 2, 3, 4, 5, 6, 0, 1, 2]
    (tree,) = d.propose([ctx], [16])
    assert _paths(tree) == [[3, 4, 5, 6]]
    d.update([2])  # 3 4 accepted, 5 rejected (the model said 9), 6 never scored
    d.propose([ctx + [3, 4, 9]], [16])
    got = {k: tuple(v) for k, v in d.counts.items()}
    assert got == {(2, 1, 0): (1, 0), (2, 2, 0): (1, 0), (2, 3, 0): (0, 1)}
    assert d.acceptance((2, 3, 0)) < NGramDrafter._PRIORS[(2, 3, 0)] < d.acceptance((2, 2, 0)) + 1


@pytest.mark.parametrize("next_token, depth_two", [(4, (1, 0)), (9, (0, 1))])
def test_ngram_scores_candidates_a_merged_cut_left_out_by_the_committed_tokens(next_token, depth_two):
    # scored_nodes hands every candidate to a drafter that merges and cuts (fastverify.hf.bpd); a candidate its cut
    # left out is scored by the tokens the step committed: the target's next token after the accepted path says
    # whether it would have been accepted (counted rejected, a cut's own pruning lowered the estimates it cuts by)
    d = NGramDrafter(max_n=2, depth=4, width=1, **OFF)
    d.reset(1)
    ctx = [1, 2, 3, 4, 5, 6, 0, 1, 2]
    (nodes,) = d.scored_nodes([ctx], [16])
    assert [p for p, _ in nodes] == [(3,), (3, 4), (3, 4, 5), (3, 4, 5, 6)]
    d.kept_nodes([[(3,)]])  # the merged tree held only its first node
    d.update([1])  # accepted; then the target's next token
    d.scored_nodes([ctx + [3, next_token]], [16])
    # (3,) accepted; (3, 4) as the next token says; (3, 4, 5) and deeper: their parent was never committed
    assert {k: tuple(v) for k, v in d.counts.items()} == {(2, 1, 0): (1, 0), (2, 2, 0): depth_two}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.08)
    return transformers.LlamaForCausalLM(cfg).eval()


def _greedy(model, ctx, k):
    out = []
    ids = list(ctx)
    with torch.no_grad():
        for _ in range(k):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
    return out


def test_draft_model_chain_is_its_greedy_continuation_and_cache_rolls_back(tiny):
    d = DraftModelDrafter(tiny, k=4)
    d.reset(2)
    ctxs = [[5, 6, 7, 8], [9, 10]]
    trees = d.propose(ctxs, [16, 16])
    for ctx, tree, cache in zip(ctxs, trees, d.caches):
        assert tree.parents.tolist() == [-1, 0, 1, 2]
        assert tree.tokens.tolist() == _greedy(tiny, ctx, 4)
        assert cache_length(cache) == len(ctx)
    # next step: the context grew by a few committed tokens; only those are fed
    ctxs = [ctxs[0] + trees[0].tokens.tolist()[:2] + [3], ctxs[1] + [4]]
    trees = d.propose(ctxs, [16, 2])
    assert trees[0].tokens.tolist() == _greedy(tiny, ctxs[0], 4)
    assert trees[1].tokens.tolist() == _greedy(tiny, ctxs[1], 2)  # budget 2
    assert [cache_length(c) for c in d.caches] == [len(c) for c in ctxs]


def test_draft_model_topk_tree(tiny):
    d = DraftModelDrafter(tiny, k=3, tree_topk=3)
    d.reset(1)
    ctx = [11, 12, 13]
    (tree,) = d.propose([ctx], [64])
    assert len(tree) == 9 and tree.max_depth == 3
    assert tree.parents.tolist() == [-1, -1, -1, 0, 0, 0, 3, 3, 3]
    # the chain through the first sibling of each depth is the greedy continuation
    assert tree.tokens[[0, 3, 6]].tolist() == _greedy(tiny, ctx, 3)
    with torch.no_grad():
        top = torch.topk(tiny(torch.tensor([ctx])).logits[0, -1], 3).indices.tolist()
    assert tree.tokens[:3].tolist() == top
    assert len(d.propose([ctx], [0])[0]) == 0


def test_draft_model_bad_arguments(tiny):
    with pytest.raises(ValueError, match="k"):
        DraftModelDrafter(tiny, k=0)
    with pytest.raises(ValueError, match="tree_topk"):
        DraftModelDrafter(tiny, tree_topk=0)
    with pytest.raises(TypeError, match="k: expected an int, got 2.5"):
        DraftModelDrafter(tiny, k=2.5)
    with pytest.raises(TypeError, match="draft_model: expected a transformers causal LM .a torch.nn.Module., got str"):
        DraftModelDrafter("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_ngram_calibrates_the_fixed_cost_from_step_times():
    t = [0.0]
    d = NGramDrafter(calibrate=True, fixed_cost=0.55, node_cost=0.065)
    d.clock = lambda: t[0]
    d.reset(1)
    ctx = [1, 2, 3, 4, 5, 6, 7, 0] * 3 + [1, 2, 3]  # always drafted
    plain = [9, 8, 7, 6]                              # never drafted
    for step in range(4):                             # plain steps of 10 ms
        d.propose([plain], [16])
        t[0] += 0.010
    assert d.plain_step == pytest.approx(0.010, rel=1e-3)
    assert d.step_fixed_cost() == pytest.approx(0.55)
    k = len(d.propose([ctx], [16])[0])
    assert k > 0
    t[0] += 0.040                                     # the drafted step took 4 plain steps
    d.propose([plain], [16])
    obs = 4.0 - 1.0 - 0.065 * k
    assert d.step_fixed_cost() == pytest.approx((4 * 0.55 + obs) / 5)
    for _ in range(40):                               # expensive drafts: the drafter stops drafting
        t[0] += 0.040 if len(d.propose([ctx], [16])[0]) else 0.010
    assert len(d.propose([ctx], [16])[0]) == 0
    d.reset(1)                                        # the gap over a reset (prefill) is not a step
    t[0] += 5.0
    d.propose([plain], [16])
    t[0] += 3.0                                       # nor the first step's, whose forward runs the prompt
    d.propose([plain], [16])
    assert d.plain_step == pytest.approx(0.010, rel=1e-3)
    t[0] += 0.010
    d.propose([plain], [16])
    assert d.plain_step == pytest.approx(0.010, rel=1e-3)  # a plain step, timed again


# -- the memory of earlier calls (NGramDrafter(memory=N)) -----------------------------------------------------------

def _call(d, contexts, budget=16):
    """One generate call as the loop makes it: reset, then a propose of each request's context."""
    d.reset(len(contexts))
    return d.propose([list(c) for c in contexts], [budget] * len(contexts))


def test_ngram_memory_drafts_from_earlier_calls():
    d, plain = NGramDrafter(memory=1000, depth=4, **OFF), NGramDrafter(depth=4, **OFF)
    for drafter in (d, plain):
        assert len(_call(drafter, [[1, 2, 3, 4, 5, 6, 7]])[0]) == 0  # nothing in the context, nothing remembered
    (tree,) = _call(d, [[9, 3, 4]])  # the earlier call's "3 4" -> 5 6 7, and no further: its sequence ends there
    assert _paths(tree) == [[5, 6, 7]]
    assert [key[0] for key, _ in d.states[0].pending[2]] == ["memory"] * 3
    assert len(_call(plain, [[9, 3, 4]])[0]) == 0
    d.forget()
    assert len(_call(d, [[9, 3, 4]])[0]) == 0 and len(d.memory) == 0
    _call(d, [[1]])
    assert len(d.memory) == 3 + 1  # the call before: its context and a separator


def test_ngram_memory_is_read_where_its_match_is_longer_than_the_contexts():
    d = NGramDrafter(memory=1000, depth=2, width=1, **OFF)
    _call(d, [[1, 2, 30, 31]])
    assert _paths(_call(d, [[5, 1, 2]])[0]) == [[30, 31]]  # no match in the context
    assert _paths(_call(d, [[1, 2, 40, 41, 1, 2]])[0]) == [[40, 41]]  # its own "1 2" -> 40 41: as long
    d = NGramDrafter(memory=1000, depth=2, width=1, **OFF)
    _call(d, [[1, 2, 30, 31]])
    assert _paths(_call(d, [[9, 2, 40, 1, 2]])[0]) == [[30, 31]]  # its own "2" -> 40 1: shorter


def test_ngram_memory_longest_match_then_most_recent():
    d = NGramDrafter(memory=1000, depth=1, width=1, **OFF)
    _call(d, [[7, 8, 2, 3, 50], [9, 8, 2, 3, 60]])  # one call, two requests: both remembered at the next call
    _call(d, [[1, 2, 3, 70]])
    assert _paths(_call(d, [[7, 8, 2, 3]])[0]) == [[50]]  # "7 8 2 3": four tokens
    assert _paths(_call(d, [[9, 8, 2, 3]])[0]) == [[60]]
    assert _paths(_call(d, [[4, 2, 3]])[0]) == [[70]]  # "2 3" everywhere: the most recent
    # no match across the end of one sequence and the start of the next, no continuation past its end
    assert d.memory.continuations([3, 50, 9], 4, 2, d.scan) == (0, [], {})
    assert d.memory.continuations([2, 3, 50], 4, 2, d.scan) == (0, [], {})
    assert d.memory.continuations([0, 3, 50, 9], 4, 2, d.scan) == (0, [], {})


def test_ngram_memory_holds_at_most_its_capacity():
    rng = random.Random(1)
    d = NGramDrafter(memory=100, depth=4, width=3, **OFF)
    held = []  # what the memory should hold: the calls before the last one, the oldest dropped past 100 tokens
    for _ in range(60):
        s = [rng.randrange(8) for _ in range(rng.randrange(3, 40))]
        _call(d, [s])
        assert len(d.memory) == sum(len(x) + 1 for x in held) <= 100
        assert d.memory.live == sum(len(x) - 2 for x in held)
        assert sum(map(len, d.memory.index.values())) == d.memory.live + d.memory.stale <= 2 * d.memory.live + 40
        fresh = NGramDrafter(memory=100)
        for x in held:
            fresh.memory.add(x)
        for _ in range(5):  # the same lookups as a memory that only ever held the sequences kept
            ctx = [rng.randrange(8) for _ in range(rng.randrange(2, 6))]
            assert d.memory.continuations(ctx, 4, 3, d.scan) == fresh.memory.continuations(ctx, 4, 3, d.scan)
        held.append(s)
        while sum(len(x) + 1 for x in held) > 100:
            held.pop(0)


def test_ngram_memory_bad_arguments():
    with pytest.raises(ValueError, match="memory: expected >= 0"):
        NGramDrafter(memory=-1)
    with pytest.raises(TypeError, match="memory: expected an int"):
        NGramDrafter(memory=1e5)


def test_ngram_memory_through_generate_is_exact_and_drafts_an_answer_again():
    from conftest import patched_generate, tiny_llama
    model = tiny_llama(vocab=1000)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (2, 12), generator=g)
    want = model.generate(ids, max_new_tokens=40, do_sample=False)
    d = NGramDrafter(memory=10_000)
    out1, s1 = patched_generate(model, d, ids, max_new_tokens=40, do_sample=False)
    out2, s2 = patched_generate(model, d, ids.flip(0), max_new_tokens=40, do_sample=False)
    assert torch.equal(out1, want) and torch.equal(out2, want.flip(0))
    assert s2.steps < s1.steps / 2  # the second call drafts the first call's answers


@pytest.mark.parametrize("capacity", [1, 2, 3, 4, 5])
def test_ngram_memory_of_a_few_tokens(capacity):
    d = NGramDrafter(memory=capacity, depth=4, **OFF)
    for s in ([1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 2]):
        _call(d, [s])
        assert len(d.memory) <= capacity
    _call(d, [[5]])
    # [7, 8, 9] and its separator where they fit; [1, 2] holds no 2-gram with a continuation: not kept
    assert len(d.memory) == (4 if capacity >= 4 else 0)
    assert d.memory.continuations([7, 8], 4, 1, 32) == ((2, [(9,)], {(9,): 1}) if capacity >= 4 else (0, [], {}))


def test_ngram_remember_drafts_from_given_sequences_as_from_earlier_calls():
    given = [[1, 2, 30, 31, 32], [4, 5, 60, 61]]
    for form in (given, [torch.tensor(s) for s in given], (tuple(s) for s in given)):
        d = NGramDrafter(memory=1000, depth=3, width=1, **OFF)
        d.remember(form)
        assert _paths(_call(d, [[9, 1, 2]])[0]) == [[30, 31, 32]]
        assert _paths(_call(d, [[9, 4, 5]])[0]) == [[60, 61]]
    called = NGramDrafter(memory=1000, depth=3, width=1, **OFF)
    for s in given:  # the same memory as calls that generated them
        _call(called, [s])
    _call(called, [[0]])
    d = NGramDrafter(memory=1000, depth=3, width=1, **OFF)
    d.remember(torch.tensor([[1, 2, 30, 31, 32], [7, 7, 7, 7, 7]])[:1])  # a 2-D tensor: its rows
    d.remember([given[1]])
    assert d.memory.buf == called.memory.buf == [1, 2, 30, 31, 32, -1, 4, 5, 60, 61, -1]
    assert d.memory.index == called.memory.index
    d = NGramDrafter(memory=8, **OFF)
    d.remember([[1, 2, 3], [4, 5, 6, 7]])  # the oldest dropped past its capacity, as a call's tokens
    assert d.memory.buf == [4, 5, 6, 7, -1]


def test_ngram_remember_bad_arguments():
    with pytest.raises(ValueError, match="remember: this drafter keeps no memory"):
        NGramDrafter().remember([[1, 2, 3]])
    d = NGramDrafter(memory=100)
    for bad, err, match in ((torch.tensor([1, 2, 3]), ValueError, "sequences: expected a 2-D tensor"),
                            (5, TypeError, "sequences: expected an iterable"),
                            ("1 2 3", TypeError, "sequences: expected an iterable"),
                            ([[1, 2, 3], [4, -1, 5]], ValueError, r"sequences\[1\]: expected token ids >= 0, got -1"),
                            ([[1, 2.0, 3]], TypeError, r"sequences\[0\]: expected token ids \(ints\)"),
                            ([[1, True, 3]], TypeError, r"sequences\[0\]: expected token ids \(ints\)"),
                            ([7], TypeError, r"sequences\[0\]: expected a sequence of token ids"),
                            ([torch.ones(2, 3, dtype=torch.long)], ValueError, r"sequences\[0\]: expected a 1-D"),
                            ([torch.ones(3)], ValueError, r"sequences\[0\]: expected a 1-D integer tensor")):
        with pytest.raises(err, match=match):
            d.remember(bad)
    assert len(d.memory) == 0  # nothing added by a call that raised, the valid sequences before the bad one included


def test_ngram_remember_through_generate_is_exact_and_drafts_the_given_text():
    from conftest import patched_generate, tiny_llama
    model = tiny_llama(vocab=1000)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 1000, (1, 12), generator=g)
    want = model.generate(ids, max_new_tokens=40, do_sample=False)
    plain, s0 = patched_generate(model, NGramDrafter(), ids, max_new_tokens=40, do_sample=False)
    d = NGramDrafter(memory=10_000)
    d.remember(want[:, 8:])  # the answer, and the prompt's last tokens before it
    out, s1 = patched_generate(model, d, ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, want) and torch.equal(plain, want)
    assert s1.steps < s0.steps / 2
    d = NGramDrafter(memory=10_000)
    d.remember([[9, 3, 8, 4, 5, 1000, 7]])  # outside the vocabulary: the loop's check of the drafts names it
    with pytest.raises(ValueError, match="1000"):
        patched_generate(model, d, torch.tensor([[3, 8, 4, 5]]), max_new_tokens=8, do_sample=False)
