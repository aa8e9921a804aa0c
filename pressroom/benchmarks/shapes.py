"""Model shapes: published Hugging Face `config.json`s of real models, shipped in the package (`configs/` beside
this file), so the bench commands run dummy weights at real shapes from a source checkout or an installed wheel.

A bench command's `--model` takes a shape's name (`llama-3.1-8b`) or a path (a model directory, its
`config.json`, or a `.gguf` file); `resolve_shape` is the one place that tells them apart.
"""
from __future__ import annotations

import argparse
from pathlib import Path

SHAPES_DIR = Path(__file__).resolve().with_name("configs")


def shape_names() -> list[str]:
    """The shapes shipped in the package, by name: each a directory of `configs/` holding a config.json."""
    return sorted(p.name for p in SHAPES_DIR.iterdir() if (p / "config.json").is_file())


def resolve_shape(model: str | Path) -> Path:
    """What a bench command loads for `model`: an existing path as given (a `config.json` stands for its
    directory, which is what the engine loads), else the shipped shape of that name."""
    path = Path(model).expanduser()
    if path.exists():  # a path wins over a name: a directory called llama-3.1-8b in the cwd is what was meant
        return path.parent if path.is_file() and path.name == "config.json" else path
    if str(model) in shape_names():  # an exact name only: no path arithmetic inside the package
        return SHAPES_DIR / str(model)
    raise ValueError(f"{str(model)!r} is neither an existing path nor a model shape shipped with pressroom "
                     f"(known shapes: {', '.join(shape_names())}).")


def shape_arg(text: str) -> str:
    """`resolve_shape` as an argparse type, a string as engine arguments and reports take it; its message
    reaches the user (argparse hides a ValueError's)."""
    try:
        return str(resolve_shape(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def shape_help(what: str) -> str:
    """A `--model` help line: what the argument is, then the shapes it may name."""
    return f"{what}: a shipped shape ({', '.join(shape_names())}) or a path (model directory, config.json or .gguf)"
