"""``python -m fastverify.train METHOD [options]``; ``--help`` after METHOD lists its options."""

import sys

from fastverify.train import RECIPES


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in RECIPES:
        print(f"usage: python -m fastverify.train {{{','.join(RECIPES)}}} [options]", file=sys.stderr)
        sys.exit(2)
    if argv[0] == "heads":
        from fastverify.train.heads import main as run
    elif argv[0] == "slots":
        from fastverify.train.slots import main as run
    elif argv[0] == "ptp":
        from fastverify.train.ptp import main as run
    elif argv[0] == "eagle":
        from fastverify.train.eagle import main as run
    run(argv[1:])


if __name__ == "__main__":
    main()
