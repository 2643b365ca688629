"""Short prompts under steady load (issue 35), pure, on a fake clock: the scheduler at its
defaults, steps costed by a made-up machine and their timings reported back as the engine does.
Chat-sized prompts arriving while streams decode are admitted at once (their first chunk planned
within a few rounds, their first token soon after), whatever the pacing, while a long prompt is
still paced."""

from __future__ import annotations

from shardline.config import PacingConfig, SamplingParams
from shardline.pipeline.plan import DecodeStep, PrefillStep, Step
from shardline.pipeline.timing import Timing
from shardline.serving.scheduler import KeyedScheduler, SchedulerConfig
from shardline.serving.stream import Stream


def graph_seconds(step: Step) -> float:
    """A made-up 2-core machine: a decode step of 12 ms plus 2 ms a row; a chunk 6 ms plus 0.6 ms
    a token, and 30 ms more for a prompt's first chunk (it opens the stream on every stage)."""
    if isinstance(step, DecodeStep):
        return 0.012 + 0.002 * len(step.streams)
    assert isinstance(step, PrefillStep)
    return 0.006 + 0.0006 * step.inputs.input_ids.shape[1] + (0.030 if step.first else 0.0)


class Run:
    """The scheduler driven round by round: every step planned in a round comes back before the
    next one (one resource), each stream's asked positions giving a token, the timing observed
    once per step (a group's rows share one, as in the engine)."""

    def __init__(self, cfg: SchedulerConfig | None = None) -> None:
        self.sched = KeyedScheduler(cfg or SchedulerConfig())
        self.round = 0
        self.first_chunk: dict[int, int] = {}
        self.first_token: dict[int, int] = {}
        self.gaps: list[float] = []  # per round: the graph seconds of everything planned (the decode streams' gap)

    def add(self, stream_id: int, prompt: int) -> None:
        self.sched.add(Stream(stream_id, list(range(100, 100 + prompt)), SamplingParams(), 10_000))
        self.first_chunk.pop(stream_id, None)

    def rounds(self, n: int) -> None:
        for _ in range(n):
            steps = self.sched.plan().steps
            for step in steps:
                if isinstance(step, PrefillStep):
                    for s in step.streams:
                        self.first_chunk.setdefault(s, self.round)
                        if step.sample_at.size:
                            self.first_token.setdefault(s, self.round)
            self.gaps.append(sum(graph_seconds(step) for step in steps))
            for step in steps:
                self._complete(step)
            self.round += 1

    def _complete(self, step: Step) -> None:
        phase = "decode" if isinstance(step, DecodeStep) else "prefill"
        timing = Timing(phase, 0.0, {0: graph_seconds(step)}, 0.0, 0.0, 0.0, 0.0, 0.0)
        for row, s in enumerate(step.streams):
            stream = self.sched.streams[s]
            stream.in_flight = False
            stream.generated += [7] * step.entries(row)
            if row == 0:
                self.sched.observe(stream, timing)


def decoding_pair() -> Run:
    run = Run()
    run.add(1, 32)
    run.add(2, 32)
    run.rounds(20)
    assert not any(s.prefilling for s in run.sched.streams.values())
    return run


def test_four_short_prompts_arriving_while_two_streams_decode_start_within_a_few_rounds() -> None:
    """The regression of issue 35: each 158-token prompt (a 128-token chat message in its
    template) waited for its predecessors' paced prefill, up to ~50 rounds for its first chunk."""
    run = decoding_pair()
    arrived = run.round
    for i in (3, 4, 5, 6):
        run.add(i, 158)
    run.rounds(40)
    waits = {i: run.first_chunk[i] - arrived for i in (3, 4, 5, 6)}
    firsts = {i: run.first_token[i] - arrived for i in (3, 4, 5, 6)}
    assert max(waits.values()) <= 4, waits  # two at once (max_prefills), the next two as those are in
    assert max(firsts.values()) <= 6, firsts  # two 128 + 30 token chunks each
    assert all(not run.sched.streams[i].prefilling for i in (1, 2, 3, 4, 5, 6))


def test_short_prompts_pass_a_long_one_still_being_paced() -> None:
    """A long prompt holds its places (max_prefills) for many rounds while it is paced; short
    prompts arriving behind it do not wait for it, and it still moves."""
    run = decoding_pair()
    run.add(3, 4000)
    run.add(4, 4000)
    run.rounds(5)
    arrived = run.round
    for i in (5, 6):
        run.add(i, 100)
    run.rounds(6)
    assert {i: run.first_token[i] - arrived for i in (5, 6)} == {5: 0, 6: 0}
    assert run.sched.streams[3].prefilling and run.sched.streams[3].prefilled > 0


def test_a_long_prompt_is_paced_as_before_and_finishes_beside_short_traffic() -> None:
    """A long prompt's chunks are planned exactly as with every prompt paced (short=0); with a
    short prompt arriving every 10 rounds meanwhile (not counted in prefill's share), it still
    finishes."""
    runs = []
    for short in (PacingConfig().short, 0):
        run = decoding_pair() if short else Run(SchedulerConfig(pacing=PacingConfig(short=0)))
        if not short:
            run.add(1, 32)
            run.add(2, 32)
            run.rounds(20)
        run.add(3, 3000)
        run.rounds(400)
        runs.append(run)
    assert runs[0].gaps == runs[1].gaps and runs[0].first_token[3] == runs[1].first_token[3] < 420
    busy = decoding_pair()
    busy.add(3, 3000)
    for i in range(40):
        busy.add(10 + i, 120)
        busy.rounds(10)
    assert not busy.sched.streams[3].prefilling
    assert all(busy.first_token[10 + i] - busy.first_chunk[10 + i] <= 1 for i in range(40))


def test_zero_paces_every_prompt_as_before() -> None:
    run = Run(SchedulerConfig(pacing=PacingConfig(short=0)))
    run.add(1, 32)
    run.add(2, 32)
    run.rounds(20)
    arrived = run.round
    for i in (3, 4, 5, 6):
        run.add(i, 158)
    run.rounds(40)
    # the old policy: the third and fourth wait for the first two's paced prefill (the last for
    # more than these 40 rounds)
    assert max(run.first_chunk.get(i, run.round) - arrived for i in (3, 4, 5, 6)) > 10


def test_a_short_prompt_goes_in_one_call_where_the_stages_take_it() -> None:
    """With `short_chunk` (serve sets it to --short-prompt unless a stage is static), a short
    prompt is one chunk, whether streams decode or not: one fixed cost per call saved."""
    run = Run(SchedulerConfig(short_chunk=256))
    run.add(1, 158)
    run.rounds(1)
    assert run.first_token == {1: 0}
    run.add(2, 200)
    run.add(3, 300)  # a long one: paced chunks of at most `chunk`
    run.rounds(1)
    assert run.first_token == {1: 0, 2: 1} and 0 < run.sched.streams[3].prefilled <= 128


def test_a_short_prompt_never_waits_for_a_paced_one_sharing_its_start() -> None:
    """Prefix reuse's rule (a prompt sharing most of itself with an earlier one still prefilling
    waits for it to be kept) does not hold a short prompt behind a long, paced one."""
    from shardline.serving.prefix import PrefixCache

    sched = KeyedScheduler(SchedulerConfig(), prefix=PrefixCache(1 << 30, 1000))
    for i in (1, 2):  # two streams decode: the long prompt is paced
        sched.add(Stream(i, list(range(10, 42)), SamplingParams(), 10_000, prefix_scope=""))
    run = Run()
    run.sched = sched
    run.rounds(20)
    shared = list(range(1000, 1200))
    sched.add(Stream(3, [*shared, *range(5000, 5200)], SamplingParams(), 10_000, prefix_scope=""))  # 400: paced
    run.rounds(3)
    sched.add(Stream(4, [*shared, 7, 8, 9], SamplingParams(), 10_000, prefix_scope=""))  # 203: short
    arrived = run.round
    run.rounds(3)
    assert sched.streams[3].prefilling and run.first_token[4] - arrived <= 1


def test_a_short_prompt_bound_outside_its_range_is_a_clear_error() -> None:
    import pytest

    from shardline.errors import ShardlineError

    for bad in (-1, (1 << 20) + 1):
        with pytest.raises(ShardlineError, match="--short-prompt must be in 0-1048576 tokens"):
            PacingConfig(short=bad)
    with pytest.raises(ShardlineError, match="short prompt's chunk"):
        SchedulerConfig(short_chunk=-1)
