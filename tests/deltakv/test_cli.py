"""`sparsevllm deltakv --help` explains every flag; bad input ends with one line on
stderr and exit status 2, without a traceback and (where it can) before a model loads."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sparsevllm.cli import build_parser, main


def _subparser(name: str) -> argparse.ArgumentParser:
    root = build_parser(with_bench=False)
    top = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    deltakv = top.choices["deltakv"]
    kinds = next(a for a in deltakv._actions if isinstance(a, argparse._SubParsersAction))
    return kinds.choices[name]


@pytest.mark.parametrize("name", ["collect", "train", "eval"])
def test_help_explains_every_flag(name, capsys):
    parser = _subparser(name)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 15, action.option_strings
    with pytest.raises(SystemExit) as done:
        main(["deltakv", name, "--help"])
    assert done.value.code == 0
    assert parser.description.split()[0] in capsys.readouterr().out


def test_the_deltakv_parsers_import_no_torch():
    code = (
        "import argparse, sys\n"
        "from sparsevllm.cli_deltakv import add_deltakv_parser\n"
        "p = argparse.ArgumentParser(); add_deltakv_parser(p.add_subparsers())\n"
        "try:\n    p.parse_args(['deltakv', 'train', '--help'])\nexcept SystemExit: pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


BAD = [
    (["collect", "--out", "x"], "nothing to collect"),
    (["collect", "--out", "x", "--files", "/no/such.txt"], "no such text file"),
    (["collect", "--out", "x", "--prompts", "/no/prompts.txt"], "no prompt file"),
    (["collect", "--out", "x", "--haystacks", "niah_nope"], "unknown haystack task"),
    (["collect", "--out", "x", "--files", "f", "--max-gb", "0"], "must be > 0"),
    (["collect", "--out", "x", "--haystacks", "niah_single", "--queries", "-1"], "--queries"),
    (["train", "--data", "/no/capture", "--out", "x"], "no capture at /no/capture"),
    (["train", "--data", "d", "--out", "x", "--latent-dim", "0"], "positive integers"),
    (["train", "--data", "d", "--out", "x", "--hidden-dim", "8"], "--init pca needs linear"),
    (["train", "--data", "d", "--out", "x", "--cluster-ratio", "0.3"], "whole number"),
    (["train", "--data", "d", "--out", "x", "--steps", "0"], "--steps must be >= 1"),
    (["eval", "/no/c.safetensors", "--data", "d"], "no compressor checkpoint"),
    (["eval", "c", "--data", "d", "--split", "test"], "invalid choice"),
]


def _status(argv: list[str]) -> int | str | None:
    """main's exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as done:
        return done.code


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_and_status_2(argv, message, capsys):
    assert _status(["deltakv", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_eval_refuses_a_capture_of_another_model(tiny_model_factory, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(" ".join(f"w{10 + i % 200}" for i in range(300)))
    caps = {}
    for kind in ("llama", "llama4"):  # two layers or four: other fingerprints
        caps[kind] = tmp_path / kind
        argv = ["deltakv", "collect", "--model", tiny_model_factory(kind), "--out", str(caps[kind])]
        argv += ["--files", str(tmp_path / "doc.txt"), "--max-tokens", "100", "--no-progress"]
        assert main(argv) == 0
    out = tmp_path / "ckpt"
    argv = ["deltakv", "train", "--data", str(caps["llama"]), "--out", str(out), "--steps", "2"]
    assert main([*argv, "--no-progress"]) == 0
    capsys.readouterr()
    code = main(
        ["deltakv", "eval", str(out / "compressor.safetensors"), "--data", str(caps["llama4"])]
    )
    err = capsys.readouterr().err
    assert code == 2 and "fingerprint" in err and "Traceback" not in err
    assert err.count("sha256:") == 2
