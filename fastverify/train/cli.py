"""Command-line flags from a recipe's config dataclass: one ``--flag`` per field, ``--x / --no-x`` for booleans."""

import argparse
import dataclasses

__all__ = ["parse_config"]


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
