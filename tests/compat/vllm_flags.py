"""The 60 `vllm serve` flags a vLLM 0.32 deployment uses most, each with a value as vLLM's docs write it.

The first group is the flags issue 46 names; the rest are the engine, server, LoRA, parser and speculative
flags that vLLM's quickstart, deployment and feature pages put on their command lines. `{tmp}` stands for a
folder the test makes (config files, certificates). The slow suite checks that vLLM 0.32's own parser takes
every line here; the fast one that pressroom's CLI either honours each or refuses it by name.
"""
from __future__ import annotations

NAMED_IN_ISSUE_46: tuple[tuple[str, ...], ...] = (
    ("--chat-template", "{tmp}/template.jinja"),
    ("--default-chat-template-kwargs", '{"enable_thinking": false}'),
    ("--enable-log-requests",),
    ("--allowed-origins", '["https://example.com"]'),
    ("--allowed-methods", '["GET", "POST"]'),
    ("--allowed-headers", '["X-Team"]'),
    ("--allow-credentials",),
    ("--ssl-keyfile", "{tmp}/key.pem"),
    ("--ssl-certfile", "{tmp}/cert.pem"),
    ("--root-path", "/llm"),
    ("--config", "{tmp}/config.yaml"),
    ("--api-key", "key-one", "key-two"),
    ("--max-model-len", "4k"),
    ("-tp", "2"),
    ("-dp", "2"),
    ("-ep",),
    ("-q", "fp8"),
    ("-O", "3"),
    ("--kv-cache-memory-bytes", "1G"),
    ("--enable-chunked-prefill",),
    ("--generation-config", "vllm"),
    ("--structured-outputs-config", '{"backend": "xgrammar"}'),
)

COMMON: tuple[tuple[str, ...], ...] = (
    ("--host", "0.0.0.0"),
    ("--port", "8001"),
    ("--served-model-name", "chat", "chat-v2"),
    ("--dtype", "bfloat16"),
    ("--gpu-memory-utilization", "0.8"),
    ("--max-num-seqs", "64"),
    ("--max-num-batched-tokens", "8192"),
    ("--enforce-eager",),
    ("--trust-remote-code",),
    ("--tokenizer", "{tmp}"),
    ("--revision", "main"),
    ("--download-dir", "{tmp}/downloads"),
    ("--seed", "1"),
    ("--no-enable-prefix-caching",),
    ("--enable-lora",),
    ("--lora-modules", "sql={tmp}/sql-lora"),
    ("--max-lora-rank", "32"),
    ("--max-loras", "2"),
    ("--enable-auto-tool-choice",),
    ("--tool-call-parser", "hermes"),
    ("--reasoning-parser", "deepseek_r1"),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'),
    ("--kv-cache-dtype", "fp8"),
    ("--block-size", "32"),
    ("--pipeline-parallel-size", "2"),
    ("--distributed-executor-backend", "mp"),
    ("--disable-log-stats",),
    ("--uvicorn-log-level", "debug"),
    ("--max-logprobs", "10"),
    ("--tokenizer-mode", "mistral"),
    ("--load-format", "safetensors"),
    ("--hf-overrides", '{"max_position_embeddings": 4096}'),
    ("--limit-mm-per-prompt", '{"image": 2}'),
    ("--enable-sleep-mode",),
    ("--enable-prompt-tokens-details",),
    ("--override-generation-config", '{"temperature": 0.5}'),
    ("--quantization", "awq"),
    ("--compilation-config", '{"mode": 3}'),
)

FLAGS: tuple[tuple[str, ...], ...] = NAMED_IN_ISSUE_46 + COMMON

# Accepted at a value that asks for what pressroom always does, so nothing in the parsed arguments changes.
ACCEPTED_AS_ALREADY_DONE = {"--enable-chunked-prefill"}

# vLLM flags pressroom's CLI neither takes nor refuses by name yet (argparse's "unrecognized arguments"): issue 46
# item 2's gap, tracked here so that the fast test shows it; remove a flag from this set once the CLI handles it.
NOT_YET_HANDLED: set[str] = set()


def argv_of(flag: tuple[str, ...], tmp: str) -> list[str]:
    return [part.replace("{tmp}", tmp) for part in flag]
