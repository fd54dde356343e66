"""fastverify: fast, exact draft-and-verify decoding for PyTorch and Hugging Face models.

Ops (each with torch / cpp / triton / cuda backends, see ``fastverify.backends()``):

  verify                      batched verification of chains and trees under every acceptance rule
  uniform, cdf_sample,        reproducible uniforms, inverse-CDF sampling and its inverse (PTP)
  cdf_invert, aux_bits
  tree_mask, block_mask,      tree / block attention masks, positions, tree attention, cache compaction
  tree_positions, tree_attention, compact_cache
  masked_attention            SDPA with an additive mask and grouped-query heads for a few query rows (CPU; also
                              narrower values, Gemma 2's soft cap, gpt-oss's sinks)
  skinny_linear               x @ W^T for a few rows, streaming W once (CPU; the verify forward's GEMMs)

Hugging Face integration: ``fastverify.patch(model)`` / ``fastverify.unpatch(model)``; drafters NGramDrafter,
DraftModelDrafter, HeadsDrafter (proposal heads: ``fastverify.load_drafter("smollm2-bpd", model)``; training:
``python -m fastverify.train heads``), EagleDrafter (an EAGLE draft layer over the target's features; training:
``python -m fastverify.train eagle``).
"""

from fastverify._ext import backends  # noqa: F401  (loads the compiled extension, warning once if missing)
from fastverify.ops.verify import RULES, VerifyOutput, verify  # noqa: F401
from fastverify.ops.tree import block_mask, tree_mask, tree_positions  # noqa: F401
from fastverify.ops.attention import masked_attention, tree_attention  # noqa: F401
from fastverify.ops.cache import compact_cache  # noqa: F401
from fastverify.ops.linear import skinny_linear  # noqa: F401
from fastverify import tree  # noqa: F401
from fastverify.ops.sampling import aux_bits, cdf_invert, cdf_sample, sample_v, uniform  # noqa: F401
from fastverify import ptp  # noqa: F401

from fastverify.hf import patch, unpatch  # noqa: F401,E402
from fastverify.hf.drafters import DraftModelDrafter, Drafter, NGramDrafter  # noqa: F401,E402
from fastverify.hf.bpd import HeadsDrafter, load_drafter  # noqa: F401,E402  (proposal heads, Stern et al. 2018)
from fastverify.hf.eagle import EagleDrafter  # noqa: F401,E402  (EAGLE draft layer, Li et al. 2024)

__version__ = "0.1.0"
