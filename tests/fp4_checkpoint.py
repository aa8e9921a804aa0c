"""FP4 checkpoints written by hand for the tests, in the exact forms real ones ship:

- MXFP4 as gpt-oss ships it (`P_blocks` uint8 [..., rows, cols / 32, 16], `P_scales` E8M0 [..., rows, cols / 32];
  quantization_config `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`), experts per expert or fused
  as gpt-oss's `experts.gate_up_proj_blocks` (gate and up rows interleaved) and `experts.down_proj_blocks`; a
  gpt-oss checkpoint's own dense fused experts (`experts.gate_up_proj` [experts, hidden, 2 * inter], x @ W) become
  those blocks of their transpose, as OpenAI ships them;
- NVFP4 as NVIDIA ModelOpt exports it (`weight` uint8 [out, in / 2], `weight_scale` FP8 [out, in / 16],
  `weight_scale_2` and `input_scale` fp32 scalars; quant_method "modelopt" in config.json, or hf_quant_config.json).

Values are rounded here with each format's own recipe (OCP's floor(log2(amax)) - 2 exponent for MXFP4, ModelOpt's
amax / (6 * 448) global scale for NVFP4), not pressroom's quantizers, and the fp32 twin's weights are decoded
independently of pressroom: MXFP4 by HF transformers' gpt-oss dequantizer, NVFP4 by a lookup table here.
"""
from __future__ import annotations

import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8 = torch.float8_e4m3fn
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_GPT_OSS_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # dense [experts, in, out]


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Values (already divided by their scale) -> the nearest E2M1 codes (sign in bit 3), clipped at 6."""
    magnitude = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - E2M1).abs().argmin(dim=-1).to(torch.uint8)
    return magnitude | ((scaled < 0).to(torch.uint8) << 3)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte along the last dimension, the even one in the low nibble (gpt-oss and ModelOpt alike)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def mxfp4_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8 [..., rows, cols / 32]) by
    the OCP MX recipe: a block's exponent floor(log2(amax)) - 2 (its largest value lands in [4, 8): up to a third
    of it clips at 6)."""
    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -120)
    exponent = torch.floor(torch.log2(amax)) - 2
    codes = e2m1_codes(blocks / torch.exp2(exponent))
    return pack(codes), (exponent.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF transformers' gpt-oss dequantizer on [rows, cols / 32, 16] blocks -> [rows, cols] fp32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t().contiguous()


def nvfp4_parts(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [rows, cols] -> ModelOpt's NVFP4 tensors: weight (packed), weight_scale (FP8 per 16 inputs), weight_scale_2
    (amax / (6 * 448)) and a static input_scale (which a weight-only reader ignores)."""
    w = w.float()
    scale_2 = w.abs().amax() / (6.0 * 448.0)
    blocks = w.reshape(w.shape[0], -1, 16)
    block_scale = (blocks.abs().amax(dim=-1) / 6.0 / scale_2).to(FP8)
    divisor = block_scale.float().unsqueeze(-1) * scale_2
    scaled = torch.where(divisor > 0, blocks / divisor, torch.zeros_like(blocks)).reshape(w.shape)
    return {"weight": pack(e2m1_codes(scaled)), "weight_scale": block_scale, "weight_scale_2": scale_2.reshape(()),
            "input_scale": torch.tensor(0.02)}


def nvfp4_decode(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    packed = parts["weight"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    values = torch.cat([E2M1, -E2M1])[codes]
    scale = (parts["weight_scale"].float() * parts["weight_scale_2"]).repeat_interleave(16, dim=1)
    return values * scale


def _quantized(name: str) -> bool:
    """The checkpoint tensors these writers quantize: projections and experts' matrices (not norms, embeddings,
    LM head or routers)."""
    return name.endswith(("_proj.weight", *_GPT_OSS_EXPERTS)) or _EXPERT.match(name) is not None


def _finish(src: str, dst, out: dict[str, torch.Tensor], quantization: dict | None) -> None:
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    if quantization is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization
        (dst / "config.json").write_text(json.dumps(config))


def write_mxfp4_checkpoint(src: str, dst, fused_experts: bool = False, unconverted: tuple[str, ...] = (),
                           expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                           ) -> dict[str, torch.Tensor]:
    """The checkpoint at `src` in MXFP4, except modules whose names contain one of `unconverted` (written to the
    config as `model.layers.*.<name>`); returns the decoded weights by their plain checkpoint names."""
    shutil.copytree(src, dst)
    weights, out, decoded = load_file(f"{src}/model.safetensors"), {}, {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, w in weights.items():
        if not _quantized(name) or any(f".{u}." in name for u in unconverted):
            out[name] = w
            continue
        if name.endswith(_GPT_OSS_EXPERTS):  # HF's dequantizer turns the blocks back into [experts, in, out]
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales = mxfp4_parts(w.transpose(1, 2))
            decoded[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
            continue
        blocks, scales = mxfp4_parts(w)
        decoded[name] = mxfp4_decode(blocks, scales)
        m = _EXPERT.match(name)
        if fused_experts and m:
            experts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = w
            continue
        out[name + "_blocks"], out[name + "_scales"] = blocks, scales
    for stem, matrices in experts.items():  # gpt-oss's form: gate and up rows interleaved, then down
        gate, up, down = expert_names
        count = 1 + max(e for e, _ in matrices)
        gate_up = torch.stack([torch.stack([matrices[e, gate], matrices[e, up]], dim=1).flatten(0, 1)
                               for e in range(count)])
        out[f"{stem}.gate_up_proj_blocks"], out[f"{stem}.gate_up_proj_scales"] = mxfp4_parts(gate_up)
        out[f"{stem}.down_proj_blocks"], out[f"{stem}.down_proj_scales"] = \
            mxfp4_parts(torch.stack([matrices[e, down] for e in range(count)]))
    _finish(src, dst, out, {"quant_method": "mxfp4",
                            "modules_to_not_convert": [f"model.layers.*.{u}" for u in unconverted] + ["lm_head"]})
    return decoded


def write_nvfp4_checkpoint(src: str, dst, excluded: tuple[str, ...] = (), hf_quant_config: bool = False
                           ) -> dict[str, torch.Tensor]:
    """The checkpoint at `src` in ModelOpt's NVFP4, except modules whose names contain one of `excluded` (listed
    as `*<name>*` globs, ModelOpt's style); the config in config.json, or in hf_quant_config.json (older exports).
    Returns the decoded weights by their plain checkpoint names."""
    shutil.copytree(src, dst)
    weights, out, decoded = load_file(f"{src}/model.safetensors"), {}, {}
    for name, w in weights.items():
        if not _quantized(name) or any(f".{e}." in name for e in excluded):
            out[name] = w
            continue
        parts = nvfp4_parts(w)
        decoded[name] = nvfp4_decode(parts)
        base = name.removesuffix("weight")
        out |= {base + k: v for k, v in parts.items()}
    quantization = {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None}
    exclude = [f"*{e}*" for e in excluded] + ["lm_head"]
    if hf_quant_config:
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.29.0"},
             "quantization": quantization | {"exclude_modules": exclude}}))
        _finish(src, dst, out, None)
    else:
        _finish(src, dst, out, {"quant_method": "modelopt", **quantization, "ignore": exclude})
    return decoded


def write_twin(src: str, dst, decoded: dict[str, torch.Tensor]) -> None:
    """The plain fp32 checkpoint with the quantized tensors replaced by their decoded weights."""
    shutil.copytree(src, dst)
    save_file(load_file(f"{src}/model.safetensors") | decoded, f"{dst}/model.safetensors", metadata={"format": "pt"})
