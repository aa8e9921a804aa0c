"""`pressroom bench gpu`: pressroom, HF transformers and the card's own ceilings, in one process, one JSON.

Ceilings first (copy bandwidth, bf16 matmul rate), then pressroom on dummy weights at a real model's
shapes, then HF transformers on the very same weights. Each figure is set against a physical bound:
batch-1 decode against the weight-streaming roofline, batched generation against the matmul rate.
Runs on the CPU too (tiny model, tiny workloads), so CI checks the plumbing.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.benchmarks.workload import Workload, machine, random_prompts
from pressroom.config import KV_CACHE_DTYPE_CHOICES

DEFAULT_MODEL = "llama-3.1-8b"  # a shape shipped in the package (pressroom/benchmarks/configs/)
WORKLOADS = ("decode", "throughput", "prefill")
IMAGE_WORKLOAD = "image"  # requests of one image and text against HF (benchmarks/vision.py), a run of its own
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WARMUP_REPS, TIMED_REPS = 3, 10
DECODE_READ_NOTE = ("bytes one batch-1 decode step reads: every weight except the input embedding table (one row of "
                    "it is read per token) and the routed experts the token did not select (top_k of num_experts per "
                    "MoE layer); the LM head counts in full even when tied; KV-cache reads not counted")
WARMUP_NOTE = ("pressroom: --warmup-requests requests of the workload, untimed, then the prefix cache reset; "
               "HF: one untimed batch of the timed shape per batch size; ceilings: 3 untimed reps, mean of 10")
FLOPS_NOTE = ("throughput: 2 x active non-embedding params x (prompt + output tokens) + 2 x LM-head params x output "
              "tokens; prefill: 2 x active non-embedding params x prompt tokens + 2 x LM-head params x prompts; "
              "active: a mixture of experts counts the top_k routed experts a token uses, not all of them; "
              "attention score FLOPs not counted")
# pressroom stacks these HF matrices row-wise, in this order.
UNSTACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# pressroom's stacked expert tensors under transformers' (>= 5) names: the same [experts, out, in] layout.
HF_EXPERTS = {"experts.w13": "experts.gate_up_proj", "experts.w2": "experts.down_proj"}


@dataclass(slots=True)
class Ceilings:
    copy_bytes_per_s: float  # read + write bytes
    copy_buffer_bytes: int
    matmul_flops_per_s: float
    matmul_size: int
    timer: str


@dataclass(slots=True)
class ModelSize:
    total_params: int  # unique parameters (a tied LM head counts once)
    embedding_params: int
    lm_head_params: int
    non_embedding_params: int  # everything but the input embedding and the LM head
    tied_word_embeddings: bool
    routed_expert_params: int  # all routed experts of every MoE layer (0: a dense model)
    active_non_embedding_params: int  # what one token computes with: the non-embedding params less the
    # routed experts it does not select
    bytes_per_param: int
    decode_read_bytes: int
    decode_read_note: str = DECODE_READ_NOTE
    # Quantized weights: decode_read_bytes as loaded (packed values and their scales), set from the engine
    loaded_decode_read_bytes: int | None = None


@dataclass(slots=True)
class Run:
    backend: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    input_tokens_per_s: float
    batch_size: int | None = None  # HF only: requests per generate call


# ---- ceilings ----

def mean_seconds(fn: Callable[[], object], device: torch.device, warmup: int = WARMUP_REPS,
                 reps: int = TIMED_REPS) -> float:
    """Mean time of `reps` calls after `warmup`; CUDA events on a GPU, so host overhead is not counted."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.fmean(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / mean_seconds(lambda: dst.copy_(src), device)


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / mean_seconds(lambda: torch.mm(a, b, out=c), device)


def measure_ceilings(device: torch.device, copy_bytes: int, matmul_size: int, dtype: torch.dtype) -> Ceilings:
    ceilings = Ceilings(copy_bandwidth(device, copy_bytes), copy_bytes, matmul_rate(device, matmul_size, dtype),
                        matmul_size, "cuda events" if device.type == "cuda" else "perf_counter")
    free_device_memory(device)  # the engine sizes its KV cache from what is free
    return ceilings


# ---- model shapes and FLOPs ----

def model_size(hf_config, dtype: torch.dtype) -> ModelSize:
    """Parameter counts of pressroom's model for this config, built on the meta device (no memory)."""
    from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from pressroom.model.registry import resolve_architecture
    with torch.device("meta"):
        model = resolve_architecture(hf_config)(hf_config)
    total = sum(p.numel() for p in model.parameters())
    embed = next(m for m in model.modules() if type(m) is VocabParallelEmbedding).weight
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead)).weight
    tied = head is embed
    non_embedding = total - embed.numel() - (0 if tied else head.numel())
    routed, unselected = routed_expert_params(model)
    active = non_embedding - unselected
    itemsize = dtype.itemsize
    return ModelSize(total, embed.numel(), head.numel(), non_embedding, tied, routed, active, itemsize,
                     (active + head.numel()) * itemsize)


def loaded_decode_read_bytes(model: nn.Module) -> int:
    """decode_read_bytes of the weights as the engine holds them: every parameter and the tensors a
    quantization method hangs on linear layers and experts (packed values, scales), less the input
    embedding (the LM head counts in full) and the routed experts a token does not select."""
    from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from pressroom.model.layers.fused_moe import FusedMoE
    from pressroom.model.layers.linear import LinearBase
    total, seen = 0.0, set()
    top_k = {id(b.experts): _router_top_k(b) for b in model.modules()
             if isinstance(getattr(b, "experts", None), FusedMoE) and _router_top_k(b)}
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    for module in model.modules():
        if type(module) is VocabParallelEmbedding and module.weight is not head.weight:
            seen.add(id(module.weight))
        holds_weights = isinstance(module, LinearBase | FusedMoE | ParallelLMHead)
        tensors = [*module.parameters(recurse=False), *(module.buffers(recurse=False) if holds_weights else ())]
        share = top_k[id(module)] / module.num_experts if id(module) in top_k else 1.0
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size() * share
    return int(total)


def routed_expert_params(model: nn.Module) -> tuple[int, int]:
    """All routed experts' parameters, and those a token leaves unselected ((E - top_k) / E of them)."""
    from pressroom.model.layers.fused_moe import FusedMoE
    routed = unselected = 0
    for block in model.modules():
        experts, top_k = getattr(block, "experts", None), _router_top_k(block)
        if isinstance(experts, FusedMoE) and top_k:
            params = experts.w13.numel() + experts.w2.numel()
            routed += params
            unselected += params * (experts.num_experts - top_k) // experts.num_experts
    return routed, unselected


def _router_top_k(block: nn.Module) -> int | None:
    """Experts per token of an MoE block: its `router` (a RouterConfig) or a `gate` module that knows it (V4)."""
    for name in ("router", "gate"):
        top_k = getattr(getattr(block, name, None), "top_k", None)
        if top_k:
            return top_k
    return None


def model_flops(size: ModelSize, body_tokens: int, lm_head_positions: int) -> float:
    """Matmul FLOPs: every token through the layers (the experts it selects), only the sampled positions
    through the LM head."""
    return 2.0 * size.active_non_embedding_params * body_tokens + 2.0 * size.lm_head_params * lm_head_positions


def batch_read_bytes(size: ModelSize, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens reads: what each token reads alone (the decode bound's bytes)
    less the routed experts it selects, plus every routed expert at least one of the tokens selects. Uniform
    routing: an expert is left by all `batch` tokens with probability (unselected share) ** batch. Quantized weights
    scale by their loaded bytes; KV-cache reads not counted."""
    per_token = size.loaded_decode_read_bytes or size.decode_read_bytes
    if not size.routed_expert_params:
        return per_token
    scale = per_token / size.decode_read_bytes  # quantized: loaded bytes per bf16-equivalent byte
    unselected = size.non_embedding_params - size.active_non_embedding_params
    routed_bytes = size.routed_expert_params * size.bytes_per_param * scale
    share_untouched = unselected / size.routed_expert_params
    selected_bytes = routed_bytes * (1 - share_untouched)
    return per_token - selected_bytes + routed_bytes * (1 - share_untouched ** batch)


def throughput_roofline(size: ModelSize, ceilings: Ceilings, run: Run, flops: float, batch: int) -> dict:
    """The throughput workload's roofline: output tokens a second if every step were decode steps of `batch`
    sequences at the copy bandwidth (weights only), against the matmul-rate bound; the smaller binds. A mixture of
    experts at a few hundred sequences reads nearly all its experts each step: bandwidth, not FLOPs, binds it."""
    memory = batch * ceilings.copy_bytes_per_s / batch_read_bytes(size, batch)
    compute = ceilings.matmul_flops_per_s * run.output_tokens / flops
    return {"decode_batch": batch, "memory_bound_tokens_per_s": round(memory, 2),
            "roofline_tokens_per_s": round(min(memory, compute), 2),
            "pressroom_over_roofline": round(run.output_tokens_per_s / min(memory, compute), 4)}


def workload_flops(name: str, size: ModelSize, run: Run) -> float:
    """Prefill's one output token is sampled, never fed back: the layers see the prompts only. Generation
    counts prompt and output tokens through the layers (the usual 2 x params x tokens rule)."""
    body = run.input_tokens if name == "prefill" else run.input_tokens + run.output_tokens
    return model_flops(size, body, run.output_tokens)


# ---- workloads ----

def build_workloads(args, vocab_size: int) -> dict[str, Workload]:
    shapes = {"decode": (1, args.decode_input_len, args.decode_output_len),
              "throughput": (args.num_prompts, args.input_len, args.output_len),
              "prefill": (args.prefill_prompts, args.prefill_len, 1)}
    # A different seed per workload, so no workload's prompts are another's prefix.
    return {name: Workload(random_prompts(n, length, vocab_size, args.seed + i), out, ignore_eos=True)
            for i, (name, (n, length, out)) in enumerate(shapes.items()) if name in args.workloads}


def required_model_len(workloads: dict[str, Workload]) -> int:
    return max(max(len(p) for p in w.prompts) + w.output_len for w in workloads.values())


# ---- pressroom ----

def pressroom_kwargs(args, max_model_len: int) -> tuple[dict, list[str]]:
    """Engine arguments for this run, and those this engine build does not know yet (left out)."""
    from pressroom.config import EngineArgs
    wanted = {"model": str(args.model), "load_format": "dummy", "dtype": args.dtype, "device": args.device,
              "max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager,
              "skip_tokenizer_init": True, "seed": args.seed, "kv_cache_dtype": args.kv_cache_dtype,
              "quantization": args.quantization, "tensor_parallel_size": args.tensor_parallel_size,
              "encoder_cudagraph_sizes": args.encoder_cudagraph_sizes}
    if args.kv_cache_memory_gib is not None:
        wanted["kv_cache_memory_gib"] = args.kv_cache_memory_gib
    known = EngineArgs.names()
    return {k: v for k, v in wanted.items() if k in known}, sorted(set(wanted) - known)


def build_llm(kwargs: dict, device: torch.device):
    """The engine and its time to ready (weights, KV cache, and CUDA-graph capture where there is one)."""
    from pressroom import LLM
    sync(device)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    sync(device)
    return llm, time.perf_counter() - start


def run_pressroom(llm, workload: Workload, warmup_requests: int, device: torch.device) -> Run:
    from pressroom import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: int) -> list:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    generate(workload.prompts[:warmup_requests], workload.output_len)
    reset_prefix_cache(llm)  # the timed pass must compute every prompt
    sync(device)
    start = time.perf_counter()
    outputs = generate(workload.prompts, workload.output_len)
    sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return make_run("pressroom", workload.prompts, produced, elapsed)


def reset_prefix_cache(llm) -> None:
    reset = getattr(llm, "reset_prefix_cache", None) or llm.engine.kv_cache.reset_prefix_cache
    reset()


# ---- HF transformers on pressroom's weights ----

def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """pressroom's parameters under HF names: stacked qkv / gate_up matrices split back into their parts
    (views, no copies, where the weight is held plainly; rows a model reordered at load, such as
    DeepSeek's rope rows, back in the checkpoint's order). Tensor parallelism must be 1."""
    modules = dict(model.named_modules())
    to_checkpoint = getattr(model, "to_checkpoint_layout", None)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, kind = name.rpartition(".")
        module = modules[module_name]
        tensor = plain_tensor(module, kind, param)
        if to_checkpoint is not None:
            tensor = to_checkpoint(name, tensor)
        expert_name = next((hf for ours, hf in HF_EXPERTS.items() if name.endswith(ours)), None)
        if expert_name is not None:
            state[name.rsplit(".", 2)[0] + "." + expert_name] = tensor
            continue
        parent, _, leaf = module_name.rpartition(".")
        if leaf not in UNSTACKED:
            state[name] = tensor
            continue
        if getattr(module, "tp_size", 1) != 1:
            raise ValueError("Copying weights to HF needs tensor_parallel_size 1.")
        for part, piece in zip(UNSTACKED[leaf], tensor.split(stacked_sizes(module), dim=0), strict=True):
            state[f"{parent}.{part}.{kind}"] = piece
    to_hf = getattr(model, "to_hf_state", None)  # a family whose HF layout differs further (gpt-oss's experts)
    return state if to_hf is None else to_hf(state)


def plain_tensor(module: nn.Module, kind: str, param: nn.Parameter) -> torch.Tensor:
    """The parameter's values in plain layout; bf16 CPU linears keep theirs only oneDNN-blocked."""
    blocked = getattr(module, "onednn", None)
    if kind == "weight" and blocked is not None and param.numel() == 0:
        return blocked.to_dense()
    return param.data


def stacked_sizes(module: nn.Module) -> list[int]:
    from pressroom.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    if isinstance(module, QKVParallelLinear):
        kv = module.num_kv_heads * module.head_dim
        return [module.num_heads * module.head_dim, kv, kv]
    if isinstance(module, MergedColumnParallelLinear):
        return list(module.output_sizes)
    raise TypeError(f"{type(module).__name__} is not a stacked linear layer.")


def load_into_hf(hf_model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy every HF parameter from `state` (and the buffers it names, such as DeepSeek-V3's router
    correction bias); names and shapes must match one to one."""
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    params.update((n, b) for n, b in hf_model.named_buffers() if n in state)
    missing, extra = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
    if missing or extra:
        raise ValueError(f"pressroom and HF parameters differ: HF lacks {extra[:3]}, pressroom lacks {missing[:3]}.")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != state[name].shape:
                raise ValueError(f"{name}: pressroom has {tuple(state[name].shape)}, HF {tuple(param.shape)}.")
            param.copy_(state[name])


def build_hf(model_path: Path, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> nn.Module:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_path)
    # SDPA where HF's model has it; gpt-oss's sinks need its eager attention
    attention = "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    load_into_hf(model, state)
    model.generation_config.eos_token_id = None  # ignore EOS: every request runs to its length
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.inference_mode()
def hf_generate(model: nn.Module, prompts: list[list[int]], output_len: int, device: torch.device) -> int:
    """Greedy generate for one batch of equal-length prompts; returns the output tokens produced."""
    ids = torch.tensor(prompts, device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                         min_new_tokens=output_len, do_sample=False)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def run_hf(model: nn.Module, workload: Workload, batch_size: int, max_requests: int, device: torch.device) -> Run:
    prompts = workload.prompts[:max_requests]
    batch_size = min(batch_size, len(prompts))
    # Warm-up: one untimed batch of the timed shape. A short one is not enough: the first pass through each
    # new sequence length ran HF about 3x slower per token on the H200 (attention kernels picked per shape).
    hf_generate(model, prompts[:batch_size], workload.output_len, device)
    sync(device)
    start = time.perf_counter()
    produced = sum(hf_generate(model, prompts[i:i + batch_size], workload.output_len, device)
                   for i in range(0, len(prompts), batch_size))
    sync(device)
    return make_run("hf", prompts, produced, time.perf_counter() - start, batch_size)


def run_hf_workloads(model: nn.Module, workloads: dict[str, Workload], args, device: torch.device
                     ) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {}
    if "decode" in workloads:
        runs["decode"] = [run_hf(model, workloads["decode"], 1, 1, device)]
    if "throughput" in workloads:
        runs["throughput"] = [run_hf(model, workloads["throughput"], b, args.hf_max_requests, device)
                              for b in args.hf_batch_sizes]
    if "prefill" in workloads:
        w = workloads["prefill"]
        runs["prefill"] = [run_hf(model, w, args.hf_prefill_batch_size, len(w.prompts), device)]
    return runs


# ---- the whole run ----

def make_run(backend: str, prompts: list[list[int]], produced: int, elapsed: float,
             batch_size: int | None = None) -> Run:
    inputs = sum(len(p) for p in prompts)
    return Run(backend, len(prompts), inputs, produced, round(elapsed, 4), round(produced / elapsed, 2),
               round(inputs / elapsed, 2), batch_size)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The caching allocator's retries (it freed its cache, a device-wide sync, to fit an allocation) and
    its cudaFree calls so far: either inside a timed run stalls the pipeline."""
    if device.type != "cuda":
        return {"alloc_retries": 0, "device_frees": 0}
    stats = torch.cuda.memory_stats(device)
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_frees": stats.get("num_device_free", 0)}


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no GPU; use --device cpu with a tiny model to test.")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {name!r}.")
    return torch.device(name)


def run(args) -> dict:
    if args.executors:
        return run_executors(args)
    if args.batch_invariant:
        return run_batch_invariant(args)
    from pressroom.model.loader import load_hf_config
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    hf_config = load_hf_config(str(args.model))
    size = model_size(hf_config, dtype)
    workloads = build_workloads(args, hf_config.vocab_size)
    copy_bytes = int((args.copy_gib or (4.0 if device.type == "cuda" else 0.25)) * (1 << 30))
    matmul_n = args.matmul_size or (8192 if device.type == "cuda" else 1024)
    ceilings = measure_ceilings(device, copy_bytes, matmul_n, dtype)
    kwargs, dropped = pressroom_kwargs(args, required_model_len(workloads))
    llm, ready_s = build_llm(kwargs, device)
    phases = {name: round(seconds, 3) for name, seconds in llm.engine.startup_phases.items()}
    ranks = args.tensor_parallel_size
    if args.quantization not in ("auto", "none") and ranks == 1:  # the roofline of the bytes the engine reads
        size.loaded_decode_read_bytes = loaded_decode_read_bytes(llm.engine.model)
    ours, allocator = {}, {}
    for name, w in workloads.items():
        before = allocator_counts(device)
        ours[name] = run_pressroom(llm, w, args.warmup_requests, device)
        allocator[name] = {k: v - before[k] for k, v in allocator_counts(device).items()}
        print(f"pressroom {name}: {ours[name].output_tokens_per_s:.1f} output tok/s "
              f"({ours[name].input_tokens_per_s:.1f} input tok/s)", flush=True)  # kept if a later phase fails
    collectives = profile_collectives(llm, workloads, args, hf_config, dtype, device) if ranks > 1 else None
    # HF runs dense weights on one device: a quantized engine's are not its to copy, and ranks' shards live in
    # their own processes, so HF is skipped for both (run TP 1 beside for the comparison)
    skip_hf = args.skip_hf or args.quantization not in ("auto", "none") or ranks > 1
    state = None if skip_hf else hf_state_dict(llm.engine.model)  # views: only the weights outlive the engine
    del llm
    free_device_memory(device)
    hf_runs, memory, hf_info = run_hf_phase(state, workloads, args, device, dtype) if state else ({}, {}, {})
    from pressroom.config import default_max_num_seqs
    max_num_seqs = args.max_num_seqs or default_max_num_seqs(device.type)
    report = {"benchmark": "gpu", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": device_machine(device),
              "device": device.type, "model": str(args.model), "dtype": args.dtype, "engine_args": kwargs,
              "engine_args_not_supported": dropped, "time_to_ready_s": round(ready_s, 3),
              "time_to_ready_phases_s": phases, "hf": hf_info, "model_size": asdict(size),
              "ceilings": asdict(ceilings), "flops_note": FLOPS_NOTE,
              "warmup_note": WARMUP_NOTE, "memory": memory, "allocator_during_pressroom": allocator,
              "tensor_parallel_size": ranks, "collectives": collectives,
              "workloads": {name: workload_report(name, workloads[name], ours[name], hf_runs.get(name), size,
                                                  ceilings, ranks, max_num_seqs) for name in workloads}}
    report["ratios"] = summary_ratios(report["workloads"])
    print_report(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def run_executors(args) -> dict:
    """pressroom alone, once per executor (`--executors uni,mp`), the same workloads in one run: what a worker
    in a process of its own costs against the in-process one. Each engine is shut down before the next."""
    from pressroom.model.loader import load_hf_config
    device = resolve_device(args.device)
    workloads = build_workloads(args, load_hf_config(str(args.model)).vocab_size)
    kwargs, dropped = pressroom_kwargs(args, required_model_len(workloads))
    figures: dict[str, dict[str, dict]] = {}
    for backend in args.executors:
        llm, ready_s = build_llm(kwargs | {"distributed_executor_backend": backend}, device)
        figures[backend] = {"time_to_ready_s": round(ready_s, 3)}
        for name, w in workloads.items():
            r = run_pressroom(llm, w, args.warmup_requests, device)
            figures[backend][name] = {"output_tokens_per_s": round(r.output_tokens_per_s, 2),
                                      "input_tokens_per_s": round(r.input_tokens_per_s, 2)}
            print(f"{backend} {name}: {r.output_tokens_per_s:.1f} output tok/s", flush=True)
        llm.shutdown()
        del llm
        free_device_memory(device)
    base = args.executors[0]
    ratios = {backend: {name: round(figures[backend][name]["output_tokens_per_s"]
                                    / figures[base][name]["output_tokens_per_s"], 4) for name in workloads}
              for backend in args.executors[1:]}
    report = {"benchmark": "gpu-executors", "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": device_machine(device), "device": device.type, "model": str(args.model),
              "engine_args": kwargs, "engine_args_not_supported": dropped, "executors": figures,
              f"ratios_vs_{base}": ratios}
    print(json.dumps(ratios))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def run_batch_invariant(args) -> dict:
    """The workloads on the default engine and then on `--batch-invariant`'s, in one run (no HF phase): the
    mode's cost as its output tok/s over the default's."""
    from pressroom.model.loader import load_hf_config
    device = resolve_device(args.device)
    workloads = build_workloads(args, load_hf_config(str(args.model)).vocab_size)
    kwargs, dropped = pressroom_kwargs(args, required_model_len(workloads))
    figures: dict[str, dict] = {}
    for mode, invariant in (("default", False), ("batch_invariant", True)):
        llm, ready_s = build_llm(kwargs | {"batch_invariant": invariant}, device)
        figures[mode] = {"time_to_ready_s": round(ready_s, 3)}
        for name, w in workloads.items():
            r = run_pressroom(llm, w, args.warmup_requests, device)
            figures[mode][name] = {"output_tokens_per_s": round(r.output_tokens_per_s, 2),
                                   "input_tokens_per_s": round(r.input_tokens_per_s, 2)}
            print(f"{mode} {name}: {r.output_tokens_per_s:.1f} output tok/s "
                  f"({r.input_tokens_per_s:.1f} input tok/s)", flush=True)
        llm.shutdown()
        del llm
        free_device_memory(device)
    ratios = {name: round(figures["batch_invariant"][name]["output_tokens_per_s"]
                          / figures["default"][name]["output_tokens_per_s"], 4) for name in workloads}
    report = {"benchmark": "gpu-batch-invariant", "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": device_machine(device), "device": device.type, "model": str(args.model),
              "engine_args": kwargs, "engine_args_not_supported": dropped, "modes": figures,
              "ratios_invariant_vs_default": ratios}
    print(json.dumps(ratios))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def run_hf_phase(state: dict[str, torch.Tensor], workloads: dict[str, Workload], args, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict[str, list[Run]], dict[str, int], dict[str, str | None]]:
    """HF on pressroom's weights; `state` is emptied once copied, so the engine's last tensors go too.
    Also which transformers ran, and its MoE experts implementation (grouped_mm where it can)."""
    import transformers
    memory = {"after_engine_freed_bytes": allocated_bytes(device)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    hf_model = build_hf(Path(args.model), state, device, dtype)
    state.clear()
    info = {"transformers": transformers.__version__,
            "experts_implementation": getattr(hf_model.config, "_experts_implementation", None)}
    runs = run_hf_workloads(hf_model, workloads, args, device)
    memory["hf_peak_bytes"] = peak_bytes(device)
    del hf_model
    free_device_memory(device)
    return runs, memory, info


def device_machine(device: torch.device) -> dict:
    info = machine()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return info


def workload_report(name: str, workload: Workload, ours: Run, hf: list[Run] | None, size: ModelSize,
                    ceilings: Ceilings, ranks: int = 1, max_num_seqs: int | None = None) -> dict:
    """Figures, the physical bound and the ratios of one workload. Prefill compares prompt tokens/s
    (its bound ratio is the model FLOP utilisation); the others compare output tokens/s. With `ranks`
    devices (tensor parallelism) the bound is theirs together: each reads and multiplies its shard. Throughput
    also gets its roofline (throughput_roofline) at the sequences that run at once (max_num_seqs at most), on one
    device."""
    key = "input_tokens_per_s" if name == "prefill" else "output_tokens_per_s"
    bound_name, bound = workload_bound(name, ours, size, ceilings)
    if ranks > 1:
        bound_name, bound = f"{ranks} devices x {bound_name}", bound * ranks
    best_hf = max(hf, key=lambda r: getattr(r, key)) if hf else None
    section = {"num_requests": len(workload.prompts), "input_len": len(workload.prompts[0]),
               "output_len": workload.output_len, "compared": key, "bound": bound_name,
               "bound_tokens_per_s": round(bound, 2), "pressroom": asdict(ours),
               "hf": asdict(best_hf) if best_hf else None,
               "pressroom_over_bound": round(getattr(ours, key) / bound, 4),
               "hf_over_bound": round(getattr(best_hf, key) / bound, 4) if best_hf else None,
               "pressroom_over_hf": round(getattr(ours, key) / getattr(best_hf, key), 3) if best_hf else None}
    if name == "decode":
        return section
    flops = workload_flops(name, size, ours)
    section["flops"] = flops
    if name == "throughput":
        section["flops_per_output_token"] = flops / ours.output_tokens
        section["hf_by_batch_size"] = [asdict(r) for r in hf or []]
        if ranks == 1:
            batch = min(len(workload.prompts), max_num_seqs or len(workload.prompts))
            section["roofline"] = throughput_roofline(size, ceilings, ours, flops, batch)
    else:
        section["pressroom_mfu"] = section["pressroom_over_bound"]
        section["hf_mfu"] = section["hf_over_bound"]
    return section


def workload_bound(name: str, run: Run, size: ModelSize, ceilings: Ceilings) -> tuple[str, float]:
    if name == "decode":
        if size.loaded_decode_read_bytes:
            return ("copy bandwidth / loaded_decode_read_bytes",
                    ceilings.copy_bytes_per_s / size.loaded_decode_read_bytes)
        return "copy bandwidth / decode_read_bytes", ceilings.copy_bytes_per_s / size.decode_read_bytes
    flops = workload_flops(name, size, run)
    if name == "throughput":
        return "matmul rate / FLOPs per output token", ceilings.matmul_flops_per_s * run.output_tokens / flops
    return "matmul rate / FLOPs per prompt token (ratio = MFU)", ceilings.matmul_flops_per_s * run.input_tokens / flops


def profile_collectives(llm, workloads: dict[str, Workload], args, hf_config, dtype: torch.dtype,
                        device: torch.device) -> dict:
    """Each rank's collectives over one more, untimed pass of the decode workload (or the first one), under
    torch.profiler: all-reduce time per step against the cost model of docs/PARALLELISM.md (a ring
    all-reduce: a fixed latency per call plus 2 (n - 1) / n of the tensor over the bus bandwidth)."""
    name = "decode" if "decode" in workloads else next(iter(workloads))
    workload = workloads[name]
    executor = llm.engine.core.executor
    executor.collective_rpc("start_collective_profile")
    run_pressroom(llm, workload, 0, device)
    per_rank = executor.collective_rpc("stop_collective_profile")
    ranks, steps = args.tensor_parallel_size, per_rank[0]["steps"]
    calls = per_rank[0]["all_reduce"]["calls"] / max(1, steps)
    tokens = len(workload.prompts) * (len(workload.prompts[0]) + workload.output_len) / max(1, steps)
    tensor_bytes = tokens * hf_config.hidden_size * dtype.itemsize  # one all-reduced activation, a step's tokens
    model_s = calls * (args.allreduce_latency_us * 1e-6 + tensor_bytes * 2 * (ranks - 1) / ranks
                       / (args.allreduce_bus_gbps * 1e9))
    measured = [r["all_reduce"]["seconds"] / max(1, r["steps"]) for r in per_rank]
    return {"workload": name, "steps": steps, "all_reduce_calls_per_step": calls,
            "all_reduce_s_per_step": measured, "all_gather_s_per_step":
                [r["all_gather"]["seconds"] / max(1, r["steps"]) for r in per_rank],
            "model_all_reduce_s_per_step": model_s, "model_assumes": {
                "latency_us_per_call": args.allreduce_latency_us, "bus_gb_per_s": args.allreduce_bus_gbps,
                "tokens_per_step": tokens, "bytes_per_call": tensor_bytes},
            "note": "device time of NCCL kernels on CUDA, wall time of gloo transfers on the CPU; per rank"}


def summary_ratios(sections: dict[str, dict]) -> dict[str, float | None]:
    ratios = {}
    for name, s in sections.items():
        ratios[f"{name}.pressroom/hf"] = s["pressroom_over_hf"]
        ratios[f"{name}.pressroom/bound"] = s["pressroom_over_bound"]
        ratios[f"{name}.hf/bound"] = s["hf_over_bound"]
    return ratios


def print_report(report: dict) -> None:
    c = report["ceilings"]
    print(f"\n== bench gpu: {Path(report['model']).name} ({report['dtype']}) on {report['device']} ==")
    print(f"ceilings: copy {c['copy_bytes_per_s'] / 1e12:.3f} TB/s (read+write), "
          f"matmul {c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({c['matmul_size']}^3, {c['timer']})")
    parts = ", ".join(f"{name} {s:.1f}" for name, s in report.get("time_to_ready_phases_s", {}).items())
    print(f"pressroom time to ready: {report['time_to_ready_s']:.1f} s ({parts})")
    print(f"{'workload':<11}{'tokens/s of':>12}{'pressroom':>12}{'hf':>12}{'bound':>12}{'pr/hf':>8}"
          f"{'pr/bound':>10}{'hf/bound':>10}")
    for name, s in report["workloads"].items():
        key = s["compared"]
        hf = s["hf"][key] if s["hf"] else None
        print(f"{name:<11}{key.split('_')[0]:>12}{s['pressroom'][key]:>12.1f}{_fmt(hf, 12, '.1f')}"
              f"{s['bound_tokens_per_s']:>12.1f}{_fmt(s['pressroom_over_hf'], 8, '.2f')}"
              f"{s['pressroom_over_bound']:>10.3f}{_fmt(s['hf_over_bound'], 10, '.3f')}")
    roofline = report["workloads"].get("throughput", {}).get("roofline")
    if roofline:
        print(f"throughput roofline at {roofline['decode_batch']} sequences a step: "
              f"{roofline['roofline_tokens_per_s']:.1f} tok/s (weights at the copy bandwidth: "
              f"{roofline['memory_bound_tokens_per_s']:.1f}); pressroom at {roofline['pressroom_over_roofline']:.3f}")
    col = report.get("collectives")
    if col:
        measured = ", ".join(f"{x * 1e3:.3f}" for x in col["all_reduce_s_per_step"])
        print(f"TP {report['tensor_parallel_size']}, {col['workload']}: {col['all_reduce_calls_per_step']:.0f} "
              f"all-reduces per step, {measured} ms per step by rank; cost model "
              f"{col['model_all_reduce_s_per_step'] * 1e3:.3f} ms")


def _fmt(value: float | None, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


# ---- command line ----

def _executors(text: str) -> list[str]:
    from pressroom.config import EXECUTOR_BACKENDS
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) < 2 or any(n not in EXECUTOR_BACKENDS for n in names):
        raise argparse.ArgumentTypeError(f"give two or more of {', '.join(EXECUTOR_BACKENDS)}; got {text!r}")
    return names


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in (*WORKLOADS, IMAGE_WORKLOAD)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"workloads must come from {', '.join(WORKLOADS)}, or {IMAGE_WORKLOAD} "
                                         f"alone; got {text!r}")
    if IMAGE_WORKLOAD in names and len(names) > 1:
        raise argparse.ArgumentTypeError(f"{IMAGE_WORKLOAD} runs alone (its own engine and HF model); got {text!r}")
    return names


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated; got {text!r}")
    return values


def add_gpu_bench_args(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--model", type=shape_arg, default=DEFAULT_MODEL, help=shape_help("the model, dummy weights"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda, or cpu to test the plumbing with a tiny model")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="the weights' dtype (pressroom and HF)")
    p.add_argument("--workloads", type=_names, default=list(WORKLOADS), help="comma-separated subset of "
                   + ",".join(WORKLOADS) + f", or {IMAGE_WORKLOAD} alone")
    p.add_argument("--image-size", type=int, default=1024,
                   help=f"{IMAGE_WORKLOAD}: the side of each request's square random image, in pixels (--input-len "
                        "text tokens before it; a vision-language model's shape, such as qwen2.5-vl-7b)")
    p.add_argument("--decode-input-len", type=int, default=32, help="batch-1 decode: prompt length")
    p.add_argument("--decode-output-len", type=int, default=256, help="batch-1 decode: output length")
    p.add_argument("--num-prompts", type=int, default=1000, help="throughput requests")
    p.add_argument("--input-len", type=int, default=512, help="throughput prompt length")
    p.add_argument("--output-len", type=int, default=256, help="throughput output length")
    p.add_argument("--prefill-prompts", type=int, default=16, help="prefill: prompts, one output token each")
    p.add_argument("--prefill-len", type=int, default=2048, help="prefill: prompt length")
    p.add_argument("--warmup-requests", type=int, default=4, help="untimed requests before each pressroom pass")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the dummy weights")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="below the engine's 0.92 so HF still fits after the engine is freed")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV-cache size in GiB (default: the engine's; on CUDA from --gpu-memory-utilization)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests running at once at most (default: the engine's, 1024 on CUDA)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="tokens one engine step computes at most")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--encoder-cudagraph-sizes", default=None,
                   help="the engine's: patch counts of the vision tower's CUDA graphs (default: the engine's)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="pressroom's KV-cache dtype (auto: the model's); HF keeps the model's")
    p.add_argument("--quantization", default="auto", help="the engine's --quantization (fp8, mxfp4: weights "
                   "quantized at load; HF is then skipped); the decode bound then counts the bytes as loaded")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs) the engine shards the model over; above 1: HF is skipped, the bounds count "
                        "every rank, and each rank's all-reduce time per step is profiled")
    p.add_argument("--allreduce-latency-us", type=float, default=8.0,
                   help="the all-reduce cost model's fixed cost per call (docs/PARALLELISM.md)")
    p.add_argument("--allreduce-bus-gbps", type=float, default=360.0,
                   help="the all-reduce cost model's bus bandwidth, GB/s (NVLink 4 on H200s)")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers runs")
    p.add_argument("--hf-batch-sizes", type=positive_ints, default=[64, 128, 256],
                   help="comma-separated batch sizes HF's throughput runs at")
    p.add_argument("--hf-max-requests", type=int, default=256, help="throughput requests HF runs per batch size")
    p.add_argument("--hf-prefill-batch-size", type=int, default=16,
                   help="prompts per HF prefill batch (8: two batches)")
    p.add_argument("--copy-gib", type=float, default=None,
                   help="the copy ceiling's buffer in GiB (default: 4 on cuda, 0.25 on cpu)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="n of the matmul ceiling's n^3 matmul (default: 8192 on cuda, 1024 on cpu)")
    p.add_argument("--executors", type=_executors, default=None,
                   help="compare executors in one run, e.g. uni,mp: pressroom's workloads once per executor "
                        "(no HF phase), the later ones' output tok/s as ratios of the first's")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the workloads on the default engine, then with --batch-invariant, in one run (no HF "
                        "phase): the mode's output tok/s as a ratio of the default's")
    p.add_argument("--output-json", default=None, help="write the report here too (default: print only)")
