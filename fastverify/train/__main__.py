"""``python -m fastverify.train METHOD [options]``; ``--help`` after METHOD lists its options."""

import importlib
import sys

from fastverify.train import RECIPES


def usage() -> str:
    lines = [f"usage: python -m fastverify.train {{{','.join(RECIPES)}}} [options]", "", "recipes:"]
    lines += [f"  {name:<6} {what}" for name, what in RECIPES.items()]
    lines += ["", "python -m fastverify.train METHOD --help lists the options of METHOD."]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0)
    if not argv or argv[0] not in RECIPES:
        got = f"unknown recipe {argv[0]!r}; " if argv else ""
        print(f"{usage()}\n\nerror: {got}expected one of {', '.join(RECIPES)}", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(f"fastverify.train.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main()
