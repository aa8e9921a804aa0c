"""`pressroom generate | chat | serve | train-drafter | make-prompts | bench`: every engine argument is a
flag with vLLM's spelling, derived from its `EngineArgs` field; every flag's help shows its default and choices."""
from __future__ import annotations

import time

STARTED = time.monotonic()  # before the heavy imports: `pressroom serve` reports time to ready from here

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import ssl  # noqa: E402
import sys  # noqa: E402
from dataclasses import fields  # noqa: E402
from typing import Any, get_args, get_type_hints  # noqa: E402

import pressroom  # noqa: E402
from pressroom.config import OPTIMIZATION_LEVELS, EngineArgs, default_of  # noqa: E402
from pressroom.entrypoints.cli_argv import SearchableHelp, VLLMArgvParser  # noqa: E402
from pressroom.entrypoints.openai.limits import add_limit_args  # noqa: E402
from pressroom.entrypoints.openai.settings import REASONING_PARSERS, ServerSettings  # noqa: E402
from pressroom.logger import DATE_FORMAT, FORMAT, configure_logging  # noqa: E402
from pressroom.multimodal.media import MediaPolicy  # noqa: E402

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# entrypoints/openai/tool_parsers' registry (not imported: start-up)
TOOL_CALL_PARSERS = ("deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "granite", "hermes", "internlm",
                     "jamba", "kimi_k2", "llama3_json", "mistral", "openai", "pythonic", "qwen3_coder")
SECRET_ARGS = frozenset({"api_key"})  # masked in the start-up line of non-default arguments

logger = logging.getLogger("pressroom")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default; a None default is left out (the help says what it means)
    and a list is shown comma-separated, as it is typed."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        # "%(default)" already there: BooleanOptionalAction appends its own (Python < 3.13)
        if action.default is None or action.default is argparse.SUPPRESS or "%(default)" in help_text:
            return help_text
        return f"{help_text} (default: {_default_text(action.default)})".strip()


def _default_text(default: Any) -> str:
    """A default as help shows it: %-escaped (help strings are %-formatted), lists comma-separated."""
    text = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
    return text.replace("%", "%%")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field, all from the field: name, type (its annotation, or a size for vLLM's size
    flags), default, help, choices."""
    group = parser.add_argument_group("engine arguments (EngineArgs)")
    hints = get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        flags = ("--" + f.name.replace("_", "-"), *SHORT_FLAGS.get(f.name, ()))
        kind = _flag_type(hints[f.name])
        text = f.metadata["help"].replace("%", "%%")  # argparse formats help with %: a "25%" would break --help
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        elif f.name in SIZE_FLAGS:
            parse = SIZE_FLAGS[f.name]
            group.add_argument(*flags, type=parse, default=f.default, help=text + _size_help(parse))
        else:
            group.add_argument(*flags, type=VALUE_TYPES.get(f.name, kind), default=f.default,
                               choices=f.metadata["choices"], help=text)


# vLLM's short forms (-O also takes its level attached: -O0, -O3)
SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",), "enable_expert_parallel": ("-ep",),
               "quantization": ("-q",), "optimization_level": ("-O",)}


def optimization_level(value: str) -> int:
    """vLLM's -O levels, checked as the flag is read."""
    try:
        level = int(value)
    except ValueError:
        level = None
    if level not in OPTIMIZATION_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a level: {', '.join(map(str, OPTIMIZATION_LEVELS))}")
    return level


VALUE_TYPES = {"optimization_level": optimization_level}  # flags whose values are checked as they are read


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def size(value: str) -> int:
    """An integer as vLLM's size flags read it: a lowercase suffix multiplies by a power of 1000 (25.6k = 25600),
    an uppercase one by a power of 1024 and takes a whole number only (32K = 32768)."""
    text = value.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer or a size such as 4k or 32K") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: a binary suffix ({suffix}) takes a whole number; "
                                         f"{number}{suffix.lower()} is a decimal one")
    return int(number) * _BINARY_SUFFIXES[suffix]


def size_or_auto(value: str) -> int | None:
    """`size`, or None (the engine's own choice) for vLLM's "auto" and -1."""
    return None if value.strip().lower() in ("auto", "-1") else size(value)


# vLLM's flags that read sizes, among those pressroom has
SIZE_FLAGS = {"max_model_len": size_or_auto, "max_num_batched_tokens": size, "kv_cache_memory_bytes": size}


def _size_help(parse: Any) -> str:
    auto = "; auto or -1: the default" if parse is size_or_auto else ""
    return f"; a size: 4k = 4000, 4K = 4096 (k, m, g, t: powers of 1000; K, M, G, T: of 1024){auto}"


def _flag_type(hint: Any) -> type:
    """What a flag's value parses to: the annotation's one type besides None, or str where str is among
    several (a JSON string standing for a dict, as --speculative-config)."""
    members = [t for t in get_args(hint) or (hint,) if t is not type(None)]
    if str in members:
        return str
    (kind,) = members
    return kind


def engine_kwargs(ns: argparse.Namespace) -> dict:
    return {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (the SamplingParams of every prompt)")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt at most")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="sample among the most likely tokens whose probabilities sum to this, in (0, 1]")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    group.add_argument("--request-seed", type=int, default=None,
                       help="SamplingParams.seed: each prompt's draws keyed by this seed and the output position, "
                            "so they do not depend on batching (default: unseeded, drawn from the engine's "
                            "generator, which --seed seeds)")


def _subparser(sub: argparse._SubParsersAction, name: str, summary: str,
               usage: str | None = "%(prog)s [options]") -> argparse.ArgumentParser:
    """A subcommand whose --help shows every flag's default, under a short usage line (not ~40 flags), and whose
    --help=all, --help=GROUP, --help=WORD show all, a group's, or the matching flags (vLLM's);
    usage None: argparse's own (a parent's usage becomes its subcommands' prog)."""
    parser = sub.add_parser(name, help=summary, description=summary, usage=usage, formatter_class=HelpFormatter,
                            add_help=False)
    parser.add_argument("-h", "--help", action=SearchableHelp)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = VLLMArgvParser(prog="pressroom", description="An LLM inference and serving engine.",
                            formatter_class=HelpFormatter)
    parser.add_argument("--log-level", type=str.upper, default=None, choices=LOG_LEVELS,
                        help="pressroom's log level (start-up lines and periodic stats are INFO; default: "
                             "PRESSROOM_LOGGING_LEVEL, else VLLM_LOGGING_LEVEL, else INFO)")
    # default None: a version action's own default (argparse's SUPPRESS) would read as a value in --help's checks
    parser.add_argument("--version", action="version", version=pressroom.__version__, default=None,
                        help="print pressroom's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)

    gen = _subparser(sub, "generate", "generate completions for prompts", "%(prog)s PROMPT [PROMPT ...] [options]")
    gen.add_argument("prompts", nargs="+", help="prompts, completed one by one in the output")
    _sampling_args(gen)
    add_engine_args(gen)

    chat = _subparser(sub, "chat", "interactive chat in the terminal, streaming tokens")
    chat.add_argument("--system", default=None, help="system message (default: none)")
    _sampling_args(chat)
    chat.set_defaults(max_tokens=512, temperature=0.7)
    add_engine_args(chat)

    _add_serve_args(_subparser(sub, "serve", "an OpenAI-compatible HTTP server", "%(prog)s [MODEL] [options]"))
    from pressroom.entrypoints.router import add_router_args
    add_router_args(_subparser(sub, "router", "an OpenAI-compatible front for disaggregated prefill and decode "
                                              "engines", "%(prog)s --prefill URL --decode URL [options]"))
    _add_train_drafter_args(_subparser(sub, "train-drafter",
                                       "distil a drafter (DFlash2 or DSpark) from the target's own greedy generations"))

    _add_make_prompts_args(_subparser(sub, "make-prompts",
                                      "training prompts for a drafter, written by the target model itself"))

    _add_bench_commands(_subparser(sub, "bench", "benchmarks with vLLM's bench semantics", usage=None))
    return parser


def _add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """`pressroom bench`'s subcommands, each module adding its own flags (imported only here: start-up)."""
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=argparse.ArgumentParser)
    _add_bench_run_args(_subparser(bench_sub, "throughput", "offline throughput: every prompt submitted at once"),
                        input_len=128)
    _add_bench_run_args(_subparser(bench_sub, "latency", "the latency of one batch, end to end"), input_len=32)
    from pressroom.benchmarks.serve import add_cli_args as add_serve_bench_args
    add_serve_bench_args(_subparser(bench_sub, "serve", "load an OpenAI-compatible server over HTTP "
                                                        "(vLLM's bench serve)"))
    from pressroom.benchmarks.gpu import add_gpu_bench_args
    add_gpu_bench_args(_subparser(bench_sub, "gpu", "pressroom vs HF transformers vs the GPU's copy and matmul "
                                                    "ceilings, dummy weights at a real model's shapes"))
    from pressroom.benchmarks.spec import add_spec_bench_args
    add_spec_bench_args(_subparser(bench_sub, "spec", "adaptive speculative budget vs no speculation vs fixed K "
                                                      "at several concurrencies (draft model, synthetic acceptance)"))
    from pressroom.benchmarks.offload import add_offload_bench_args
    add_offload_bench_args(_subparser(bench_sub, "offload", "tiered KV offload: no offload vs the CPU tier vs CPU + "
                                                            "disk on a shared-document workload"))
    from pressroom.benchmarks.context import add_context_bench_args
    add_context_bench_args(_subparser(bench_sub, "context", "decode step time against context length (and batch), "
                                                            "linear-attention vs full-attention models, dummy weights"))
    from pressroom.benchmarks.sparse import add_sparse_bench_args
    add_sparse_bench_args(_subparser(bench_sub, "sparse-attention", "DeepSeek sparse attention vs dense MLA: "
                                                                    "decode attention time against context length"))
    from pressroom.benchmarks.embed import add_embed_bench_args
    add_embed_bench_args(_subparser(bench_sub, "embed", "embeddings throughput: pressroom vs sentence-transformers "
                                                        "on the same texts and CPU"))
    from pressroom.benchmarks.structured import add_structured_bench_args
    add_structured_bench_args(_subparser(bench_sub, "structured", "structured outputs vs unconstrained output tok/s "
                                                                  "through one server (a fixed JSON schema)"))
    from pressroom.benchmarks.disagg import add_disagg_bench_args
    add_disagg_bench_args(_subparser(bench_sub, "disagg", "disaggregated prefill/decode (prefill + decode engines "
                                                          "and the router) vs one engine: streams' ITL under long "
                                                          "prompts"))


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    server = serve.add_argument_group("server")
    _add_server_args(server)
    _add_server_chat_args(server)
    _add_tls_args(serve.add_argument_group("https: uvicorn's TLS on the server's socket"))
    _add_generation_args(serve.add_argument_group("generation defaults: what a request that leaves a sampling "
                                                  "parameter out gets"))
    _add_browser_args(serve.add_argument_group("browsers (a list: JSON, as vLLM takes it, or comma-separated)"))
    _add_media_args(serve.add_argument_group("media in chat requests: image_url, input_audio, audio_url and "
                                             "video_url parts (each refusal a 400 naming its limit)"))
    add_limit_args(serve.add_argument_group("admission limits: what one request may cost (docs/LIMITS.md); "
                                            "over one, a 400 naming the field"))
    _add_log_args(serve.add_argument_group("logging"))
    add_engine_args(serve)
    add_refused_args(serve)


def _add_server_args(server: argparse._ArgumentGroup) -> None:
    server.add_argument("--host", default=_server_default("host"), help="address to listen on")
    server.add_argument("--port", type=int, default=_server_default("port"), help="port to listen on")
    server.add_argument("--root-path", default=None,
                        help="the path prefix a proxy serves the API under, e.g. /llm (FastAPI's root_path, as vLLM "
                             "sets it): requests are answered with the prefix or without it (a proxy that strips "
                             "it), and /docs' schema names it")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="names clients use; the first is reported (default: the model)")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help='with --enable-lora: adapters served by name, each name=path or JSON {"name": ..., '
                             '"path": ..., "base_model_name": ...}')
    server.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` (any of several keys) on every route but /health "
                             "(default: VLLM_API_KEY's, else no key)")
    server.add_argument("--disable-metrics-auth", action="store_true",
                        help="let /metrics answer without the API key (for scrapers that cannot send one)")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens in responses: the prompt's tokens read from "
                             "the prefix cache (vLLM's)")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help="GET /load reports the requests in flight on the model's routes (vLLM's; without it, 0)")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream ends with a usage chunk, as if stream_options.include_usage were set "
                             "(vLLM's)")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='logprobs write each token as "token_id:<id>" (a request\'s return_tokens_as_token_ids '
                             "decides for itself; vLLM's)")
    server.add_argument("--max-request-bytes", type=int, default=_server_default("max_request_bytes"),
                        help="larger bodies get a 413")
    server.add_argument("--body-read-timeout", type=float, default=_server_default("body_read_timeout"),
                        help="seconds a client has to send a request's whole body (a 408 after), and a new "
                        "connection its first request's headers (closed after); 0: no limit")
    server.add_argument("--max-concurrent-requests", type=int, default=_server_default("max_concurrent_requests"),
                        help="generation requests in flight beyond this get a 429 with Retry-After (0: no limit)")


def _add_server_chat_args(server: argparse._ArgumentGroup) -> None:
    """The server's chat handling: templates, reasoning spans and tool calls."""
    server.add_argument("--chat-template", default=None,
                        help="a chat template (a file, or the template itself) in place of the tokenizer's")
    server.add_argument("--default-chat-template-kwargs", default=None,
                        help='template variables every request has unless it sets them, a JSON object, e.g. '
                             '{"enable_thinking": false}')
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a `chat_template` in chat and tokenize requests (rendered sandboxed, with "
                             "time and size limits, either way)")
    server.add_argument("--shutdown-timeout", type=float, default=_server_default("shutdown_timeout"),
                        help="seconds to let in-flight requests finish on SIGTERM; those still running then are "
                             "ended with an error (a stream: a finish_reason \"abort\" chunk, an error event and "
                             "[DONE]; otherwise a 503)")
    server.add_argument("--engine-stall-timeout", type=float, default=_server_default("engine_stall_timeout"),
                        help="/health answers 503 when the engine core has sent nothing (step outputs, or its "
                             "heartbeat every second when idle) for this many seconds: its loop is stuck. Keep it "
                             "above the longest engine step (a long prefill on a CPU takes seconds); 0: never")
    server.add_argument("--reasoning-parser", default=_server_default("reasoning_parser"), choices=REASONING_PARSERS,
                        help="split <think>...</think> into message.reasoning (auto: when the model's chat "
                             "template or vocabulary has the markers; deepseek_r1: the output starts inside the "
                             "reasoning; deepseek_v3 / deepseek_v4: the prompt's end says whether thinking is on)")
    server.add_argument("--reasoning-start-str", default=_server_default("reasoning_start"),
                        help="the reasoning span's start marker")
    server.add_argument("--reasoning-end-str", default=_server_default("reasoning_end"),
                        help="the reasoning span's end marker")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide to call tools (tool_choice "auto", the default with tools); '
                             "needs --tool-call-parser")
    server.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="how tool calls are written in the model's output: hermes (<tool_call>{json}"
                             "</tool_call>, Qwen, SmolLM2) or llama3_json (Llama 3.x's JSON calls)")


def _add_tls_args(tls: argparse._ArgumentGroup) -> None:
    tls.add_argument("--ssl-certfile", default=None,
                     help="serve HTTPS with this certificate (PEM; the chain after it), not HTTP")
    tls.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM; default: in the "
                                                         "certificate's file)")
    tls.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates are checked "
                                                          "against (PEM)")
    tls.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                     help="client certificates, as Python's ssl.VerifyMode: 0 none, 1 optional, 2 required")
    tls.add_argument("--ssl-ciphers", default=None, help="OpenSSL cipher list for TLS 1.2 and below (default: "
                                                         "OpenSSL's)")
    tls.add_argument("--enable-ssl-refresh", action="store_true",
                     help="reload the key and certificates when their files change (new connections get them)")


def _add_generation_args(generation: argparse._ArgumentGroup) -> None:
    generation.add_argument("--generation-config", default=_server_default("generation_config"),
                            help="default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty; "
                                 "max_new_tokens as max_tokens) from a generation_config.json: auto, the model's; "
                                 "vllm, none (the API's own defaults); or a folder's, whose max_new_tokens also caps "
                                 "every request's max_tokens")
    generation.add_argument("--override-generation-config", default=None, metavar="JSON",
                            help='values over the generation config\'s, a JSON object in its names, e.g. '
                                 '\'{"temperature": 0.5}\'; a max_new_tokens caps every request\'s max_tokens')


def _add_media_args(media: argparse._ArgumentGroup) -> None:
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="DOMAIN",
                       help="host names http(s) media URLs (and their redirects) may come from; \"*\": any "
                            "(default: none, no http(s) media; vLLM's: any)")
    media.add_argument("--allowed-local-media-path", default="", metavar="FOLDER",
                       help="the folder file:// media URLs may read under (default: none, no file:// media)")
    media.add_argument("--media-fetch-timeout", type=float, default=_media_default("fetch_timeout"),
                       metavar="SECONDS", help="seconds an http(s) media fetch may take in all, redirects included "
                                               "(vLLM's VLLM_IMAGE_FETCH_TIMEOUT)")


def _media_default(name: str) -> Any:
    return default_of(MediaPolicy, name)


def _add_browser_args(browsers: argparse._ArgumentGroup) -> None:
    browsers.add_argument("--allowed-origins", type=_string_list, default=None,
                          help='origins besides the server\'s own whose pages may call it (CORS), e.g. '
                               '\'["http://a.example"]\'; "*": any. Others get no CORS headers, and a 403 for a '
                               "POST, PUT or DELETE (default: none, the server's own only; vLLM's: any)")
    browsers.add_argument("--allowed-methods", type=_string_list, default=_server_default("allowed_methods"),
                          help="methods allowed origins may use (CORS)")
    browsers.add_argument("--allowed-headers", type=_string_list, default=_server_default("allowed_headers"),
                          help="request headers allowed origins may send (CORS)")
    browsers.add_argument("--allow-credentials", action="store_true",
                          help="let allowed origins send cookies and HTTP authentication (CORS)")
    browsers.add_argument("--allowed-hosts", type=_string_list, default=None,
                          help="Host header names answered, any port (\"*\": any; others get a 400), against DNS "
                               "rebinding (default: localhost, 127.0.0.1 and [::1] when --host is a loopback "
                               "address, any otherwise)")


def _add_log_args(logs: argparse._ArgumentGroup) -> None:
    logs.add_argument("--enable-log-requests", action="store_true",
                      help="an INFO line per finished request (ids, tokens, queue time, TTFT, end to end), as vLLM's")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="no line per request at all, the access line per HTTP request included (vLLM's older name)")
    logs.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    logs.add_argument("--log-stats-interval", type=float, default=_server_default("log_stats_interval"),
                      help="seconds between periodic stats log lines (0: none)")
    logs.add_argument("--uvicorn-log-level", default=_server_default("uvicorn_log_level"), choices=UVICORN_LOG_LEVELS,
                      help="uvicorn's own log level")
    logs.add_argument("--disable-uvicorn-access-log", action="store_true", help="no uvicorn access log")


class RefusedFlag(argparse.Action):
    """A vLLM flag pressroom cannot honour: given, it is an error that names it and says why; given with a value in
    `honoured` (a switch: the spelling used), it is accepted, being what pressroom does anyway."""

    def __init__(self, option_strings: list[str], dest: str, reason: str, honoured: tuple[str, ...] = (),
                 **kwargs: Any) -> None:
        accepted = f" (accepted: {', '.join(honoured)})" if honoured else ""
        super().__init__(option_strings, dest, default=None, help=(reason + accepted).replace("%", "%%"), **kwargs)
        self.reason, self.honoured = reason, honoured

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = option_string if self.nargs == 0 else values
        if given not in self.honoured:
            raise argparse.ArgumentError(self, f"refused: {self.reason}")


_HUB = "pressroom runs no code from a model's repository (only its own model code)"
_MULTINODE = "pressroom runs on one node behind one API server"
_MULTIMODAL = "pressroom serves text models only: no image, audio or video inputs"
_PLUGINS = "parsers are built in (--tool-call-parser, --reasoning-parser): plug-ins are not loaded"
_CLASSES = "pressroom's scheduler and workers cannot be replaced by a class"
_COMPILE = ("pressroom compiles nothing with torch.compile: CUDA graphs follow -O, --enforce-eager and "
            "--max-cudagraph-capture-size")
_TRACES = "OpenTelemetry tracing is not implemented"
# vLLM 0.32's `vllm serve` flags that pressroom cannot honour yet: option strings -> (reason, values accepted:
# the ones that ask for what pressroom does anyway; a switch is accepted only in a spelling listed).
# A flag pressroom has (a field of EngineArgs, a server flag) is never refused: add_refused_args skips it.
REFUSED_FLAGS: dict[tuple[str, ...], tuple[str, tuple[str, ...]]] = {
    ("--pipeline-parallel-size", "-pp"): ("pipeline parallelism is not implemented: split a model with "
                                          "--tensor-parallel-size (-tp), replicate it with --data-parallel-size "
                                          "(-dp)", ("1",)),
    ("--decode-context-parallel-size", "-dcp"): ("context parallelism is not implemented", ("1",)),
    ("--prefill-context-parallel-size", "-pcp"): ("context parallelism is not implemented", ("1",)),
    ("--nnodes", "-n"): (_MULTINODE + " (a Ray cluster may host tensor-parallel ranks: --distributed-executor-"
                                      "backend ray)", ("1",)),
    ("--node-rank", "-r"): (_MULTINODE, ("0",)),
    ("--headless",): (_MULTINODE, ()),
    ("--api-server-count", "-asc"): (_MULTINODE, ("1",)),
    ("--data-parallel-size-local", "-dpl"): (_MULTINODE + ": every data-parallel core is local", ()),
    ("--data-parallel-address", "-dpa"): (_MULTINODE, ()),
    ("--data-parallel-rpc-port", "-dpp"): (_MULTINODE, ()),
    ("--data-parallel-start-rank", "-dpr"): (_MULTINODE, ()),
    ("--enable-eplb",): ("expert-parallel load balancing is not implemented", ()),
    ("--enable-chunked-prefill", "--no-enable-chunked-prefill"): (
        "pressroom always prefills long prompts in chunks (--max-num-batched-tokens, --long-prefill-token-"
        "threshold): it cannot be turned off", ("--enable-chunked-prefill",)),
    ("--code-revision",): (_HUB, ()),
    ("--hf-token",): ("set HF_TOKEN in the environment: huggingface_hub reads it", ()),
    ("--tokenizer-mode",): ("pressroom reads HF tokenizers (tokenizer.json) or a GGUF's own", ("auto", "hf")),
    ("--structured-outputs-config",): ("structured outputs run on xgrammar with fixed settings; the config is not "
                                       "read yet", ()),
    ("--mm-processor-kwargs",): (_MULTIMODAL, ()),
    ("--enable-prompt-embeds",): ("prompt embeddings as inputs are not supported", ()),
    ("--uds",): ("listening on a Unix domain socket is not supported yet: use --host and --port", ()),
    ("--middleware",): ("ASGI middleware is not loaded from the command line", ()),
    ("--tool-parser-plugin",): (_PLUGINS, ()),
    ("--reasoning-parser-plugin",): (_PLUGINS, ()),
    ("--tool-server",): ("built-in tool servers (MCP) are not supported", ()),
    ("--logits-processors",): ("custom logits processors are not loaded", ()),
    ("--compilation-config", "-cc"): (_COMPILE, ()),
    ("--cudagraph-capture-sizes",): ("pressroom captures its own ladder of batch sizes up to "
                                     "--max-cudagraph-capture-size", ()),
    ("--attention-backend",): ("pressroom picks its attention backend by device (Triton on CUDA, C kernels on "
                               "the CPU)", ()),
    ("--disable-sliding-window",): ("sliding-window layers always attend within their window", ()),
    ("--kv-events-config",): ("KV-cache events are not published", ()),
    ("--enable-scale-out",): ("the scale-out routes (render, derender, /inference/v1/generate) are not served: "
                              "they answer 403, as vLLM's do without this flag", ()),
    ("--tokens-only",): ("the tokens-in, tokens-out route (/inference/v1/generate) is not served", ()),
    ("--enable-elastic-ep",): ("elastic expert parallelism is not implemented: the data-parallel size is fixed at "
                               "start", ()),
    ("--scheduler-cls",): (_CLASSES, ()),
    ("--worker-cls",): (_CLASSES, ()),
    ("--worker-extension-cls",): (_CLASSES, ()),
    ("--otlp-traces-endpoint",): (_TRACES, ()),
    ("--collect-detailed-traces",): (_TRACES, ()),
    ("--spec-method",): ("give speculative decoding as --speculative-config (JSON)", ()),
    ("--spec-model",): ("give speculative decoding as --speculative-config (JSON)", ()),
    ("--spec-tokens",): ("give speculative decoding as --speculative-config (JSON)", ()),
}
_SWITCHES = {"--headless", "--enable-eplb", "--enable-chunked-prefill",
             "--enable-prompt-embeds",
             "--disable-sliding-window", "--enable-scale-out", "--tokens-only", "--enable-elastic-ep"}


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that pressroom cannot honour, each refused by name with its reason (listed in --help). A flag
    the parser already has is left to it: a flag pressroom learns to honour is never refused."""
    group = parser.add_argument_group("vLLM flags pressroom cannot honour yet: each is an error saying why, but at "
                                      "the values it lists as accepted (what pressroom does anyway)")
    for names, (reason, honoured) in REFUSED_FLAGS.items():
        if any(name in parser._option_string_actions for name in names):
            continue
        shape = {"nargs": 0} if names[0] in _SWITCHES else {"metavar": "VALUE"}
        group.add_argument(*names, action=RefusedFlag, dest=argparse.SUPPRESS, reason=reason, honoured=honoured,
                           **shape)


def _server_default(name: str) -> Any:
    return default_of(ServerSettings, name)


def _string_list(value: str) -> tuple[str, ...]:
    """A list flag's value: a JSON list of strings, as vLLM's CORS flags take it, or comma-separated words."""
    if not value.lstrip().startswith("["):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    try:
        items = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    if not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError('a JSON list of strings, e.g. \'["http://a.example"]\'')
    return tuple(items)


def _add_train_drafter_args(tr: argparse.ArgumentParser) -> None:
    data = tr.add_argument_group("data")
    data.add_argument("--dataset-path", required=True,
                      help="prompts: JSONL ({\"prompt\": ...}) or text, one per line")
    data.add_argument("--output", required=True, help="directory for the drafter (dflash2.json, model.safetensors)")
    data.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    data.add_argument("--num-prompts", type=int, default=256, help="prompts read from the dataset at most")
    data.add_argument("--max-tokens", type=int, default=128, help="generated tokens per prompt")
    data.add_argument("--held-out-path", default=None,
                      help="prompts for the acceptance report, never trained on (default: 10%% of the dataset's)")
    data.add_argument("--ignore-eos", action="store_true", help="generate past EOS (serving stops at it)")
    data.add_argument("--record-batch", type=int, default=32, help="prompts generated together while recording")
    drafter = tr.add_argument_group("drafter")
    drafter.add_argument("--method", default="dflash2", choices=["dflash2", "dspark"],
                         help="dflash2 (pressroom's block drafter and candidate selector) or dspark (DeepSpec's "
                              "layout: Markov and confidence heads; loads with method \"dspark\")")
    drafter.add_argument("--draft-block-size", type=int, default=8, help="K: tokens the drafter proposes per pass")
    drafter.add_argument("--target-layers", default=None,
                         help="comma-separated target layers whose hidden states the drafter reads (default: "
                              "three across the depth)")
    drafter.add_argument("--num-layers", type=int, default=1, help="the drafter's transformer layers")
    drafter.add_argument("--num-heads", type=int, default=8, help="the drafter's attention heads")
    drafter.add_argument("--rank", type=int, default=32, help="the selector's transition rank (dflash2)")
    drafter.add_argument("--markov-rank", type=int, default=32, help="the Markov head's rank (dspark; 0: none)")
    drafter.add_argument("--markov-head-type", default="gated", choices=["vanilla", "gated", "rnn"],
                         help="the Markov head's form (dspark)")
    drafter.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
                         help="dtype of the saved weights")
    training = tr.add_argument_group("training")
    training.add_argument("--steps", type=int, default=1000, help="optimizer steps for the drafter")
    training.add_argument("--batch-size", type=int, default=32, help="training examples per step")
    training.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (warm-up, cosine decay)")
    training.add_argument("--scorer-steps", type=int, default=None,
                          help="CRF steps for the selector, the drafter frozen (default: steps / 4)")
    training.add_argument("--validation-fraction", type=float, default=0.0,
                          help="training prompts kept aside to stop early on (0: train every step)")
    training.add_argument("--eval-every", type=int, default=250,
                          help="steps between validation measurements (with --validation-fraction)")
    training.add_argument("--patience", type=int, default=5,
                          help="validation measurements without a gain before a phase stops early")
    resume = tr.add_argument_group("resuming (a device call has a time limit)")
    resume.add_argument("--work-dir", default=None,
                        help="keeps the recorded continuations and training checkpoints; the same command "
                             "resumes from them")
    resume.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints")
    resume.add_argument("--time-limit", type=float, default=None,
                        help="seconds: past this, checkpoint and exit with 75 (needs --work-dir)")
    add_engine_args(tr)


def _add_make_prompts_args(mp: argparse.ArgumentParser) -> None:
    data = mp.add_argument_group("prompts")
    data.add_argument("--num-prompts", type=int, default=50000, help="distinct prompts to write")
    data.add_argument("--output", required=True, help="JSONL file: {\"prompt\": ...} or {\"messages\": [...]}")
    data.add_argument("--exclude", nargs="*", default=["benchmarks/data/chat_heldout.jsonl"],
                      help="held-out prompt files: no prompt written is one of them or shares 8 words in a row "
                           "(--seed picks the topics, wordings and samples)")
    data.add_argument("--batch", type=int, default=1024, help="requests written per round")
    data.add_argument("--max-tokens", type=int, default=96, help="tokens per written request")
    add_engine_args(mp)


def _peer_dtypes(value: str) -> str:
    bad = [d for d in value.split(",") if d.strip() not in ("float32", "bfloat16")]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)}: the vllm peer runs float32 or bfloat16")
    return value


def _add_bench_run_args(b: argparse.ArgumentParser, input_len: int) -> None:
    from pressroom.benchmarks.bench import BACKENDS
    b.add_argument("--backend", default="pressroom",
                   help=f"comma-separated, run back to back: {', '.join(BACKENDS)}")
    b.add_argument("--input-len", type=int, default=input_len,
                   help="prompt tokens (a dataset's prompts are cut to this)")
    b.add_argument("--output-len", type=int, default=128, help="output tokens per prompt")
    b.add_argument("--num-prompts", type=int, default=32, help="prompts (throughput; latency runs --batch-size)")
    b.add_argument("--batch-size", type=int, default=1, help="prompts in the timed batch (latency)")
    b.add_argument("--dataset-path", default=None,
                   help="JSONL ({\"prompt\": ...}) or text file, one per line (default: random prompts)")
    b.add_argument("--chat", action="store_true", help="send each dataset prompt as a user turn of the chat template")
    b.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    b.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs first")
    b.add_argument("--num-iters", type=int, default=3, help="timed runs (latency)")
    b.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"], help="the hf backend's dtype")
    b.add_argument("--peer-dtype", default="bfloat16", type=_peer_dtypes,
                   help="the vllm backend's dtype: float32, bfloat16, or both comma-separated (one run each)")
    b.add_argument("--num-loras", type=int, default=4, help="the pressroom-lora backend's random adapters")
    b.add_argument("--lora-rank", type=int, default=16, help="the pressroom-lora backend's adapters' rank")
    b.add_argument("--llamacpp-isa", default="avx2", choices=["avx2", "native"],
                   help="the llamacpp backend's build (benchmarks/llama_cpp/setup.sh with LLAMA_ISA=...)")
    b.add_argument("--output-json", default=None, help="write the report here too (default: print only)")
    add_engine_args(b)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=FORMAT, datefmt=DATE_FORMAT)  # other libraries: warnings only
    configure_logging(args.log_level)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            from pressroom.entrypoints.chat import run_chat
            return run_chat(args, engine_kwargs(args))
        if args.command == "serve":
            return _serve(args)
        if args.command == "router":
            from pressroom.entrypoints.router import run_router
            return run_router(args)
        if args.command == "train-drafter":
            from pressroom.training.train_cli import run_cli
            if args.time_limit and not args.work_dir:
                raise ValueError("--time-limit needs --work-dir, where the paused run is kept.")
            return run_cli(args, engine_kwargs(args))
        if args.command == "make-prompts":
            from pressroom.training.prompts import run_cli as make_prompts
            return make_prompts(args, engine_kwargs(args))
        if args.command == "bench":
            return _bench(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


# bench commands whose module's main(args) returns the exit status
_BENCH_MAINS = {"offload": "offload", "context": "context", "sparse-attention": "sparse", "embed": "embed",
                "disagg": "disagg"}


def _bench(args) -> int:
    """`pressroom bench ...`: each command's module, imported only when run."""
    import importlib
    name = args.bench_command
    if name in _BENCH_MAINS:
        return importlib.import_module(f"pressroom.benchmarks.{_BENCH_MAINS[name]}").main(args)
    if name == "gpu":
        from pressroom.benchmarks import gpu, vision
        (vision.run_image if gpu.IMAGE_WORKLOAD in args.workloads else gpu.run)(args)
        return 0
    if name == "spec":
        from pressroom.benchmarks import spec
        spec.run(args)
        return 0
    if name == "structured":
        from pressroom.benchmarks import structured
        structured.run(args)
        return 0
    if name == "serve":
        from pressroom.benchmarks import serve
        return 0 if serve.run(args)["completed"] else 1
    from pressroom.benchmarks import bench  # throughput, latency
    args.command = name
    bench.run(args, engine_kwargs(args))
    return 0


def _generate(args) -> int:
    from pressroom import LLM
    llm = LLM(**engine_kwargs(args))
    from pressroom.entrypoints.chat import sampling_params
    for out in llm.generate(args.prompts, sampling_params(args)):
        print(f"--- {out.prompt!r}\n{out.outputs[0].text}")
    return 0


def _serve(args) -> int:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"Two models given: {args.model_tag!r} and --model {args.model!r}; give one.")
    settings = ServerSettings.from_args(args)
    logger.info("pressroom server version %s, serving model %s", pressroom.__version__,
                args.model_tag or args.model or "(the embedded default)")
    logger.info("non-default args: %s", non_default_args(args))
    from pressroom.entrypoints.openai.server import run_server
    return run_server(settings, engine_kwargs(args) | {"model": args.model_tag or args.model}, STARTED)


def non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    """`pressroom serve`'s arguments that differ from their defaults, as vLLM logs them at start (secrets masked)."""
    defaults = vars(build_parser().parse_args(["serve"]))
    return {name: "***" if name in SECRET_ARGS else value for name, value in vars(args).items()
            if name not in defaults or defaults[name] != value}


if __name__ == "__main__":
    sys.exit(main())
