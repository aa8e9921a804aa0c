"""vLLM 0.32's `vllm serve` command line on `pressroom serve`: sizes (4k, 32K), short forms (-tp, -dp, -ep, -q, -O),
the version, the start-up lines, the port checked before the model loads, and vLLM's flags pressroom refuses by
name."""
from __future__ import annotations

import argparse
import ast
import re
import socket
import subprocess
import sys

import pytest

import pressroom
from pressroom.config import EngineArgs
from pressroom.entrypoints import cli


def _engine_args(*argv: str) -> EngineArgs:
    return EngineArgs.from_kwargs(**cli.engine_kwargs(cli.build_parser().parse_args(["serve", *argv])))


# ---- sizes, as vLLM reads them: lowercase suffixes decimal, uppercase binary ----

@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("4k", 4000), ("4K", 4096), ("32K", 32768),
                                             ("1m", 1_000_000), ("1M", 1 << 20), ("25.6k", 25_600),
                                             ("2g", 2_000_000_000), ("1T", 1 << 40), (" 8k ", 8000)])
def test_size_flags_read_vllm_suffixes(text, value):
    assert _engine_args("--max-model-len", text).max_model_len == value
    assert _engine_args("--max-num-batched-tokens", text).max_num_batched_tokens == value
    assert _engine_args("--kv-cache-memory-bytes", text).kv_cache_memory_bytes == value


@pytest.mark.parametrize("text", ["auto", "AUTO", "-1"])
def test_max_model_len_auto_is_the_default(text):
    assert _engine_args("--max-model-len", text).max_model_len is None


@pytest.mark.parametrize(("text", "says"), [("1.5K", "binary suffix"), ("4x", "not an integer"),
                                            ("k", "not an integer"), ("4kb", "not an integer")])
def test_bad_sizes_are_refused_at_parse(text, says, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--max-model-len", text])
    err = capsys.readouterr().err
    assert "argument --max-model-len" in err and says in err, err


def test_kv_cache_size_has_two_spellings_and_one_value():
    cpu = ("--device", "cpu")
    assert _engine_args(*cpu, "--kv-cache-memory-bytes", "64M").create_engine_config().cache.kv_cache_memory_bytes \
        == 64 << 20
    assert _engine_args(*cpu, "--kv-cache-memory-gib", "0.0625").create_engine_config().cache.kv_cache_memory_bytes \
        == 64 << 20
    with pytest.raises(ValueError, match="give one"):
        _engine_args(*cpu, "--kv-cache-memory-bytes", "64M", "--kv-cache-memory-gib", "1").create_engine_config()


# ---- vLLM's short forms ----

@pytest.mark.parametrize(("argv", "field", "value"), [
    (["-tp", "2"], "tensor_parallel_size", 2), (["-tp=4"], "tensor_parallel_size", 4),
    (["-dp", "3"], "data_parallel_size", 3), (["-ep"], "enable_expert_parallel", True),
    (["-q", "fp8"], "quantization", "fp8"), (["-qfp8"], "quantization", "fp8"),
    (["-O0"], "optimization_level", 0), (["-O", "3"], "optimization_level", 3), (["-O=1"], "optimization_level", 1),
    (["--optimization-level", "0"], "optimization_level", 0)])
def test_short_forms_set_their_long_flags(argv, field, value):
    args = _engine_args(*argv)
    assert getattr(args, field) == value
    assert args == EngineArgs(**{field: value})  # nothing else moved


@pytest.mark.parametrize("level", ["0", "1", "2", "3"])
def test_O0_alone_runs_eagerly(level):
    compilation = _engine_args("--device", "cpu", f"-O{level}").create_engine_config().compilation
    assert compilation.enforce_eager is (level == "0")
    assert _engine_args("--device", "cpu", f"-O{level}", "--enforce-eager").create_engine_config() \
        .compilation.enforce_eager


@pytest.mark.parametrize("text", ["4", "-1", "decode"])
def test_O_refuses_levels_vllm_lacks(text, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", f"-O{text}"])
    assert "argument --optimization-level/-O" in capsys.readouterr().err
    with pytest.raises(ValueError, match="optimization_level"):
        EngineArgs(device="cpu", optimization_level=7).create_engine_config()


# ---- the version, the start-up lines, the port checked before the model loads ----

def test_version(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.build_parser().parse_args(["--version"])
    assert ended.value.code == 0 and capsys.readouterr().out.strip() == pressroom.__version__


LINE = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR) pressroom: ")  # time first, as vLLM's lines


def test_a_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pressroom.entrypoints.cli", "serve", "--device", "cpu", "--port",
                            str(port), "-tp", "1", "--max-model-len", "2k", "--api-key", "sekrit"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    lines = r.stderr.splitlines()
    assert all(LINE.match(line) for line in lines), lines
    # the version, the arguments, the error: nothing of the engine (it logs "engine ready" once the model loaded)
    assert len(lines) == 3, lines
    assert f"INFO pressroom: pressroom server version {pressroom.__version__}, serving model" in lines[0]
    assert "INFO pressroom: non-default args: {" in lines[1]
    given = ast.literal_eval(lines[1].split("non-default args: ", 1)[1])
    assert given == {"port": port, "max_model_len": 2000, "device": "cpu", "api_key": "***"}  # -tp 1 is the default
    assert f"ERROR pressroom: port {port} on 127.0.0.1 is in use" in lines[2]


# ---- vLLM's flags pressroom cannot honour: refused by name, with the reason ----

def _parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ended:
        cli.build_parser().parse_args(["serve", *argv])
    assert ended.value.code == 2
    return capsys.readouterr().err


def _serve_parser() -> argparse.ArgumentParser:
    return next(a for a in cli.build_parser()._actions if a.choices and "serve" in a.choices).choices["serve"]


SERVE = _serve_parser()


def _refusing_argv(names: tuple[str, ...], honoured: tuple[str, ...]) -> list[str]:
    """The flag given as pressroom cannot honour it: a switch in a spelling not accepted, else a value not accepted."""
    if SERVE._option_string_actions[names[0]].nargs == 0:
        return [next(name for name in names if name not in honoured)]
    return [names[-1], "7"]


@pytest.mark.parametrize("names", cli.REFUSED_FLAGS, ids=lambda names: names[0])
def test_each_refused_flag_is_an_error_naming_it_and_why(names, capsys):
    reason, honoured = cli.REFUSED_FLAGS[names]
    assert all(isinstance(SERVE._option_string_actions[name], cli.RefusedFlag) for name in names)  # none stale
    err = _parse_error(_refusing_argv(names, honoured), capsys)
    assert f"argument {'/'.join(names)}: refused: {reason}" in err, err


@pytest.mark.parametrize("argv", [["-pp", "1"], ["--nnodes", "1"], ["--enable-chunked-prefill"],
                                  ["--tokenizer-mode", "auto"]], ids=" ".join)
def test_values_that_ask_for_what_pressroom_does_are_accepted(argv):
    ns = cli.build_parser().parse_args(["serve", *argv])
    assert cli.non_default_args(ns) == {}  # accepted, and nothing changed
    assert _engine_args(*argv) == EngineArgs()


def test_accepted_switch_and_its_refused_spelling(capsys):
    assert "refused: pressroom always prefills long prompts in chunks" in \
        _parse_error(["--no-enable-chunked-prefill"], capsys)
    assert "refused: pipeline parallelism is not implemented" in _parse_error(["-pp", "2"], capsys)


def test_a_flag_pressroom_has_is_never_refused():
    assert not isinstance(SERVE._option_string_actions["--tensor-parallel-size"], cli.RefusedFlag)
    own = argparse.ArgumentParser()
    own.add_argument("--chat-template", default=None)
    cli.add_refused_args(own)
    assert own.parse_args(["--chat-template", "t.jinja"]).chat_template == "t.jinja"
    assert isinstance(own._option_string_actions["--uds"], cli.RefusedFlag)
