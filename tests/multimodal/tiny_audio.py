"""A tiny random Qwen2-Audio checkpoint with its processor: the SmolLM2 tokenizer with Qwen2-Audio's audio tokens
added, a WhisperFeatureExtractor of 16 mel bins and a 2-second window (the encoder's 100 positions), and
Qwen2AudioProcessor's own chat template (each audio part rendered `Audio n: <|audio_bos|><|AUDIO|><|audio_eos|>`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
PAD = "<|audio_bos|><|AUDIO|><|audio_eos|>"
WINDOW_SECONDS = 2  # the feature extractor's chunk_length: 200 mel frames, 100 encoder positions
MEL_BINS = 16


def build_tiny_qwen2_audio(path: Path, smollm_tokenizer, seed: int = 0):
    """Saves the checkpoint, tokenizer and processor under `path`; returns the HF model (fp32, eval)."""
    import transformers
    tok = smollm_tokenizer
    tok.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    config = transformers.Qwen2AudioConfig(
        audio_config=transformers.Qwen2AudioEncoderConfig(
            num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
            max_source_positions=WINDOW_SECONDS * 50),
        text_config=transformers.Qwen2Config(
            vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # larger weights than HF's init, so the audio moves the logits
        for name, param in model.named_parameters():
            if ("audio_tower" in name or "projector" in name) and param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    features = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, chunk_length=WINDOW_SECONDS)
    processor = transformers.Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok)
    tok.chat_template = processor.chat_template
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def tone(seed: int, seconds: float, rate: int = 16_000) -> np.ndarray:
    """A clip of `seconds`: two random tones and a little noise, float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f1, f2 = rng.uniform(100, 3000, 2)
    clip = 0.5 * np.sin(2 * np.pi * f1 * t) + 0.3 * np.sin(2 * np.pi * f2 * t) + 0.05 * rng.standard_normal(t.size)
    return clip.astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = 16_000) -> bytes:
    import io

    import soundfile
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()
