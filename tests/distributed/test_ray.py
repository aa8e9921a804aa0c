"""The Ray executor on a real two-node local cluster (`ray.cluster_utils.Cluster`, one CPU per node): TP=2
with one rank per node gives the tokens of TP=1."""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="Ray is a test dependency (make install-test)")
from ray.cluster_utils import Cluster  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)


@pytest.fixture
def two_nodes(monkeypatch):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow  # a two-node Ray cluster and two engines: about 20 s on two cores
def test_tp2_over_two_ray_nodes_equals_one_rank(two_nodes, tiny_model_dir):
    model, prompts = tiny_model_dir("llama"), random_prompts(4, seed=11)
    one = LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True)
    expected = _generate(one, prompts)
    one.shutdown()
    llm = LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        executor = llm.engine.core.executor
        assert len(set(executor.nodes)) == 2  # one rank per node
        assert _generate(llm, prompts) == expected
    finally:
        llm.shutdown()
