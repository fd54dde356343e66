"""Hugging Face integration: ``patch(model)`` makes ``model.generate`` run fastverify's draft-and-verify loop;
``unpatch(model)`` restores it. ``stats(model)`` returns what the last patched generate did."""

from fastverify.hf.drafters import DraftModelDrafter, Drafter, NGramDrafter  # noqa: F401
from fastverify.hf.loop import LoopStats  # noqa: F401
from fastverify.hf.patch import (MODEL_REGISTRY, ModelSpec, is_patched, patch, register_model_type,  # noqa: F401
                                 stats, unpatch)

__all__ = ["patch", "unpatch", "is_patched", "stats", "register_model_type", "ModelSpec", "MODEL_REGISTRY",
           "Drafter", "NGramDrafter", "DraftModelDrafter", "LoopStats"]
