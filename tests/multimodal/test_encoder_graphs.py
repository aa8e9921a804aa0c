"""Encoder CUDA graphs' bucketing and padding, checked on the CPU: the vision towers of Qwen2.5-VL (windowed and full
attention) and Qwen3-VL (full attention, DeepStack) run at a bucket's fixed shapes (patches padded, windows and frames
as fixed-size tensors) give the rows the unpadded eager tower gives, and EncoderGraphs packs a step's images from
several requests into buckets (one padded run per bucket-sized batch, the oversized ones eagerly together) with the
rows each item would get alone. The captured replay itself is tests/gpu/test_vl_gpu.py's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pressroom.multimodal.inputs import MediaItem
from pressroom.worker.encoder_graphs import EncoderGraphs, pack_batches

# images of several shapes (windows cut at the edges), one of two temporal patches (a video)
GRIDS = [(1, 8, 12), (2, 6, 4), (1, 4, 4), (1, 10, 6)]
PATCH_DIM = 3 * 2 * 14 * 14


def _qwen2_5_vl():
    import transformers

    from pressroom.model.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    return _randomized(Qwen2_5_VLForConditionalGeneration(config))


def _qwen3_vl():
    import transformers

    from pressroom.model.models.qwen3_vl import Qwen3VLForConditionalGeneration
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
        image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    return _randomized(Qwen3VLForConditionalGeneration(config))


def _randomized(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.visual.parameters():  # away from the init, so every part of the tower moves the rows
            param.normal_(0, 0.2)
    return model.float().eval()


def _pixels(grids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=gen)


@pytest.mark.parametrize("family", [_qwen2_5_vl, _qwen3_vl], ids=["qwen2_5_vl", "qwen3_vl"])
@torch.inference_mode()
def test_padded_tower_equals_unpadded(family):
    tower = family().visual
    pixels = _pixels(GRIDS)
    n = pixels.shape[0]
    expected = tower(pixels, GRIDS)
    for patches in (n, n + 4, 1024):  # no padding, one merged row of it, most of the bucket
        inputs = tower.padded_inputs(pixels, GRIDS, patches)
        assert all(t.shape[0] in (patches, patches // 4) for k, t in inputs.items() if not k.startswith("run_"))
        out = tower.static_forward(inputs)
        assert out.shape[0] == patches // 4
        torch.testing.assert_close(out[:expected.shape[0]], expected, rtol=1e-5, atol=1e-5)
    assert tower.padded_inputs(pixels, GRIDS, n - 4) is None  # more patches than the bucket


@torch.inference_mode()
def test_more_windows_than_the_bucket_holds_does_not_fit():
    tower = _qwen2_5_vl().visual
    grids = [(1, 2, 2)] * 20  # 20 one-window images in 80 patches: the bucket's fixed window count is 16
    assert tower.window_runs(80) == 16
    assert tower.padded_inputs(_pixels(grids), grids, 80) is None
    assert tower.padded_inputs(_pixels(grids), grids, 320) is not None  # 40 windows' room


def test_pack_batches_in_order_up_to_the_largest_bucket():
    assert pack_batches([40, 30, 50, 200, 10, 128], 128) == ([[0, 1, 2], [4], [5]], [3])
    assert pack_batches([], 64) == ([], [])


def _items(grids, seed):
    items = []
    for i, (t, h, w) in enumerate(grids):
        pixels = _pixels([(t, h, w)], seed + i).numpy()
        items.append(MediaItem(modality="image", hash=f"img{seed}-{i}", offset=0, length=t * h * w // 4,
                               pixels=pixels.tobytes(), pixels_shape=tuple(pixels.shape), grid_thw=(t, h, w)))
    return items


@pytest.mark.parametrize("family", [_qwen2_5_vl, _qwen3_vl], ids=["qwen2_5_vl", "qwen3_vl"])
@torch.inference_mode()
def test_encoder_graphs_batch_a_steps_images_into_buckets(family):
    """Two requests' images (a step's missing ones) through buckets of 128 and 256 patches: 96 + 48 + 16 patches
    pack into one run of the 256 bucket, 120 into a run of the 128 one, 24 x 12 = 288 patches run eagerly."""
    model = family()
    items = _items([(1, 8, 12), (2, 6, 4), (1, 4, 4)], 0) + _items([(1, 24, 12), (1, 10, 12)], 10)
    graphs = EncoderGraphs(model, [256, 128])
    rows = graphs.encode_media(items)
    assert (graphs.padded_runs, graphs.eager_items) == (2, 1)
    for item, got in zip(items, rows):
        alone = model.encode_media([item])[0]
        assert got.shape == (item.length, alone.shape[1])
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_buckets_must_be_positive():
    with pytest.raises(ValueError, match="positive patch counts"):
        EncoderGraphs(torch.nn.Linear(1, 1), [0, 64])


def test_text_positions_collapse_to_one_row():
    """A step of text positions only (decodes past the image) gets one position row, which decode graphs take;
    a step reaching image tokens keeps M-RoPE's three."""
    from pressroom.multimodal.step_inputs import MultimodalInputs, StepSpan
    model = _qwen2_5_vl()
    mm = MultimodalInputs(model, 1024)
    item = _items([(1, 8, 8)], 0)[0]
    item = MediaItem(modality="image", hash=item.hash, offset=2, length=16, pixels=item.pixels,
                     pixels_shape=item.pixels_shape, grid_thw=item.grid_thw)
    mm.start("a", 20, [item])
    ids = torch.zeros(1, dtype=torch.long)
    _, positions = mm.step_inputs(ids, torch.tensor([25]), [StepSpan("a", 25, 1, 0)])
    assert positions.tolist() == [25 + mm.requests["a"].mrope_delta]
    _, positions = mm.step_inputs(torch.zeros(20, dtype=torch.long), torch.arange(20), [StepSpan("a", 0, 20, 0)])
    assert positions.shape == (3, 20) and not np.array_equal(positions[1].numpy(), positions[2].numpy())


def _model_of(llm):
    return llm.engine.core.executor.driver_worker.model_runner.model


def test_audio_clips_padded_to_whole_windows_give_the_eager_rows(tmp_path, smollm_tokenizer):
    """Qwen2-Audio's tower at a bucket's fixed shape (every clip padded to the 30-s window, here the tiny model's
    2 s; a bucket a number of clips, padding clips of one frame) gives each clip the rows the eager batch padded
    to its longest clip gives; the configured patch counts become whole windows."""
    import copy

    from tiny_audio import PAD, build_tiny_qwen2_audio, tone

    from pressroom import LLM
    build_tiny_qwen2_audio(tmp_path, copy.deepcopy(smollm_tokenizer))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gib=0.02)
    engine, model = llm.engine, _model_of(llm)
    clips = [(tone(1, 0.9), 16_000), (tone(2, 1.7), 16_000), (tone(3, 0.4), 16_000)]
    _, ids = engine.tokenize_prompt(PAD * 3)
    _, items = engine.process_media({"multi_modal_data": {"audio": clips}}, ids)
    window = model.audio_tower.window_frames
    graphs = EncoderGraphs(model, [window - 1, window, 2 * window + 5, 4 * window])
    assert graphs.buckets == [window, 2 * window, 4 * window]  # whole windows; one under a window dropped
    with torch.inference_mode():
        eager = model.encode_media(items)
        padded = graphs.encode_media(items)
    assert graphs.padded_runs == 1 and graphs.eager_items == 0  # three clips in the four-clip bucket
    for e, p, item in zip(eager, padded, items):
        assert p.shape == e.shape and p.shape[0] == item.length
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)


def test_whisper_windows_in_a_bucket_give_the_eager_rows(tmp_path):
    """Whisper's clips (each its whole window, unmasked) through a two-clip bucket: each clip's encoder row equals
    the eager pass's, a lone clip padded with a zero clip too."""
    from test_whisper import build_tiny_whisper, tone

    from pressroom import LLM
    build_tiny_whisper(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gib=0.02)
    model, inputs = _model_of(llm), llm.engine.encoder_inputs()
    items = [inputs.item(tone(s, [220.0 * (i + 1)], i)) for i, s in enumerate((1.5, 0.7, 1.9))]
    window = model.audio_tower_for_graphs.window_frames
    graphs = EncoderGraphs(model, [2 * window])
    with torch.inference_mode():
        eager = model.encode_media(items)
        padded = graphs.encode_media(items)
    assert graphs.padded_runs == 2  # two clips, then the third beside a padding clip
    for e, p in zip(eager, padded):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)
