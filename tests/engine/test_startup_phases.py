"""The engine times each part of its start (issue 44: time to ready), so a slow start says where it went."""
from pressroom import LLM


def test_the_engine_reports_where_its_start_went(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05)
    try:
        phases = llm.engine.startup_phases
        assert list(phases) == ["workers", "weights", "memory profile", "KV cache", "compile and graphs"]
        assert all(seconds >= 0 for seconds in phases.values())
        # the parts are inside the whole, which also counts what falls between them
        assert sum(phases.values()) <= llm.engine.startup_seconds
        assert phases["weights"] > 0
    finally:
        llm.shutdown()
