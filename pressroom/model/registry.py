"""Architecture name -> model class."""
from __future__ import annotations

import importlib

from torch import nn

from pressroom.model.models.bert import BertModel
from pressroom.model.models.bert_classifier import BertForSequenceClassification
from pressroom.model.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
from pressroom.model.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pressroom.model.models.gpt_oss import GptOssForCausalLM
from pressroom.model.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from pressroom.model.models.llava import LlavaForConditionalGeneration
from pressroom.model.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pressroom.model.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from pressroom.model.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from pressroom.model.models.qwen3_vl import Qwen3VLForConditionalGeneration

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,  # images in (multimodal/)
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # SigLIP tower, bidirectional image tokens
    "Qwen2AudioForConditionalGeneration": Qwen2AudioForConditionalGeneration,  # audio in (multimodal/)
    "BertModel": BertModel,  # encoders: pooling only
    "BertForMaskedLM": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,  # classifiers, cross-encoders
}
# Families with a recurrent state per layer (model/layers/state.py): imported when a config names them.
_RECURRENT: dict[str, str] = {
    "MambaForCausalLM": "mamba", "Mamba2ForCausalLM": "mamba", "Qwen3NextForCausalLM": "qwen3_next",
    "KimiLinearForCausalLM": "kimi_linear", "NemotronHForCausalLM": "nemotron_h", "FalconH1ForCausalLM": "falcon_h1",
    "DeepseekV4ForCausalLM": "deepseek_v4",  # its compressors keep the tokens of a window not yet compressed
    "WhisperForConditionalGeneration": "whisper",  # its cross-attention keys and values, one set per request
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                "deepseek_v32": "DeepseekV32ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen3_vl": "Qwen3VLForConditionalGeneration", "llava": "LlavaForConditionalGeneration",
                "gemma3": "Gemma3ForConditionalGeneration",
                "qwen2_audio": "Qwen2AudioForConditionalGeneration",
                "bert": "BertModel", "mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "kimi_linear": "KimiLinearForCausalLM",
                "nemotron_h": "NemotronHForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
                "deepseek_v4": "DeepseekV4ForCausalLM", "whisper": "WhisperForConditionalGeneration"}


def resolve_architecture(hf_config) -> type[nn.Module]:
    names = list(getattr(hf_config, "architectures", None) or [])
    names.append(_MODEL_TYPES.get(getattr(hf_config, "model_type", ""), ""))
    for name in names:
        if name in _RECURRENT:
            module = importlib.import_module(f"pressroom.model.models.{_RECURRENT[name]}")
            return getattr(module, name)
        if name in _ARCHITECTURES:
            if name == "Qwen2ForCausalLM":
                hf_config.attention_bias = True  # Qwen2 always biases q, k and v
            elif name == "Qwen2MoeForCausalLM":
                hf_config.attention_bias = bool(getattr(hf_config, "qkv_bias", True))
            return _ARCHITECTURES[name]
    raise ValueError(f"Model architecture {names[0] or hf_config.model_type!r} is not supported; "
                     f"supported: {', '.join([*_ARCHITECTURES, *_RECURRENT])}.")

