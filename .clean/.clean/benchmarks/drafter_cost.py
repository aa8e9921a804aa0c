"""What the committed DFlash2 drafter costs per call on this machine (embedded SmolLM2, bf16): the whole
`DFlash2Proposer.propose`, and its pieces, the block pass and the target's LM head over K slots, for
1 and for 32 greedy requests with full feature context. Run: python benchmarks/drafter_cost.py"""
import time

import torch

from pressroom import LLM, SamplingParams
from pressroom.worker.proposer import DraftRequest


def ms(fn, reps: int = 10) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def report(proposer, ids: list[int], n: int) -> None:
    model, width, k = proposer.target.model, proposer.drafter.width, proposer.k
    requests = []
    for i in range(n):
        proposer.features[f"r{i}"] = torch.randn(proposer.context_len, 3 * width, dtype=torch.bfloat16)
        requests.append(DraftRequest(f"r{i}", ids, 100, SamplingParams(temperature=0)))
    feats, mask = proposer._context([proposer.features[r.req_id] for r in requests])
    anchor = model.model.embed_tokens(torch.tensor([ids[-1]] * n))
    slots = proposer.drafter(feats, mask, anchor)
    print(f"{n} request(s): propose {ms(lambda: proposer.propose(requests)):.2f} ms; "
          f"block pass {ms(lambda: proposer.drafter(feats, mask, anchor)):.2f} ms; "
          f"LM head over {k} slots {ms(lambda: model.compute_logits(slots.flatten(0, 1))):.2f} ms")


def main() -> None:
    llm = LLM(speculative_config={"method": "dflash2", "num_speculative_tokens": 8, "adaptive_token_budget": False})
    ids = llm.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    with torch.inference_mode():
        for n in (1, 32):
            report(llm.engine.runner.proposer, ids, n)


if __name__ == "__main__":
    main()
