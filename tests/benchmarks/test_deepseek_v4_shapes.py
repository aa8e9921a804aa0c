"""DeepSeek-V4's shipped shapes (pressroom/benchmarks/configs/): Flash and Pro as published, and Flash cut to five
decoder layers for one H200. Each resolves by name, loads with transformers' AutoConfig as deepseek_v4 and builds
HF's DeepseekV4ForCausalLM on the meta device (no memory): Flash and Pro at their model cards' sizes, the reduced
one within an H200's memory with room for the KV cache."""
from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import transformers

from pressroom.benchmarks.shapes import SHAPES_DIR, resolve_shape, shape_names


@dataclass(frozen=True)
class V4Shape:
    name: str
    attention_layers: dict[str, int]  # decoder layers by attention type, as HF reads compress_ratios
    hash_moe_layers: int
    mtp_layers: int


FLASH = V4Shape("deepseek-v4-flash", {"sliding_attention": 2, "compressed_sparse_attention": 21,
                                      "heavily_compressed_attention": 20}, hash_moe_layers=3, mtp_layers=1)
PRO = V4Shape("deepseek-v4-pro", {"heavily_compressed_attention": 31, "compressed_sparse_attention": 30},
              hash_moe_layers=3, mtp_layers=1)
REDUCED = V4Shape("deepseek-v4-flash-reduced", {"sliding_attention": 2, "compressed_sparse_attention": 2,
                                                "heavily_compressed_attention": 1}, hash_moe_layers=3, mtp_layers=1)
SHAPES = [FLASH, PRO, REDUCED]

# The model cards' totals. HF builds no MTP layer: Flash's card counts without it (284.33B built, 290.95B in the
# checkpoint), Pro's "1.6T" rounds the checkpoint's 1598.85B, of which HF builds 1573.00B (1.7% under).
CARD_TOTALS = {FLASH.name: 284e9, PRO.name: 1.6e12}
CARD_TOLERANCE = 0.02

H200_BYTES = 141e9
REDUCED_WEIGHT_BYTES = (60e9, 80e9)  # bf16, without the MTP layer
KV_CACHE_ROOM_BYTES = 50e9  # what the weights with the MTP layer must leave free on the H200
BF16_BYTES = 2


def _published(name: str) -> dict:
    return json.loads((SHAPES_DIR / name / "config.json").read_text())


@functools.cache
def _hf_state_dict_sizes(name: str) -> dict[str, int]:
    """Elements of each tensor in HF's state dict (parameters and persistent buffers, e.g. the hash routers'
    tid2eid): what a checkpoint of this shape holds, less the MTP layer HF does not build. Cached: Pro's meta
    build takes seconds."""
    cfg = transformers.AutoConfig.from_pretrained(resolve_shape(name))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model) is transformers.DeepseekV4ForCausalLM
    return {key: tensor.numel() for key, tensor in model.state_dict().items()}


def _decoder_layer_sizes(sizes: dict[str, int]) -> dict[int, int]:
    by_layer: Counter[int] = Counter()
    for key, numel in sizes.items():
        if key.startswith("model.layers."):
            by_layer[int(key.split(".")[2])] += numel
    return dict(by_layer)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_a_shape_resolves_by_name_and_loads_as_deepseek_v4(shape):
    assert shape.name in shape_names()
    path = resolve_shape(shape.name)
    assert path == SHAPES_DIR / shape.name
    cfg = transformers.AutoConfig.from_pretrained(path)
    assert cfg.model_type == "deepseek_v4" and cfg.architectures == ["DeepseekV4ForCausalLM"]
    assert Counter(cfg.layer_types) == shape.attention_layers
    assert sum(shape.attention_layers.values()) == cfg.num_hidden_layers
    assert cfg.mlp_layer_types == ["hash_moe"] * shape.hash_moe_layers + ["moe"] * (
        cfg.num_hidden_layers - shape.hash_moe_layers)
    assert cfg.num_nextn_predict_layers == shape.mtp_layers
    # the published compress_ratios carry one entry past the decoder layers per MTP layer (0: sliding window)
    assert _published(shape.name)["compress_ratios"][cfg.num_hidden_layers:] == [0] * shape.mtp_layers


@pytest.mark.parametrize("shape", [FLASH, PRO], ids=lambda s: s.name)
def test_hf_builds_the_published_size(shape):
    built = sum(_hf_state_dict_sizes(shape.name).values())
    assert built == pytest.approx(CARD_TOTALS[shape.name], rel=CARD_TOLERANCE)


def test_the_reduced_flash_is_flash_with_fewer_decoder_layers():
    flash, reduced = _published(FLASH.name), _published(REDUCED.name)
    assert {key for key in flash.keys() | reduced.keys() if flash.get(key) != reduced.get(key)} == {
        "num_hidden_layers", "compress_ratios"}
    # Flash's layout with its repeated [CSA, HCA] pair kept once: the two sliding-window layers, the pair,
    # the last CSA layer and the MTP layer's 0
    ratios = flash["compress_ratios"]
    assert reduced["compress_ratios"] == ratios[:4] + ratios[-2:]
    assert len(reduced["compress_ratios"]) == reduced["num_hidden_layers"] + reduced["num_nextn_predict_layers"]


def test_the_reduced_flash_fits_one_h200_with_room_for_the_kv_cache():
    sizes = _hf_state_dict_sizes(REDUCED.name)
    weight_bytes = BF16_BYTES * sum(sizes.values())
    assert REDUCED_WEIGHT_BYTES[0] <= weight_bytes <= REDUCED_WEIGHT_BYTES[1]
    # the MTP layer, which HF does not build: one more decoder layer and its two hidden x hidden projections
    hidden = transformers.AutoConfig.from_pretrained(resolve_shape(REDUCED.name)).hidden_size
    mtp_bytes = BF16_BYTES * (max(_decoder_layer_sizes(sizes).values()) + 2 * hidden * hidden)
    assert weight_bytes + mtp_bytes <= H200_BYTES - KV_CACHE_ROOM_BYTES
