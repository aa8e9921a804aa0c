"""Video inputs on Qwen2.5-VL against HF transformers' Qwen2_5_VLForConditionalGeneration on tiny random weights
(fp32): a video's frames are cut into temporal patches (two frames a patch, an odd count padded with the last) and
run through the vision tower; its placeholder run is as long as HF's processor makes it (video_grid_thw's product /
merge^2: HF's model refuses any other count); its M-RoPE rows, whose time axis steps by tokens_per_second x seconds
per temporal patch, equal HF's get_rope_index; greedy tokens and prompt logprobs equal HF's with a video, a video
beside an image, and a text-only prompt in one batch. Videos come offline as frames ([T, H, W, 3] uint8, or
(frames, {"fps": ...})), through LLM.chat and the server as `video_url` data URLs of videos PyAV writes.

HF's video processors need torchvision, which does not load against this torch build: HF's model gets the pixels
pressroom's numpy processor makes (its resize is PIL's bicubic where HF's fast one is torchvision's), so the parity
is the model's and the placeholder layout's, not the resize's."""
from __future__ import annotations

import base64
import io
import json
import shutil

import numpy as np
import pytest
import torch
from tiny_vl import random_image

from pressroom import LLM, SamplingParams

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_video(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """Frames that change smoothly from one to the next (so a lossy codec keeps them close), [T, H, W, 3] uint8."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3)).astype(np.int16)
    steps = rng.integers(-12, 13, (frames, 1, 1, 3))
    return np.clip(base[None] + np.cumsum(steps, axis=0), 0, 255).astype(np.uint8)


def video_data_url(frames: np.ndarray, container: str = "mp4", codec: str = "mpeg4", fps: int = 8) -> str:
    """The frames encoded by PyAV as a data URL (what a client sends as a video_url part)."""
    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return f"data:video/{container};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def video_vl(tiny_vl, tmp_path_factory):
    """(folder, HF model): the tiny Qwen2.5-VL with a chat template that renders video parts too."""
    path, hf_model = tiny_vl
    folder = tmp_path_factory.mktemp("tiny-qwen2_5_vl-video")
    shutil.copytree(path, folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").write_text(VIDEO_TEMPLATE)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": VIDEO_TEMPLATE}))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        config["chat_template"] = VIDEO_TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder), hf_model


def _processed(llm: LLM, prompt: dict):
    text_ids = llm.engine.tokenize_prompt(prompt)[1]
    return llm.engine.process_media(prompt, text_ids)


@torch.inference_mode()
def _hf_reference(hf_model, llm: LLM, prompt: dict, new_tokens: int) -> tuple[list[int], list[float], list[int]]:
    """HF's greedy tokens and prompt logprobs on the prompt's ids and media as pressroom processed them, and the
    ids (pressroom's expansion)."""
    token_ids, items = _processed(llm, prompt)
    ids = torch.tensor([token_ids])
    config = hf_model.config
    kwargs = {"mm_token_type_ids": (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()}
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        groups = _whole_items([m for m in items or () if m.modality == modality])
        if groups:
            kwargs[key] = torch.cat([m.pixel_tensor() for group in groups for m in group])
            kwargs[f"{modality}_grid_thw"] = torch.tensor([_grid(group) for group in groups])
            if modality == "video" and config.model_type == "qwen2_5_vl":  # a float32 tensor, as HF's processor's
                kwargs["second_per_grid_ts"] = torch.tensor([group[0].seconds_per_grid for group in groups])
    logits = hf_model(input_ids=ids, **kwargs).logits[0, :-1]
    lps = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
    hf_model.model.rope_deltas = None
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            do_sample=False, min_new_tokens=new_tokens, **kwargs)
    hf_model.model.rope_deltas = None
    return out[0, len(token_ids):].tolist(), lps, token_ids


def _whole_items(items: list) -> list[list]:
    """Items grouped by the video they come from (Qwen3-VL's video is an item a temporal patch, hash "video:i")."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(item.hash.split(":")[0], []).append(item)
    return list(groups.values())


def _grid(group: list) -> tuple[int, int, int]:
    return (sum(m.grid_thw[0] for m in group), *group[0].grid_thw[1:])


def _hf_expanded_ids(llm: LLM, prompt: dict) -> list[int]:
    """HF's processor's text-side expansion (its replace_image_token / replace_video_token and
    get_text_with_replacements, Qwen3-VL's timestamps among them) on the grids of the prompt's media, tokenized.
    HF's processor object is made without its video processor (torchvision) and given the two sizes it reads."""
    import types

    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from pressroom.multimodal.processor import _video_parts
    config = llm.engine.hf_config
    hf = object.__new__(Qwen3VLProcessor if config.model_type == "qwen3_vl" else Qwen2_5_VLProcessor)
    hf.tokenizer = llm.engine.tokenizer
    hf.image_token, hf.video_token = "<|image_pad|>", "<|video_pad|>"
    hf.vision_start_token, hf.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    hf.image_processor = types.SimpleNamespace(merge_size=2)
    hf.video_processor = types.SimpleNamespace(merge_size=2, temporal_patch_size=2)
    data = prompt.get("multi_modal_data") or {}
    listed = {k: v if isinstance(v, list) else [v] for k, v in data.items()}
    processors = llm.engine.media_processor()
    images = {"image_grid_thw": torch.tensor([processors.processor("image").encode(i).grid
                                              for i in listed.get("image", [])])}
    videos, metadata = [], []
    for video in listed.get("video", []):
        frames, _, indices, fps = _video_parts(video)
        videos.append(processors.processor("video").encode(video).grid)
        given = video[1].get("fps") if isinstance(video, tuple) else None  # HF's: 24 where none was given
        metadata.append(VideoMetadata(total_num_frames=len(frames), fps=given, frames_indices=indices))
    video_inputs = {"video_grid_thw": torch.tensor(videos), "video_metadata": metadata}
    text, _ = hf.get_text_with_replacements(
        [prompt["prompt"]], [hf.replace_image_token(images, i) for i in range(len(listed.get("image", [])))],
        [hf.replace_video_token(video_inputs, i) for i in range(len(videos))])
    return llm.engine.tokenizer.encode(text[0], add_special_tokens=False)


def _check(llm: LLM, hf_model, prompts: list[dict], new_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, prompt_logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens, lps, token_ids = _hf_reference(hf_model, llm, prompt, new_tokens)
        assert out.prompt_token_ids == token_ids == _hf_expanded_ids(llm, prompt)
        assert out.outputs[0].token_ids == tokens
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert len(ours) == len(lps)
        assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-3


def test_video_matches_hf_placeholders_rope_and_tokens(video_vl):
    """The default case: one 5-frame video (padded to 3 temporal patches) with (frames, metadata) at 2 fps beside a
    text-only prompt, 8 new tokens; ids, M-RoPE rows and tokens equal HF's."""
    path, hf_model = video_vl
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    video = random_video(1, 5, 60, 90)
    prompt = f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>\n<|im_start|>assistant\n"
    item = {"prompt": prompt, "multi_modal_data": {"video": (video, {"fps": 2.0})}}
    token_ids, items = _processed(llm, item)
    assert [m.grid_thw[0] for m in items] == [3] and items[0].seconds_per_grid == 1.0
    assert token_ids == _hf_expanded_ids(llm, item)
    ids = torch.tensor([token_ids])
    want, delta = hf_model.model.get_rope_index(
        ids, (ids == hf_model.config.video_token_id).int() * 2, video_grid_thw=torch.tensor([items[0].grid_thw]),
        second_per_grid_ts=torch.tensor([items[0].seconds_per_grid]))
    ours, our_delta = llm.engine.runner.model.mrope_positions(len(token_ids), items)
    assert np.array_equal(ours, want[:, 0].numpy()) and our_delta == int(delta)
    assert len(set(ours[0][items[0].offset:items[0].end])) == 3  # the time axis moves: 0, 2, 4 (2 tokens/s x 1 s)
    _check(llm, hf_model, [item, {"prompt": "Text alone, with no video in it."}], 8)
    # a model that takes no video names what it takes
    import transformers

    from pressroom.multimodal.processor import MediaProcessor
    with pytest.raises(ValueError, match=r"not supported by this model \(llava\); it takes image and text"):
        MediaProcessor(path, transformers.LlavaConfig()).process(token_ids, {"video": [video]})


@pytest.mark.slow  # HF's 32-token generate on four prompts and a chunked-prefill rerun: ~20 s alone on two cores
def test_videos_and_images_match_hf_in_one_batch(video_vl):
    path, hf_model = video_vl
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.1)
    videos = [random_video(2, 8, 84, 56), random_video(3, 7, 64, 100)]
    image = random_image(4, (70, 90))
    prompts = [
        {"prompt": f"<|im_start|>user\n{VIDEO}Describe the clip.<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"video": videos[0]}},
        {"prompt": f"Picture {PAD} then clip {VIDEO} compared.",
         "multi_modal_data": {"image": [image], "video": [(videos[1], {"fps": 4.0})]}},
        {"prompt": "A prompt of text alone, with no media in it at all."},
        {"prompt": f"Two clips: {VIDEO} and {VIDEO}.", "multi_modal_data": {"video": [videos[1], videos[0]]}},
    ]
    _check(llm, hf_model, prompts, 32)
    # keyed by content (and rate: the time axis moves the KV): the clip in two prompts encoded once
    assert llm.engine.runner.multimodal.cache.encoder_runs == 4
    # 8 tokens a step: chunked prefill splits the video runs (48 and 60 rows) over steps
    chunked = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=8, max_num_seqs=4,
                  enable_prefix_caching=False)
    _check(chunked, hf_model, prompts[:2], 8)
    assert max(m.length for m in _processed(chunked, prompts[0])[1]) > 8


def _chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}]


def test_video_url_over_http_from_an_allowed_domain():
    """A video_url over http(s) from --allowed-media-domains (a loopback server): the same frames and rate as its
    data URL; a host outside the list is refused before any fetch."""
    from hostile_media import media_server

    from pressroom.multimodal.chat import extract_media
    from pressroom.multimodal.media import MediaPolicy
    url = video_data_url(random_video(11, 4, 32, 48))
    body = base64.b64decode(url.split(",", 1)[1])
    with media_server({"/clip.mp4": ("video/mp4", body)}) as server:
        policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
        _, fetched = extract_media(_chat(server.url("/clip.mp4")), {"video"}, policy)
        _, inline = extract_media(_chat(url), {"video"}, policy)
        assert np.array_equal(fetched["video"][0][0], inline["video"][0][0])
        assert fetched["video"][0][1] == inline["video"][0][1]
        with pytest.raises(ValueError, match="localhost"):
            extract_media(_chat(server.url("/clip.mp4", host="localhost")), {"video"}, policy)


def test_chat_video_url_data_urls(video_vl):
    """LLM.chat with mp4 and webm data URLs: the frames decoded (PyAV) and sampled, then the same as the frames
    given offline; a different clip steers the answer; more videos than --limit-mm-per-prompt allows is refused."""
    path, _ = video_vl
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    video = random_video(5, 6, 48, 64)
    mp4 = llm.chat(_chat(video_data_url(video)), params, use_tqdm=False)[0]
    webm = llm.chat(_chat(video_data_url(video, "webm", "libvpx-vp9")), params, use_tqdm=False)[0]
    other = llm.chat(_chat(video_data_url(random_video(6, 6, 48, 64))), params, use_tqdm=False)[0]
    assert mp4.prompt_token_ids.count(llm.engine.hf_config.video_token_id) == 3 * 2 * 2  # 3 patches of 2x2 rows
    assert mp4.outputs[0].token_ids != other.outputs[0].token_ids  # the video steers the answer
    assert len(webm.outputs[0].token_ids) == 6
    from pressroom.multimodal.chat import extract_media
    from pressroom.multimodal.media import MediaPolicy
    # the stream's rate rides along: 6 frames of 8 fps, all kept, are 2 / 8 s a temporal patch (M-RoPE's time axis)
    _, media = extract_media(_chat(video_data_url(video)), {"video"})
    assert media["video"][0][1] == {"fps": 8.0, "frames_indices": list(range(6)), "total_num_frames": 6}
    assert llm.engine.media_processor().processor("video").encode(media["video"][0]).seconds_per_grid == 0.25
    with pytest.raises(ValueError, match=r"At most 1 video\(s\)"):
        extract_media(_chat(video_data_url(video)) * 2, {"image", "video"}, MediaPolicy(limit_per_prompt={"video": 1}))


@pytest.mark.slow  # a server start of its own (~10 s quiet)
def test_video_url_through_the_server(video_vl, tmp_path):
    import openai
    from serving import serve
    path, _ = video_vl
    url = video_data_url(random_video(7, 6, 48, 64))
    offline = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    want = offline.chat(_chat(url), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    offline.shutdown()
    args = ["serve", path, "--dtype", "float32", "--kv-cache-memory-gib", "0.05",
            "--limit-mm-per-prompt", '{"video": 1}']
    with serve(args, tmp_path / "server.log") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        body = dict(model=path, messages=_chat(url), max_tokens=8, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True})
        assert client.chat.completions.create(**body).choices[0].model_extra["token_ids"] == list(want)
        with pytest.raises(openai.BadRequestError, match=r"At most 1 video\(s\)"):
            two = [{"role": "user", "content": _chat(url)[0]["content"] * 2}]
            client.chat.completions.create(**{**body, "messages": two})


# Qwen3-VL's own tiny model and HF references: ~10 s on two cores
@pytest.mark.slow
def test_qwen3_vl_videos_with_timestamps_match_hf(tiny_qwen3_vl):
    """Qwen3-VL: each temporal patch its own run after its `<t seconds>` text (the frames' times from the
    metadata's indices and fps, 24 fps where none is given), a video beside an image and a text-only prompt."""
    path, hf_model = tiny_qwen3_vl
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.1)
    videos = [random_video(8, 5, 70, 90), random_video(9, 8, 64, 64)]
    image = random_image(10, (80, 60))
    prompts = [
        {"prompt": f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"video": (videos[0], {"fps": 2.0, "frames_indices": [0, 3, 6, 9, 12],
                                                    "total_num_frames": 14})}},
        {"prompt": f"Picture {PAD} and clip {VIDEO}.", "multi_modal_data": {"image": image, "video": videos[1]}},
        {"prompt": "Only text here, nothing else."},
    ]
    _check(llm, hf_model, prompts, 32)
    ids = llm.engine.tokenize_prompt(prompts[0])[1]
    expanded, items = _processed(llm, prompts[0])
    assert len(items) == 3 and llm.engine.tokenizer.decode(expanded).count(" seconds>") == 3  # 5 frames: 3 patches
    assert len(expanded) > len(ids)
