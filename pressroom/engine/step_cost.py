"""Per-step estimates of floating-point operations and memory traffic, per GPU, for vLLM's MFU metrics
(vllm:estimated_flops_per_gpu_total, vllm:estimated_read_bytes_per_gpu_total,
vllm:estimated_write_bytes_per_gpu_total; counted with --enable-mfu-metrics, as vLLM counts them).

The figures come from the model's shape alone (its HF config) and each step's token counts, never from the device:
- each matrix multiply of n rows through an (in x out) weight costs 2 n in out FLOPs, reads its weight once per step
  and its n input rows, and writes its n output rows: per layer the attention projections (q, k, v; o) and the
  feed-forward (gate and up; down), for a mixture of experts the routed experts' (top-k rows per token, the weights
  of the experts those rows can reach, at most all of them) and the shared experts'; then the LM head over the rows
  that are sampled;
- attention: each of a request's new tokens attends over the request's context at the end of the step (its
  computed tokens plus the new ones, as vLLM counts it): QK^T and PV cost 2 heads head_dim context FLOPs each;
  it reads the new tokens' queries and the context's keys and values from the KV cache, and writes the new tokens'
  keys and values to it;
- per GPU: heads, the feed-forward's width and the vocabulary split over the tensor-parallel ranks.
Left out (small beside the above): norms, rotary embeddings, the embedding lookup, softmax, the sampler.

The same estimates, over the device's roofline (`Roofline`: its bf16 matmul rate and memory bandwidth, by the GPU's
name, `device_roofline`), time a step for the scheduler's step-time bound (`StepTimer`, core/step_time.py): the
matmuls and attention each take the longer of their FLOPs at the matmul rate and their bytes at the bandwidth (they
run as kernels of their own, so one's reads do not hide under the other's FLOPs), at the shares of those rates an
engine reaches, until the engine's measured step times have fitted its own (core/step_time.py's StepTimeFit).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pressroom.core.outputs import SchedulerOutput
from pressroom.core.step_time import FIT_OUTLIER, StepLoad, StepTimeFit

logger = logging.getLogger("pressroom")


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: int = 0
    read_bytes: int = 0
    write_bytes: int = 0

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(self.flops + other.flops, self.read_bytes + other.read_bytes,
                        self.write_bytes + other.write_bytes)


@dataclass(frozen=True, slots=True)
class RequestStep:
    """One request's share of a step: `num_tokens` new tokens after `num_computed` ones; `num_sampled`: the rows
    of them that go through the LM head (a prefill chunk's last, a decode's token, verified drafts)."""
    num_tokens: int
    num_computed: int
    num_sampled: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What the estimates need of a decoder, per GPU (heads, widths and vocabulary already split over the
    tensor-parallel ranks)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # a dense layer's feed-forward width (0: every layer is a mixture of experts)
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # all shared experts together (0: none)
    vocab_size: int
    weight_bytes: float  # per parameter (0.5 for 4-bit weights)
    activation_bytes: int
    kv_bytes: int  # per element of the KV cache

    @classmethod
    def from_hf_config(cls, hf_config: Any, *, tp_size: int = 1, weight_bytes: float, activation_bytes: int,
                       kv_bytes: int) -> ModelShape:
        """From an HF config (a multi-modal model's text_config), split over `tp_size` ranks. ValueError naming
        what is missing."""
        c = getattr(hf_config, "text_config", None) or hf_config
        split = max(1, tp_size)
        layers, hidden = _need(c, "num_hidden_layers"), _need(c, "hidden_size")
        heads = _need(c, "num_attention_heads")
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        ffn = {name: value // split if name.endswith("size") else value for name, value in _ffn(c, layers).items()}
        return cls(num_layers=layers, hidden_size=hidden, num_heads=max(1, heads // split),
                   num_kv_heads=max(1, kv_heads // split), head_dim=head_dim,
                   vocab_size=_need(c, "vocab_size") // split, weight_bytes=weight_bytes,
                   activation_bytes=activation_bytes, kv_bytes=kv_bytes, **ffn)


def _need(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not value:
        raise ValueError(f"the model config has no {name}")
    return int(value)


def _ffn(c: Any, layers: int) -> dict[str, int]:
    """The feed-forward's fields of ModelShape, whole (not split): dense, or experts (routed and shared) on every
    layer past the first dense ones (first_k_dense_replace)."""
    dense = int(getattr(c, "intermediate_size", 0) or 0)
    experts = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
                  or getattr(c, "n_routed_experts", None) or 0)
    if not experts:
        return {"intermediate_size": dense}
    moe_layers = layers - int(getattr(c, "first_k_dense_replace", 0) or 0)
    width = int(getattr(c, "moe_intermediate_size", None) or dense)
    shared = int(getattr(c, "shared_expert_intermediate_size", None) or 0) \
        or int(getattr(c, "n_shared_experts", None) or 0) * width
    return {"intermediate_size": dense if moe_layers < layers else 0, "num_moe_layers": moe_layers,
            "num_experts": experts, "experts_per_token": int(getattr(c, "num_experts_per_tok", 0) or 0),
            "expert_intermediate_size": width, "shared_intermediate_size": shared}


def _matmul(rows: int, d_in: int, d_out: int, shape: ModelShape, copies: int = 1) -> StepCost:
    """`rows` through `copies` distinct (d_in x d_out) weights (the rows spread over them)."""
    return StepCost(2 * rows * d_in * d_out,
                    int(copies * d_in * d_out * shape.weight_bytes) + rows * d_in * shape.activation_bytes,
                    rows * d_out * shape.activation_bytes)


def _layer_matmuls(tokens: int, shape: ModelShape, moe: bool) -> StepCost:
    s, d = shape, shape.head_dim
    cost = _matmul(tokens, s.hidden_size, (s.num_heads + 2 * s.num_kv_heads) * d, s) \
        + _matmul(tokens, s.num_heads * d, s.hidden_size, s)
    if not moe:
        return cost + _matmul(tokens, s.hidden_size, 2 * s.intermediate_size, s) \
            + _matmul(tokens, s.intermediate_size, s.hidden_size, s)
    routed = tokens * s.experts_per_token
    reached = min(routed, s.num_experts)  # experts whose weights the step reads (every one, given rows enough)
    cost += _matmul(routed, s.hidden_size, 2 * s.expert_intermediate_size, s, reached) \
        + _matmul(routed, s.expert_intermediate_size, s.hidden_size, s, reached)
    if s.shared_intermediate_size:
        cost += _matmul(tokens, s.hidden_size, 2 * s.shared_intermediate_size, s) \
            + _matmul(tokens, s.shared_intermediate_size, s.hidden_size, s)
    return cost


def _attention(load: StepLoad, shape: ModelShape) -> StepCost:
    """One layer's attention over the KV cache: each new token's query read and its output written, QK^T and PV
    over its context (`load.attended` pairs), every request's context read once, the new keys and values written."""
    s, d = shape, shape.head_dim
    rows = load.tokens * s.num_heads * d * s.activation_bytes
    return StepCost(2 * 2 * s.num_heads * d * load.attended,
                    rows + 2 * load.context * s.num_kv_heads * d * s.kv_bytes,
                    rows + 2 * load.tokens * s.num_kv_heads * d * s.kv_bytes)


def _times(cost: StepCost, layers: int) -> StepCost:
    return StepCost(layers * cost.flops, layers * cost.read_bytes, layers * cost.write_bytes)


def matmul_cost(load: StepLoad, shape: ModelShape) -> StepCost:
    """Every layer's matrix multiplies, and the LM head's over the sampled rows."""
    if not load.tokens:
        return StepCost()
    total = StepCost()
    for count, moe in ((shape.num_layers - shape.num_moe_layers, False), (shape.num_moe_layers, True)):
        if count:
            total += _times(_layer_matmuls(load.tokens, shape, moe), count)
    return total + _matmul(load.sampled, shape.hidden_size, shape.vocab_size, shape) if load.sampled else total


def attention_cost(load: StepLoad, shape: ModelShape) -> StepCost:
    """Every layer's attention."""
    return _times(_attention(load, shape), shape.num_layers) if load.tokens else StepCost()


def load_of(steps: list[RequestStep]) -> StepLoad:
    return StepLoad.of((r.num_tokens, r.num_computed, r.num_sampled) for r in steps)


def estimate(steps: list[RequestStep], shape: ModelShape) -> StepCost:
    """The step's FLOPs and bytes read and written, per GPU."""
    load = load_of(steps)
    return matmul_cost(load, shape) + attention_cost(load, shape)


def request_steps(sched: SchedulerOutput) -> list[RequestStep]:
    """A scheduled step's requests. Rows sampled: a new request's or a multi-token chunk's last (vLLM's rule: a
    prefill chunk), every row of a one-token decode, and a verify step's drafts plus its own."""
    steps = []
    for new in sched.new_requests:
        n = sched.num_scheduled_tokens.get(new.req_id, 0)
        if n:
            steps.append(RequestStep(n, new.num_computed_tokens, 1))
    for cached in sched.cached_requests:
        n = sched.num_scheduled_tokens.get(cached.req_id, 0)
        if n:
            drafts = len(sched.scheduled_spec_decode_tokens.get(cached.req_id, ()))
            steps.append(RequestStep(n, cached.num_computed_tokens, drafts + 1 if drafts or n == 1 else 1))
    return steps


# bytes per weight by quantization method (--quantization, or a checkpoint's quant_method); others: the dtype's
QUANTIZED_WEIGHT_BYTES = {"fp8": 1, "fbgemm_fp8": 1, "mxfp4": 0.5, "nvfp4": 0.5, "modelopt_fp4": 0.5, "awq": 0.5,
                          "gptq": 0.5, "compressed-tensors": 0.5, "bitsandbytes": 0.5}


def weight_bytes(quantization: str, hf_config: Any, dtype_bytes: int) -> float:
    """Bytes per weight: the method's given by name, else the checkpoint's own, else the dtype's."""
    method = quantization if quantization not in ("auto", "none") else None
    if method is None and quantization == "auto":
        quant = getattr(hf_config, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return QUANTIZED_WEIGHT_BYTES.get(method or "", dtype_bytes)


class StepCostMeter:
    """Running totals over an engine core's steps (what the counters show)."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self.total = StepCost()

    def count(self, sched: SchedulerOutput) -> StepCost:
        cost = estimate(request_steps(sched), self.shape)
        self.total += cost
        return cost


@dataclass(frozen=True, slots=True)
class Roofline:
    """A device's dense bf16 matmul rate and memory bandwidth, per GPU."""
    name: str
    flops_per_s: float
    bytes_per_s: float

    def seconds(self, cost: StepCost) -> float:
        """The longer of the cost's FLOPs at the matmul rate and its bytes at the bandwidth."""
        return max(cost.flops / self.flops_per_s, (cost.read_bytes + cost.write_bytes) / self.bytes_per_s)


# The vendor's figures (dense bf16 tensor-core FLOP/s without sparsity, memory bandwidth), by a part of the name
# torch gives the GPU, most specific first. Only the ratio of the two shapes the step-time bound (it compares a step
# with the decodes' own step), so figures a card reaches (an H200 measured 775-789 TFLOP/s and 4.2 TB/s in
# docs/BENCHMARKS.md) would set it about the same.
DEVICE_ROOFLINES = (
    Roofline("B200", 2.25e15, 8.0e12),
    Roofline("GH200", 989e12, 4.0e12),  # the 96 GB HBM3 part (the 144 GB HBM3e: 4.9 TB/s)
    Roofline("H200", 989e12, 4.8e12),
    Roofline("H100 PCIe", 756e12, 2.0e12),
    Roofline("H100 NVL", 835e12, 3.9e12),
    Roofline("H100", 989e12, 3.35e12),  # SXM
    Roofline("A100-PCIE-40GB", 312e12, 1.555e12),
    Roofline("A100-SXM4-40GB", 312e12, 1.555e12),
    Roofline("A100", 312e12, 2.039e12),  # 80 GB
    Roofline("L40S", 362e12, 0.864e12),
    Roofline("L4", 121e12, 0.3e12),
    Roofline("A10", 125e12, 0.6e12),
)
# The shares of those figures an engine's steps reach, the step-time estimate's starting point before the engine's
# own steps are fitted: a decode step reads at ~80% of the bandwidth, a mixed step's prompt chunk multiplies at ~55% of
# the matmul rate (an H100, 2026-12-07: with the data sheet's figures the estimate put a 1,000-token chunk beside 64
# decodes at 3x the decodes' step; it took 4.33x, 1.44 times more, about the 0.80 / 0.55 = 1.45 assumed here).
BANDWIDTH_SHARE_REACHED = 0.80
MATMUL_SHARE_REACHED = 0.55
# A GPU not in the table, or one whose name the engine core cannot ask without a CUDA context of its own (the mp
# and ray executors): an H100's ratio, about that of the other data-centre parts above (150-400 FLOP per byte).
DEFAULT_CUDA_ROOFLINE = Roofline("CUDA GPU (default)", 989e12, 3.35e12)
# The CPU's, only where its step-time bound is asked for (its default is off): a nominal 2-core AVX-512 server
# (~0.2 TFLOP/s bf16, ~20 GB/s), not measured.
CPU_ROOFLINE = Roofline("CPU (nominal)", 2e11, 2e10)


def device_roofline(device: str, gpu_name: str | None = None) -> Roofline:
    """The roofline of `device` ("cuda" or "cpu"); on CUDA by `gpu_name` (torch's name for it; None: not known)."""
    if device != "cuda":
        return CPU_ROOFLINE
    name = (gpu_name or "").upper()
    return next((r for r in DEVICE_ROOFLINES if r.name.upper() in name), DEFAULT_CUDA_ROOFLINE)


def local_gpu_name() -> str | None:
    """The name of this process's GPU where it has a CUDA context already (the worker runs in it: the uni
    executor); None otherwise, rather than create a context that would take GPU memory the KV cache was sized
    without."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class StepTimer:
    """A step's estimated seconds on a device (core/step_time.py's StepTimeModel): the matmuls' and attention's
    costs (`matmul_cost`, `attention_cost`), each over the roofline, until the engine's own step times (`observe`)
    have fitted what its kernels reach (core/step_time.py's StepTimeFit); from then on the fit's."""

    def __init__(self, shape: ModelShape, roofline: Roofline) -> None:
        self.shape, self.roofline = shape, roofline
        self.floor_tokens = compute_bound_tokens(shape, roofline)
        # what an engine reaches of the data sheet until its own steps say (the fit's prior: 1x these rates)
        self.reached = Roofline(roofline.name, roofline.flops_per_s * MATMUL_SHARE_REACHED,
                                roofline.bytes_per_s * BANDWIDTH_SHARE_REACHED)
        self.fit = StepTimeFit()

    def seconds(self, load: StepLoad) -> float:
        return self._estimate(matmul_cost(load, self.shape), attention_cost(load, self.shape))

    def observe(self, load: StepLoad, seconds: float) -> None:
        """A step of `load` took `seconds` on the device (or, where it cannot be timed alone, between results); a
        step far slower than its estimate (a kernel compiling, a collection pausing the host) teaches nothing."""
        if not load.tokens:
            return
        matmuls, attention = matmul_cost(load, self.shape), attention_cost(load, self.shape)
        if seconds <= FIT_OUTLIER * self._estimate(matmuls, attention):
            fitted = self.fit.coefficients is not None
            self.fit.observe(*self._terms(matmuls + attention), seconds)
            if not fitted and self.fit.coefficients is not None:
                logger.info("step-time estimates fitted to %d steps: %.2f ms a step + %.2fx the bytes' time + %.2fx "
                            "the FLOPs' time at the rates reached (%s)", self.fit.steps,
                            self.fit.coefficients[0] * 1e3, *self.fit.coefficients[1:], self.roofline.name)

    def _estimate(self, matmuls: StepCost, attention: StepCost) -> float:
        if self.fit.coefficients is None:
            return self.reached.seconds(matmuls) + self.reached.seconds(attention)
        return self.fit.predict(*self._terms(matmuls + attention))

    def forget(self) -> None:
        """Drops what the fit learned (the warm-up's steps, which were compiles)."""
        self.fit = StepTimeFit()

    def _terms(self, cost: StepCost) -> tuple[float, float]:
        """The cost's bytes at the bandwidth and its FLOPs at the matmul rate an engine reaches (the fit's terms)."""
        return (cost.read_bytes + cost.write_bytes) / self.reached.bytes_per_s, cost.flops / self.reached.flops_per_s


def compute_bound_tokens(shape: ModelShape, roofline: Roofline, limit: int = 1 << 20) -> int:
    """The fewest tokens (prompt tokens, one row sampled) whose step of matmuls takes as long at the matmul rate as
    its weights' reads at the bandwidth: below it a step's matmuls are memory-bound, so tokens added ride on the
    weight reads. bf16 weights: about the device's FLOP per byte (an H200's 206, an H100's 295); a mixture of
    experts' far more (its step reads every expert, each token computes with a few)."""
    def compute_bound(n: int) -> bool:
        cost = matmul_cost(StepLoad(tokens=n, sampled=1), shape)
        return cost.flops / roofline.flops_per_s >= (cost.read_bytes + cost.write_bytes) / roofline.bytes_per_s
    lo, hi = 0, limit  # compute_bound(hi) holds, or hi is the limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if compute_bound(mid):
            hi = mid
        else:
            lo = mid
    return hi
