"""Training recipes for the drafters that read the target: ``python -m fastverify.train METHOD``.

  heads     blockwise proposal heads (Stern et al. 2018; Medusa-1): fastverify.train.heads
"""

RECIPES = ("heads",)
