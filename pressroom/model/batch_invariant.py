"""`--batch-invariant` on a loaded model: refuse what the mode does not cover, switch the rest to kernels
whose result for a row does not depend on the rows beside it (kernels/batch_invariant.py).

Covered: the Llama family's dense layers (Llama, Mistral without a sliding window, Qwen2, Qwen3) in float32
or bfloat16. Each covered module has a `batch_invariant` switch read in its forward: linear layers and
the LM head (fixed-shape GEMMs), RMSNorm (one row per program, always the kernel path) and SiLU-and-mul.
The attention backend takes the mode from the model runner.
"""
from __future__ import annotations

from torch import nn

from pressroom.model.layers.activation import SiluAndMul
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.embedding import ParallelLMHead
from pressroom.model.layers.fused_moe import FusedMoE
from pressroom.model.layers.linear import LinearBase
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

_SWITCHED = (LinearBase, ParallelLMHead, RMSNorm, SiluAndMul)


def make_batch_invariant(model: nn.Module) -> None:
    """After loading (and prepacking): a ValueError naming the first thing not covered, else every covered
    module switched to its invariant kernels."""
    problem = unsupported(model)
    if problem is not None:
        raise ValueError(f"--batch-invariant does not cover {problem} yet; run this model without it.")
    for module in model.modules():
        if isinstance(module, _SWITCHED):
            module.batch_invariant = True


def unsupported(model: nn.Module) -> str | None:
    """What in `model` the mode cannot make batch-invariant, in words; None if nothing."""
    if not isinstance(model, LlamaForCausalLM):
        return f"the {type(model).__name__} architecture (it covers the Llama family)"
    for module in model.modules():
        problem = _module_problem(module)
        if problem is not None:
            return problem
    for layer in model.model.layers:
        attention = getattr(layer, "self_attn", None)
        if not isinstance(attention, LlamaAttention):  # None: a recurrent layer (Gated DeltaNet) instead
            return f"the {type(attention or layer).__name__} layer"
        if not isinstance(layer.mlp, LlamaMLP) or not isinstance(layer.mlp.act, SiluAndMul):
            return f"the {type(layer.mlp).__name__} feed-forward block"
    return None


def _module_problem(module: nn.Module) -> str | None:
    if isinstance(module, FusedMoE):
        return "mixture-of-experts layers"
    if isinstance(module, nn.Linear):
        return "torch's own linear layers (a mixture-of-experts router)"
    if isinstance(module, Attention) and module.latent:
        return "multi-head latent attention (MLA)"
    if isinstance(module, Attention) and module.sliding_window is not None:
        return "sliding-window attention"
    if isinstance(module, LinearBase) and _quantized(module):
        return "quantized weights (--quantization, a quantized checkpoint or GGUF matrices kept quantized)"
    if isinstance(module, ParallelLMHead) and module.tp_size > 1:
        return "tensor parallelism"
    return None


def _quantized(linear: LinearBase) -> bool:
    kept = (linear.quant_method, linear.int4, getattr(linear, "ggml", None))
    return any(form is not None for form in kept)
