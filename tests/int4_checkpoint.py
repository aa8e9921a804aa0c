"""GPTQ and AWQ int4 checkpoints written by hand for the tests: a tiny HF checkpoint's projections rounded to the
nearest int4 step per group (asymmetric, min-max), packed in each format's exact layout, with the dequantized
weights computed here from the unpacked values (not through pressroom's unpacking) for an fp32 twin."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from pressroom.kernels.int4 import AWQ_ORDER, pack_inputs, pack_outputs

# which input a projection reads: parts reading one input share GPTQ's act-order permutation (as GPTQ's Hessian)
_INPUTS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


def _round_to_nearest(w: torch.Tensor, groups: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, ...]:
    """w [N, K] -> q int32 [K, N], zeros int32 [G, N] in 1..15 (so GPTQ v1's zero - 1 packs), scales fp16 [G, N]."""
    wt = w.t()
    q = torch.empty_like(wt, dtype=torch.int32)
    zeros = torch.empty(n_groups, wt.shape[1], dtype=torch.int32)
    scales = torch.empty(n_groups, wt.shape[1], dtype=torch.float16)
    for g in range(n_groups):
        rows = wt[groups == g]
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(1, 15).to(torch.int32)
        q[groups == g] = (torch.round(rows / scale.float()) + zero).clamp(0, 15).to(torch.int32)
        zeros[g], scales[g] = zero, scale
    return q, zeros, scales


def _dequantized(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return ((q - zeros[groups]).float() * scales[groups].float()).t().contiguous()


def _groups(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    """Each input's group: consecutive inputs, or (act-order) consecutive in a random order of the inputs."""
    if not act_order:
        return torch.arange(k) // group
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    return torch.empty(k, dtype=torch.long).scatter_(0, order, torch.arange(k) // group)


def write_int4_checkpoint(src: str, dst, fmt: str, group: int, act_order: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint at `src` with every projection in `fmt` ("gptq" or "awq"); returns the dequantized
    projections by their checkpoint name."""
    shutil.copytree(src, dst)
    weights, out, dequantized = load_file(f"{src}/model.safetensors"), {}, {}
    for name, w in weights.items():
        if not name.endswith("_proj.weight"):
            out[name] = w
            continue
        base, n_in = name.removesuffix(".weight"), w.shape[1]
        layer, proj = int(name.split(".")[2]), base.rsplit(".", 1)[1]
        groups = _groups(n_in, group, act_order, seed=4 * layer + _INPUTS[proj])
        n_groups = -(-n_in // group)
        q, zeros, scales = _round_to_nearest(w, groups, n_groups)
        dequantized[name] = _dequantized(q, zeros, scales, groups)
        if fmt == "gptq":
            out |= {f"{base}.qweight": pack_inputs(q), f"{base}.qzeros": pack_outputs(zeros - 1),  # v1: zero - 1
                    f"{base}.scales": scales, f"{base}.g_idx": groups.to(torch.int32)}
        else:
            out |= {f"{base}.qweight": pack_outputs(q, AWQ_ORDER), f"{base}.qzeros": pack_outputs(zeros, AWQ_ORDER),
                    f"{base}.scales": scales}
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": False,
         "checkpoint_format": "gptq"} if fmt == "gptq" else
        {"quant_method": "awq", "version": "gemm", "w_bit": 4, "q_group_size": group, "zero_point": True})
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def write_twin(src: str, dst, dequantized: dict[str, torch.Tensor]) -> None:
    """The plain fp32 checkpoint with the projections replaced by their dequantized weights."""
    shutil.copytree(src, dst)
    save_file(load_file(f"{src}/model.safetensors") | dequantized, f"{dst}/model.safetensors",
              metadata={"format": "pt"})
