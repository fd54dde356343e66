"""Training recipes for the drafters that read the target: ``python -m fastverify.train METHOD``; each recipe is the
module fastverify.train.METHOD, and RECIPES below says what it trains (``--help`` prints that list)."""

RECIPES = {
    "heads": "blockwise proposal heads (Stern et al. 2018; Medusa-1, Hydra) on the target's last hidden state",
    "slots": "GAD / LUD slot drafters: slot rows and a gated LoRA on the target (--method gad|lud)",
    "ptp": "Parallel Token Prediction slot drafters, fed the sampler's auxiliary uniforms (--variant o|c)",
    "eagle": "an EAGLE draft layer over the target's features",
}
