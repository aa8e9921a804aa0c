"""Random-weight HF checkpoints of two recurrent families for the CPU bench (docs/BENCHMARKS.md, issue 42): a Mamba
at mamba-130m's shape and a ~0.16B Falcon-H1 (attention and Mamba2 in parallel in every layer), both with the
embedded SmolLM2's vocabulary and tokenizer. Usage: python benchmarks/make_recurrent_checkpoints.py OUT_DIR"""
import sys

import torch
import transformers

from pressroom.model.gguf_file import embedded_model_path, load_gguf_tokenizer

out = sys.argv[1]
tok = load_gguf_tokenizer(embedded_model_path())
torch.manual_seed(0)
# state-spaces/mamba-130m-hf's shape (hidden 768, 24 layers, state 16, expand 2, conv 4), SmolLM2's vocabulary
mamba = transformers.MambaConfig(vocab_size=49152, hidden_size=768, num_hidden_layers=24, state_size=16, expand=2,
                                 conv_kernel=4, tie_word_embeddings=True)
# a ~0.16B Falcon-H1 (attention and Mamba2 in parallel in every layer)
hybrid = transformers.FalconH1Config(vocab_size=49152, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                     num_key_value_heads=4, head_dim=64, intermediate_size=2048, mamba_d_ssm=1536,
                                     mamba_n_heads=24, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1,
                                     mamba_chunk_size=128, tie_word_embeddings=True, max_position_embeddings=4096)
for name, cfg in (("mamba-130m", mamba), ("falcon-h1-small", hybrid)):
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    print(name, sum(p.numel() for p in m.parameters()) / 1e6, "M params")
    m.save_pretrained(f"{out}/{name}")
    tok.save_pretrained(f"{out}/{name}")
