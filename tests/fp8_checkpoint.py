"""FP8 checkpoints written by hand for the tests: a tiny HF checkpoint's projections in FP8, in each scale
layout vLLM's fp8 reads (per tensor, per channel, blocks), with an fp32 twin of the dequantized weights."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from pressroom import LLM, SamplingParams
from pressroom.kernels import fp8

PROMPTS = [{"prompt_token_ids": [11, 402, 9, 3071, 77, 1500, 23, 8, 640, 5, 4410, 37]},
           {"prompt_token_ids": [300, 2, 48000, 17, 9021, 333, 64, 1]}]
LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
LAYOUTS = {"tensor": None, "channel": None, "block": (128, 128), "block_48x32": (48, 32)}
def _quantize_tensor(w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """One weight as an FP8 checkpoint ships it: the values and the scale under the layout's name."""
    if layout == "tensor":
        scale = w.abs().max().clamp(min=1e-12) / fp8.FP8_MAX
        return {"weight": (w / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), "weight_scale": scale,
                "input_scale": torch.tensor(0.05)}  # a static activation scale: read past
    if layout == "channel":
        q, scale = fp8.quantize(w, w.shape[1])
        return {"weight": q, "weight_scale": scale}
    rows, cols = LAYOUTS[layout]
    br, bc = -(-w.shape[0] // rows), -(-w.shape[1] // cols)
    padded = torch.nn.functional.pad(w, (0, bc * cols - w.shape[1], 0, br * rows - w.shape[0]))
    blocks = padded.view(br, rows, bc, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fp8.FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return {"weight": q.view(br * rows, bc * cols)[:w.shape[0], :w.shape[1]].contiguous(), "weight_scale_inv": scale}


def _dequantize_tensor(parts: dict[str, torch.Tensor], layout: str) -> torch.Tensor:
    q = parts["weight"].float()
    if layout in ("tensor", "channel"):
        return q * parts["weight_scale"]
    rows, cols = LAYOUTS[layout]
    scale = parts["weight_scale_inv"].repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return q * scale[:q.shape[0], :q.shape[1]]


def write_fp8_checkpoint(src: str, dst, layout: str, twin=None) -> dict[str, torch.Tensor]:
    """The checkpoint at `src` with every projection in FP8 (quantization_config as vLLM's fp8 reads it);
    `twin`: also a plain fp32 copy with those weights dequantized. Returns the dequantized projections."""
    shutil.copytree(src, dst)
    weights, out, dequantized = load_file(f"{src}/model.safetensors"), {}, {}
    for name, w in weights.items():
        if not name.endswith("_proj.weight"):
            out[name] = w
            continue
        parts = _quantize_tensor(w, layout)
        base = name.removesuffix("weight")
        out |= {base + k: v for k, v in parts.items()}
        dequantized[name] = _dequantize_tensor(parts, layout)
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if layout == "tensor"
                                     else "dynamic", **({"weight_block_size": list(LAYOUTS[layout])}
                                                        if LAYOUTS[layout] else {})}
    (dst / "config.json").write_text(json.dumps(config))
    if twin is not None:
        shutil.copytree(src, twin)
        save_file(weights | dequantized, f"{twin}/model.safetensors", metadata={"format": "pt"})
    return dequantized


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    """The logprob of each prompt token after the first, both prompts in a row."""
    outs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    return torch.tensor([next(iter(p.values())).logprob for o in outs for p in o.prompt_logprobs[1:]])


