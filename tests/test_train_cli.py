"""``python -m fastverify.train METHOD``: flags from the recipe configs, each with the help written beside its field."""

import dataclasses

import pytest

from fastverify.train.cli import field_comments, parse_config
from fastverify.train.eagle import EagleConfig
from fastverify.train.heads import HeadsConfig
from fastverify.train.ptp import PTPConfig
from fastverify.train.slots import SlotsConfig

CONFIGS = [HeadsConfig, EagleConfig, SlotsConfig, PTPConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_flag_has_help(cls, capsys):
    helps = field_comments(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not helps.get(f.name)]
    assert not missing, f"{cls.__name__}: fields without a comment: {missing}"
    with pytest.raises(SystemExit):
        parse_config(cls, ["--help"], "prog", "desc")
    text = "".join(capsys.readouterr().out.split())  # argparse rewraps (and breaks words at hyphens)
    for f in dataclasses.fields(cls):
        assert "".join(helps[f.name].split()) in text, f.name


def test_continued_comments_join_and_subclasses_override():
    heads = field_comments(HeadsConfig)
    assert heads["arch"].startswith('"sequential" (Hydra') and heads["arch"].endswith('"parallel" (Medusa-1 heads)')
    assert heads["data_workers"].endswith("on a busy CPU)")
    assert heads["epochs"] == "passes over the training positions"  # not the "# training" section line above it
    assert "gad" in field_comments(SlotsConfig)["method"]
    assert field_comments(PTPConfig)["method"].startswith("Parallel Token Prediction")


def test_flags_parse_into_the_config():
    cfg = parse_config(HeadsConfig, ["--out", "d", "--num-heads", "3", "--ffn", "2", "--no-resume", "--lr", "5e-4"],
                       "prog", "desc")
    assert (cfg.out, cfg.num_heads, cfg.ffn, cfg.resume, cfg.lr) == ("d", 3, 2.0, False, 5e-4)
    assert cfg.epochs == HeadsConfig(out="x").epochs
    with pytest.raises(SystemExit):
        parse_config(HeadsConfig, [], "prog", "desc")  # --out is required
