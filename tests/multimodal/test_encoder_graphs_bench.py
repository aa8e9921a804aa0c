"""`pressroom bench gpu --workloads image` on the CPU at a tiny size: every flag benchmarks/gpu/vl_bench.sh passes is
taken, pressroom and HF transformers both generate every token, every request runs the encoder, and the report holds
the figures docs/BENCHMARKS.md quotes. Slow (some 30 s on 2 cores: two engines' worth of work and HF's generate)."""
from __future__ import annotations

import json

import pytest

from pressroom.entrypoints import cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_vl_shape(tmp_path_factory):
    """A tiny Qwen2.5-VL's config.json and preprocessor_config.json (dummy weights: no checkpoint)."""
    import transformers
    path = tmp_path_factory.mktemp("tiny-vl-shape")
    transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=240, eos_token_id=241,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
        bos_token_id=240, eos_token_id=241).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor", "patch_size": 14,
        "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 12845056,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    return path


def test_image_workload_against_hf(tiny_vl_shape, tmp_path):
    out = tmp_path / "vl.json"
    argv = ["bench", "gpu", "--device", "cpu", "--dtype", "float32", "--model", str(tiny_vl_shape),
            "--workloads", "image", "--image-size", "112", "--num-prompts", "4", "--input-len", "16",
            "--output-len", "4", "--warmup-requests", "1", "--max-num-seqs", "8", "--hf-batch-sizes", "2,4",
            "--hf-max-requests", "4", "--gpu-memory-utilization", "0.85", "--encoder-cudagraph-sizes", "256,1024",
            "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["image"]["grid_thw"] == [1, 8, 8] and report["image"]["image_tokens"] == 16
    assert report["image"]["prompt_tokens"] == 16 + 16 + 2  # text, the image's rows, vision start and end
    assert report["pressroom"]["output_tokens"] == 4 * 4 and report["images_encoded"] == 4
    assert [r["batch_size"] for r in report["hf_by_batch_size"]] == [2, 4]
    assert all(r["output_tokens"] == 4 * 4 for r in report["hf_by_batch_size"])
    assert report["pressroom_over_hf"] > 0 and report["encoder"]["eager_ms_per_image"] > 0
    assert "graphs_ms_per_image" not in report["encoder"]  # the CPU captures no graphs
    assert report["engine_args"]["encoder_cudagraph_sizes"] == "256,1024"


def test_image_runs_alone(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "gpu", "--workloads", "image,decode"])
    assert "image runs alone" in capsys.readouterr().err
