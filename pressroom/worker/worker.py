"""One rank's worker: it owns the device, the model, its KV cache and the model runner.

The executor (executor/) drives workers through the calls tensor parallelism needs, in this order:
`load_model`, `determine_available_memory`, `initialize_kv_cache`, `compile_or_warm_up_model`, then
`execute_model` once per step, and `shutdown`. Everything that touches the device's memory (the
profile, the cache, CUDA graphs, freeing it all) happens here, so nothing above worker/ calls torch.cuda.
Its answers are plain data that can cross a process boundary.
"""
from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pressroom.config import EngineConfig, SpeculativeConfig
from pressroom.core.outputs import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from pressroom.distributed.kv_transfer.worker_side import KVConnectorWorker
from pressroom.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pressroom.kernels.triton.precompile import StartupKernels, start_kernel_precompile
from pressroom.lora.manager import LoRAManager
from pressroom.model.loader import load_model, resolve_model_path
from pressroom.model.weight_offload import WeightOffload
from pressroom.platforms import set_up_worker_threads
from pressroom.worker.collective_profile import CollectiveProfile
from pressroom.worker.model_runner import ModelRunner
from pressroom.worker.offload_copier import OffloadCopier, kv_chunk_shape, kv_head_range
from pressroom.worker.profiling import profile_peak_memory, profile_step_costs
from pressroom.worker.proposer import Proposer
from pressroom.worker.sleep import (
    HostCopy,
    check_wake_tags,
    device_storages,
    drop_storages,
    model_bytes,
    offload_to_host,
    restore_from_host,
)

logger = logging.getLogger("pressroom")

CUDA_GRAPH_RESERVE = 1 << 30  # graphs' memory pool is allocated after the KV cache; measured and logged at capture
PROFILE_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

ProposerFactory = Callable[[SpeculativeConfig | None, ModelRunner], Proposer | None]


@dataclass(slots=True)
class ModelSpec:
    """What the engine core needs to know of the loaded model to size its cache and requests."""
    model_path: str
    vocab_size: int
    max_position: int  # the longest context the model supports (inside its sliding window, unless it applies it)
    kv_bytes_per_block: int  # the target's cache and a draft model's, per block
    lookahead: int  # slots a request keeps past its step for a drafter's writes into the target's blocks
    device_drafts: int  # drafts a device drafter makes per request and step (async scheduling), else 0
    kv_chunk_shape: tuple[int, ...] | None = None  # one block over every layer, as KV offload tiers hold it
    state_bytes_per_slot: int = 0  # one request's recurrent state over every recurrent layer (0: none)
    # A hybrid's KV bytes per block if every decoder layer were one of its attention layers (0: no attention)
    full_attention_bytes_per_block: int = 0


@dataclass(slots=True)
class StepCosts:
    """Measured step times the adaptive speculative budget weighs (seconds, per token count)."""
    verify: list[tuple[int, float]]
    decode: list[tuple[int, float]]
    per_context_token: float
    drafts: list[tuple[int, float]] | None
    first_draft: list[tuple[int, float]] | None
    block_passes: list[tuple[int, float]] | None


class Worker:
    def __init__(self, config: EngineConfig, make_proposer: ProposerFactory, rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        """`make_proposer` builds the drafter the speculative config names (spec_decode/ implements
        drafters; worker/ only knows their interface). With several ranks, every rank's worker joins the
        tensor-parallel group at `distributed_init_method` before it builds its model."""
        self.config, self.rank, self._make_proposer = config, rank, make_proposer
        world = config.parallel.world_size
        set_up_worker_threads(config.device, config.num_threads, world)
        if config.device == "cuda" and (world > 1 or config.parallel.data_parallel_rank):
            torch.cuda.set_device(config.parallel.data_parallel_rank * world + rank)  # each core its own GPUs
        if world > 1:
            init_tensor_parallel(rank, world, config.device, distributed_init_method,
                                 config.parallel.enable_expert_parallel)
        # Triton's kernels of earlier starts compile in other processes while the weights load (issue 44)
        self._kernels = _start_kernels(config, rank)
        self.model_runner: ModelRunner | None = None
        self.model: torch.nn.Module | None = None
        self.hf_config = None
        self._profile: CollectiveProfile | None = None
        self.kv_connector: KVConnectorWorker | None = None  # a KV connector's copies (disaggregated serving)
        self.weight_offload: WeightOffload | None = None  # --cpu-offload-gb: the layers streamed from host memory
        # sleep mode (sleep / wake_up): what is asleep, the weights parked in host memory (level 1 on a GPU), and
        # the cache's arguments, to build it again on waking
        self._asleep: set[str] = set()
        self._host_weights: list[HostCopy] = []
        self._kv_args: tuple[int, int, int] | None = None
        self._grammar_info: str | None = None  # given again to a runner rebuilt after a level-2 sleep

    def load_model(self) -> ModelSpec:
        config = self.config
        loaded = load_model(config.model, config.device)
        self.model, self.hf_config = loaded.model, loaded.hf_config
        self.weight_offload = loaded.weight_offload
        hf_config = self.hf_config
        sched = config.scheduler
        runner = ModelRunner(self.model, config.cache.block_size, config.model.dtype, config.model.seed,
                             config.device, sched.async_scheduling, config.cache.cache_dtype,
                             max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                             batch_invariant=config.model.batch_invariant)
        if config.lora is not None:  # before the memory profile and graph capture (graphs apply the adapters)
            runner.lora = LoRAManager(self.model, config.lora, config.model.dtype, config.device)
        spec = config.speculative
        if spec is not None and runner.state_cache is not None:  # before the states are sized
            runner.state_cache.reserve_draft_rows(spec.num_speculative_tokens)
        if spec is not None and spec.method == "mtp" and not spec.model:  # the target's checkpoint holds the layer
            spec = replace(spec, model=loaded.source)
        synthetic = spec is not None and spec.rejection_sample_method == "synthetic"
        runner.set_proposer(self._make_proposer(spec, runner), spec.synthetic_acceptance_rates if synthetic else None)
        self.model_runner = runner
        per_block = runner.kv_cache_bytes_per_block()
        if runner.proposer is not None:  # a draft model's cache has as many blocks
            per_block += runner.proposer.kv_bytes_per_block()
        device_drafts = spec.num_speculative_tokens if runner.device_drafting else 0
        shares_tables = runner.proposer is not None and runner.proposer.shares_block_tables
        lookahead = spec.num_speculative_tokens if runner.device_drafting or shares_tables else 0
        chunk = None
        if config.offload is not None or config.kv_transfer is not None:
            layers = runner.attention_layers
            chunk = kv_chunk_shape(layers, kv_head_range(self.model, layers), config.cache.block_size)
        return ModelSpec(loaded.source, hf_config.vocab_size, _max_position(hf_config, self.model), per_block,
                         lookahead, device_drafts, chunk, runner.state_bytes_per_slot(),
                         _full_attention_bytes_per_block(runner, hf_config))

    def parameter_count(self) -> int:
        """Parameters this rank holds (its shards, and what every rank replicates)."""
        return sum(p.numel() for p in self.model.parameters())

    def set_grammar_tokenizer(self, info_json: str) -> None:
        """The tokenizer info structured outputs' grammars are read with (they come as xgrammar's JSON)."""
        self._grammar_info = info_json
        self.model_runner.grammars.set_tokenizer(info_json)

    def attach_kv_offload(self, handle) -> None:
        """Maps the KV offload CPU tier (a kv_offload.slab.SlabHandle) for the runner's copies."""
        self.model_runner.attach_kv_offload(handle)

    def attach_kv_connector(self, handle) -> None:
        """Maps a KV connector's staging buffer (a kv_offload.slab.SlabHandle) for this rank's copies."""
        runner = self.model_runner
        copier = OffloadCopier(handle, kv_head_range(self.model, runner.attention_layers), runner.device)
        self.kv_connector = KVConnectorWorker(copier, copier.mapped.tensor)

    def kv_connector_save(self, saves: list[tuple[int, int]]) -> None:
        """A finished request's blocks into staged chunks, (block, slot) pairs; done when this returns."""
        self.kv_connector.save_kv(self.model_runner.kv_caches, saves)

    def kv_connector_load(self, loads: list[tuple[int, int]]) -> None:
        """Chunks read from another engine into a newly admitted request's blocks, before its step's forward."""
        self.kv_connector.start_load_kv(self.model_runner.kv_caches, loads)
        self.kv_connector.wait_for_load()

    def _encoder_cache(self):
        return self.model_runner.multimodal.cache if self.model_runner.multimodal is not None else None

    def kv_connector_media_shapes(self, keys: list[str]) -> list:
        """E/P/D: the encoder cache's rows for these media hashes, (shape, dtype) or None where absent."""
        return self.kv_connector.media_shapes(self._encoder_cache(), keys)

    def kv_connector_encode_media(self, items: list) -> list:
        """E/P/D: encodes the MediaItems the encoder cache lacks (evicted before their rows were staged, or never
        computed: their tokens were prefix hits); returns each item's (shape, dtype) as kv_connector_media_shapes."""
        cache, model = self._encoder_cache(), self.model_runner.model
        missing = list({m.hash: m for m in items if cache is not None and m.hash not in cache}.values())
        if missing:
            with torch.inference_mode():
                for item, rows in zip(missing, model.encode_media(missing)):
                    cache.put(item.hash, rows)
        return self.kv_connector.media_shapes(cache, [m.hash for m in items])

    def kv_connector_save_media(self, saves: list[tuple[str, list[int]]]) -> None:
        """E/P/D: cached encoder rows into staged chunks, (media hash, slots); rank 0's (every rank's are equal)."""
        if self.rank == 0:
            self.kv_connector.save_media(self._encoder_cache(), saves)

    def kv_connector_load_media(self, loads: list) -> int:
        """E/P/D: encoder rows read from another engine into the encoder cache; returns the encoder runs so far."""
        cache = self._encoder_cache()
        if cache is None:
            return 0
        self.kv_connector.load_media(cache, loads, self.model_runner.device)
        return cache.encoder_runs

    def kv_connector_encoder_runs(self) -> int:
        """Media items this rank's encoder computed (E/P/D's /metrics counter)."""
        cache = self._encoder_cache()
        return cache.encoder_runs if cache is not None else 0

    def save_kernel_manifest(self) -> None:
        """The end of the start: the kernels it compiled are saved for the next start's precompile."""
        if self._kernels is not None:
            self._kernels.save()

    def determine_available_memory(self) -> int:
        """Bytes this rank can give the KV cache: the configured size, or on CUDA what a memory profile
        leaves (vLLM's rule): gpu_memory_utilization of the card, minus the weights and the activation
        peak of a max_num_batched_tokens forward pass (both in the profiled peak), memory outside
        torch's allocator (CUDA context, cuBLAS workspaces) and a reserve for CUDA graphs."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        peak = profile_peak_memory(self.model_runner, sched.max_num_batched_tokens, sched.max_num_seqs,
                                   _max_position(self.hf_config, self.model))
        free, total = torch.cuda.mem_get_info()
        outside_torch = (total - free) - torch.cuda.memory_reserved()
        graphs = 0 if self.config.compilation.enforce_eager else CUDA_GRAPH_RESERVE
        budget = int(total * cache.gpu_memory_utilization) - peak - outside_torch - graphs
        logger.info("memory profile: %.2f GiB of %.2f GiB usable; weights + activation peak %.2f GiB, outside "
                    "torch %.2f GiB, CUDA graph reserve %.2f GiB -> KV cache %.2f GiB",
                    total * cache.gpu_memory_utilization / (1 << 30), total / (1 << 30), peak / (1 << 30),
                    outside_torch / (1 << 30), graphs / (1 << 30), budget / (1 << 30))
        return budget

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int, num_state_slots: int = 1) -> None:
        """`max_model_len`: the longest sequence a block table must hold (lookahead slots included);
        `num_state_slots`: rows of the recurrent layers' state tensors."""
        self._kv_args = (num_blocks, max_model_len, num_state_slots)
        self.model_runner.initialize_kv_cache(num_blocks, max_model_len, num_state_slots)

    def compile_or_warm_up_model(self) -> bool:
        """Captures CUDA graphs for decode steps and, with speculation, verification steps (up to 1 + K
        query tokens per request); a draft model captures its own passes. Whether graphs are in use."""
        config = self.config
        if config.device != "cuda" or config.compilation.enforce_eager:
            return False
        runner = self.model_runner
        runner.capture_encoder_graphs(config.compilation.encoder_cudagraph_sizes)
        if not runner.model.cuda_graphs_supported:
            logger.warning("%s runs without CUDA graphs: its forward is not graph-safe yet",
                           type(runner.model).__name__)
            return False
        sched, spec, compilation = config.scheduler, config.speculative, config.compilation
        k = spec.num_speculative_tokens if spec is not None else 0
        runner.capture_cudagraphs(
            compilation.graph_shapes(sched.max_num_seqs, sched.max_num_batched_tokens, 1 + k), sched.max_num_seqs,
            decode_head=config.model.runner == "generate")
        if runner.proposer is not None:
            runner.proposer.capture_cudagraphs(compilation, sched.max_num_seqs, sched.max_num_batched_tokens)
        return True

    def profile_step_costs(self, max_drafts: int, max_model_len: int) -> StepCosts:
        """Two step shapes up to the largest decode step (max_num_seqs requests, each with every draft):
        plain decodes and verifications (1 + K query tokens per request), one more verification at a long
        context (attention grows with the context each query reads), and the drafter's own passes."""
        sched, runner = self.config.scheduler, self.model_runner
        largest = min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + max_drafts))
        ladder = [n for n in PROFILE_LADDER if n < largest] + [largest]
        counts = [n for n in ladder if n <= sched.max_num_seqs]
        decode = profile_step_costs(runner, counts, 1)
        verify = profile_step_costs(runner, ladder, 1 + max_drafts)
        bs, rows = self.config.cache.block_size, min(64, largest)  # rows is on the ladder: measured at short context
        long_ctx = max(2 * bs, min(1024, max_model_len // 2) // bs * bs)
        long_t = profile_step_costs(runner, [rows], 1 + max_drafts, long_ctx)[0][1]
        per_context_token = max(0.0, (long_t - dict(verify)[rows]) / (rows * (long_ctx - bs)))
        proposer = runner.proposer
        drafts = proposer.profile_decode_steps(counts)  # each draft position has a cost of its own
        first = proposer.profile_first_draft_steps(counts) if drafts is not None else None  # mirroring under async
        return StepCosts(verify, decode, per_context_token, drafts, first, proposer.profile_block_passes(counts))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        if self._profile is not None:
            self._profile.steps += 1
        return self.model_runner.execute_model(sched)

    def start_collective_profile(self) -> None:
        """Starts torch.profiler on this rank, for `stop_collective_profile` (bench gpu's all-reduce time)."""
        self._profile = CollectiveProfile.start(self.config.device)

    def stop_collective_profile(self) -> dict:
        """This rank's collectives since `start_collective_profile`: calls, seconds, and the steps run."""
        profile, self._profile = self._profile, None
        return profile.stop()

    def discard_inflight(self) -> None:
        """Drops the async carry-over (the last launched step and its tokens on the device) after a step
        failed: the requests it held are ended, and a stale output must not be resolved again."""
        self.model_runner.discard_inflight()

    # ---- sleep mode ----

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep, on this rank: level 1 frees the KV cache (its contents are lost) and moves the weights to
        host memory (on the CPU they are there already, and stay); level 2 frees the weights too (waking reloads
        them from the checkpoint, the loader's way). The engine core has ended or drained every request first.
        Returns the bytes freed: the cache's, and the weights' where they left the device or were dropped."""
        if level not in (1, 2):
            raise ValueError(f"Sleep level must be 1 or 2 (0 only pauses the scheduler); got {level}.")
        if self._asleep:
            logger.warning("the worker is asleep already; sleep(%d) changes nothing", level)
            return 0
        runner = self.model_runner
        runner.discard_inflight()
        runner.release_cuda_graphs()  # they hold the cache's and the weights' addresses
        freed = sum(t.untyped_storage().nbytes() for t in runner.kv_caches)
        runner.release_kv_cache()
        device = torch.device(self.config.device)
        if level == 1 and device.type != "cpu":
            self._host_weights = offload_to_host(device_storages(self.model, device))
            freed += sum(c.host.numel() for c in self._host_weights)
        elif level == 2:
            freed += model_bytes(self.model, device)
            if device.type == "cuda":  # now: a reference elsewhere (a proposer, an adapter's hooks) must not keep them
                drop_storages(device_storages(self.model, device))
            self.model_runner = self.model = None
        self._asleep = {"weights", "kv_cache"}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("sleep level %d freed %.3f GiB", level, freed / (1 << 30))
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: restores the weights and the KV cache, or those `tags` name (weights, kv_cache). The
        cache comes back empty. Once both are back, CUDA graphs are captured again (their addresses changed)."""
        for tag in check_wake_tags(tags):
            if tag not in self._asleep:
                continue
            self._asleep.discard(tag)
            if tag == "weights":
                self._wake_weights()
            elif self.model_runner is not None:  # else the cache is built with the reloaded weights' runner
                self.model_runner.initialize_kv_cache(*self._kv_args)
        if not self._asleep:
            self.compile_or_warm_up_model()

    def sleep_state(self) -> tuple[list[str], int]:
        """What is asleep on this rank (tags) and the bytes its KV cache holds now (a plain answer for the core's
        collective_rpc: tests and tools read every rank's)."""
        runner = self.model_runner
        held = 0 if runner is None else sum(t.untyped_storage().nbytes() for t in runner.kv_caches)
        return sorted(self._asleep), held

    def _wake_weights(self) -> None:
        if self.model_runner is not None:  # level 1: back from host memory
            restore_from_host(self._host_weights)
            self._host_weights = []
            return
        self.load_model()  # level 2: a new model and runner from the checkpoint, the loader's way
        if self._grammar_info is not None:
            self.model_runner.grammars.set_tokenizer(self._grammar_info)
        if "kv_cache" not in self._asleep:  # woken first, waiting for a runner
            self.model_runner.initialize_kv_cache(*self._kv_args)

    def shutdown(self) -> None:
        """Drops the model and its caches and returns the device's memory. The model's modules hold cycles
        (parameters keep their layer's bound weight loaders), so nothing is freed until a collection: one
        runs here rather than whenever the collector gets to it."""
        if self.model_runner is not None and self.model_runner.kv_offload is not None:
            self.model_runner.kv_offload.close()
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        self.model_runner = self.model = self.weight_offload = None
        if self._kernels is not None:
            self._kernels.close()
        destroy_tensor_parallel()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _start_kernels(config: EngineConfig, rank: int) -> StartupKernels | None:
    """On CUDA, the first engine's rank 0 precompiles and records (the ranks' kernels and the disk cache are shared:
    another rank's JIT finds in the disk cache what the pool compiled before it got there)."""
    if config.device != "cuda" or not config.compilation.precompile_kernels or rank or \
            config.parallel.data_parallel_rank:
        return None
    model = config.model
    return start_kernel_precompile(_model_identity(model.model, model.hf_overrides), str(model.dtype),
                                   model.quantization, config.parallel.tensor_parallel_size)


def _model_identity(model: str, hf_overrides: dict | None) -> str:
    """The model's config.json (its shapes), with --hf-overrides; a GGUF file's name and size; else its name."""
    try:
        path = resolve_model_path(model)
        text = Path(path, "config.json").read_text() if os.path.isdir(path) else \
            f"{os.path.basename(path)}:{os.path.getsize(path)}"
    except (OSError, ValueError):
        text = str(model)
    return text + json.dumps(hf_overrides, sort_keys=True, default=str)


def _full_attention_bytes_per_block(runner: ModelRunner, hf_config) -> int:
    """For a model with recurrent layers beside attention ones: its attention layers' KV bytes per block scaled to
    every decoder layer, the full-attention equivalent its capacity is set against. A model whose paged layers are
    not full attention says what full attention would keep per token (`full_attention_kv_per_token`: values)."""
    per_token = getattr(runner.model, "full_attention_kv_per_token", None)
    if per_token is not None and runner.state_cache is not None:
        return per_token * runner.block_size * runner.kv_dtype.itemsize
    layers = len(runner.attention_layers)
    if runner.state_cache is None or not layers:
        return 0
    return runner.kv_cache_bytes_per_block() * getattr(hf_config, "num_hidden_layers", layers) // layers


def _max_position(hf_config, model) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and not getattr(model, "applies_sliding_window",
                                                                                  False):
        limit = min(limit, window)  # a model that ignores the window must stay inside it
    return limit
