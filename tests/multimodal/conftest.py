from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory, smollm_tokenizer):
    """(folder, HF model) of a tiny random Qwen2.5-VL with its tokenizer and image processor."""
    import copy

    from tiny_vl import build_tiny_qwen2_5_vl
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    model = build_tiny_qwen2_5_vl(path, copy.deepcopy(smollm_tokenizer))
    return str(path), model


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory, smollm_tokenizer):
    """(folder, HF model) of a tiny random Qwen3-VL with its tokenizer and image processor."""
    import copy

    from tiny_vl import build_tiny_qwen3_vl
    path = tmp_path_factory.mktemp("tiny-qwen3_vl")
    model = build_tiny_qwen3_vl(path, copy.deepcopy(smollm_tokenizer))
    return str(path), model


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, smollm_tokenizer):
    """(folder, HF model) of a tiny random LLaVA (CLIP tower, Llama decoder) with its tokenizer and processor."""
    import copy

    from tiny_vl import build_tiny_llava
    path = tmp_path_factory.mktemp("tiny-llava")
    model = build_tiny_llava(path, copy.deepcopy(smollm_tokenizer))
    return str(path), model
