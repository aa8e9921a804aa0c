"""Engine configuration: one flat `EngineArgs` (vLLM's names) resolved into validated sub-configs."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pressroom.platforms import cuda_available
from pressroom.platforms.cpu import cpu_info
from pressroom.pooling_params import PoolingParams

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# built-in names; plug-ins add theirs (check_quantization)
QUANTIZATIONS = ("auto", "none", "fp8", "mxfp4", "nvfp4", "gptq", "awq")
QUANTIZATION_ENTRY_POINTS = "pressroom.quantization"  # the entry-point group of installed quantization plug-ins
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --runner: generate (completions, chat) or pooling (embeddings, /pooling, /score, /rerank); auto: pooling
# for an encoder-only checkpoint (it cannot generate), generate otherwise. --task embed is the older spelling.
RUNNERS = ("auto", "generate", "pooling")
TASKS = ("auto", "generate", "embed")
ENCODER_MODEL_TYPES = ("bert",)  # bidirectional attention: a prompt is computed whole, in one step
DEVICES = ("auto", "cpu", "cuda")
MAX_CUDAGRAPH_CAPTURE_SIZE = 1024
OPTIMIZATION_LEVELS = (0, 1, 2, 3)  # vLLM's -O; 0 alone differs here: no CUDA graphs
VARLEN_GRAPH_MAX_TOKENS = 4096  # steps that verify more tokens at once are compute-bound: eager costs little more
# Patch counts a vision tower's CUDA graphs are captured at (worker/encoder_graphs.py), in steps of 512: a 1024x1024
# image is 5476 Qwen2.5-VL patches (5632's bucket, 2.8% padding; steps of 1024 past 3072 padded it to 6144, 12%, and
# the tower was ~3/4 of an image request's time on the H100), a 512x512 one 1296 (1536's); the largest bounds the
# graphs' memory (their full-attention blocks attend over the whole bucket: patches^2)
ENCODER_CUDAGRAPH_SIZES = tuple(range(1024, 8193, 512))


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}.")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA GPU; use device='cpu' or 'auto'.")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # bf16 halves the weight bytes each step streams, but only CPUs with AVX512-BF16/AMX multiply it
        # natively; elsewhere fp32 is faster (pressroom/platforms/cpu.py says why per tier).
        return torch.bfloat16 if device == "cuda" else cpu_info().default_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]


# vLLM's kv_cache_dtype names. FP8 entries are stored with a scale of 1 (vLLM's default without
# calibrated scales), saturated at the format's largest value.
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The KV cache's element type: the model's ("auto") or an FP8 format (CUDA only)."""
    if name == "auto":
        return model_dtype
    if name not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_KV_CACHE_DTYPES)}; got {name!r}.")
    if device != "cuda":
        raise ValueError(f"kv_cache_dtype {name!r} needs the CUDA backend (--device cuda); the CPU backend "
                         "stores the KV cache in the model's dtype (kv_cache_dtype auto).")
    return _KV_CACHE_DTYPES[name]


def check_quantization(name: str) -> None:
    """A built-in method, an installed plug-in's entry point, or `module.path:ClassName` (imported at load)."""
    if name in QUANTIZATIONS or ":" in name:
        return
    from importlib.metadata import entry_points
    plugins = sorted(ep.name for ep in entry_points(group=QUANTIZATION_ENTRY_POINTS))
    if name not in plugins:
        raise ValueError(f"quantization must be one of {', '.join([*QUANTIZATIONS, *plugins])} (an installed "
                         f"plug-in's name, entry point group {QUANTIZATION_ENTRY_POINTS!r}) or "
                         f"module.path:ClassName; got {name!r}.")


def limits_of(value: str | Mapping[str, Any]) -> dict[str, int]:
    """--limit-mm-per-prompt (LLM's limit_mm_per_prompt) as vLLM takes it: a JSON object of counts, '{"image": 2,
    "audio": 1}', or that mapping itself (a modality's value may also be vLLM's {"count": N, ...} form, of which the
    count is read)."""
    value = json_object(dict(value) if isinstance(value, Mapping) else value,
                        '--limit-mm-per-prompt (counts per modality, e.g. {"image": 2, "audio": 1})')
    out = {}
    for modality, limit in value.items():
        count = limit.get("count") if isinstance(limit, Mapping) else limit
        if not isinstance(modality, str) or isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality!r} needs a count of 0 or more, got {limit!r}")
        out[modality] = count
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    max_model_len: int | None = None
    seed: int = 0
    # auto: the checkpoint's own method, and on the CPU GGUF Q4 matrices and a Q8_0 LM head stay as shipped;
    # none: dequantize all; else a method's name (model/quantization/registry.py)
    quantization: str = "auto"
    skip_tokenizer_init: bool = False  # token ids in and out only (benchmarks of dummy-weight shapes)
    runner: str = "generate"  # generate or pooling (resolved: never auto)
    pooler: PoolingParams | None = None  # --pooler-config: overrides the model's pooling defaults
    encoder_only: bool = False  # a BERT-family checkpoint: pooling only, each prompt whole in one step
    batch_invariant: bool = False  # a request's tokens and logprobs whatever its batch (model/batch_invariant.py)
    hf_overrides: dict[str, Any] | None = None  # --hf-overrides: config.json values replaced at load
    # the most logprobs (sample or prompt) a request may ask for a position (vLLM's default; -1: the vocabulary)
    max_logprobs: int = 20
    cpu_offload_gb: float = 0  # GiB of decoder layers kept in host memory, streamed in (model/weight_offload.py)
    enable_sleep_mode: bool = False  # vLLM's: LLM.sleep / wake_up and the server's /sleep may free the engine's memory
    # media items one prompt may hold, per modality (--limit-mm-per-prompt); a modality not named: 999, vLLM's
    limit_mm_per_prompt: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be at least 0 (GiB of weights kept in host memory); got "
                             f"{self.cpu_offload_gb}.")
        if self.runner not in RUNNERS[1:]:
            raise ValueError(f"runner must be generate or pooling; got {self.runner!r}.")
        if self.encoder_only and self.runner != "pooling":
            raise ValueError("An encoder-only model (BERT family) cannot generate; serve it with --runner pooling "
                             "(or leave --runner at auto).")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}.")
        check_quantization(self.quantization)
        if self.batch_invariant and self.quantization not in ("auto", "none"):
            raise ValueError(f"--batch-invariant covers dense weights only; drop --quantization {self.quantization}.")
        if self.batch_invariant and self.runner == "pooling":
            raise ValueError("--batch-invariant covers generation only; drop it for --runner pooling.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary) or at least 0, got {self.max_logprobs}.")


CPU_KV_CACHE_GIB = 2  # the CPU's KV cache without --kv-cache-memory-gib or PRESSROOM_CPU_KVCACHE_SPACE


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # CPU: the KV cache's size. CUDA: None = what a memory profile leaves of gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = CPU_KV_CACHE_GIB << 30
    num_blocks: int | None = None  # overrides the memory budget (tests use it to force preemption)
    gpu_memory_utilization: float = 0.92
    cache_dtype: torch.dtype | None = None  # None: the model's dtype
    # Recurrent layers (Mamba, delta rule): tokens between prefix-cache checkpoints of a prompt's state, a multiple
    # of block_size. None: the block-size multiple at which a checkpoint takes about the attention layers' KV bytes
    # of its tokens (256 tokens for an attention-free model).
    mamba_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.mamba_block_size is not None and (self.mamba_block_size < self.block_size
                                                  or self.mamba_block_size % self.block_size):
            raise ValueError(f"mamba_block_size ({self.mamba_block_size}) must be a multiple of block_size "
                             f"({self.block_size}): a state checkpoint ends at a block boundary.")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_blocks}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}.")


@dataclass(frozen=True, slots=True, kw_only=True)
class CompilationConfig:
    """CUDA graphs: decode steps of up to `max_cudagraph_capture_size` requests replay a captured graph."""
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = 512
    # the Triton kernels earlier starts recorded compile in parallel processes at start (kernels/triton/precompile.py)
    precompile_kernels: bool = True
    # the vision tower's graphs: a step's images padded to the smallest of these patch counts that holds them
    encoder_cudagraph_sizes: tuple[int, ...] = ENCODER_CUDAGRAPH_SIZES

    def __post_init__(self) -> None:
        if not self.encoder_cudagraph_sizes or min(self.encoder_cudagraph_sizes) < 1:
            raise ValueError("encoder_cudagraph_sizes must be positive patch counts, e.g. 1024,4096; got "
                             f"{self.encoder_cudagraph_sizes!r}.")
        if not 1 <= self.max_cudagraph_capture_size <= MAX_CUDAGRAPH_CAPTURE_SIZE:
            raise ValueError(f"max_cudagraph_capture_size must lie in [1, {MAX_CUDAGRAPH_CAPTURE_SIZE}], "
                             f"got {self.max_cudagraph_capture_size}.")

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        """Padded batch sizes to capture, vLLM's ladder: 1, 2, 4, every 8 below 256, then every 16 (at 256+ rows a
        step's time grows with its rows, so 16 more pad by at most 6%), up to the limit: 51 graphs for 512
        (every 8 to 512 was 67: ~16 captures of start-up each time)."""
        limit = min(self.max_cudagraph_capture_size, max_num_seqs)
        ladder = [1, 2, 4, *range(8, 256, 8), *range(256, MAX_CUDAGRAPH_CAPTURE_SIZE + 1, 16)]
        sizes = [s for s in ladder if s < limit]
        return sizes + [limit]

    def graph_shapes(self, max_num_seqs: int, max_num_batched_tokens: int,
                     max_query_len: int = 1) -> dict[int, list[int]]:
        """What to capture (see worker/cuda_graphs.py): {1: padded request counts of decode steps} and,
        where steps verify drafts (queries of up to `max_query_len` tokens), {max_query_len: padded token
        counts of those steps}, on a ladder that pads by at most ~12%, up to the step's token budget."""
        shapes = {1: self.capture_sizes(max_num_seqs)}
        if max_query_len > 1:
            top = min(max_num_batched_tokens, VARLEN_GRAPH_MAX_TOKENS,
                      min(self.max_cudagraph_capture_size, max_num_seqs) * max_query_len)
            ladder = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 1025, 32), *range(1088, 4097, 64)]
            shapes[max_query_len] = [n for n in ladder if n < top] + [top]
        return shapes


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 16384  # a GPU's; the CPU's follows its threads (default_max_num_batched_tokens)
    max_num_seqs: int = 256  # the CPU's; a GPU's is CUDA_MAX_NUM_SEQS
    policy: str = "fcfs"
    max_model_len: int = 0  # the engine core's: it builds its scheduler's config once the KV cache's size is known
    # Schedule and prepare step N+1 while the device runs step N (tokens come back one step late).
    async_scheduling: bool = False
    # vLLM's: a prompt with more tokens left than this gets at most this many per step (0: no limit), so a
    # long prompt leaves the rest of the step to other requests and bounds a step's time.
    long_prefill_token_threshold: int = 0
    # Cost-based prefill chunks: a chunk of n prompt tokens after c computed ones counts
    # n * (1 + c / prefill_cost_context) against max_num_batched_tokens and long_prefill_token_threshold,
    # since its attention grows with c: a long prompt's later chunks shrink. 0: every token counts 1.
    # EngineArgs sets both by default: the CPU's measured, CUDA's from the model's shape (_prefill_chunking).
    prefill_cost_context: int = 0
    # While decodes run, a step's prompt tokens are held so that its estimated time on the device stays within this
    # many times that of its decodes alone, with a floor of prompt tokens per step (core/step_time.py; the estimate
    # from the model's shape over the device's roofline, engine/step_cost.py). 0: no such bound. EngineArgs sets
    # CUDA's (CUDA_STEP_TIME_FACTOR); the CPU's token budget already keeps its steps short.
    step_time_factor: float = 0.0
    # --enable-lora's --max-loras: the distinct adapters the running requests may hold (their steps run them all
    # at once); a request for another waits. 0: no adapters.
    max_loras: int = 0
    # vLLM's: encoder output rows (image or audio embeddings) one step may ask the encoder for; 0: as many as
    # max_num_batched_tokens (core/media_schedule.py)
    max_num_encoder_input_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("long_prefill_token_threshold", "prefill_cost_context", "max_num_encoder_input_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}.")
        if self.step_time_factor != 0 and not self.step_time_factor > 1:
            raise ValueError(f"step_time_factor must be 0 (off) or above 1 (a step holds its decodes at least), got "
                             f"{self.step_time_factor}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}.")

    @property
    def encoder_budget(self) -> int:
        """Encoder output rows a step may ask for (max_num_encoder_input_tokens, else max_num_batched_tokens)."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens


CUDA_MAX_NUM_SEQS = 1024  # vLLM's for large GPUs
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def default_executor_backend(world_size: int) -> str:
    """One rank runs in the engine core's process ("uni"); more need a process each ("mp")."""
    return "uni" if world_size == 1 else "mp"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # "uni": the worker runs in the engine core's process; "mp": one worker process per rank; "ray": one
    # Ray actor per rank (EngineArgs leaves it to default_executor_backend)
    distributed_executor_backend: str = "uni"
    enable_expert_parallel: bool = False  # MoE layers split whole experts over the ranks
    data_parallel_size: int = 1  # engine cores behind one front-end, each with its tensor-parallel ranks
    data_parallel_rank: int = 0  # this core's (set per core by engine/dp_client.py)

    def __post_init__(self) -> None:
        if type(self.data_parallel_size) is not int or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {self.data_parallel_size!r}.")
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}.")
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError("tensor_parallel_size > 1 needs one process per rank: distributed_executor_backend "
                             "mp or ray (or leave it unset).")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                             f"got {self.distributed_executor_backend!r}.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


SPEC_METHODS = ("ngram", "draft_model", "dflash2", "mtp", "dspark")
# Methods whose drafts are made on the device from the device's own verified tokens, so step N+1 can be
# prepared before step N's tokens reach the host. ngram looks up host token histories; dflash2's
# proposer reads host token ids (anchors, selector path) each step; mtp catches up from host token ids.
ASYNC_SPEC_METHODS = ("draft_model",)


def json_object(value: dict | str, name: str) -> dict:
    """A config given as a dict or as a JSON string (its CLI flag's form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object / dict.")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys. A proposer drafts up to `num_speculative_tokens` per request
    and step; the target verifies them all in its forward pass, keeping its own distribution."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # draft_model: a smaller model with the target's tokenizer; dflash2: a drafter; mtp: the checkpoint holding
    # the MTP layer (default: the target's own); dspark: a DeepSpec DSpark checkpoint
    model: str | None = None
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched earlier in the context
    prompt_lookup_max: int = 4  # ngram: longest, tried first
    # Each step verifies, per request, only the drafts expected to pay for their share of the step
    # (core/spec_budget.py); off: always every draft, up to num_speculative_tokens.
    adaptive_token_budget: bool = True
    # "synthetic": drafts are accepted with these conditional per-position probabilities whatever the
    # target says (not lossless): the system cost of speculation at real sizes with dummy weights.
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: list[float] | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPEC_METHODS)}; "
                             f"got {self.method!r}.")
        if self.method == "draft_model" and not self.model:  # dflash2 without one: the embedded model's drafter
            raise ValueError('speculative_config method "draft_model" needs "model": the draft model\'s path.')
        if self.method == "dspark" and not self.model:
            raise ValueError('speculative_config method "dspark" needs "model": the DSpark drafter\'s directory.')
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}.")
        if self.rejection_sample_method not in ("standard", "synthetic"):
            raise ValueError("rejection_sample_method must be standard or synthetic, got "
                             f"{self.rejection_sample_method!r}.")
        rates = self.synthetic_acceptance_rates
        if self.rejection_sample_method == "synthetic" and (not rates or any(not 0 <= r <= 1 for r in rates)):
            raise ValueError("rejection_sample_method synthetic needs synthetic_acceptance_rates: one probability "
                             "in [0, 1] per draft position (the last repeats).")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}.")

    @classmethod
    def from_value(cls, value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A dict, a JSON string (the CLI's --speculative-config) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"Unknown speculative_config key(s): {', '.join(sorted(unknown))}.")
        return cls(**value)


def resolve_async_scheduling(asked: bool | None, device: str, speculative: SpeculativeConfig | None) -> bool:
    """None: on for CUDA (the CPU has nothing to overlap with) unless the speculative method drafts on
    the host. True with such a method is refused."""
    overlaps = speculative is None or speculative.method in ASYNC_SPEC_METHODS
    if asked and not overlaps:
        raise ValueError(f'Speculative method "{speculative.method}" drafts from host-side token ids, so it '
                         "runs with synchronous scheduling; drop async_scheduling=True, or use "
                         f"method {' or '.join(ASYNC_SPEC_METHODS)}.")
    return asked if asked is not None else device == "cuda" and overlaps


OFFLOAD_CONNECTORS = ("OffloadingConnector",)
# connectors that move a request's KV between engines (disaggregated prefill/decode): the config is a KVTransferConfig
P2P_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferConfig:
    """vLLM's --kv-transfer-config for a connector that moves KV between engines: `kv_role` says whether this engine
    stages its finished prompts' KV for others (producer), reads KV others staged (consumer), or both. `kv_ip` and
    `kv_port`: where this engine's transfer agent takes metadata requests (peers learn them from the
    kv_transfer_params a producer returns); `kv_buffer_size`: bytes of host memory for staged chunks; the extra
    config's `transfer_timeout_s` bounds a read (then the prompt is computed here), `abort_request_timeout_s` how
    long a producer holds chunks no consumer has read, and `fault_injection` ("stall_reads" or "corrupt_staged")
    makes transfers fail on purpose, for tests."""
    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 5600
    kv_buffer_size: int = 1 << 30
    transfer_timeout_s: float = 30.0
    abort_request_timeout_s: float = 120.0
    fault_injection: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in P2P_CONNECTORS:
            raise ValueError(f"kv_connector {self.kv_connector!r} does not move KV between engines; use "
                             f"{', '.join(P2P_CONNECTORS)}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role {self.kv_role!r} is not one of {', '.join(KV_ROLES)}.")
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port {self.kv_port} is not a TCP port.")
        if self.kv_buffer_size <= 0 or self.transfer_timeout_s <= 0 or self.abort_request_timeout_s <= 0:
            raise ValueError("kv_buffer_size, transfer_timeout_s and abort_request_timeout_s must be positive.")
        if self.fault_injection not in (None, "stall_reads", "corrupt_staged"):
            raise ValueError(f"fault_injection {self.fault_injection!r}: use \"stall_reads\" or \"corrupt_staged\".")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_value(cls, value: dict | str | None) -> KVTransferConfig | None:
        """The config of a P2P connector's --kv-transfer-config; None for none, or for an offload connector's."""
        if value is None:
            return None
        transfer = json_object(value, "kv_transfer_config")
        if transfer.get("kv_connector") not in P2P_CONNECTORS:
            return None
        known = {"kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port", "kv_buffer_size",
                 "kv_connector_extra_config", "kv_rank", "kv_parallel_size", "kv_buffer_device"}
        unknown = set(transfer) - known
        if unknown:
            raise ValueError(f"unknown kv_transfer_config key(s) {', '.join(sorted(unknown))}.")
        extra = transfer.get("kv_connector_extra_config") or {}
        extra_keys = {"transfer_timeout_s", "abort_request_timeout_s", "fault_injection", "backends"}
        if not isinstance(extra, dict) or set(extra) - extra_keys:
            raise ValueError(f"kv_connector_extra_config must be an object of {', '.join(sorted(extra_keys))}.")
        if extra.get("backends", ["UCX"]) != ["UCX"]:
            raise ValueError('kv_connector_extra_config "backends": pressroom\'s NixlConnector moves KV over ["UCX"] '
                             "only.")
        if "kv_role" not in transfer:
            raise ValueError('kv_transfer_config needs a "kv_role": kv_producer, kv_consumer or kv_both.')
        fields = {k: transfer[k] for k in ("kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port") if k in transfer}
        if "kv_buffer_size" in transfer:
            fields["kv_buffer_size"] = int(float(transfer["kv_buffer_size"]))
        fields.update({k: extra[k] for k in ("transfer_timeout_s", "abort_request_timeout_s", "fault_injection")
                       if k in extra})
        return cls(**fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadTierSpec:
    """A secondary KV-offload tier: "fs" (a directory, `path`, capped at `max_bytes`) or "module" (an
    out-of-tree `SecondaryTier`, `module_path` + `class_name`, built with `options`)."""
    kind: str
    path: str | None = None
    max_bytes: int | None = None
    module_path: str | None = None
    class_name: str | None = None
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind == "fs" and not self.path:
            raise ValueError('a KV offload tier of type "fs" needs a "path".')
        if self.kind == "module" and not (self.module_path and self.class_name):
            raise ValueError('a KV offload tier of type "module" needs "module_path" and "class_name".')
        if self.kind not in ("fs", "module"):
            raise ValueError(f'unknown KV offload tier type {self.kind!r}; use "fs" or "module".')
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError("a KV offload tier's size cap must not be negative.")


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadConfig:
    """Tiered KV offload: the CPU tier's bytes and the secondary tiers behind it, in order."""
    cpu_bytes: int
    secondary: list[OffloadTierSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cpu_bytes <= 0:
            raise ValueError("the KV offload CPU tier needs a positive size (--kv-offloading-size, GiB).")

    @classmethod
    def from_args(cls, *, size_gib: float | None, disk_path: str | None, disk_gib: float | None,
                  transfer: dict | str | None) -> OffloadConfig | None:
        """From pressroom's flags, or vLLM's --kv-transfer-config (OffloadingConnector; its extra config's
        cpu_bytes_to_use and secondary_tiers: [{"type": "fs", "path", "max_bytes"} | {"type": "module",
        "module_path", "class_name", ...options}])."""
        disk_bytes = None if disk_gib is None else int(disk_gib * (1 << 30))
        tiers = [OffloadTierSpec(kind="fs", path=disk_path, max_bytes=disk_bytes)] if disk_path else []
        cpu = None if size_gib is None else int(size_gib * (1 << 30))
        if transfer is not None:
            extra = _offload_extra_config(transfer)
            if "cpu_bytes_to_use" in extra:
                cpu = int(extra["cpu_bytes_to_use"])
            tiers += [_tier_from_dict(t) for t in extra.get("secondary_tiers", [])]
        if cpu is None and not tiers:
            return None
        if cpu is None:
            raise ValueError("KV offload tiers need the CPU tier in front of them: set --kv-offloading-size "
                             "(GiB) or cpu_bytes_to_use.")
        return cls(cpu_bytes=cpu, secondary=tiers)


def _offload_extra_config(transfer: dict | str) -> dict:
    transfer = json_object(transfer, "kv_transfer_config")
    connector = transfer.get("kv_connector")
    if connector not in OFFLOAD_CONNECTORS:
        raise ValueError(f"kv_connector {connector!r} is not supported; use "
                         f"{', '.join(OFFLOAD_CONNECTORS + P2P_CONNECTORS)}.")
    if transfer.get("kv_role", "kv_both") != "kv_both":
        raise ValueError('the OffloadingConnector runs with kv_role "kv_both".')
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object.")
    unknown = set(extra) - _OFFLOAD_EXTRA_KEYS
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) {', '.join(sorted(unknown))}; pressroom reads "
                         f"{', '.join(sorted(_OFFLOAD_EXTRA_KEYS))}.")
    if extra.get("spec_name", "CPUOffloadingSpec") not in ("CPUOffloadingSpec", "TieringOffloadingSpec"):
        raise ValueError('spec_name must be "CPUOffloadingSpec" or "TieringOffloadingSpec".')
    return extra


# vLLM's keys; block_size is accepted and ignored: a chunk here is always one KV-cache block
_OFFLOAD_EXTRA_KEYS = {"cpu_bytes_to_use", "spec_name", "secondary_tiers", "block_size"}


def _tier_from_dict(entry: dict) -> OffloadTierSpec:
    if not isinstance(entry, dict) or "type" not in entry:
        raise ValueError('each secondary_tiers entry must be an object with a "type" ("fs" or "module").')
    rest = {k: v for k, v in entry.items() if k != "type"}
    if entry["type"] == "fs":
        unknown = set(rest) - {"path", "max_bytes"}
        if unknown:
            raise ValueError(f'unknown keys for an "fs" tier: {", ".join(sorted(unknown))}.')
        return OffloadTierSpec(kind="fs", path=rest.get("path"), max_bytes=rest.get("max_bytes"))
    module_path, class_name = rest.pop("module_path", None), rest.pop("class_name", None)
    return OffloadTierSpec(kind=str(entry["type"]), module_path=module_path, class_name=class_name, options=rest)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoRAConfig:
    """--enable-lora: adapters served over the base model (pressroom/lora/)."""
    max_loras: int = 1  # adapters one step may hold (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras and --max-lora-rank must be at least 1; got {self.max_loras} and "
                             f"{self.max_lora_rank}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                             f"({self.max_loras}).")

    @property
    def pool_size(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    compilation: CompilationConfig
    device: str = "cpu"
    speculative: SpeculativeConfig | None = None
    num_threads: int | None = None  # torch CPU threads, set in every process that runs the model
    offload: OffloadConfig | None = None
    lora: LoRAConfig | None = None  # None: no adapters
    kv_transfer: KVTransferConfig | None = None  # a connector moving KV between engines (disaggregated serving)
    # vLLM's: each step's FLOPs and bytes estimated from the model's shape, counted into /metrics' estimated_*_per_gpu
    enable_mfu_metrics: bool = False

    def __post_init__(self) -> None:
        if self.model.batch_invariant and self.parallel.tensor_parallel_size > 1:
            raise ValueError("--batch-invariant needs --tensor-parallel-size 1: an all-reduce's order of "
                             "summation depends on the message's size, so on the batch.")
        if self.model.enable_sleep_mode:
            _check_sleep_mode(self)


def _check_sleep_mode(config: EngineConfig) -> None:
    """Sleep mode frees and rebuilds the target's weights and KV cache; what lives beside them is refused by name."""
    beside = [name for name, on in (("--speculative-config", config.speculative is not None),
                                    ("--kv-offloading-size", config.offload is not None),
                                    ("--kv-transfer-config", config.kv_transfer is not None),
                                    ("--cpu-offload-gb", config.model.cpu_offload_gb > 0)) if on]
    if beside:
        raise ValueError(f"--enable-sleep-mode does not work with {', '.join(beside)} yet (sleep frees and rebuilds "
                         "only the model's weights and KV cache); drop one or the other.")


DTYPE_CHOICES = ("auto", *_DTYPES)
KV_CACHE_DTYPE_CHOICES = ("auto", *_KV_CACHE_DTYPES)


def default_of(config: type, name: str) -> Any:
    """The default of `config`'s field `name`: written there once, and read from there by `EngineArgs`."""
    return {f.name: f for f in fields(config)}[name].default


def _arg(default: Any, help: str, choices: Sequence[str] | None = None) -> Any:
    """An `EngineArgs` field: its default, plus the help and choices its CLI flag shows."""
    return field(default=default, metadata={"help": help, "choices": choices})


def _config_arg(config: type, name: str, help: str, choices: Sequence[str] | None = None) -> Any:
    """An `EngineArgs` field that `config`'s field `name` takes as it is; its default is that field's."""
    return field(default=default_of(config, name), metadata={"help": help, "choices": choices, "sets": (config, name)})


CPU_TOKENS_PER_THREAD = 128  # a 512-token prefill step of SmolLM2-135M took ~1.9 s on one core
CPU_MIN_BATCHED_TOKENS = 512  # twice the CPU's max_num_seqs: a step carries every running decode and a prefill chunk
# SchedulerConfig.prefill_cost_context on the CPU: the context at which a prompt token's attention costs as much
# as the rest of its forward pass, so a step's time stays about that of its first chunk. Measured with the
# embedded SmolLM2-135M (fp32, AVX2, one torch thread, CPU time of engine steps): a chunk's time per token was
# 5.4 ms at context 0 and 27 ms (256-token chunks) to 30 ms (512) at 4,096, i.e. ~4-4.8 ms plus 5.3-5.9 us per
# context token: 660-900, the context term rising a little faster past 2k. A plain regression over all contexts
# says ~500, but with 512 the steps' work shrank below their fixed cost (chunks of 128 units took 0.55-0.65 s a
# step at every context up to 1.8k, ~0.3 s of it per step whatever its size) and an 8,000-token prompt beside
# a stream took 490 s against 228 s in 512-token chunks. With 1024, in one run of both (tests/engine/
# test_scheduling.py, one thread): the prompt in 421 s against 330 s, the stream's worst gap 2.8 s against 38.6 s.
# (Counting FLOPs would say ~3,000, 212 MFLOP of matmuls against 69 KFLOP of attention per context token: the
# CPU's attention, over a gathered and masked context, runs far below matmul speed.)
CPU_PREFILL_COST_CONTEXT = 1024
# long_prefill_token_threshold on CUDA, as a share of the step's budget: a long prompt's chunk leaves three quarters
# of every step to decodes and other prompts (up to four long prompts progress side by side), while a lone one
# still gets 4,096 tokens a step at the default budget, enough to keep a GPU's matmuls at full speed, so its
# prefill is barely slower. vLLM's rule with partial prefills on, 4% of max_model_len, lands in the same range
# for the usual contexts (1,310 at 32k, 5,243 at 128k), but it follows a length the core only knows once the KV
# cache is sized, and on short contexts it would cut a GPU's chunks below what keeps it busy.
CUDA_LONG_PREFILL_SHARE = 0.25
# SchedulerConfig.step_time_factor on CUDA: a step that carries prompt tokens beside running decodes is estimated at
# no more than 3 decode-only steps. Issue 44's target is a P99 inter-token latency under 4x the median; the estimate
# leaves out what every step spends around the model (the host's scheduling and sampling, launch gaps: an H200's
# c=256 decode step of a Llama-3.1-8B shape is estimated at 5.7-7.5 ms against a 12.8 ms measured TPOT), so a step
# estimated at 3x takes less than 3x as long, and 3 keeps a margin for the estimate's errors. It still leaves each
# such step 2 decode steps' worth of prompt work: 800-1,050 prompt tokens beside those 256 decodes (contexts
# 256-511), over 3x the ~256 a step that workload's arrivals need (one 256-token prompt a step as streams finish).
# Simulated on the scheduler (serve_vs_offline.sh's workload, a step taking 1.5x its estimate + 2.5 ms): P99 ITL
# 354 -> 33 ms (2.5x the median), output tok/s -2.0%; with 4: 3.2x and -1.2%; with 2: 1.4x and -3.9%. bench gpu's
# offline 1,000 x 512/256 at max_num_seqs 1,024: -2.8% (tests/core/test_step_time_bound.py's simulation).
CUDA_STEP_TIME_FACTOR = 3.0


def _env_flag(name: str) -> bool:
    """An environment variable set to 1 (vLLM's convention for its switches)."""
    return os.environ.get(name, "0").strip() == "1"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointFacts:
    """What resolving the configs needs to know of the checkpoint itself. The engine's start reads them
    (read_checkpoint_facts) and hands them to `EngineArgs.create_engine_config`, which reads no file."""
    encoder_only: bool = False  # an encoder-only family (BERT): pooling only, each prompt whole in one step
    # A decoder's prefill_cost_context by its shape's FLOPs (flops_prefill_cost_context; 0: unknown): CUDA's default.
    prefill_cost_context: int = 0


def read_checkpoint_facts(model: str | None) -> CheckpointFacts:
    """The facts of an HF directory's config.json; none (the defaults) for a GGUF file, the embedded model or an
    unreadable config (the loader reports a bad config.json with its own error)."""
    path = os.path.join(os.path.expanduser(model), "config.json") if model else ""
    if not path or not os.path.isfile(path):
        return CheckpointFacts()
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, json.JSONDecodeError):
        return CheckpointFacts()
    return checkpoint_facts(values) if isinstance(values, dict) else CheckpointFacts()


def checkpoint_facts(values: dict[str, Any]) -> CheckpointFacts:
    """The facts of a checkpoint's config (config.json's keys, HF's names)."""
    if values.get("model_type") in ENCODER_MODEL_TYPES:
        return CheckpointFacts(encoder_only=True)  # its prompts are computed whole: never chunked
    return CheckpointFacts(prefill_cost_context=flops_prefill_cost_context(values))


def flops_prefill_cost_context(config: dict[str, Any]) -> int:
    """The context at which a prompt token's attention takes as many FLOPs as its linear layers: per token, the
    linear layers take 2 x their active parameters, and attention 2 x heads x (q/k width + v width) per context
    token in each attention layer (QK^T, then PV), so K = active parameters / (attention layers x heads x
    (d_qk + d_v)); for standard attention, active parameters / (2 x layers x heads x head_dim). Llama-3-8B: ~26,600;
    SmolLM2-135M: ~3,070. 0 where the config does not give its shape, or has no attention layer (a linear-attention
    model's cost does not grow with its context).

    Approximations: the active parameters are the layers' projections and MLPs (embeddings and the LM head, computed
    for one token per prompt, do not count); every MLP gated (3 matrices); a MoE layer's active MLP its top-k
    experts plus its shared ones (first_k_dense_replace and mlp_only_layers layers dense); MLA's projections as its
    prefill computes them (q and kv expanded per head); linear-attention layers (`layer_types`) count their
    parameters but no attention, and sliding-window layers count as full ones, which overstates a long
    context's attention (so shrinks its chunks more than needed, the safe side)."""
    text = config.get("text_config")
    c = text if isinstance(text, dict) else config  # a multimodal checkpoint: its language model's
    try:
        hidden, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        attention, width = _attention_params(c, hidden, heads)
        linear = layers * attention + 3 * hidden * _mlp_widths(c, layers)
        return max(1, round(linear / (_attention_layers(c, layers) * heads * width)))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0


def _attention_params(c: dict[str, Any], hidden: int, heads: int) -> tuple[int, int]:
    """One layer's attention projections (parameters), and a head's q/k width plus its v width."""
    if c.get("kv_lora_rank"):  # MLA
        rank, nope, rope, v = int(c["kv_lora_rank"]), int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), \
            int(c["v_head_dim"])
        q_rank = int(c.get("q_lora_rank") or 0)
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        kv = hidden * (rank + rope) + rank * heads * (nope + v)
        return q + kv + heads * v * hidden, nope + rope + v
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    return hidden * head_dim * 2 * (heads + kv_heads), 2 * head_dim


def _mlp_widths(c: dict[str, Any], layers: int) -> int:
    """The MLPs' active intermediate widths summed over the layers (a MoE layer's: its top-k and shared experts)."""
    dense = int(c["intermediate_size"])
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    top_k = c.get("num_experts_per_tok") or c.get("experts_per_token") or c.get("moe_topk")
    if not experts or not top_k:
        return layers * dense
    expert = int(c.get("moe_intermediate_size") or dense)
    shared = int(c.get("shared_expert_intermediate_size") or int(c.get("n_shared_experts") or 0) * expert)
    dense_layers = min(layers, int(c.get("first_k_dense_replace") or 0) + len(c.get("mlp_only_layers") or ()))
    return dense_layers * dense + (layers - dense_layers) * (int(top_k) * expert + shared)


def _attention_layers(c: dict[str, Any], layers: int) -> int:
    """Layers whose attention reads the context (full or sliding window), not linear-attention or SSM ones."""
    kinds = c.get("layer_types")
    if not isinstance(kinds, list):
        return layers
    return sum(1 for kind in kinds if "attention" in str(kind) and "linear" not in str(kind))


ENCODER_BATCHED_TOKENS = 8192  # an encoder's step on the CPU: no streams wait on it, and larger matmuls run faster


def default_max_num_batched_tokens(device: str, threads: int, encoder_only: bool = False) -> int:
    """A GPU takes a 16k-token step in well under a second; a CPU takes about 4 ms per token per core, so
    its budget follows its threads (on 2 cores, one 8,000-token prompt in a 16k step froze every other
    stream for minutes). Not below 512: at 256, as many as the CPU's running decodes, prefills got only
    the leftovers and 256 concurrent streams took 3x as long. An encoder serves no streams: its CPU steps are as
    large as ENCODER_BATCHED_TOKENS (see docs/BENCHMARKS.md, "Embeddings"). `threads`: torch's CPU threads."""
    if device == "cuda":
        return default_of(SchedulerConfig, "max_num_batched_tokens")
    if encoder_only:
        return ENCODER_BATCHED_TOKENS
    return max(CPU_MIN_BATCHED_TOKENS, CPU_TOKENS_PER_THREAD * threads)


def default_max_num_seqs(device: str) -> int:
    return CUDA_MAX_NUM_SEQS if device == "cuda" else default_of(SchedulerConfig, "max_num_seqs")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """Every knob a user may set, flat, with vLLM's names. Each field declares its own help and choices:
    the CLI's engine flags are derived from them (entrypoints/cli.py, add_engine_args)."""
    model: str | None = _arg(None, "HF model directory (config.json, *.safetensors), .gguf file, or a hub repository "
                                   "id (org/name: its snapshot in the HF cache, fetched unless HF_HUB_OFFLINE=1) "
                                   "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = _config_arg(ModelConfig, "tokenizer", "tokenizer directory or .gguf file (default: the "
                                                                  "model's)")
    load_format: str = _config_arg(ModelConfig, "load_format", "weights to load: auto (by the model path), "
                                   "safetensors, gguf, or dummy (random weights at the config's shapes, for "
                                   "benchmarks)", LOAD_FORMATS)
    dtype: str = _arg("auto", "weights' and activations' dtype; auto: bfloat16 on CUDA and on CPUs with native "
                              "bf16 (AVX512-BF16 or AMX); float32 on other CPUs", DTYPE_CHOICES)
    quantization: str = _config_arg(
        ModelConfig, "quantization", "auto: the checkpoint's own quantization (config.json quantization_config), "
        "and on the CPU a GGUF's Q4 matrices (and a Q8_0 LM head) also stay as shipped for steps of at most 8 "
        "tokens; none: dequantize every weight; fp8: FP8 e4m3 weights with per-channel scales computed at load (or "
        "an FP8 checkpoint's), activations scaled per token; mxfp4: MXFP4 weights (32-input blocks, power-of-two "
        "scales) quantized at load, weight-only; nvfp4: likewise in 16-input blocks with FP8 scales and a global "
        "one; or a plug-in: an installed package's entry point (group pressroom.quantization) by name, or "
        "module.path:ClassName")
    max_model_len: int | None = _config_arg(ModelConfig, "max_model_len", "longest prompt + output in tokens "
                                            "(default: the model's max_position_embeddings, lowered to what the KV "
                                            "cache holds)")
    seed: int = _config_arg(ModelConfig, "seed", "seeds the engine's sampling generator and dummy weights")
    cpu_offload_gb: float = _config_arg(ModelConfig, "cpu_offload_gb", "GiB of the weights to keep in (pinned) host "
                                        "memory: the last decoder layers, whole, each copied to the device ahead of "
                                        "its use, so a model larger than the GPU's budget serves, slower (per GPU; "
                                        "no effect on the CPU, where the weights live in host memory)")
    block_size: int = _config_arg(CacheConfig, "block_size", "tokens per KV-cache block (a power of two)")
    enable_prefix_caching: bool = _config_arg(CacheConfig, "enable_prefix_caching",
                                              "reuse the KV-cache blocks of prompt prefixes seen before")
    mamba_block_size: int | None = _config_arg(
        CacheConfig, "mamba_block_size", "models with recurrent layers (Mamba, Gated DeltaNet, KDA): tokens between "
        "prefix-cache checkpoints of a prompt's state, a multiple of --block-size (default: where a checkpoint takes "
        "about the attention layers' KV bytes of its tokens; 256 for an attention-free model)")
    kv_cache_dtype: str = _arg("auto", "KV-cache element type; auto: the model's dtype; fp8 (= fp8_e4m3) or "
                                       "fp8_e5m2: CUDA only, scale 1", KV_CACHE_DTYPE_CHOICES)
    kv_cache_memory_gib: float | None = _arg(None, "KV-cache size in GiB (default: on the CPU "
                                                   f"{CPU_KV_CACHE_GIB}, or PRESSROOM_CPU_KVCACHE_SPACE; on CUDA "
                                                   "what a memory profile leaves of --gpu-memory-utilization)")
    kv_cache_memory_bytes: int | None = _arg(None, "KV-cache size in bytes, vLLM's spelling of "
                                                   "--kv-cache-memory-gib (give one of them)")
    num_gpu_blocks_override: int | None = _config_arg(CacheConfig, "num_blocks",
                                                      "KV-cache blocks, overriding the memory budget")
    max_num_batched_tokens: int | None = _arg(
        None, "tokens one engine step computes at most (prefill chunks + decodes); default: "
        f"{default_of(SchedulerConfig, 'max_num_batched_tokens')} on CUDA; on the CPU {CPU_TOKENS_PER_THREAD} per "
        f"torch thread, at least {CPU_MIN_BATCHED_TOKENS}: a long prompt is prefilled in chunks and running streams "
        "get a token between them")
    long_prefill_token_threshold: int | None = _arg(None, "a prompt with more tokens left than this gets at most "
                                                          "this many per step (counted as cost where "
                                                          "--prefill-cost-context is set), leaving the rest of the "
                                                          "step to other requests; 0: no limit (default: "
                                                          f"{CUDA_LONG_PREFILL_SHARE:.0%} of "
                                                          "--max-num-batched-tokens on CUDA; on the CPU "
                                                          f"{CPU_TOKENS_PER_THREAD} per torch thread)")
    prefill_cost_context: int | None = _arg(None, "cost-based prefill chunks: n prompt tokens after c computed ones "
                                                  "count n * (1 + c / this) against the step's budget and "
                                                  "--long-prefill-token-threshold, so a long prompt's later chunks "
                                                  "shrink and a step's time stays bounded; 0: tokens count alone "
                                                  "(default: on CUDA the context at which a token's attention "
                                                  "FLOPs equal its linear layers', from the model's config.json "
                                                  "(0 where it gives no shape, as a GGUF's); "
                                                  f"{CPU_PREFILL_COST_CONTEXT} on the CPU)")
    step_time_factor: float | None = _arg(None, "while decodes run, a step's prompt tokens are held so that the "
                                                "step's estimated time (the model's FLOPs and bytes over the "
                                                "device's roofline) stays within this many times that of its "
                                                "decodes alone, with a floor of prompt tokens per step where the "
                                                "device's matmuls turn compute-bound; 0: no such bound (default: "
                                                f"{CUDA_STEP_TIME_FACTOR:g} on CUDA, 0 on the CPU)")
    max_num_seqs: int | None = _arg(None, f"requests running at once at most (default: {CUDA_MAX_NUM_SEQS} on "
                                          "CUDA, vLLM's for large GPUs; "
                                          f"{default_of(SchedulerConfig, 'max_num_seqs')} on the CPU)")
    scheduling_policy: str = _config_arg(SchedulerConfig, "policy", "fcfs: first come, first served; priority: by "
                                         "the requests' priority", SCHEDULING_POLICIES)
    tensor_parallel_size: int = _config_arg(ParallelConfig, "tensor_parallel_size", "ranks to shard the model over, "
                                            "one worker process each (GPUs on CUDA, processes sharing the cores on "
                                            "the CPU)")
    distributed_executor_backend: str | None = _arg(
        None, "where workers run: uni (in the engine core's process), mp (one process per rank) or ray (one Ray "
        "actor per rank, across the nodes of the cluster RAY_ADDRESS names, or of a local one); default: uni for "
        "one rank, mp for more", EXECUTOR_BACKENDS)
    enable_expert_parallel: bool = _config_arg(ParallelConfig, "enable_expert_parallel", "mixture-of-experts layers "
                                               "split whole experts over the tensor-parallel ranks instead of each "
                                               "expert's matrices")
    data_parallel_size: int = _config_arg(ParallelConfig, "data_parallel_size", "engine cores behind one API server "
                                          "(pressroom serve), each a copy of the model on tensor_parallel_size "
                                          "ranks; requests are balanced by load and shared prefix, or pinned with "
                                          "data_parallel_rank")
    device: str = _arg("auto", "auto: cuda when torch sees a GPU, else cpu", DEVICES)
    num_threads: int | None = _config_arg(EngineConfig, "num_threads", "torch CPU threads (default: torch's)")
    gpu_memory_utilization: float = _config_arg(CacheConfig, "gpu_memory_utilization", "share of the GPU's memory "
                                                "the engine may use (weights, activations, KV cache), in (0, 1]")
    enforce_eager: bool = _config_arg(CompilationConfig, "enforce_eager", "no CUDA graphs: every step runs eagerly")
    precompile_kernels: bool = _config_arg(CompilationConfig, "precompile_kernels", "on CUDA, compile the Triton "
                                           "kernels earlier starts of this model recorded in parallel processes "
                                           "while the weights load (--no-precompile-kernels: the JIT compiles each "
                                           "at its first launch)")
    optimization_level: int = _arg(2, "vLLM's -O: 0 runs every step eagerly, as --enforce-eager; 1, 2 (vLLM's default) "
                                      "and 3 replay CUDA graphs as --enforce-eager and --max-cudagraph-capture-size "
                                      "allow (pressroom compiles nothing with torch.compile, so the levels above 0 "
                                      "run alike)")
    max_cudagraph_capture_size: int = _config_arg(CompilationConfig, "max_cudagraph_capture_size",
                                                  "largest decode batch replayed from a captured CUDA graph "
                                                  f"(at most {MAX_CUDAGRAPH_CAPTURE_SIZE})")
    encoder_cudagraph_sizes: str | list[int] | None = _arg(
        None, "patch counts (comma-separated) a vision tower's CUDA graphs are captured at; a step's images are "
              "padded to the smallest that holds them, larger ones run eagerly (default: "
              f"{','.join(map(str, ENCODER_CUDAGRAPH_SIZES))}; --enforce-eager: none)")
    enable_sleep_mode: bool = _config_arg(ModelConfig, "enable_sleep_mode", "allow LLM.sleep / wake_up (and, with "
                                          "VLLM_SERVER_DEV_MODE=1, POST /sleep and /wake_up): level 1 moves the "
                                          "weights to host memory and frees the KV cache, level 2 frees both "
                                          "(the weights reload from the checkpoint on waking)")
    enable_mfu_metrics: bool = _config_arg(EngineConfig, "enable_mfu_metrics", "estimate each engine step's "
                                           "FLOPs and bytes read and written per GPU from the model's shape and "
                                           "count them into /metrics' vllm:estimated_*_per_gpu_total (0 without)")
    max_logprobs: int = _config_arg(ModelConfig, "max_logprobs", "the most logprobs a request may ask for at a "
                                    "position (logprobs, top_logprobs, prompt_logprobs); -1: the whole vocabulary")
    batch_invariant: bool = _config_arg(ModelConfig, "batch_invariant", "a request's tokens and logprobs do not "
                                        "depend on the requests beside it (fixed-order GEMMs, attention and norms; "
                                        "dense Llama-family models, one rank); also VLLM_BATCH_INVARIANT=1")
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT checkpoints) over the base model; a request names "
                                    "one (LoRARequest offline, its name as `model` on the server)")
    max_loras: int = _config_arg(LoRAConfig, "max_loras", "with --enable-lora: adapters one step may hold")
    max_lora_rank: int = _config_arg(LoRAConfig, "max_lora_rank", "with --enable-lora: the largest adapter rank")
    max_cpu_loras: int | None = _config_arg(LoRAConfig, "max_cpu_loras", "with --enable-lora: adapters kept read "
                                            "in host memory (default: --max-loras)")
    revision: str | None = _arg(None, "a hub model's branch, tag or commit (with MODEL a repository id: org/name)")
    tokenizer_revision: str | None = _arg(None, "a hub tokenizer's branch, tag or commit (default: --revision)")
    download_dir: str | None = _arg(None, "the HF cache a hub model is found in or downloaded to (default: "
                                          "huggingface_hub's, HF_HOME / HF_HUB_CACHE); HF_HUB_OFFLINE=1: found only")
    trust_remote_code: bool = _arg(False, "accepted for vLLM's command lines: pressroom runs only its own model code, "
                                          "so a checkpoint whose architecture it lacks is refused, naming it")
    skip_tokenizer_init: bool = _config_arg(ModelConfig, "skip_tokenizer_init",
                                            "load no tokenizer: prompts and outputs are token ids only")
    limit_mm_per_prompt: dict | str | None = _arg(None, 'media items one prompt may hold, per modality, a JSON '
                                                        'object, e.g. {"image": 2, "audio": 1} (default: 999 of '
                                                        "each, vLLM's)")
    hf_overrides: dict | str | None = _arg(None, 'config.json values to replace, a JSON object, e.g. '
                                                 '{"max_position_embeddings": 131072}; a nested object updates that '
                                                 "sub-config (text_config, vision_config) key by key")
    async_scheduling: bool | None = _arg(None, "schedule and prepare step N+1 while the device runs step N "
                                               "(default: on for CUDA unless the speculative method drafts on "
                                               "the host; off on the CPU, with nothing to overlap)")
    speculative_config: dict | str | None = _arg(None, 'speculative decoding: a JSON object of vLLM keys, e.g. '
                                                       '{"method": "ngram", "num_speculative_tokens": 3}; methods: '
                                                       f"{', '.join(SPEC_METHODS)} (default: off)")

    runner: str = _arg("auto", "generate: completions and chat; pooling: embeddings and vLLM's /pooling, /score, "
                               "/rerank (last-token or mean pooling over a decoder; an encoder's own pooling); "
                               "auto: pooling for an encoder-only (BERT-family) model, else generate", RUNNERS)
    task: str = _arg("auto", "vLLM's older spelling of --runner: embed = --runner pooling", TASKS)
    pooler_config: dict | str | None = _arg(None, 'pooling defaults, e.g. {"pooling_type": "MEAN", "normalize": '
                                                  'true}; pooling_type LAST, MEAN or CLS (default: the model\'s '
                                                  "sentence-transformers config, else LAST, normalised)")
    kv_offloading_size: float | None = _arg(None, "GiB of host memory for the KV offload CPU tier: blocks the "
                                                  "device cache releases are kept there and reloaded on a prefix "
                                                  "hit (default: off); per engine core under data parallelism")
    kv_offloading_disk_path: str | None = _arg(None, "a directory for the KV offload disk tier behind the CPU "
                                                     "tier; it survives restarts (needs --kv-offloading-size)")
    kv_offloading_disk_size: float | None = _arg(None, "GiB cap of the disk tier, least recently used out "
                                                       "first (default: no cap)")
    kv_transfer_config: dict | str | None = _arg(None, "vLLM's KV connector settings: the offload tiers, e.g. "
                                                       '{"kv_connector": "OffloadingConnector", "kv_role": '
                                                       '"kv_both", "kv_connector_extra_config": '
                                                       '{"cpu_bytes_to_use": 4000000000}}, or disaggregated '
                                                       'prefill/decode over NIXL, e.g. {"kv_connector": '
                                                       '"NixlConnector", "kv_role": "kv_producer", "kv_port": 5600}')

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        unknown = set(kwargs) - cls.names()
        if unknown:
            raise ValueError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}.")
        return cls(**kwargs)

    def create_engine_config(self, checkpoint: CheckpointFacts | None = None) -> EngineConfig:
        """The validated configs these arguments resolve to on this machine. It changes nothing and reads no
        file: `checkpoint` brings what it needs of the model's own config (read_checkpoint_facts; None: a
        decoder's), and the engine's start sets the threads and logs the CPU path."""
        checkpoint = checkpoint or CheckpointFacts()
        device = resolve_device(self.device)
        speculative = SpeculativeConfig.from_value(self.speculative_config)
        model = self._model_config(device, checkpoint.encoder_only)
        return EngineConfig(
            model=model,
            cache=self._cache_config(device, model.dtype),
            scheduler=self._scheduler_config(device, checkpoint, speculative),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend
                                    or default_executor_backend(self.tensor_parallel_size),
                                    enable_expert_parallel=self.enable_expert_parallel,
                                    data_parallel_size=self.data_parallel_size),
            compilation=CompilationConfig(enforce_eager=self.enforce_eager or self._optimization_level() == 0,
                                          max_cudagraph_capture_size=self.max_cudagraph_capture_size,
                                          precompile_kernels=self.precompile_kernels,
                                          **self._encoder_cudagraph_sizes()),
            device=device,
            speculative=speculative,
            num_threads=self.num_threads or None,
            offload=self._offload_config(),
            kv_transfer=self._kv_transfer_config(),
            lora=LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras) if self.enable_lora else None,
            enable_mfu_metrics=self.enable_mfu_metrics,
        )

    def _encoder_cudagraph_sizes(self) -> dict[str, tuple[int, ...]]:
        """CompilationConfig's encoder_cudagraph_sizes from a list or a comma-separated string ({}: its default)."""
        sizes = self.encoder_cudagraph_sizes
        if sizes is None:
            return {}
        try:
            values = tuple(int(n) for n in (sizes.split(",") if isinstance(sizes, str) else sizes))
        except ValueError:
            raise ValueError(f"encoder_cudagraph_sizes takes patch counts such as 1024,4096; got {sizes!r}.") from None
        return {"encoder_cudagraph_sizes": values}

    def _model_config(self, device: str, encoder_only: bool) -> ModelConfig:
        runner = self._runner_fields(encoder_only)
        return ModelConfig(model=self.model or "", tokenizer=self.tokenizer, load_format=self.load_format,
                           dtype=resolve_dtype(self.dtype, device), max_model_len=self.max_model_len,
                           seed=self.seed, quantization=self.quantization, skip_tokenizer_init=self.skip_tokenizer_init,
                           cpu_offload_gb=self.cpu_offload_gb, enable_sleep_mode=self.enable_sleep_mode,
                           max_logprobs=self.max_logprobs, limit_mm_per_prompt=self._media_limits(),
                           hf_overrides=None if self.hf_overrides is None else json_object(self.hf_overrides,
                                                                                           "hf_overrides"),
                           batch_invariant=self.batch_invariant or _env_flag("VLLM_BATCH_INVARIANT"), **runner)

    def _media_limits(self) -> dict[str, int] | None:
        return None if self.limit_mm_per_prompt is None else limits_of(self.limit_mm_per_prompt)

    def _cache_config(self, device: str, dtype: torch.dtype) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                           kv_cache_memory_bytes=self._kv_cache_memory_bytes(device),
                           num_blocks=self.num_gpu_blocks_override, mamba_block_size=self.mamba_block_size,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, device))

    def _optimization_level(self) -> int:
        if self.optimization_level not in OPTIMIZATION_LEVELS:
            raise ValueError(f"optimization_level (-O) must be one of {', '.join(map(str, OPTIMIZATION_LEVELS))}; "
                             f"got {self.optimization_level!r}.")
        return self.optimization_level

    def _kv_cache_memory_bytes(self, device: str) -> int | None:
        """The KV cache's size from either spelling (vLLM's bytes or GiB), else the CPU's default; None on CUDA:
        what the memory profile leaves."""
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_gib is not None:
            raise ValueError("--kv-cache-memory-bytes and --kv-cache-memory-gib both set the KV cache's size; "
                             "give one.")
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        gib = self.kv_cache_memory_gib
        if gib is None and device == "cpu":
            gib = float(os.environ.get("PRESSROOM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB))
        return None if gib is None else int(gib * (1 << 30))

    def _scheduler_config(self, device: str, checkpoint: CheckpointFacts,
                          speculative: SpeculativeConfig | None) -> SchedulerConfig:
        threads = self.num_threads or torch.get_num_threads()  # what the engine's start leaves torch with
        budget = self.max_num_batched_tokens or default_max_num_batched_tokens(device, threads, checkpoint.encoder_only)
        return SchedulerConfig(max_num_batched_tokens=budget,
                               max_num_seqs=self.max_num_seqs or default_max_num_seqs(device),
                               policy=self.scheduling_policy,
                               async_scheduling=resolve_async_scheduling(self.async_scheduling, device, speculative),
                               max_loras=self.max_loras if self.enable_lora else 0,
                               step_time_factor=self._step_time_factor(device),
                               **self._prefill_chunking(device, threads, budget, checkpoint))

    def _step_time_factor(self, device: str) -> float:
        """As asked, else CUDA's CUDA_STEP_TIME_FACTOR; the CPU's steps stay short by their token budget (0)."""
        if self.step_time_factor is not None:
            return self.step_time_factor
        return CUDA_STEP_TIME_FACTOR if device == "cuda" else 0.0

    def _prefill_chunking(self, device: str, threads: int, budget: int,
                          checkpoint: CheckpointFacts) -> dict[str, int]:
        """Both knobs as asked, else this device's defaults, so a long prompt's chunk leaves room in every step
        and a step's time stays about that of its budget in plain tokens. The CPU: a chunk gets about half a
        second of a step (CPU_TOKENS_PER_THREAD per thread), counted with its attention as measured
        (CPU_PREFILL_COST_CONTEXT). CUDA: a chunk gets CUDA_LONG_PREFILL_SHARE of the step's `budget`, counted
        with its attention as the model's FLOPs put it (CheckpointFacts.prefill_cost_context)."""
        asked = {"long_prefill_token_threshold": self.long_prefill_token_threshold,
                 "prefill_cost_context": self.prefill_cost_context}
        if device == "cpu":
            defaults = {"long_prefill_token_threshold": CPU_TOKENS_PER_THREAD * threads,
                        "prefill_cost_context": CPU_PREFILL_COST_CONTEXT}
        else:
            defaults = {"long_prefill_token_threshold": max(1, int(budget * CUDA_LONG_PREFILL_SHARE)),
                        "prefill_cost_context": checkpoint.prefill_cost_context}
        return {name: defaults[name] if value is None else value for name, value in asked.items()}

    def _runner_fields(self, encoder: bool) -> dict[str, Any]:
        runner = self.runner
        if self.task != "auto":
            implied = "pooling" if self.task == "embed" else "generate"
            if runner not in ("auto", implied):
                raise ValueError(f"--task {self.task} contradicts --runner {runner}; give one of them.")
            runner = implied
        if runner == "auto":
            runner = "pooling" if encoder else "generate"
        pooler = None
        if self.pooler_config is not None:
            values = json_object(self.pooler_config, "pooler_config")
            unknown = set(values) - {"pooling_type", "normalize", "dimensions"}
            if unknown:
                raise ValueError(f"pooler_config has unknown key(s) {', '.join(sorted(unknown))}; known: "
                                 "pooling_type, normalize, dimensions.")
            pooler = PoolingParams(**values)
        return {"runner": runner, "pooler": pooler, "encoder_only": encoder}

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        transfer = KVTransferConfig.from_value(self.kv_transfer_config)
        if transfer is None:
            return None
        if self.kv_offloading_size is not None or self.kv_offloading_disk_path is not None:
            raise ValueError(f"{transfer.kv_connector} and KV offloading (--kv-offloading-size) cannot be combined "
                             "yet; drop one of them.")
        if self.distributed_executor_backend == "ray":
            raise ValueError(f"{transfer.kv_connector} stages KV in the engine core's memory, which every rank maps: "
                             "use distributed_executor_backend 'mp'.")
        if self.data_parallel_size > 1:
            raise ValueError(f"{transfer.kv_connector} runs one transfer agent per engine core, on kv_port: start one "
                             "engine per data-parallel rank (each with its own kv_port) behind the router instead of "
                             "--data-parallel-size.")
        return transfer

    def _offload_config(self) -> OffloadConfig | None:
        transfer = None if KVTransferConfig.from_value(self.kv_transfer_config) else self.kv_transfer_config
        offload = OffloadConfig.from_args(size_gib=self.kv_offloading_size, disk_path=self.kv_offloading_disk_path,
                                          disk_gib=self.kv_offloading_disk_size, transfer=transfer)
        if offload is not None and not self.enable_prefix_caching:
            raise ValueError("KV offloading finds blocks by their prefix hashes; it needs prefix caching on "
                             "(drop --no-enable-prefix-caching).")
        if offload is not None and self.distributed_executor_backend == "ray":
            raise ValueError("KV offloading shares its CPU tier with the ranks through the engine core's memory, "
                             "so the ranks must run on its machine: use distributed_executor_backend 'mp' "
                             "(Ray may place them on other nodes).")
        return offload
