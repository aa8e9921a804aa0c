"""The scheduler's encoder budget per step (vLLM's max_num_encoder_input_tokens): a step's prompt chunks first reach
media whose encoder rows sum to at most the budget (a chunk stops before the image that would pass it), every request
still finishes, and an image larger than the whole budget runs alone in a step rather than never."""
from __future__ import annotations

from pressroom.config import SchedulerConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import ModelRunnerOutput
from pressroom.core.request import Request
from pressroom.core.scheduler import Scheduler
from pressroom.multimodal.inputs import MediaItem
from pressroom.sampling_params import SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _image(offset: int, rows: int, bidirectional: bool = False) -> MediaItem:
    return MediaItem("image", f"h{offset}-{rows}", offset, rows, b"", (0,), bidirectional=bidirectional)


def _scheduler(encoder_budget: int, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=512,
                             max_num_encoder_input_tokens=encoder_budget)
    return Scheduler(config, KVCacheManager(256, 16, enable_caching=False))


def _run(sched: Scheduler, requests: list[Request]) -> list[int]:
    """Every step's encoder rows (the media units its chunks first reach) until all requests finish."""
    for req in requests:
        sched.add_request(req)
    rows_per_step = []
    while sched.has_unfinished():
        before = {r.request_id: r.num_computed_tokens for r in requests}
        out = sched.schedule()
        rows = 0
        for rid, n in out.num_scheduled_tokens.items():
            req, start = sched.requests[rid], before[rid]
            rows += sum(m.encoder_cost for m in req.mm_features or () if start <= m.offset < start + n)
        rows_per_step.append(rows)
        sampled = {rid: [7] for rid in out.num_scheduled_tokens
                   if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        assert len(rows_per_step) < 100
    return rows_per_step


def _requests() -> list[Request]:
    """Two prompts of 48 tokens, three and two 8-row images."""
    return [Request("a", [1] * 48, ONE, None, mm_features=[_image(4, 8), _image(16, 8), _image(28, 8)]),
            Request("b", [1] * 48, ONE, None, mm_features=[_image(2, 8), _image(20, 8)])]


def test_a_steps_encoder_work_is_capped_and_every_request_finishes():
    rows = _run(_scheduler(encoder_budget=20), _requests())
    assert max(rows) <= 20 and sum(rows) == 40
    assert rows[0] == 16  # a's first two images; its third and b's first wait for the next step
    uncapped = _run(_scheduler(encoder_budget=0), _requests())  # 0: as many as max_num_batched_tokens
    assert uncapped[0] == 32 and sum(uncapped) == 40  # the same work in fewer steps: the cap is what held it back


def test_a_chunk_stops_before_the_image_that_does_not_fit():
    sched = _scheduler(encoder_budget=10)
    for req in _requests():
        sched.add_request(req)
    assert sched.schedule().num_scheduled_tokens == {"a": 16, "b": 2}  # each stops before the image over budget


def test_an_image_larger_than_the_budget_runs_alone_in_a_step():
    big = Request("big", [1] * 40, ONE, None, mm_features=[_image(0, 24)])
    small = Request("small", [1] * 20, ONE, None, mm_features=[_image(0, 4)])
    rows = _run(_scheduler(encoder_budget=16), [big, small])
    assert rows[0] == 24 and sum(rows) == 28  # the step's first unit fits whatever its size; the other waits


def test_a_bidirectional_run_of_adjacent_images_is_one_unit():
    """Gemma 3's adjacent images are one run: paid together, never split by the encoder budget."""
    req = Request("g", [1] * 40, ONE, None, mm_features=[_image(4, 8, True), _image(12, 8, True)])
    other = Request("o", [1] * 40, ONE, None, mm_features=[_image(4, 8, True)])
    sched = _scheduler(encoder_budget=16)
    for r in (req, other):
        sched.add_request(r)
    assert sched.schedule().num_scheduled_tokens == {"g": 40, "o": 4}  # o's image waits for the next step's budget


def test_a_clip_pays_its_encoder_rows_not_its_one_placeholder():
    """Whisper's clip sits on one decoder token but its encoder computes 1,500 rows (a 30-s window): the budget
    counts those, so a 2,000-row budget encodes one clip a step."""
    def clip(rid: str) -> Request:
        item = MediaItem("audio", f"clip-{rid}", 0, 1, b"", (80, 3000), encoder_rows=1500)
        return Request(rid, [1] * 4, ONE, None, mm_features=[item])
    rows = _run(_scheduler(encoder_budget=2000), [clip("a"), clip("b"), clip("c")])
    assert [r for r in rows if r] == [1500, 1500, 1500]
