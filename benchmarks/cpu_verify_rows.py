"""A/B of verifications as rows of the CPU's fused decode stack (layers/cpu_decode.py), in one process: the
embedded SmolLM2 with its committed dflash2 drafter, fixed K = 3, the first held-out chat prompt, 128 tokens;
the rows switched on and off between runs. Usage: python benchmarks/cpu_verify_rows.py [pairs]"""
import json
import sys
import time

from pressroom import LLM, SamplingParams
from pressroom.benchmarks.workload import file_prompts
from pressroom.model.layers import cpu_decode
from pressroom.model.loader import load_tokenizer, resolve_model_path


def main(pairs: int) -> None:
    prompt = file_prompts("benchmarks/data/chat_heldout.jsonl", load_tokenizer(resolve_model_path(None)), 1, 0, True)[0]
    llm = LLM(speculative_config={"method": "dflash2", "num_speculative_tokens": 3, "adaptive_token_budget": False})
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

    def tokens_per_s() -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return 128 / (time.perf_counter() - start)

    tokens_per_s()  # warm-up
    rates: dict[str, list[float]] = {"rows": [], "no rows": []}
    for _ in range(pairs):
        for rows in (True, False):
            cpu_decode.CpuDecodeStack.short_queries = rows
            rates["rows" if rows else "no rows"].append(round(tokens_per_s(), 1))
    print(json.dumps(rates))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
