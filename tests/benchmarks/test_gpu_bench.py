"""`pressroom bench gpu` plumbing on the CPU (tiny model, tiny workloads; nothing here is timed), the
pressroom -> HF weight mapping, and the model shapes shipped in pressroom/benchmarks/configs/."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pressroom.benchmarks import gpu
from pressroom.benchmarks.shapes import SHAPES_DIR as CONFIGS
from pressroom.entrypoints import cli

TINY_FLAGS = ["--device", "cpu", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
              "--decode-input-len", "8", "--decode-output-len", "4", "--prefill-prompts", "2", "--prefill-len", "16",
              "--hf-batch-sizes", "2,4", "--copy-gib", "0.01", "--matmul-size", "128", "--kv-cache-memory-gib", "0.05"]
RUN_KEYS = {"backend", "num_requests", "input_tokens", "output_tokens", "elapsed_s", "output_tokens_per_s",
            "input_tokens_per_s", "batch_size"}
SECTION_KEYS = {"num_requests", "input_len", "output_len", "compared", "bound", "bound_tokens_per_s", "pressroom",
                "hf", "pressroom_over_bound", "hf_over_bound", "pressroom_over_hf"}


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench-gpu") / "result.json"
    argv = ["bench", "gpu", "--model", tiny_model_dir("llama"), *TINY_FLAGS, "--output-json", str(out)]
    assert cli.main(argv) == 0
    return json.loads(out.read_text())


def test_report_has_every_figure(report):
    assert report["time_to_ready_s"] > 0
    assert report["ceilings"]["copy_bytes_per_s"] > 0 and report["ceilings"]["matmul_flops_per_s"] > 0
    size = report["model_size"]
    assert size["decode_read_bytes"] == (size["non_embedding_params"] + size["lm_head_params"]) * 2
    assert set(report["workloads"]) == set(gpu.WORKLOADS)
    assert report["allocator_during_pressroom"] == {name: {"alloc_retries": 0, "device_frees": 0}
                                                    for name in gpu.WORKLOADS}  # counted on CUDA only
    for name, section in report["workloads"].items():
        assert SECTION_KEYS <= section.keys(), name
        assert set(section["pressroom"]) == RUN_KEYS and set(section["hf"]) == RUN_KEYS
        for key in ("bound_tokens_per_s", "pressroom_over_bound", "hf_over_bound", "pressroom_over_hf"):
            assert section[key] > 0, (name, key)
    assert {"flops_per_output_token", "hf_by_batch_size", "roofline"} <= report["workloads"]["throughput"].keys()
    assert report["workloads"]["throughput"]["roofline"]["decode_batch"] == 4  # the 4 prompts, all at once
    assert {"pressroom_mfu", "hf_mfu", "flops"} <= report["workloads"]["prefill"].keys()
    assert all(v is not None for v in report["ratios"].values()) and len(report["ratios"]) == 9


def test_hf_and_pressroom_produce_the_same_tokens(report):
    for name, section in report["workloads"].items():
        ours = section["pressroom"]
        hf_runs = section.get("hf_by_batch_size") or [section["hf"]]
        for hf in hf_runs:
            assert (hf["num_requests"], hf["output_tokens"]) == (ours["num_requests"], ours["output_tokens"]), name
    assert report["workloads"]["throughput"]["pressroom"]["output_tokens"] == 4 * 4
    assert [r["batch_size"] for r in report["workloads"]["throughput"]["hf_by_batch_size"]] == [2, 4]


def test_skip_hf_and_one_workload(tiny_model_dir, tmp_path):
    out = tmp_path / "result.json"
    argv = ["bench", "gpu", "--model", tiny_model_dir("llama"), *TINY_FLAGS, "--workloads", "decode", "--skip-hf",
            "--output-json", str(out)]
    assert cli.main(argv) == 0
    section = json.loads(out.read_text())["workloads"]
    assert list(section) == ["decode"] and section["decode"]["hf"] is None
    assert section["decode"]["pressroom"]["output_tokens"] == 4


def test_a_quantized_engine_is_benched_without_hf(tiny_model_dir, tmp_path):
    out = tmp_path / "result.json"
    argv = ["bench", "gpu", "--model", tiny_model_dir("llama"), *TINY_FLAGS, "--workloads", "decode",
            "--quantization", "mxfp4", "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["engine_args"]["quantization"] == "mxfp4" and report["workloads"]["decode"]["hf"] is None


@pytest.mark.slow  # two worker processes and a profile (~10 s on two cores); the TP engine runs in test_tensor_parallel
def test_tensor_parallel_bench_profiles_each_ranks_all_reduces(tiny_model_dir, tmp_path):
    """TP 2 over gloo (the CPU form of the two-GPU run): the bound counts both ranks, HF is skipped, and each
    rank's all-reduces per step are counted from its profile (two per layer and the embedding's) and timed."""
    out = tmp_path / "result.json"
    model = tiny_model_dir("llama")
    argv = ["bench", "gpu", "--model", model, *TINY_FLAGS, "--workloads", "decode", "--dtype", "float32",
            "--tensor-parallel-size", "2", "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    col = report["collectives"]
    assert report["engine_args"]["tensor_parallel_size"] == 2 and col["workload"] == "decode"
    assert col["steps"] == 4 and col["all_reduce_calls_per_step"] == 2 * layers + 1
    assert len(col["all_reduce_s_per_step"]) == 2 and min(col["all_reduce_s_per_step"]) > 0
    assert min(col["all_gather_s_per_step"]) > 0 and col["model_all_reduce_s_per_step"] > 0  # the LM head gathers
    decode = report["workloads"]["decode"]
    size, ceilings = report["model_size"], report["ceilings"]
    assert decode["hf"] is None and decode["bound"].startswith("2 devices")
    assert abs(decode["bound_tokens_per_s"] - 2 * ceilings["copy_bytes_per_s"] / size["decode_read_bytes"]) < 0.01


@pytest.mark.slow  # three engines, one in its own process (~10 s on two cores)
def test_executors_side_by_side(tiny_model_dir, tmp_path):
    out = tmp_path / "executors.json"
    argv = ["bench", "gpu", "--model", tiny_model_dir("llama"), *TINY_FLAGS, "--workloads", "decode",
            "--executors", "uni,mp", "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["executors"]) == {"uni", "mp"}
    assert all(report["executors"][e]["decode"]["output_tokens_per_s"] > 0 for e in ("uni", "mp"))
    assert report["ratios_vs_uni"]["mp"]["decode"] > 0


def test_batch_invariant_beside_the_default(tiny_model_dir, tmp_path):
    out = tmp_path / "invariant.json"
    argv = ["bench", "gpu", "--model", tiny_model_dir("llama"), *TINY_FLAGS, "--workloads", "decode",
            "--batch-invariant", "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"default", "batch_invariant"}
    assert report["ratios_invariant_vs_default"]["decode"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_state_dict_gives_back_the_checkpoint(tiny_model_dir, arch, dtype):
    """Checkpoint -> pressroom (stacked, and oneDNN-blocked for bf16 on the CPU) -> HF names: the same tensors."""
    from pressroom.config import ModelConfig
    from pressroom.model.loader import iter_safetensors, load_model
    path = tiny_model_dir(arch)
    model = load_model(ModelConfig(model=path, dtype=dtype), "cpu").model
    state = gpu.hf_state_dict(model)
    original = {name: lazy.load() for name, lazy in iter_safetensors(path)}
    assert state.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(state[name], tensor.to(dtype)), name


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_hf_state_dict_equals_hf_models_own_weights(tiny_model_dir, arch):
    """MoE and MLA models: stacked experts under transformers' names, DeepSeek's rope rows interleaved
    again and V3's router correction bias (an HF buffer) all equal what HF itself loads."""
    import transformers

    from pressroom.config import ModelConfig
    from pressroom.model.loader import load_model
    path = tiny_model_dir(arch)
    state = gpu.hf_state_dict(load_model(ModelConfig(model=path, dtype=torch.float32), "cpu").model)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = hf_model.state_dict()
    assert state.keys() <= expected.keys()
    assert {n for n, _ in hf_model.named_parameters()} <= state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name
    gpu.load_into_hf(hf_model, state)  # names and shapes accepted one to one


def _pressroom_and_hf_on_meta(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pressroom.model.registry import resolve_architecture
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return resolve_architecture(config)(config), AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "qwen3-8b", "qwen3-0.6b", "qwen3-30b-a3b",
                                  "mixtral-8x7b"])
def test_committed_config_builds_and_maps_to_hf(name):
    ours, hf = _pressroom_and_hf_on_meta(CONFIGS / name)
    state = gpu.hf_state_dict(ours)
    expected = {n: tuple(p.shape) for n, p in hf.named_parameters(remove_duplicate=False)}
    assert {n: tuple(t.shape) for n, t in state.items()} == expected


@pytest.mark.parametrize(("name", "params", "active"), [
    ("llama-3.1-8b", 8.03e9, 8.03e9), ("llama-3.1-70b", 70.55e9, 70.55e9), ("llama-3.2-1b", 1.236e9, 1.236e9),
    ("qwen3-8b", 8.19e9, 8.19e9),
    ("qwen3-0.6b", 0.596e9, 0.596e9),
    ("qwen3-30b-a3b", 30.5e9, 3.35e9), ("mixtral-8x7b", 46.7e9, 12.9e9)])  # the model cards' total / active
def test_committed_config_parameter_count(name, params, active):
    from pressroom.model.loader import load_hf_config
    size = gpu.model_size(load_hf_config(str(CONFIGS / name)), torch.bfloat16)
    assert size.total_params == pytest.approx(params, rel=0.01)
    head = 0 if size.tied_word_embeddings else size.lm_head_params
    with_embeddings = size.active_non_embedding_params + size.embedding_params + head
    assert with_embeddings == pytest.approx(active, rel=0.01)


def test_moe_decode_reads_the_selected_experts_only():
    """Qwen3-30B-A3B: 48 layers x 128 experts x 3 x 2048 x 768 routed parameters, of which a token uses 8
    experts per layer; decode reads those, the rest of the layers and the LM head."""
    from pressroom.model.loader import load_hf_config
    size = gpu.model_size(load_hf_config(str(CONFIGS / "qwen3-30b-a3b")), torch.bfloat16)
    routed = 48 * 128 * 3 * 2048 * 768
    assert size.routed_expert_params == routed
    assert size.active_non_embedding_params == size.non_embedding_params - routed * 120 // 128
    assert size.decode_read_bytes == 2 * (size.active_non_embedding_params + size.lm_head_params)


def test_a_moe_batch_reads_the_experts_any_token_selects():
    """Qwen3-30B-A3B: one token reads the decode bound's bytes; 200 tokens of uniform routing leave an expert with
    probability (120/128)^200 (~2.5e-6), so a step reads nearly every expert: bandwidth binds its throughput far
    below the matmul rate's bound, and the roofline takes the smaller."""
    from pressroom.model.loader import load_hf_config
    size = gpu.model_size(load_hf_config(str(CONFIGS / "qwen3-30b-a3b")), torch.bfloat16)
    assert gpu.batch_read_bytes(size, 1) == pytest.approx(size.decode_read_bytes)
    everything = size.decode_read_bytes + 2 * size.routed_expert_params * 120 // 128
    assert gpu.batch_read_bytes(size, 200) == pytest.approx(everything, rel=1e-5)
    assert size.decode_read_bytes < gpu.batch_read_bytes(size, 4) < gpu.batch_read_bytes(size, 16) < everything
    ceilings = gpu.Ceilings(copy_bytes_per_s=4e12, copy_buffer_bytes=0, matmul_flops_per_s=8e14, matmul_size=0,
                            timer="")
    run = gpu.Run("pressroom", 200, 200 * 512, 200 * 256, 10.0, 200 * 25.6, 0.0)
    flops = gpu.workload_flops("throughput", size, run)
    roofline = gpu.throughput_roofline(size, ceilings, run, flops, 200)
    assert roofline["memory_bound_tokens_per_s"] == pytest.approx(200 * 4e12 / everything, rel=1e-4)
    assert roofline["roofline_tokens_per_s"] == roofline["memory_bound_tokens_per_s"]  # < the compute bound
    assert roofline["pressroom_over_roofline"] == pytest.approx(200 * 25.6 / roofline["roofline_tokens_per_s"],
                                                                rel=1e-3)
    dense = gpu.model_size(load_hf_config(str(CONFIGS / "llama-3.1-8b")), torch.bfloat16)
    assert gpu.batch_read_bytes(dense, 200) == dense.decode_read_bytes


def test_deepseek_v4_decode_reads_the_selected_experts_only():
    """V4-Flash: 43 MoE layers x 256 experts x 3 x 4096 x 2048 routed parameters (its router, `gate`, knows the
    6 experts a token takes); the card's 13B activated counts the embedding and the LM head."""
    from pressroom.model.loader import load_hf_config
    size = gpu.model_size(load_hf_config(str(CONFIGS / "deepseek-v4-flash")), torch.bfloat16)
    routed = 43 * 256 * 3 * 4096 * 2048
    assert size.routed_expert_params == routed
    assert size.active_non_embedding_params == size.non_embedding_params - routed * 250 // 256
    activated = size.active_non_embedding_params + size.embedding_params + size.lm_head_params
    assert activated == pytest.approx(13e9, rel=0.07)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_moe_bench_runs_hf_on_the_same_weights(tiny_model_dir, tmp_path, arch):
    """MoE families (DeepSeek's latent attention too) through the whole bench: pressroom's weights copied
    into HF's, and both produce every token; the bound counts the active parameters."""
    out = tmp_path / "result.json"
    argv = ["bench", "gpu", "--model", tiny_model_dir(arch), *TINY_FLAGS, "--workloads", "decode,throughput",
            "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["hf"]["experts_implementation"] in ("grouped_mm", "eager", "batched_mm")
    size = report["model_size"]
    assert 0 < size["active_non_embedding_params"] < size["non_embedding_params"]
    for section in report["workloads"].values():
        assert section["hf"]["output_tokens"] == section["pressroom"]["output_tokens"] > 0


def test_llama_decode_reads_all_but_the_embedding():
    from pressroom.model.loader import load_hf_config
    size = gpu.model_size(load_hf_config(str(CONFIGS / "llama-3.1-8b")), torch.bfloat16)
    assert not size.tied_word_embeddings and size.embedding_params == size.lm_head_params == 128256 * 4096
    assert size.decode_read_bytes == 2 * (size.total_params - size.embedding_params)


def test_flops_follow_the_stated_formulas():
    size = gpu.ModelSize(total_params=0, embedding_params=10, lm_head_params=10, non_embedding_params=130,
                         tied_word_embeddings=False, routed_expert_params=40, active_non_embedding_params=100,
                         bytes_per_param=2, decode_read_bytes=220)
    run = gpu.Run("pressroom", num_requests=4, input_tokens=40, output_tokens=8, elapsed_s=1.0,
                  output_tokens_per_s=8.0, input_tokens_per_s=40.0)
    assert gpu.workload_flops("throughput", size, run) == 2 * 100 * (40 + 8) + 2 * 10 * 8
    prefill = gpu.Run("pressroom", 4, 40, 4, 1.0, 4.0, 40.0)
    assert gpu.workload_flops("prefill", size, prefill) == 2 * 100 * 40 + 2 * 10 * 4


@pytest.mark.parametrize(("name", "total", "active"),
                         [("deepseek-v2-lite", 15.7e9, 2.4e9), ("deepseek-v3", 671e9, 37e9)])
def test_committed_deepseek_configs_build_their_published_size(name, total, active):
    """The model cards' totals, and their activated parameters (LM head included, input embedding not)."""
    from pressroom.model.loader import load_hf_config
    size = gpu.model_size(load_hf_config(str(CONFIGS / name)), torch.bfloat16)
    assert size.total_params == pytest.approx(total, rel=0.01)
    assert size.active_non_embedding_params + size.lm_head_params == pytest.approx(active, rel=0.03)


def test_the_sparse_attention_config_is_v2_lite_sized_with_an_indexer():
    from pressroom.model.loader import load_hf_config
    from pressroom.model.registry import resolve_architecture
    dsa, lite = (load_hf_config(str(CONFIGS / n)) for n in ("deepseek-v2-lite-dsa", "deepseek-v2-lite"))
    with torch.device("meta"):
        model = resolve_architecture(dsa)(dsa)
    attn = model.model.layers[0].self_attn
    assert (attn.indexer.heads, attn.indexer.dim, attn.indexer.topk) == (64, 128, 2048)
    assert attn.attn.cache_shape(1, 1)[-1] == 512 + 64 + 128  # latent, rope key, indexer key
    sizes = [gpu.model_size(c, torch.bfloat16).total_params for c in (dsa, lite)]
    assert 0 < sizes[0] - sizes[1] < 0.03 * sizes[1]  # the indexer and q compression add under 3%


def test_loaded_bytes_are_the_formula_for_dense_weights_and_shrink_with_fp8(tiny_model_dir):
    """The bound of a quantized run counts the bytes the engine holds: a dense model's are the formula's;
    FP8 holds each linear weight in one byte plus one fp32 scale per output row."""
    from pressroom import LLM
    from pressroom.model.layers.linear import LinearBase
    from pressroom.model.loader import load_hf_config
    from pressroom.model.registry import resolve_architecture
    config = load_hf_config(str(CONFIGS / "llama-3.1-8b"))
    with torch.device("meta"):
        model = resolve_architecture(config)(config).to(torch.bfloat16)
    assert gpu.loaded_decode_read_bytes(model) == gpu.model_size(config, torch.bfloat16).decode_read_bytes
    path = tiny_model_dir("llama")
    dense = gpu.model_size(load_hf_config(path), torch.float32).decode_read_bytes
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, quantization="fp8", skip_tokenizer_init=True)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, LinearBase)]
    weights, rows = sum(m.weight.numel() for m in linears), sum(m.weight.shape[0] for m in linears)
    assert gpu.loaded_decode_read_bytes(llm.engine.model) == dense - 3 * weights + 4 * rows
