"""Command-line flags from a recipe's config dataclass: one ``--flag`` per field, ``--x / --no-x`` for booleans."""

import argparse
import dataclasses

__all__ = ["parse_config", "run_recipe"]


def parse_config(cls, argv, prog: str, description: str):
    """An instance of the dataclass ``cls`` from command-line arguments ``argv`` (fields without a default are
    required flags)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    for f in dataclasses.fields(cls):
        name = "--" + f.name.replace("_", "-")
        if f.type is bool or isinstance(f.default, bool):
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.default is dataclasses.MISSING:
            p.add_argument(name, required=True)
        else:
            typ = {"int": int, "float": float}.get(getattr(f.type, "__name__", str(f.type)), str)
            p.add_argument(name, type=typ, default=f.default)
    return cls(**vars(p.parse_args(argv)))


def run_recipe(cls, train, argv, prog: str, description: str):
    """The command line of a recipe: its config from ``argv``, torch's thread count, the target model and
    tokenizer (``fastverify.train.heads.load_target``), then ``train(model, tokenizer, cfg, base_name=...)``."""
    import torch

    from fastverify.train.heads import load_target

    cfg = parse_config(cls, argv, prog, description)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tokenizer, base = load_target(cfg.model, cfg.device)
    return train(model, tokenizer, cfg, base_name=base)
