"""llama.cpp's greedy tokens for raw prompts (the oracle of tests/model/test_gemma3_llama_cpp.py), as JSON.

Run with a llama venv's interpreter (benchmarks/llama_cpp/setup.sh makes it):

    .llama-venv-native/bin/python benchmarks/llama_cpp/greedy_oracle.py --model FILE.gguf \\
        --prompts prompts.json --tokens 64 --output oracle.json

prompts.json: a list of strings, tokenized with BOS (llama.cpp's tokenizer; the test checks pressroom's agrees).
Output: per prompt, its token ids, llama.cpp's greedy tokens (it does not stop at EOS), and at each generated
position the top 5 (token, log-probability) of llama.cpp's own logits. With --arrays FILE.npz, also the first
--array-prompts prompts' final hidden states (after the output norm: llama.cpp's embeddings with no pooling) and
their last position's logits, so a test can feed llama.cpp's hidden state to pressroom's LM head.
"""
from __future__ import annotations

import argparse
import json
import os

TOP = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--output", required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--arrays", help="an .npz for hidden states and logits")
    p.add_argument("--array-prompts", type=int, default=3)
    args = p.parse_args()
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(args.model, n_ctx=512, n_threads=args.threads, logits_all=True, verbose=False, seed=0)
    results = []
    for prompt in json.load(open(args.prompts)):
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        tokens = []
        llm.reset()  # no prefix kept from the last prompt: the whole prompt is one batch from an empty cache, as
        # pressroom evaluates it (llama.cpp's batched kernels group a batch's rows by 4, so a kept BOS shifts them)
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(tok))
            if len(tokens) == args.tokens:
                break
        logits = np.array(llm.scores[len(ids) - 1:len(ids) - 1 + args.tokens], dtype=np.float64)
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        top = np.argsort(-logprobs, axis=-1)[:, :TOP]
        results.append({"prompt": prompt, "prompt_ids": [int(i) for i in ids], "tokens": tokens,
                        "top": [[[int(t), float(row[t])] for t in idx] for idx, row in zip(top, logprobs)]})
    json.dump({"llama_cpp_python": llama_cpp.__version__, "results": results}, open(args.output, "w"))
    if args.arrays:
        _dump_arrays(llm, args, results[:args.array_prompts])


def _dump_arrays(llm, args, results: list[dict]) -> None:
    import llama_cpp
    import numpy as np
    emb = llama_cpp.Llama(args.model, n_ctx=512, n_threads=args.threads, embedding=True, verbose=False,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE)
    arrays = {}
    for i, result in enumerate(results):
        ids = result["prompt_ids"]
        hidden = emb.embed(result["prompt"], normalize=False, truncate=False)  # per token, BOS first
        assert len(hidden) == len(ids), "the embedding pass tokenized the prompt differently"
        arrays[f"hidden{i}"] = np.array(hidden[-1], dtype=np.float32)
        llm.reset()
        llm.eval(ids)
        arrays[f"logits{i}"] = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
    np.savez(args.arrays, **arrays)


if __name__ == "__main__":
    main()
