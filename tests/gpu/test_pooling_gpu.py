"""Pooling on CUDA: a tiny random BERT encoder embeds token ids as HF's BertModel does on the same GPU (mean
pooling, normalised), in one batch of several lengths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

from pressroom import LLM  # noqa: E402
from pressroom.pooling_params import PoolingParams  # noqa: E402


def test_bert_embeddings_on_cuda_match_hf(tmp_path):
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(tmp_path)
    prompts = [[101, *range(200, 200 + n), 102] for n in (3, 17, 40, 9)]
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", skip_tokenizer_init=True, runner="pooling")
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling_type="MEAN", normalize=True),
                     use_tqdm=False)
    ours = torch.tensor([o.outputs.embedding for o in outs])
    llm.shutdown()
    hf = transformers.BertModel.from_pretrained(tmp_path).cuda().eval()
    with torch.no_grad():
        expected = torch.stack([F.normalize(hf(torch.tensor([p], device="cuda")).last_hidden_state[0].mean(0), dim=0)
                                for p in prompts]).cpu()
    assert F.cosine_similarity(ours, expected).min() > 0.9999
