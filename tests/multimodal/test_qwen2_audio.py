"""Qwen2-Audio equals HF transformers' Qwen2AudioForConditionalGeneration on tiny random weights (fp32): greedy tokens
for 32 new tokens and prompt logprobs, with 1-2 clips per prompt beside a text-only prompt in one batch (a clip past
the window, cut as HF cuts it; a clip at 44.1 kHz, resampled), and with chunked prefill splitting the audio runs.
HF's own processor expands each prompt to the same ids. The encoder cache runs a clip once however many requests
hold it; LLM.chat takes input_audio and audio_url parts; bad audio inputs are ValueErrors that say what to fix."""
from __future__ import annotations

import base64
import copy

import numpy as np
import pytest
import torch
from tiny_audio import PAD, WINDOW_SECONDS, build_tiny_qwen2_audio, tone, wav_bytes

from pressroom import LLM, SamplingParams

NEW_TOKENS = 32
RATE = 16_000
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_audio_model(tmp_path_factory, smollm_tokenizer):
    """(folder, HF model) of a tiny random Qwen2-Audio with its tokenizer and processor."""
    path = tmp_path_factory.mktemp("tiny-qwen2_audio")
    return str(path), build_tiny_qwen2_audio(path, copy.deepcopy(smollm_tokenizer))


@pytest.fixture(scope="module")
def audio_llm(tiny_audio_model):
    return LLM(tiny_audio_model[0], dtype="float32", kv_cache_memory_gib=0.05)


def _clips():
    return [tone(1, 0.9), tone(2, 0.37), tone(3, WINDOW_SECONDS + 1.0), tone(4, 1.3, 44_100)]


def _prompts():
    c = _clips()
    return [
        {"prompt": f"<|im_start|>user\nAudio 1: {PAD}\nWhat is it?<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"audio": [(c[0], RATE)]}},
        {"prompt": f"Compare {PAD} with {PAD} please.", "multi_modal_data": {"audio": [(c[1], RATE), (c[2], RATE)]}},
        {"prompt": "A prompt of text alone, with no sound in it at all."},
        {"prompt": f"{PAD}{PAD} two clips", "multi_modal_data": {"audio": [(c[3], 44_100), (c[0], RATE)]}},
    ]


@torch.inference_mode()
def _hf_reference(hf_model, llm: LLM, prompt: dict, token_ids: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and prompt logprobs on the same ids and the clips at 16 kHz (ours resampled and cut), its
    feature extractor's padded window and mask; HF's processor must expand the text to the same ids."""
    import transformers
    ids = torch.tensor([token_ids])
    kwargs = {}
    clips = (prompt.get("multi_modal_data") or {}).get("audio")
    if clips:
        samples = [llm.engine.media_processor().processor("audio").samples(c) for c in clips]
        processor = transformers.AutoProcessor.from_pretrained(llm.engine.model_path)
        batch = processor(text=[prompt["prompt"]], audio=samples, sampling_rate=RATE, return_tensors="pt")
        assert batch["input_ids"][0].tolist() == token_ids  # HF's placeholder count per clip is ours
        kwargs = dict(input_features=batch["input_features"], feature_attention_mask=batch["feature_attention_mask"])
    logits = hf_model(input_ids=ids, **kwargs).logits[0, :-1]
    lps = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(token_ids):].tolist(), lps


_REFERENCES: dict[tuple, tuple[list[int], list[float]]] = {}  # HF's, shared by the tests


def _check(llm: LLM, hf_model, prompts: list[dict]) -> None:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        key = tuple(out.prompt_token_ids)
        if key not in _REFERENCES:
            _REFERENCES[key] = _hf_reference(hf_model, llm, prompt, out.prompt_token_ids)
        tokens, lps = _REFERENCES[key]
        assert out.outputs[0].token_ids == tokens
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert len(ours) == len(lps)
        assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-3


def test_one_clip_matches_hf(tiny_audio_model, audio_llm):
    _check(audio_llm, tiny_audio_model[1], _prompts()[:1])


@pytest.mark.slow  # HF's reference on four prompts (3 with audio) and their 32 tokens: ~30 s on two busy cores
def test_audio_matches_hf_in_one_batch(tiny_audio_model, audio_llm):
    path, hf_model = tiny_audio_model
    cache, engine = audio_llm.engine.runner.multimodal.cache, audio_llm.engine
    clips = {m.hash for p in _prompts() if "multi_modal_data" in p
             for m in engine.process_media(p, engine.tokenize_prompt(p)[1])[1]}
    assert len(clips) == 4  # clip 0 is in two prompts: one hash
    new, before = [h for h in clips if h not in cache], cache.encoder_runs
    _check(audio_llm, hf_model, _prompts())
    assert cache.encoder_runs - before == len(new)  # each clip not cached yet encoded once
    out = audio_llm.generate(_prompts()[1], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    # one placeholder per encoder row: 0.37 s -> 37 frames -> 9 rows; the 3 s clip cut to its 2 s window -> 50
    assert out.prompt_token_ids.count(hf_model.config.audio_token_id) == 9 + 50


def test_audio_changes_the_answer(audio_llm):
    prompt = f"Listen: {PAD} now"
    a, b = (audio_llm.generate({"prompt": prompt, "multi_modal_data": {"audio": (tone(s, 0.8), RATE)}}, GREEDY,
                               use_tqdm=False)[0] for s in (5, 6))
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    assert b.num_cached_tokens == 0  # the first block holds audio rows: keyed by the clip, never shared
    # the same clip again, after different text: its rows come from the encoder cache, not a second encoder run
    runs = audio_llm.engine.runner.multimodal.cache.encoder_runs
    again = audio_llm.generate({"prompt": f"Other words first, then {PAD}",
                                "multi_modal_data": {"audio": (tone(5, 0.8).copy(), RATE)}}, GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == 0
    assert audio_llm.engine.runner.multimodal.cache.encoder_runs == runs


@pytest.mark.slow  # a second engine at 8 tokens a step, 35+ steps a prompt: ~15 s on two busy cores
def test_chunked_prefill_splits_audio_runs(tiny_audio_model):
    path, hf_model = tiny_audio_model
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=False)
    prompts = [p for p in _prompts() if "multi_modal_data" in p]
    _check(llm, hf_model, prompts)
    _, items = llm.engine.process_media(prompts[1], llm.engine.tokenize_prompt(prompts[1])[1])
    assert max(m.length for m in items) > 8  # a step of 8 tokens cannot hold the run: chunks split it
    assert llm.engine.runner.multimodal.cache.encoder_runs == 4  # each clip once, though its run took steps


def test_token_prompts_expand_alike_and_expanded_runs_are_kept(audio_llm):
    """vLLM's prompt_token_ids with multi_modal_data: one placeholder per clip is expanded as a text prompt's is; a
    run HF's processor already expanded (its length the clip's rows) is kept as it is."""
    engine, clips = audio_llm.engine, [(tone(13, 0.5), RATE), (tone(14, 1.1), RATE)]
    text = {"prompt": f"a {PAD} b {PAD} c", "multi_modal_data": {"audio": clips}}
    expanded, items = engine.process_media(text, engine.tokenize_prompt(text)[1])
    ids = {"prompt_token_ids": engine.tokenize_prompt(text)[1], "multi_modal_data": {"audio": clips}}
    assert engine.process_media(ids, ids["prompt_token_ids"])[0] == expanded
    again, kept = engine.process_media(text, expanded)
    assert again == expanded and [(m.offset, m.length) for m in kept] == [(m.offset, m.length) for m in items]
    assert [m.length for m in items] == [12, 27]  # 50 and 110 mel frames, halved twice


def test_chat_input_audio_and_audio_url_equal_generate(audio_llm):
    clip = tone(7, 0.6)
    data = base64.b64encode(wav_bytes(clip)).decode()
    direct = audio_llm.generate({"prompt": f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                                           f"<|im_start|>user\nAudio 1: {PAD}\nWhat is it?<|im_end|>\n"
                                           "<|im_start|>assistant\n",
                                 "multi_modal_data": {"audio": (clip, RATE)}}, GREEDY, use_tqdm=False)[0]
    for part in ({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                 {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{data}"}}):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
        chat = audio_llm.chat(messages, GREEDY, use_tqdm=False)[0]
        assert chat.prompt_token_ids == direct.prompt_token_ids
        assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_resampled_clip_is_the_clip_at_16k(audio_llm):
    """PyAV's resampler against scipy's polyphase filter on a 44.1 kHz clip (away from the edges)."""
    from scipy.signal import resample_poly
    clip = tone(8, 1.0, 44_100)
    ours = audio_llm.engine.media_processor().processor("audio").samples((clip, 44_100))
    want = resample_poly(clip, 160, 441)
    assert abs(len(ours) - len(want)) <= 2
    n = min(len(ours), len(want))
    assert np.abs(ours[100:n - 100] - want[100:n - 100]).max() < 0.02


@pytest.mark.parametrize("data, match", [
    ({"audio": (tone(0, 0.5).astype(np.int16), RATE)}, "float array"),
    ({"audio": (np.zeros((2, 800), np.float32), RATE)}, "1-D"),
    ({"audio": (tone(0, 0.5), 0)}, "sample rate"),
    ({"audio": (np.full(800, np.nan, np.float32), RATE)}, "finite"),
    ({"audio": (np.zeros(100, np.float32), RATE)}, "too short"),
    ({"audio": b"RIFF....WAVE"}, "audio item must be"),
    ({"audio": [(tone(0, 0.5), RATE)] * 2}, "1 audio placeholder"),
    ({"image": np.zeros((4, 4, 3), np.uint8)}, "modality image is not supported by this model"),
])
def test_bad_audio_inputs(audio_llm, data, match):
    with pytest.raises(ValueError, match=match):
        audio_llm.generate({"prompt": f"one {PAD}", "multi_modal_data": data}, GREEDY, use_tqdm=False)


def test_a_tiny_sample_rate_costs_no_more_than_the_window(audio_llm):
    """An hour of samples claimed at 1 Hz (a forged rate): cut to the window before resampling, so the clip is
    the window's length and is processed at once."""
    samples = audio_llm.engine.media_processor().processor("audio").samples((tone(9, 3600.0, 1), 1))
    assert len(samples) <= WINDOW_SECONDS * RATE


def test_chat_refuses_media_the_model_does_not_take(audio_llm):
    from tiny_vl import png_data_url, random_image
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(random_image(0, (20, 20)))}}]}]
    with pytest.raises(ValueError, match=r"qwen2_audio\) takes no images; it takes audio and text"):
        audio_llm.chat(messages, GREEDY, use_tqdm=False)


def _audio_messages(clip: np.ndarray) -> list[dict]:
    data = base64.b64encode(wav_bytes(clip)).decode()
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                         {"type": "text", "text": "What is it?"}]}]


@pytest.mark.slow  # a server start of its own (~10 s quiet) beside the offline engine; audio from a loopback host
def test_input_audio_through_the_server_equals_offline(tiny_audio_model, audio_llm, tmp_path):
    import openai
    from hostile_media import forged_rate_wav, media_server
    from serving import serve
    from tiny_vl import png_data_url, random_image
    path = tiny_audio_model[0]
    clips = [tone(11, 0.7), tone(12, 0.7)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [audio_llm.chat(_audio_messages(c), params, use_tqdm=False)[0].outputs[0].token_ids for c in clips]
    assert want[0] != want[1]  # the clip steers the answer
    args = ["serve", path, "--dtype", "float32", "--kv-cache-memory-gib", "0.05", "--served-model-name", "tiny-audio",
            "--allowed-media-domains", "127.0.0.1"]
    files = {"/a.wav": ("audio/wav", wav_bytes(clips[0]))}
    with serve(args, tmp_path / "server.log") as (url, _), media_server(files) as media:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for clip, tokens in zip(clips, want):
            body = dict(model="tiny-audio", messages=_audio_messages(clip), max_tokens=8, temperature=0,
                        extra_body={"ignore_eos": True, "return_token_ids": True})
            whole = client.chat.completions.create(**body)
            assert whole.choices[0].model_extra["token_ids"] == list(tokens)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                **body, stream=True) if c.choices)
            assert streamed == whole.choices[0].message.content
        # the same clip as an audio_url from an allowed http(s) domain: the same answer
        fetched = client.chat.completions.create(**{**body, "messages": [{"role": "user", "content": [
            {"type": "audio_url", "audio_url": {"url": media.url("/a.wav")}},
            {"type": "text", "text": "What is it?"}]}]})
        assert fetched.choices[0].model_extra["token_ids"] == list(want[0])
        with pytest.raises(openai.BadRequestError, match="limit of 600 s"):  # duration from samples, not header
            data = base64.b64encode(forged_rate_wav(20, claimed_rate=1)).decode()
            client.chat.completions.create(model="tiny-audio", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}])
        with pytest.raises(openai.BadRequestError, match="takes no images; 'tiny-audio' takes audio and text"):
            client.chat.completions.create(model="tiny-audio", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(random_image(0, (20, 20)))}}]}])
