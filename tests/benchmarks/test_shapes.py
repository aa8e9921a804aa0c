"""Model shapes shipped in the package: a bench command's `--model` takes a shape's name or a path, and both
give the same shape; an unknown name says which names there are."""
from __future__ import annotations

from pathlib import Path

import pytest

from pressroom.benchmarks.shapes import SHAPES_DIR, resolve_shape, shape_names
from pressroom.entrypoints import cli
from pressroom.model.loader import load_hf_config

SHIPPED = {"deepseek-v2-lite", "deepseek-v2-lite-dsa", "deepseek-v3", "gpt-oss-20b", "llama-3.1-70b", "llama-3.1-8b",
           "llama-3.2-1b", "mixtral-8x7b", "qwen3-0.6b", "qwen3-30b-a3b", "qwen3-8b", "kimi-linear-48b-a3b",
           "mamba-codestral-7b", "nemotron-h-8b", "qwen3-next-80b-a3b", "deepseek-v4-flash", "deepseek-v4-pro",
           "deepseek-v4-flash-reduced", "qwen2.5-vl-7b"}


def test_every_shipped_shape_has_a_name():
    assert set(shape_names()) == SHIPPED
    assert SHAPES_DIR.parent.name == "benchmarks" and SHAPES_DIR.parents[1].name == "pressroom"  # inside the package


def test_a_name_and_its_paths_give_the_same_shape(tmp_path, monkeypatch):
    directory = SHAPES_DIR / "llama-3.1-8b"
    assert resolve_shape("llama-3.1-8b") == resolve_shape(directory) == resolve_shape(directory / "config.json")
    assert load_hf_config(str(resolve_shape("llama-3.1-8b"))).hidden_size == 4096
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-8b").mkdir()  # a path in the cwd wins over the shape of the same name
    assert resolve_shape("qwen3-8b") == Path("qwen3-8b")


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="neither an existing path nor a model shape") as error:
        resolve_shape("llama-9")
    assert all(name in str(error.value) for name in SHIPPED)
    with pytest.raises(ValueError):
        resolve_shape("../configs/llama-3.1-8b")  # names only: no path arithmetic inside the package


def test_the_bench_commands_resolve_model_names(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "gpu"])
    assert args.model == str(SHAPES_DIR / "llama-3.1-8b")  # the default is a shipped shape
    assert parser.parse_args(["bench", "sparse-attention"]).model == str(SHAPES_DIR / "deepseek-v2-lite-dsa")
    assert parser.parse_args(["bench", "spec", "--draft-model", "qwen3-0.6b"]).draft_model == str(
        SHAPES_DIR / "qwen3-0.6b")
    assert parser.parse_args(["bench", "offload", "--model", "qwen3-8b"]).model == str(SHAPES_DIR / "qwen3-8b")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "gpu", "--model", "llama-9"])
    assert "known shapes: deepseek-v2-lite" in capsys.readouterr().err


def test_dflash2_asks_for_its_prompts(capsys):
    """The held-out chat prompts live in the source checkout, not the package: dflash2 takes them by path."""
    assert cli.main(["bench", "spec", "--method", "dflash2", "--device", "cpu"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
