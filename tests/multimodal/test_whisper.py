"""Whisper against HF transformers on a tiny random checkpoint (fp32): greedy tokens of clips of different lengths
batched together, offline (`LLM.generate` with `multi_modal_data={"audio": ...}`) and through the server's
/v1/audio/transcriptions and /v1/audio/translations with the official openai client.

The checkpoint: a byte-level BPE tokenizer with Whisper's special tokens (languages, tasks, <|notimestamps|>,
timestamps), a 2+2-layer WhisperConfig with the real 30-s window (80 mel bins, 1500 encoder positions), weights
drawn larger than HF's init so the audio moves the logits, and HF's WhisperFeatureExtractor settings."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from pressroom import LLM, SamplingParams

NEW_TOKENS = 32
RATE = 16_000
ASCII_TOKENS = 94  # "!" to "~": the byte-level alphabet's first tokens


def _byte_vocab() -> dict[str, int]:
    from tokenizers import pre_tokenizers
    return {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}


def build_tiny_whisper(path: Path):
    """Saves a tiny random Whisper with its tokenizer and feature extractor; returns (HF model, tokenizer)."""
    import transformers
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    tok = transformers.WhisperTokenizer(vocab=_byte_vocab(), merges=[])
    specials = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{c}|>" for c in LANGUAGES], "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    tok.add_tokens([transformers.AddedToken(t, special=True, normalized=False) for t in specials],
                   special_tokens=True)
    tok.add_tokens([transformers.AddedToken("<|%.2f|>" % (i * 0.02), normalized=False) for i in range(1501)])
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    config = transformers.WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=tok.convert_tokens_to_ids("<|startoftranscript|>"), suppress_tokens=[],
        begin_suppress_tokens=None)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # larger weights than HF's init: the audio moves the logits and the tokens vary
        for name, param in model.named_parameters():
            if param.dim() > 1 and "embed_positions" not in name:
                param.normal_(0, 0.15)
        # the head is the token embedding: rows other than printable ASCII's (the byte alphabet's first 94) shrunk,
        # so the text is characters (not timestamps, which decode to nothing, nor partial UTF-8)
        model.model.decoder.embed_tokens.weight[ASCII_TOKENS:] *= 0.1
    model.save_pretrained(path)
    tok.save_pretrained(path)
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-whisper")
    model, tok = build_tiny_whisper(path)
    return str(path), model, tok


def tone(seconds: float, freqs: list[float], seed: int) -> np.ndarray:
    """A sum of sines with a little noise, mono float32 at 16 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    noise = 0.05 * np.random.default_rng(seed).standard_normal(len(t))
    return (sum(0.3 * np.sin(2 * np.pi * f * t) for f in freqs) + noise).astype(np.float32)


def prompt_ids(tok, task: str = "transcribe", language: str = "en") -> list[int]:
    return tok.convert_tokens_to_ids(["<|startoftranscript|>", f"<|{language}|>", f"<|{task}|>", "<|notimestamps|>"])


def hf_features(path: str, clips: list[np.ndarray]) -> torch.Tensor:
    import transformers
    return transformers.WhisperFeatureExtractor.from_pretrained(path)(
        clips, sampling_rate=RATE, return_tensors="pt").input_features


def hf_greedy(path: str, model, tok, clips: list[np.ndarray], task: str = "transcribe",
              language: str = "en", previous: str = "") -> list[list[int]]:
    """HF's greedy continuation of Whisper's decoder prompt for each clip (batched), cut after the first EOS;
    `previous`: the text the clip continues, as HF's prompt_ids put it (<|startofprev|> and the text's tokens)."""
    import transformers
    features = hf_features(path, clips)
    context = [tok.convert_tokens_to_ids("<|startofprev|>"), *tok.encode(" " + previous, add_special_tokens=False)] \
        if previous else []
    prompt = torch.tensor([context + prompt_ids(tok, task, language)] * len(clips))
    with torch.no_grad():  # the generic greedy loop: Whisper's own generate adds its long-form machinery
        out = transformers.GenerationMixin.generate(model, input_features=features, decoder_input_ids=prompt,
                                                    max_new_tokens=NEW_TOKENS, do_sample=False)
    result = []
    for row in out[:, prompt.shape[1]:].tolist():
        result.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return result


def _audio_prompt(tok, samples: np.ndarray, rate: int) -> dict:
    return {"prompt_token_ids": prompt_ids(tok), "multi_modal_data": {"audio": (samples, rate)}}


def test_greedy_tokens_of_batched_clips_equal_hf(tiny_whisper):
    """Three clips of different lengths in one batch: each request's 32 greedy tokens are HF's, and the clips
    steer them (the cross-attention reads each request's own encoder states)."""
    path, model, tok = tiny_whisper
    clips = [tone(1.5, [220, 440], 0), tone(4.0, [330], 1), tone(7.0, [150, 600, 900], 2)]
    want = hf_greedy(path, model, tok, clips)
    assert len({tuple(w) for w in want}) == 3
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.1)
    try:
        got = llm.generate([_audio_prompt(tok, c, RATE) for c in clips],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        assert [list(r.outputs[0].token_ids) for r in got] == want
        # a clip at another rate is resampled to 16 kHz first (PyAV's resampler); a prompt without audio, or with
        # more than one window of it, is refused by name
        from pressroom.model.models.whisper_encoder import resample
        low = tone(2.0, [180, 520], 3)[::2]
        at = [llm.generate(_audio_prompt(tok, samples, rate), SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                           use_tqdm=False)[0].outputs[0].token_ids for samples, rate in
              ((low, 8000), (resample(low, 8000), RATE), (low, RATE))]
        assert at[0] == at[1] != at[2]
        with pytest.raises(ValueError, match="one audio clip per prompt"):
            llm.generate({"prompt_token_ids": prompt_ids(tok)}, SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="30-second window"):
            llm.generate(_audio_prompt(tok, tone(31, [200], 3), RATE), SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


def test_long_clips_are_cut_at_quiet_points(tiny_whisper):
    """A 65-s clip becomes three windows of at most 30 s, each cut inside its window's last second where the clip
    is quietest."""
    from pressroom.model.models.whisper import WhisperInputs
    path, _, tok = tiny_whisper
    clip = tone(65, [300], 4)
    clip[int(29.5 * RATE):int(29.6 * RATE)] = 0  # a silence inside the first window's last second
    windows = WhisperInputs(path, tok).windows(clip, RATE)
    assert [len(w) <= 30 * RATE for w in windows] == [True] * 3
    assert len(windows[0]) == int(29.5 * RATE)
    assert sum(len(w) for w in windows) == len(clip)


def _wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    import soundfile
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV")
    return buf.getvalue()


def _wav_round_trip(samples: np.ndarray) -> tuple[bytes, np.ndarray]:
    """A clip as WAV bytes (16-bit PCM) and the samples the server decodes from them (HF's oracle reads the same)."""
    import soundfile
    data = _wav(samples)
    return data, soundfile.read(io.BytesIO(data), dtype="float32")[0]


def hf_language(model, tok, path: str, clip: np.ndarray) -> str:
    """HF's most likely language token after <|startoftranscript|> (Whisper's language detection)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    sot = tok.convert_tokens_to_ids("<|startoftranscript|>")
    with torch.no_grad():
        logits = model(input_features=hf_features(path, [clip]), decoder_input_ids=torch.tensor([[sot]])).logits
    ids = {code: tok.convert_tokens_to_ids(f"<|{code}|>") for code in LANGUAGES}
    return max(ids, key=lambda code: logits[0, -1, ids[code]].item())


@pytest.mark.slow  # a server start of its own (~10 s) and HF's runs of both tasks, three windows and Whisper's generate
def test_audio_api_through_the_server_equals_hf(tiny_whisper, tmp_path):
    import openai
    from serving import serve

    from pressroom.model.models.whisper import WhisperInputs
    path, model, tok = tiny_whisper
    data, clip = _wav_round_trip(tone(3.0, [261.6, 329.6, 392.0], 5))
    hf = {task: hf_greedy(path, model, tok, [clip], task)[0] for task in ("transcribe", "translate")}
    transcript, translation = (tok.decode(hf[task], skip_special_tokens=True) for task in ("transcribe", "translate"))
    assert transcript != translation  # the task token steers the decoder
    _check_whisper_generate(model, tok, path, clip, hf["transcribe"])
    language = hf_language(model, tok, path, clip)
    detected = tok.decode(hf_greedy(path, model, tok, [clip], language=language)[0], skip_special_tokens=True)
    continued = tok.decode(hf_greedy(path, model, tok, [clip], previous="la la")[0], skip_special_tokens=True)
    assert continued != transcript  # the prompt steers the decoder
    long_data, long_clip = _wav_round_trip(tone(65, [300, 700], 6))
    windows = WhisperInputs(path, tok).windows(long_clip, RATE)
    long_text = "".join(tok.decode(t, skip_special_tokens=True) for t in hf_greedy(path, model, tok, windows))
    args = ["serve", path, "--dtype", "float32", "--kv-cache-memory-gib", "0.1"]
    with serve(args, tmp_path / "server.log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        form = dict(model=path, file=("clip.wav", data, "audio/wav"), language="en",
                    extra_body={"max_completion_tokens": NEW_TOKENS})
        whole = client.audio.transcriptions.create(**form)
        assert whole.text == transcript and whole.usage.seconds == 3
        translated = client.audio.translations.create(model=path, file=form["file"],
                                                      extra_body={"language": "en", **form["extra_body"]})
        assert translated.text == translation
        assert client.audio.transcriptions.create(**form, response_format="text") == transcript
        assert client.audio.transcriptions.create(**form, prompt="la la").text == continued
        # streamed as vLLM streams it: transcription.chunk objects whose choices carry the deltas
        chunks = list(client.audio.transcriptions.create(**form, stream=True))
        assert "".join(c.choices[0]["delta"]["content"] for c in chunks) == transcript
        assert chunks[-1].choices[0]["finish_reason"] == "length"
        # no language: the clip's most likely language token is detected first, then the clip transcribed in it
        assert client.audio.transcriptions.create(model=path, file=form["file"],
                                                  extra_body=form["extra_body"]).text == detected
        # longer than 30 s: three windows cut at quiet points, their texts joined in order
        long = client.audio.transcriptions.create(**{**form, "file": ("long.wav", long_data, "audio/wav")})
        assert long.text == long_text and long.usage.seconds == 65
        verbose = client.audio.transcriptions.create(**form, response_format="verbose_json")
        assert verbose.language == "en" and verbose.text == "".join(s.text for s in verbose.segments or [])
        with pytest.raises(openai.BadRequestError, match="srt"):
            client.audio.transcriptions.create(**form, response_format="srt")
        with pytest.raises(openai.BadRequestError, match="Unsupported language"):
            client.audio.transcriptions.create(**{**form, "language": "xx"})
        with pytest.raises(openai.BadRequestError, match="malformed|accepted formats"):
            client.audio.transcriptions.create(**{**form, "file": ("clip.wav", b"RIFF not a wav", "audio/wav")})
        with pytest.raises(openai.BadRequestError, match="limit of 600 s"):
            client.audio.transcriptions.create(**{**form, "file": ("hour.wav", _wav(np.zeros(601 * 8000,
                                                                                         np.float32), 8000))})


def _check_whisper_generate(model, tok, path: str, clip: np.ndarray, want: list[int]) -> None:
    """HF's own WhisperForConditionalGeneration.generate (language and task set, no timestamps) starts with the same
    tokens as the generic greedy loop the other checks compare with."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    gen = model.generation_config
    gen.lang_to_id = {f"<|{c}|>": tok.convert_tokens_to_ids(f"<|{c}|>") for c in LANGUAGES}
    gen.task_to_id = {t: tok.convert_tokens_to_ids(f"<|{t}|>") for t in ("transcribe", "translate")}
    gen.no_timestamps_token_id, gen.is_multilingual = tok.convert_tokens_to_ids("<|notimestamps|>"), True
    with torch.no_grad():
        out = model.generate(hf_features(path, [clip]), language="en", task="transcribe", max_new_tokens=NEW_TOKENS,
                             return_timestamps=False)
    assert out[0, :len(want)].tolist() == want


@pytest.mark.slow  # a server start of its own (~10 s)
def test_a_text_model_answers_the_audio_api_with_a_400(tiny_model_dir, tmp_path):
    import openai
    from serving import serve
    path = tiny_model_dir("llama")
    with serve(["serve", path, "--dtype", "float32", "--kv-cache-memory-gib", "0.05"], tmp_path / "server.log") as (
            url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        clip = ("clip.wav", _wav(tone(1.0, [440], 7)), "audio/wav")
        with pytest.raises(openai.BadRequestError, match="does not serve the audio API"):
            client.audio.transcriptions.create(model=path, file=clip)
        with pytest.raises(openai.BadRequestError, match="does not serve the audio API"):
            client.audio.translations.create(model=path, file=clip)
