"""Random LoRA adapters at a Llama-family model's shapes, in PEFT's format, for `bench ... --backend
pressroom-lora` (throughput and latency with requests spread over several adapters, beside the base model)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pressroom.lora.request import LoRARequest

# PEFT's module names and their (in, out) features from the config
_TARGETS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
            "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
            "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
            "mlp.down_proj": ("inter", "hidden")}


def _widths(hf_config) -> dict[str, int]:
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return {"hidden": hf_config.hidden_size, "q": heads * head_dim, "kv": kv_heads * head_dim,
            "inter": hf_config.intermediate_size}


def write_random_adapters(hf_config, root: Path, count: int, rank: int, seed: int = 0) -> list[LoRARequest]:
    """`count` rank-`rank` adapters on every projection of every layer, small random A and B."""
    from safetensors.torch import save_file
    widths, gen = _widths(hf_config), torch.Generator().manual_seed(seed)
    requests = []
    for n in range(count):
        path = root / f"adapter-{n}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for module, (fan_in, fan_out) in _TARGETS.items():
                prefix = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, widths[fan_in], generator=gen)
                tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(widths[fan_out], rank, generator=gen)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                  "target_modules": sorted({m.rsplit(".", 1)[-1] for m in _TARGETS})}
        (path / "adapter_config.json").write_text(json.dumps(config))
        requests.append(LoRARequest(f"adapter-{n}", n + 1, str(path)))
    return requests
