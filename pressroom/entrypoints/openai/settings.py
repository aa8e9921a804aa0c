"""The server's settings: one frozen object, built once from `pressroom serve`'s flags (whose defaults are
read from here) and handed to build_app and run_server. Light to import: the CLI reads it at start-up."""
from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pressroom.config import json_object, limits_of
from pressroom.engine.sampling_defaults import GENERATION_CONFIG_AUTO, check_generation_config
from pressroom.entrypoints.openai.limits import AdmissionLimits
from pressroom.entrypoints.openai.lora import LoRAModule
from pressroom.entrypoints.openai.tls import TLSSettings
from pressroom.multimodal.media import MediaPolicy

# auto: think for a model whose template or vocabulary has the markers; the deepseek ones: openai/reasoning.py
REASONING_PARSERS = ("auto", "think", "deepseek_r1", "deepseek_v3", "deepseek_v4", "qwen3", "mimo", "granite",
                     "openai_gptoss", "gpt_oss", "none")
# The Host names a server bound to loopback answers to by default (with any port): a page on another name that
# resolves to 127.0.0.1 (DNS rebinding) is refused.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
ANY = "*"  # in allowed origins or hosts: every one


def host_name(authority: str) -> str:
    """A Host header's (or an --allowed-hosts entry's) name without its port, lower case, as Host writes it:
    `LocalHost:8000` -> `localhost`, `[::1]:8000` and `::1` -> `[::1]`."""
    name = authority.strip().lower()
    if name.startswith("["):
        return name[:name.find("]") + 1] or name
    if name.count(":") > 1:  # a bare IPv6 address (an entry; a Host header brackets it)
        return f"[{name}]"
    return name.partition(":")[0].removesuffix(".")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    served_model_name: tuple[str, ...] = ()  # the names clients use, the first reported (none: the model's)
    lora_modules: tuple[LoRAModule, ...] = ()  # --lora-modules: adapters served by name (needs --enable-lora)
    host: str = "127.0.0.1"
    port: int = 8000
    tls: TLSSettings | None = None  # --ssl-certfile and the other --ssl-* flags: HTTPS (None: plain HTTP)
    # --root-path: the path prefix a proxy serves the app under (FastAPI's root_path, as vLLM sets it); requests
    # are answered with it or without it (a proxy that strips it)
    root_path: str = ""
    # `Authorization: Bearer KEY` with any one of them on every route but /health and the chat page (none: no key)
    api_keys: tuple[str, ...] = ()
    metrics_auth: bool = True  # /metrics needs the API key too (when one is set)
    tokenizer_info: bool = False  # GET /tokenizer_info is served (--enable-tokenizer-info-endpoint)
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)
    server_load_tracking: bool = False  # GET /load counts the model's requests in flight (else 0, as vLLM's)
    force_include_usage: bool = False  # every stream ends with a usage chunk (--enable-force-include-usage)
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>" unless a request says otherwise
    max_request_bytes: int = 8 << 20  # larger bodies get a 413
    # seconds a client has to send a request's whole body (a 408 after), and a new connection its first request's
    # headers (closed after); 0: no limit
    body_read_timeout: float = 30.0
    max_concurrent_requests: int = 512  # twice the CPU's max_num_seqs: a queue, but a bounded one (0: no limit)
    trust_request_chat_template: bool = False
    chat_template: str | None = None  # --chat-template, read: the template in place of the tokenizer's
    default_chat_template_kwargs: dict | None = None  # template variables every request has unless it sets them
    shutdown_timeout: float = 10.0  # seconds in-flight requests get on SIGTERM before the server ends them
    # /health turns 503 after this many seconds without a word from the engine core (0: only its death does).
    # Longer than any one engine step (a long prompt's prefill on the CPU takes seconds); the idle core's
    # heartbeat comes every second.
    engine_stall_timeout: float = 60.0
    reasoning_parser: str = "auto"  # one of REASONING_PARSERS (reasoning.make_parser checks it)
    reasoning_start: str = "<think>"
    reasoning_end: str = "</think>"
    # tool_choice "auto" (the default with tools) lets the model call tools; the parser reads its calls
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    log_requests: bool = False  # a line per finished engine request (vLLM's --enable-log-requests: off by default)
    access_log: bool = True  # pressroom.access's line per HTTP request (ids, tokens, timing)
    log_stats_interval: float = 10.0  # seconds between periodic stats lines (0: none)
    uvicorn_log_level: str = "warning"
    uvicorn_access_log: bool = True
    admission_limits: AdmissionLimits = field(default_factory=AdmissionLimits)  # what one request may cost
    # requests' default sampling parameters (sampling_defaults.py): the model's generation_config.json (auto),
    # none (vllm) or a folder's; and values over them (generation_config.json's names)
    generation_config: str = GENERATION_CONFIG_AUTO
    override_generation_config: dict | None = None
    # Browsers. CORS, as vLLM's flags: the origins besides the server's own that may call it ("*": any). vLLM allows
    # any; none here, so that a page on another site cannot drive a server that has no API key (the default).
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = (ANY,)
    allowed_headers: tuple[str, ...] = (ANY,)
    allow_credentials: bool = False
    # Host names answered (any port; "*": any); None: LOOPBACK_HOSTS and the address itself when bound to loopback,
    # any otherwise
    allowed_hosts: tuple[str, ...] | None = None
    # media in chat requests (multimodal/media.py): where they may come from, the limits on each, how many a prompt
    # may hold (--allowed-media-domains, --allowed-local-media-path, --limit-mm-per-prompt, --media-fetch-timeout)
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json).")
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if origin != ANY and not (parts.scheme and parts.netloc and origin == f"{parts.scheme}://{parts.netloc}"):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path; "
                                 'or "*").')
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path {self.root_path!r}: a path that starts with / and does not end with one, "
                             "e.g. /llm")
        check_generation_config(self.generation_config)

    def host_names(self) -> frozenset[str] | None:
        """The Host header names the server answers to (`host_name` form), or None for any."""
        if self.allowed_hosts is None:
            return frozenset(LOOPBACK_HOSTS + (host_name(self.host),)) if _is_loopback(self.host) else None
        return None if ANY in self.allowed_hosts else frozenset(map(host_name, self.allowed_hosts))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        """From `pressroom serve`'s flags; the model as given (MODEL or --model) names it unless
        --served-model-name does."""
        model = args.model_tag or args.model
        return cls(served_model_name=tuple(args.served_model_name or ([model] if model else [])),
                   lora_modules=tuple(LoRAModule.parse(text) for text in getattr(args, "lora_modules", None) or ()),
                   host=args.host, port=args.port, api_keys=api_keys_of(args.api_key),
                   tls=TLSSettings.from_flags(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs,
                                              args.ssl_cert_reqs, args.ssl_ciphers, args.enable_ssl_refresh),
                   root_path=(args.root_path or "").rstrip("/"),  # "/llm/" is "/llm", "/" none
                   metrics_auth=not args.disable_metrics_auth, tokenizer_info=args.enable_tokenizer_info_endpoint,
                   prompt_tokens_details=args.enable_prompt_tokens_details,
                   server_load_tracking=args.enable_server_load_tracking,
                   force_include_usage=args.enable_force_include_usage,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   max_request_bytes=args.max_request_bytes, body_read_timeout=args.body_read_timeout,
                   max_concurrent_requests=args.max_concurrent_requests,
                   trust_request_chat_template=args.trust_request_chat_template,
                   chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
                   default_chat_template_kwargs=json_object(args.default_chat_template_kwargs,
                                                            "--default-chat-template-kwargs")
                   if args.default_chat_template_kwargs else None,
                   shutdown_timeout=args.shutdown_timeout, engine_stall_timeout=args.engine_stall_timeout,
                   reasoning_parser=args.reasoning_parser,
                   reasoning_start=args.reasoning_start_str, reasoning_end=args.reasoning_end_str,
                   enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                   log_requests=args.enable_log_requests and not args.disable_log_requests,
                   access_log=not args.disable_log_requests,
                   log_stats_interval=0 if args.disable_log_stats else args.log_stats_interval,
                   uvicorn_log_level=args.uvicorn_log_level, uvicorn_access_log=not args.disable_uvicorn_access_log,
                   allowed_origins=args.allowed_origins or (), allowed_methods=args.allowed_methods,
                   allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                   allowed_hosts=args.allowed_hosts, admission_limits=AdmissionLimits.from_args(args),
                   generation_config=args.generation_config,
                   override_generation_config=json_object(args.override_generation_config,
                                                          "--override-generation-config")
                   if args.override_generation_config else None,
                   media_policy=media_policy_of(args))


def media_policy_of(args: argparse.Namespace) -> MediaPolicy:
    """The media flags of `pressroom serve` as a MediaPolicy (a ValueError naming the flag for a bad value)."""
    limits = args.limit_mm_per_prompt
    return MediaPolicy(allowed_media_domains=tuple(args.allowed_media_domains or ()),
                       allowed_local_media_path=args.allowed_local_media_path or "",
                       fetch_timeout=args.media_fetch_timeout,
                       limit_per_prompt=limits_of(limits) if limits else {})


def api_keys_of(flag: list[str] | None) -> tuple[str, ...]:
    """--api-key's keys (several: any one is accepted), else VLLM_API_KEY's, as vLLM reads them."""
    if flag:
        return tuple(flag)
    env = os.environ.get("VLLM_API_KEY")
    return (env,) if env else ()


def read_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's contents, or the template itself when it has template syntax
    (a brace or a line break); a ValueError for a path that does not exist."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a template.")


def _is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only (0.0.0.0, "" and other addresses: not)."""
    if host_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost
        return False
