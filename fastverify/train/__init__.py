"""Training recipes for the drafters that read the target: ``python -m fastverify.train METHOD``.

  heads     blockwise proposal heads (Stern et al. 2018; Medusa-1): fastverify.train.heads
  slots     GAD / LUD slot drafters (gated LoRA on the target; --method gad|lud): fastverify.train.slots
  ptp       Parallel Token Prediction slot drafters (O-PTP / C-PTP; --variant o|c): fastverify.train.ptp
  eagle     an EAGLE draft layer over the target's features: fastverify.train.eagle
"""

RECIPES = ("heads", "slots", "ptp", "eagle")
