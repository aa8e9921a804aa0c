"""Whisper (HF "whisper"): an audio encoder (whisper_encoder.py) and a text decoder that attends to itself through the
paged KV cache and to its request's encoder frames through cross-attention.

The engine is decoder-only; the encoder side lives in two places it already has:
- the audio is the request's one media item (multimodal/inputs.py's MediaItem: modality "audio", on the decoder
  prompt's first token, its "pixels" the clip's log-mel window). The runner calls `encode_media` when a step
  reaches that token (the encoder cache keeps the rows for chunked prefill and repeated clips); each clip's media
  row is its whole encoder output, flattened.
- each decoder layer's cross-attention keys and values are a fixed-size state per request ([encoder frames, heads,
  head dim] each), kept in the request's state slot as Mamba keeps its recurrent state (layers/state.py): `forward`
  projects a media row into every layer's slot before the layers run, and every later step reads them there. They
  never change, so a step's rounds and prefix checkpoints copy them like any state.

Weights load under HF's names (model.encoder.*, model.decoder.*; proj_out is tied to the token embedding).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.backend import get_attention_metadata, get_state_metadata
from pressroom.attention.state import StateRound
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.state import RecurrentLayer, StateShape
from pressroom.model.models.whisper_encoder import _ACTS, ClipEncoderGraphs, WhisperEncoder, WhisperFeatures, resample
from pressroom.model.weights import expected_names, load_named_weights
from pressroom.multimodal.inputs import MediaItem, MediaRows

CACHED_CLIPS = 16  # encoder outputs the runner keeps for reuse (one clip's is frames x d_model: megabytes each)


class DecoderSelfAttention(nn.Module):
    """Causal self-attention over the paged KV cache. HF scales q before the product (Whisper's numbers depend on
    that order), so the backend's scale is 1."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.attn = Attention(num_heads, self.head_dim, num_heads, scale=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q = (self.q_proj(x) * self.scaling).view(shape)
        return self.out_proj(self.attn(q, self.k_proj(x).view(shape), self.v_proj(x).view(shape)))


class CrossAttention(RecurrentLayer):
    """Attention from the decoder's tokens to their request's encoder frames, whose keys and values are the
    request's state (`write` puts them there once)."""

    def __init__(self, dim: int, num_heads: int, frames: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.frames = num_heads, dim // num_heads, frames
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)

    def state_shapes(self) -> dict[str, StateShape]:
        shape = StateShape((self.frames, self.num_heads, self.head_dim), self.q_proj.weight.dtype)
        return {"k": shape, "v": shape}

    def reserve_draft_rows(self, num_drafts: int) -> None:
        """The encoder's keys and values do not move with the decoder's tokens: drafts need nothing of them."""

    def write(self, slots: torch.Tensor, encoded: torch.Tensor) -> None:
        """encoded: [clips, frames, dim], the encoder's output for the requests at `slots`."""
        shape = (*encoded.shape[:2], self.num_heads, self.head_dim)
        dtype = self.states["k"].dtype
        self.states["k"].index_copy_(0, slots, self.k_proj(encoded).view(shape).to(dtype))
        self.states["v"].index_copy_(0, slots, self.v_proj(encoded).view(shape).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = (self.q_proj(x) * self.scaling).view(x.shape[0], self.num_heads, self.head_dim)
        return self.out_proj(self.run_rounds(self._mix, q).flatten(1))

    def _mix(self, r: StateRound, q: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        return self.decodes_then_prefills(r, out, self._decode, self._prefill, q)

    def _decode(self, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token per request: a batch of single-query attentions."""
        k, v = (self.states[n].index_select(0, slots).transpose(1, 2) for n in ("k", "v"))
        return F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), scale=1.0).squeeze(2)

    def _prefill(self, q: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        bounds = cu_seqlens.tolist()
        parts = []
        for i in range(len(bounds) - 1):
            k, v = (self.states[n].index_select(0, slots[i:i + 1]).transpose(1, 2) for n in ("k", "v"))
            rows = q[bounds[i]:bounds[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, head_dim]
            parts.append(F.scaled_dot_product_attention(rows, k.to(q.dtype), v.to(q.dtype), scale=1.0)[0]
                         .transpose(0, 1))
        return torch.cat(parts)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, heads = config.d_model, config.decoder_attention_heads
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = DecoderSelfAttention(dim, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = CrossAttention(dim, heads, config.max_source_positions)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, config.decoder_ffn_dim), nn.Linear(config.decoder_ffn_dim, dim)
        self.act = _ACTS[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model)


class WhisperModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(config)
        self.decoder = WhisperDecoder(config)


class WhisperForConditionalGeneration(ClipEncoderGraphs, nn.Module):
    supports_multimodal = True  # the runner encodes its media items (the audio) and hands their rows to forward
    cuda_graphs_supported = False  # a prefill's cross-attention loops over its requests on the host
    is_encoder_decoder = True
    max_cached_media_rows = CACHED_CLIPS

    def __init__(self, config: Any) -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError("Whisper does not run with tensor parallelism yet; use tensor_parallel_size=1.")
        # the decoder's context is what the engine serves (HF's config names it max_target_positions)
        config.max_position_embeddings = config.max_target_positions
        self.config = config
        self.model = WhisperModel(config)
        self.frames = config.max_source_positions

    # ---- the runner's multimodal interface ----

    def encode_media(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each clip's encoder output as one row ([1, frames * d_model]), every clip in one pass of the encoder
        over its full 30-second window (HF runs Whisper so, with no mask)."""
        encoder = self.model.encoder
        weight = encoder.conv1.weight
        for item in items:
            if item.modality != "audio" or item.pixels_shape != (encoder.conv1.in_channels, encoder.window_frames):
                raise ValueError(f"Whisper takes one audio clip's log-mel window of shape "
                                 f"{(encoder.conv1.in_channels, encoder.window_frames)}; got {item.modality} "
                                 f"{item.pixels_shape}.")
        features = torch.stack([m.pixel_tensor() for m in items]).to(device=weight.device, dtype=weight.dtype)
        return self.split_media_rows(items, self.encode_clips(features, None))

    def encode_clips(self, features: torch.Tensor, mel_frames: torch.Tensor | None) -> torch.Tensor:
        """[clips, mel bins, window] -> [clips, 1, frames * d_model]: HF runs the whole window unmasked, so
        `mel_frames` is not read."""
        return self.model.encoder(features).flatten(1).unsqueeze(1)

    @staticmethod
    def split_media_rows(items: list[MediaItem], rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows[:len(items)])

    @property
    def audio_tower_for_graphs(self) -> WhisperEncoder:
        return self.model.encoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = (),
                media: MediaRows | None = None):
        """`media`: the step's encoder rows, one at each request's first prompt token whose clip this step
        starts: they become the cross-attention keys and values in that request's state slot first."""
        decoder = self.model.decoder
        if media is not None:
            self._write_cross_states(media)
        x = decoder.embed_tokens(input_ids) + decoder.embed_positions(positions)
        taps = {}
        for i, layer in enumerate(decoder.layers):
            x = layer(x)
            if i in aux_layers:
                taps[i] = x
        x = decoder.layer_norm(x)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x

    def _write_cross_states(self, media: MediaRows) -> None:
        """Each media row's request (the one whose tokens hold its flat index) gets the row's keys and values."""
        starts = torch.tensor(get_attention_metadata().query_start_loc[1:], device=media.index.device)
        requests = torch.searchsorted(starts, media.index, right=True)
        slots = get_state_metadata().slots_of_requests().index_select(0, requests.to(torch.int64))
        encoded = media.rows.view(media.rows.shape[0], self.frames, -1)
        for layer in self.model.decoder.layers:
            layer.encoder_attn.write(slots, encoded)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.decoder.embed_tokens.weight)  # proj_out, tied

    # ---- the name map (model/weights.py): HF's names are the parameters' own ----

    def skips(self, name: str) -> bool:
        return name == "proj_out.weight"  # the token embedding's copy

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        return [name]

    def expected_weights(self) -> set[str]:
        return expected_names(self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_named_weights(self, weights)


# ---- the front-end's side: clips into media items, decoder prompts ----

TASKS = ("transcribe", "translate")
CHUNK_OVERLAP_S = 1.0  # the tail of each 30-s window searched for a quiet place to cut a longer clip
QUIET_WINDOW = 1600  # samples (0.1 s at 16 kHz) whose loudness is compared when choosing the cut


class WhisperInputs:
    """Audio into Whisper's requests: clips resampled to 16 kHz, cut into windows of at most 30 s (at the quietest
    0.1 s of each window's last second, as vLLM cuts them), each window's log-mel features as the request's media
    item (the model folder's WhisperFeatureExtractor, HF's numbers), and the decoder prompt of special tokens."""

    def __init__(self, model_path: str, tokenizer: Any) -> None:
        self.features = WhisperFeatures(model_path)
        self.tokenizer = tokenizer
        # OpenAI's rule: a prompt's last (decoder context / 2 - 1) tokens are kept, the rest of the room is the text's
        with open(Path(model_path) / "config.json") as f:
            self.max_prompt_tokens = int(json.load(f).get("max_target_positions", 448)) // 2 - 1
        self.sample_rate = self.features.sampling_rate
        self.window_s = self.features.max_samples / self.sample_rate
        self._fingerprint = self.features.fingerprint()

    def windows(self, samples: np.ndarray, rate: int) -> list[np.ndarray]:
        """The clip at the model's rate, cut into windows of at most `window_s` seconds."""
        samples = resample(samples, rate, self.sample_rate)
        size, overlap = self.features.max_samples, int(CHUNK_OVERLAP_S * self.sample_rate)
        out, start = [], 0
        while len(samples) - start > size:
            cut = _quietest(samples, start + size - overlap, start + size)
            out.append(samples[start:cut])
            start = cut
        out.append(samples[start:])
        return out

    def item(self, window: np.ndarray) -> MediaItem:
        """One window's (at most `window_s` seconds at the model's rate) media item."""
        if len(window) > self.features.max_samples:
            raise ValueError(f"An audio window is at most {self.window_s:g} s; cut the clip with windows().")
        return log_mel_item(self.features(window).features, self._fingerprint)

    def prompt_ids(self, language: str, task: str, prompt: str = "") -> list[int]:
        if task not in TASKS:
            raise ValueError(f"Whisper's task is one of {', '.join(TASKS)}; got {task!r}.")
        return decoder_prompt(self.tokenizer, language, task, prompt, self.max_prompt_tokens)

    def prompt_media(self, prompt: Any, token_ids: list[int], mm_features: list[MediaItem] | None
                     ) -> list[MediaItem]:
        """A prompt's one clip for the encoder: `multi_modal_data={"audio": (samples, rate)}` (vLLM's form, one
        window of at most 30 s) or an item made beforehand (`mm_features`, as the server makes them)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        audio = (data or {}).get("audio")
        if mm_features is not None and audio is not None:
            raise ValueError("Give multi_modal_data or mm_features (already processed), not both.")
        if audio is not None:
            mm_features = [self._clip_item(audio)]
        if not token_ids:
            raise ValueError("Whisper's decoder prompt is empty; give its special tokens, e.g. "
                             "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>.")
        if not mm_features or len(mm_features) != 1 or not isinstance(mm_features[0], MediaItem) \
                or mm_features[0].modality != "audio" or mm_features[0].offset != 0 or mm_features[0].length != 1:
            raise ValueError("Whisper takes one audio clip per prompt: multi_modal_data={\"audio\": (samples, "
                             "sample_rate)} beside its decoder prompt.")
        return list(mm_features)

    def _clip_item(self, audio: Any) -> MediaItem:
        if isinstance(audio, list) and len(audio) == 1:
            audio = audio[0]
        if not (isinstance(audio, tuple) and len(audio) == 2):
            raise ValueError("multi_modal_data's audio for Whisper is one (samples, sample_rate) pair.")
        windows = self.windows(np.asarray(audio[0], dtype=np.float32).reshape(-1), int(audio[1]))
        if len(windows) > 1:
            raise ValueError(f"The audio is longer than Whisper's {self.window_s:g}-second window; cut it into "
                             "windows (the server's /v1/audio/transcriptions does).")
        return self.item(windows[0])


def _quietest(samples: np.ndarray, start: int, end: int) -> int:
    """The start of the quietest QUIET_WINDOW samples in [start, end) (by RMS): where a long clip is cut."""
    span = samples[start:end]
    count = len(span) // QUIET_WINDOW
    if count < 1:
        return end
    energy = np.sqrt((span[:count * QUIET_WINDOW].reshape(count, QUIET_WINDOW) ** 2).mean(axis=1))
    return start + int(np.argmin(energy)) * QUIET_WINDOW


def decoder_prompt(tokenizer: Any, language: str, task: str, prompt: str = "", max_prompt_tokens: int = 223
                   ) -> list[int]:
    """Whisper's decoder prefix as token ids: `<|startofprev|> prompt` when a prompt is given (its last
    `max_prompt_tokens`), then `<|startoftranscript|><|lang|><|task|><|notimestamps|>` (HF's and OpenAI's order)."""
    specials = ["<|startoftranscript|>", f"<|{language}|>", f"<|{task}|>", "<|notimestamps|>"]
    ids = [_special_id(tokenizer, t) for t in specials]
    if prompt.strip():
        previous = tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)[-max_prompt_tokens:]
        ids = [_special_id(tokenizer, "<|startofprev|>"), *previous, *ids]
    return ids


def _special_id(tokenizer: Any, token: str) -> int:
    ids = tokenizer.convert_tokens_to_ids([token])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id and token != tokenizer.unk_token:
        raise ValueError(f"This model's tokenizer has no {token} token.")
    return int(ids[0])


def log_mel_item(features: np.ndarray, fingerprint: bytes = b"") -> MediaItem:
    """A clip's log-mel window ([mel bins, frames] float32) as the request's media item, on its first decoder
    token; its hash (the encoder cache's and prefix cache's key) is the features' own."""
    import hashlib
    features = np.ascontiguousarray(features, dtype=np.float32)
    digest = hashlib.sha256(fingerprint + repr(features.shape).encode() + features.tobytes()).hexdigest()
    # the encoder's convolutions halve the frames: 1,500 rows for a 30-s window, what it costs the step's budget
    return MediaItem("audio", digest, 0, 1, features.tobytes(), tuple(features.shape),
                     encoder_rows=features.shape[-1] // 2)
