"""Quantization methods as plug-ins: found by module path or an installed package's entry point, used end to
end through LLM(quantization=...), and wrong names refused with a sentence that says what exists."""
from __future__ import annotations

import pytest
import torch
from quant_plugin import GRID, round_to_grid

from pressroom import LLM, SamplingParams
from pressroom.config import QUANTIZATIONS, EngineArgs
from pressroom.model.quantization.registry import BUILTIN, NO_METHOD, method_class

PROMPT = [{"prompt_token_ids": [11, 402, 9, 3071, 77, 1500, 23, 8, 640, 5]}]
LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)


def _prompt_logprobs(llm: LLM) -> list[float]:
    out = llm.generate(PROMPT, LOGPROBS, use_tqdm=False)[0]
    return [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]


def _gridded_twin(src: str, dst) -> None:
    """The checkpoint with every projection rounded to the grid by hand: the plug-in's oracle."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    weights = load_file(f"{src}/model.safetensors")
    save_file({k: round_to_grid(v) if k.endswith("_proj.weight") else v for k, v in weights.items()},
              f"{dst}/model.safetensors", metadata={"format": "pt"})


def test_a_plugin_by_module_path_rounds_the_weights_it_is_given(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    _gridded_twin(model, tmp_path / "twin")
    plugged = LLM(model, dtype="float32", kv_cache_memory_gib=0.05, quantization="quant_plugin:GridMethod")
    layer = plugged.engine.model.model.layers[0].self_attn.qkv_proj
    assert torch.equal(layer.weight, round_to_grid(layer.weight)) and layer.weight.abs().max() >= GRID
    from safetensors.torch import load_file
    shipped = load_file(f"{model}/model.safetensors")
    by_hand = round_to_grid(torch.cat([shipped[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(layer.weight, by_hand)
    twin = LLM(str(tmp_path / "twin"), dtype="float32", kv_cache_memory_gib=0.05, quantization="none")
    plain = LLM(model, dtype="float32", kv_cache_memory_gib=0.05)
    got, want, before = _prompt_logprobs(plugged), _prompt_logprobs(twin), _prompt_logprobs(plain)
    # the same weights through F.linear (the plug-in) and oneDNN (the twin): equal to fp32 rounding
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert max(abs(a - b) for a, b in zip(got, before)) > 1e-2  # and the plug-in did change the model


def test_a_plugin_by_entry_point(tiny_model_dir, tmp_path, monkeypatch):
    """An installed package's entry point in the pressroom.quantization group, faked as a .dist-info on sys.path."""
    dist = tmp_path / "grid_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: grid-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pressroom.quantization]\ngrid = quant_plugin:GridMethod\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert method_class("grid").__name__ == "GridMethod"
    llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05, quantization="grid")
    weight = llm.engine.model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(weight, round_to_grid(weight))


def test_unknown_and_broken_methods_are_refused_with_what_exists():
    with pytest.raises(ValueError, match=r"auto, none, fp8.*module\.path:ClassName; got 'fp9'"):
        EngineArgs(model="x", quantization="fp9").create_engine_config()
    with pytest.raises(ValueError, match="cannot be imported"):
        method_class("no_such_module:Method")
    with pytest.raises(ValueError, match="not a subclass"):
        method_class("quant_plugin:NotAMethod")


def test_the_configs_names_are_the_registrys():
    assert set(QUANTIZATIONS) == {*NO_METHOD, *BUILTIN}
