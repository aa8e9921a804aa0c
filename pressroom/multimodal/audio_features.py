"""Audio for Whisper-family encoders: clips resampled to 16 kHz (PyAV's resampler), HF's WhisperFeatureExtractor's
log-mel frames (the model folder's settings: 16 kHz, 30-second windows, 80 or 128 mel bins, so the encoder sees the
numbers HF's processor gives it), and the frame counts the encoder's convolution and pool leave. The front-end's
processors use these; model/models/whisper_encoder.py is the encoder that reads them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16_000  # what every Whisper-family feature extractor reads


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples from `rate` to `target` Hz through PyAV's resampler (FFmpeg's libswresample)."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if rate == target or samples.size == 0:
        return samples
    import av
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    frame.pts = None
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]  # the filter's tail
    return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)


@dataclass(frozen=True, slots=True)
class LogMel:
    """A clip's log-mel features over the extractor's whole window and how many frames are the clip's own."""
    features: np.ndarray  # [mel bins, window frames] float32
    frames: int  # frames of the clip; the rest is the window's padding


class WhisperFeatures:
    """The model folder's WhisperFeatureExtractor: 16 kHz mono samples -> log-mel frames (100 a second)."""

    def __init__(self, model_path: str) -> None:
        from transformers import WhisperFeatureExtractor
        self.hf = WhisperFeatureExtractor.from_pretrained(model_path)
        self.sampling_rate = int(self.hf.sampling_rate)
        self.max_samples = int(self.hf.n_samples)  # one window; HF truncates longer clips to it

    def fingerprint(self) -> bytes:
        """The settings the features depend on (a media hash's prefix)."""
        return repr(sorted((k, repr(v)) for k, v in self.hf.to_dict().items() if k != "mel_filters")).encode()

    def __call__(self, samples: np.ndarray) -> LogMel:
        """`samples`: mono float32 at `sampling_rate`, at most `max_samples` (the caller truncates as HF does)."""
        batch = self.hf(samples, sampling_rate=self.sampling_rate, padding="max_length", return_attention_mask=True,
                        return_tensors="np")
        features = np.ascontiguousarray(batch["input_features"][0], dtype=np.float32)
        return LogMel(features, int(batch["attention_mask"][0].sum()))


def conv_frames(mel_frames: int) -> int:
    """Encoder positions after the stride-2 convolution."""
    return (mel_frames - 1) // 2 + 1


def pooled_frames(mel_frames: int) -> int:
    """Rows after the convolution and a 2x average pool (Qwen2-Audio's rows per clip, HF's count)."""
    return (conv_frames(mel_frames) - 2) // 2 + 1


def crop_frames(mel_frames: int, window_frames: int) -> int:
    """Mel frames an encoder with key masks needs of a clip: its own and the two its last positions' convolutions
    read past them (within the window)."""
    return min(mel_frames + 2, window_frames)
