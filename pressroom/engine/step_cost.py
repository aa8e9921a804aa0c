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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pressroom.core.outputs import SchedulerOutput


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


def _attention(steps: list[RequestStep], shape: ModelShape) -> StepCost:
    """One layer's attention over the KV cache."""
    s, d = shape, shape.head_dim
    flops = read = write = 0
    for r in steps:
        context = r.num_computed + r.num_tokens
        flops += 2 * 2 * s.num_heads * d * r.num_tokens * context  # QK^T and PV
        read += r.num_tokens * s.num_heads * d * s.activation_bytes + 2 * context * s.num_kv_heads * d * s.kv_bytes
        write += r.num_tokens * s.num_heads * d * s.activation_bytes \
            + 2 * r.num_tokens * s.num_kv_heads * d * s.kv_bytes
    return StepCost(flops, read, write)


def estimate(steps: list[RequestStep], shape: ModelShape) -> StepCost:
    """The step's FLOPs and bytes read and written, per GPU."""
    tokens = sum(r.num_tokens for r in steps)
    if not tokens:
        return StepCost()
    dense_layers = shape.num_layers - shape.num_moe_layers
    attention = _attention(steps, shape)
    total = StepCost()
    for count, moe in ((dense_layers, False), (shape.num_moe_layers, True)):
        if count:
            layer = _layer_matmuls(tokens, shape, moe) + attention
            total += StepCost(count * layer.flops, count * layer.read_bytes, count * layer.write_bytes)
    sampled = sum(r.num_sampled for r in steps)
    return total + _matmul(sampled, shape.hidden_size, shape.vocab_size, shape) if sampled else total


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
