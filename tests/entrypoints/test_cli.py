"""The console script: end to end in a real subprocess, and its parser (flags, help, defaults, choices)."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from pressroom.config import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, EngineArgs
from pressroom.entrypoints import cli
from pressroom.entrypoints.chat import sampling_params
from pressroom.entrypoints.openai.settings import ServerSettings

ENGINE = ["--dtype", "float32", "--kv-cache-memory-gib", "0.05"]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pressroom.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_each_completion(tiny_model_dir):
    r = _cli("generate", "Hello there", "Second prompt", "--model", tiny_model_dir("llama"), "--max-tokens", "5",
             *ENGINE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- ") == 2 and "'Hello there'" in r.stdout


def test_chat_streams_replies_for_each_turn(tiny_model_dir):
    r = _cli("chat", "--model", tiny_model_dir("qwen3"), "--max-tokens", "6", "--temperature", "0", *ENGINE,
             stdin="hi\nagain\n")
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 2


def test_unknown_model_is_a_clear_error():
    r = _cli("generate", "x", "--model", "/nonexistent/model")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_bench_throughput_writes_json(tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    r = _cli("bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "4", "--input-len", "8",
             "--output-len", "4", "--ignore-eos", "--output-json", str(out), *ENGINE)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    result = report["results"][0]
    assert result["backend"] == "pressroom" and result["total_output_tokens"] == 16
    assert result["output_tokens_per_s"] > 0


# ---- the parser: flags, help, defaults, choices ----

def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(the argv that reaches it, parser) for `parser` and every subcommand under it, bench's included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


PARSERS = dict(_parsers(cli.build_parser()))
ENGINE_COMMANDS = {("generate",): ["x"], ("chat",): [], ("serve",): [], ("bench", "throughput"): [],
                   ("bench", "latency"): [], ("train-drafter",): ["--dataset-path", "d", "--output", "o"]}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's entry in --help (its flags, metavar and help), whitespace-collapsed, by its first flag."""
    entries, current = {}, None
    for line in parser.format_help().splitlines():
        if re.match(r"  [^ ]", line):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += " " + line
        else:
            current = None
    return {flag: " ".join(text.split()) for flag, text in entries.items()}


def _shown(default) -> str:
    return ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)


def test_the_walk_reaches_every_subcommand():
    assert set(PARSERS) == {(), ("generate",), ("chat",), ("serve",), ("router",), ("train-drafter",),
                            ("make-prompts",), ("bench",),
                            ("bench", "throughput"), ("bench", "latency"), ("bench", "serve"), ("bench", "gpu"),
                            ("bench", "spec"), ("bench", "sparse-attention"), ("bench", "offload"),
                            ("bench", "context"), ("bench", "embed"), ("bench", "structured"), ("bench", "disagg")}


@pytest.mark.parametrize("path", PARSERS, ids=lambda p: " ".join(p) or "pressroom")
def test_every_flag_has_help_showing_its_default_and_choices(path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a default (textwrap breaks at hyphens)
    parser = PARSERS[path]
    entries = _help_entries(parser)
    for action in _options(parser):
        flag = action.option_strings[0]
        own_help = (action.help or "").replace("(default: %(default)s)", "").strip()
        assert own_help, f"{flag} has no help"
        if action.default is not None:
            assert f"(default: {_shown(action.default)})" in entries[flag], (flag, entries[flag])
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in entries[flag], (flag, entries[flag])


@pytest.mark.parametrize("path", PARSERS, ids=lambda p: " ".join(p) or "pressroom")
def test_flags_with_choices_reject_other_values(path, capsys):
    flags = [a.option_strings[0] for a in _options(PARSERS[path]) if a.choices]
    for flag in flags:
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([*path, flag, "not-a-choice"])
        assert "invalid choice" in capsys.readouterr().err, flag


def test_engine_flags_come_from_the_engine_args_fields_alone():
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    actions = _options(parser)
    assert sorted(a.dest for a in actions) == sorted(EngineArgs.names())  # exactly one flag per field
    by_dest = {a.dest: a for a in actions}
    for f in fields(EngineArgs):
        action = by_dest[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert f.metadata["help"] and action.help.replace("%%", "%").startswith(f.metadata["help"])
        assert action.default == f.default and action.choices == f.metadata["choices"]
    assert by_dest["dtype"].choices == DTYPE_CHOICES and {"auto", "bfloat16", "float32"} <= set(DTYPE_CHOICES)
    assert ("auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX); "
            "float32 on other CPUs") in by_dest["dtype"].help
    assert by_dest["kv_cache_dtype"].choices == KV_CACHE_DTYPE_CHOICES


@pytest.mark.parametrize("path", ENGINE_COMMANDS, ids=" ".join)
def test_engine_flag_defaults_are_engine_args_defaults(path):
    ns = cli.build_parser().parse_args([*path, *ENGINE_COMMANDS[path]])
    assert EngineArgs.from_kwargs(**cli.engine_kwargs(ns)) == EngineArgs()


def test_engine_flags_parse_to_their_field_types():
    ns = cli.build_parser().parse_args([
        "generate", "x", "--seed", "7", "--max-model-len", "64", "--kv-cache-memory-gib", "0.5",
        "--num-gpu-blocks-override", "9", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
        "--no-async-scheduling", "--enforce-eager", "--dtype", "float32", "--device", "cpu",
        "--load-format", "dummy", "--speculative-config", '{"method": "ngram"}'])
    args = EngineArgs.from_kwargs(**cli.engine_kwargs(ns))
    assert args.seed == 7 and args.max_model_len == 64 and args.num_gpu_blocks_override == 9
    assert args.kv_cache_memory_gib == 0.5 and args.gpu_memory_utilization == 0.5
    assert args.enable_prefix_caching is False and args.async_scheduling is False and args.enforce_eager is True
    assert (args.dtype, args.device, args.load_format) == ("float32", "cpu", "dummy")
    assert args.speculative_config == '{"method": "ngram"}'


def test_seed_is_the_engine_seed_and_request_seed_the_sampling_seed():
    ns = cli.build_parser().parse_args(["generate", "x", "--seed", "7", "--request-seed", "5"])
    assert EngineArgs.from_kwargs(**cli.engine_kwargs(ns)).seed == 7
    assert sampling_params(ns).seed == 5
    assert sampling_params(cli.build_parser().parse_args(["generate", "x", "--seed", "7"])).seed is None


def test_serve_logging_flags():
    parser = cli.build_parser()
    ns = parser.parse_args(["serve"])
    assert ns.log_level is None  # logger.default_level(): the environment's, else INFO
    assert not (ns.disable_log_requests or ns.disable_uvicorn_access_log or ns.disable_log_stats)
    ns = parser.parse_args(["--log-level", "debug", "serve", "--disable-log-requests", "--disable-uvicorn-access-log",
                            "--disable-log-stats", "--log-stats-interval", "2"])
    assert ns.log_level == "DEBUG" and ns.log_stats_interval == 2
    assert ns.disable_log_requests and ns.disable_uvicorn_access_log and ns.disable_log_stats


def test_serve_flag_defaults_are_the_server_settings_defaults():
    assert ServerSettings.from_args(cli.build_parser().parse_args(["serve"])) == ServerSettings()


def test_serve_flags_build_the_server_settings():
    ns = cli.build_parser().parse_args(["serve", "m", "--port", "9", "--api-key", "k", "--disable-metrics-auth",
                                        "--disable-log-stats", "--disable-log-requests", "--reasoning-parser", "none",
                                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    settings = ServerSettings.from_args(ns)
    assert settings.served_model_name == ("m",) and settings.port == 9 and settings.api_keys == ("k",)
    assert not (settings.metrics_auth or settings.log_requests) and settings.log_stats_interval == 0
    assert settings.reasoning_parser == "none" and settings.enable_auto_tool_choice
    named = cli.build_parser().parse_args(["serve", "--model", "m", "--served-model-name", "a", "b"])
    assert ServerSettings.from_args(named).served_model_name == ("a", "b")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerSettings.from_args(cli.build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))


def test_serve_help_lists_every_flag():
    r = _cli("serve", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: pressroom serve [MODEL] [options]")
    for flag in ("--disable-log-requests", "--seed", "--dtype", "--no-enable-prefix-caching", "--api-key"):
        assert flag in r.stdout
