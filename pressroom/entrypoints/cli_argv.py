"""vLLM's command-line conventions on pressroom's parser (vLLM's FlexibleArgumentParser): `--config FILE.yaml`
(the file's keys are flags, the command line's own flags win), flag names with underscores (`--max_model_len`),
and `--help=all`, `--help=GROUP` (a group of flags: pressroom's titles, or vLLM's config groups such as
ModelConfig and Frontend) and `--help=WORD` (the flags whose names hold it)."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

CONFIG_FLAG = "--config"
CONFIG_SUFFIXES = (".yaml", ".yml")

# vLLM's config group of each engine flag whose pressroom config class is not vLLM's (or that has none); the others
# go by the class their field sets (EngineArgs metadata "sets"), and a field with neither by "EngineArgs"
VLLM_GROUPS = {
    "model": "ModelConfig", "dtype": "ModelConfig", "revision": "ModelConfig", "tokenizer_revision": "ModelConfig",
    "trust_remote_code": "ModelConfig", "hf_overrides": "ModelConfig", "runner": "ModelConfig",
    "task": "ModelConfig", "pooler_config": "ModelConfig", "enforce_eager": "ModelConfig",
    "kv_cache_dtype": "CacheConfig", "kv_cache_memory_gib": "CacheConfig", "kv_cache_memory_bytes": "CacheConfig",
    "kv_offloading_size": "CacheConfig", "kv_offloading_disk_path": "CacheConfig",
    "kv_offloading_disk_size": "CacheConfig",
    "max_num_batched_tokens": "SchedulerConfig", "long_prefill_token_threshold": "SchedulerConfig",
    "prefill_cost_context": "SchedulerConfig", "step_time_factor": "SchedulerConfig", "max_num_seqs": "SchedulerConfig",
    "async_scheduling": "SchedulerConfig",
    "distributed_executor_backend": "ParallelConfig", "num_threads": "ParallelConfig",
    "device": "DeviceConfig", "download_dir": "LoadConfig", "enable_lora": "LoRAConfig",
    "optimization_level": "VllmConfig", "speculative_config": "VllmConfig", "kv_transfer_config": "VllmConfig",
}
FRONTEND = "frontend"  # vLLM's group of the server's own flags: every `serve` flag that is not an engine argument


class VLLMArgvParser(argparse.ArgumentParser):
    """The top-level parser: argv is read as vLLM reads it before it is parsed (`vllm_argv`)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        argv = list(sys.argv[1:] if args is None else args)
        try:
            argv = vllm_argv(argv, self)
        except ValueError as e:
            self.error(str(e))
        return super().parse_known_args(argv, namespace)


def vllm_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with --config's flags spliced in (where vLLM puts them: after the command and a `serve` command's
    MODEL, before the command line's own flags, which so win) and flag names' underscores made dashes."""
    argv = _splice_config(argv, parser)
    return [_dashed(arg) for arg in argv]


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def _splice_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    given = [i for i, arg in enumerate(argv) if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "=")]
    if not given:
        return argv
    if len(given) > 1:
        raise ValueError(f"{CONFIG_FLAG} is given {len(given)} times: give one config file.")
    at = given[0]
    if argv[at] == CONFIG_FLAG:
        if at + 1 == len(argv):
            raise ValueError(f"argument {CONFIG_FLAG}: expected a YAML file")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1:]
    command_at, command = _leaf_command(rest, parser)
    if command is None:
        raise ValueError(f"{CONFIG_FLAG} is read by a command (pressroom serve --config FILE.yaml).")
    insert_at = command_at + 1
    model_in_cli = command.prog.endswith(" serve") and insert_at < len(rest) and not rest[insert_at].startswith("-")
    config = read_config_file(path)
    if model_in_cli:  # the command line's MODEL wins over the file's, as in vLLM
        insert_at += 1
        config.pop("model", None)
    return rest[:insert_at] + config_flags(config, command) + rest[insert_at:]


def _leaf_command(argv: list[str], parser: argparse.ArgumentParser) -> tuple[int, argparse.ArgumentParser | None]:
    """The position and parser of the innermost command in `argv` (`serve`, or `bench serve`'s `serve`)."""
    at, found = -1, None
    current = parser
    for i, arg in enumerate(argv):
        commands = _commands(current)
        if arg in commands:
            at, found = i, commands[arg]
            current = found
    return at, found


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML config file's mapping of flag names to values; a ValueError saying what is wrong with it."""
    if not path.endswith(CONFIG_SUFFIXES):
        raise ValueError(f"{CONFIG_FLAG} {path!r}: a YAML file (.yaml or .yml), as vLLM reads it.")
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"{CONFIG_FLAG} {path!r}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{CONFIG_FLAG} {path!r}: not YAML ({e})") from None
    if config is None:
        return {}
    if not isinstance(config, dict) or not all(isinstance(key, str) for key in config):
        raise ValueError(f"{CONFIG_FLAG} {path!r}: a mapping of flag names to values, e.g. `port: 8001`.")
    return config


def config_flags(config: dict[str, Any], command: argparse.ArgumentParser) -> list[str]:
    """A config's entries as command-line flags, as vLLM turns them: true is the switch, false its --no- form where
    the flag has one (else nothing), a list the flag and its items (an empty one: nothing), a mapping its JSON,
    anything else its text. A null value is the flag's default: nothing. Lists come first: a MODEL given after
    --config on the command line must not land after one (it would be taken as the list's last item)."""
    lists: list[str] = []
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if flag not in command._option_string_actions:
            raise ValueError(f"{CONFIG_FLAG}: {key!r} is not a flag of `{command.prog}` (see --help=all).")
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif (negated := "--no-" + flag[2:]) in command._option_string_actions:
                flags.append(negated)
        elif isinstance(value, list):
            if value:
                lists += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return lists + flags


class SearchableHelp(argparse._HelpAction):
    """-h/--help, and vLLM's --help=all (every flag), --help=GROUP (a group's flags: a group title or its first
    words, or one of vLLM's config groups) and --help=WORD (the flags whose names hold WORD)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        # argparse's help action, but taking an optional value (its own __init__ fixes nargs at 0)
        argparse.Action.__init__(self, option_strings, argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                                 metavar="all|GROUP|WORD",
                         help="show this help and exit; =all: every flag; =GROUP: a group's flags (a group here, or "
                              "vLLM's: ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, LoRAConfig, "
                              "Frontend, ...); =WORD: the flags whose names hold it")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None or values.lower() == "all":
            parser.print_help()
        else:
            sys.stdout.write(searched_help(parser, values))
        parser.exit()


def searched_help(parser: argparse.ArgumentParser, keyword: str) -> str:
    """--help=keyword's text: a group's flags, else the flags matching, else a line saying there are none."""
    key = keyword.lower().replace("_", "-")
    formatter = parser._get_formatter()
    groups = _help_groups(parser)
    if key in groups:
        title, actions = groups[key]
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
        return formatter.format_help()
    matched = [a for a in parser._actions if any(key in option.lower() for option in a.option_strings)]
    if not matched:
        return (f"No group or flags matching {keyword!r}. Use --help to see the groups, or --help=all to see every "
                "flag.\n")
    formatter.start_section(f"flags matching {keyword!r}")
    formatter.add_arguments(matched)
    formatter.end_section()
    return formatter.format_help()


def _help_groups(parser: argparse.ArgumentParser) -> dict[str, tuple[str, list[argparse.Action]]]:
    """Lower-case name -> (title, flags): each group by its title and by its title's first words (before a colon
    or parenthesis), then vLLM's config groups of the engine flags and its Frontend group (the rest of `serve`'s)."""
    groups: dict[str, tuple[str, list[argparse.Action]]] = {}
    for group in parser._action_groups:
        if not group.title or not group._group_actions:
            continue
        short = group.title.split(":")[0].split(" (")[0].strip()
        for name in (group.title, short):
            groups.setdefault(name.lower().replace("_", "-"), (group.title, list(group._group_actions)))
    engine = _engine_groups(parser)
    for name, actions in engine.items():
        groups.setdefault(name.lower(), (name, actions))
    if parser.prog.endswith(" serve"):
        engine_actions = {id(a) for actions in engine.values() for a in actions}
        frontend = [a for a in parser._actions if a.option_strings and id(a) not in engine_actions
                    and not isinstance(a, SearchableHelp) and a.dest != argparse.SUPPRESS]
        groups.setdefault(FRONTEND, ("Frontend", frontend))
    return groups


def _engine_groups(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """vLLM's config group name -> the parser's engine flags in it."""
    from pressroom.config import EngineArgs
    by_dest = {a.dest: a for a in parser._actions}
    groups: dict[str, list[argparse.Action]] = {}
    for f in fields(EngineArgs):
        if f.name not in by_dest:
            continue
        sets = f.metadata.get("sets")
        name = VLLM_GROUPS.get(f.name) or (sets[0].__name__ if sets else "EngineArgs")
        groups.setdefault(name, []).append(by_dest[f.name])
    return groups
