"""The scheduler's block decisions on stand-in sequences (no model): drafts give way to other rows' next
tokens before anyone is preempted; a request's cached-prompt count and the prefix-cache stats count what
the prompt found, once."""
from __future__ import annotations

from specdec.engine.block_manager import BlockManager
from specdec.engine.scheduler import Scheduler, SchedulerConfig
from specdec.engine.sequence import Status


class StandInSeq:
    """What the scheduler and block manager read of a sequence."""
    reads_prefix_cache, cache_salt, begun = True, None, False

    def __init__(self, prompt: list[int], outputs: int = 0):
        self.prompt_ids, self.output_ids = list(prompt), list(range(1000, 1000 + outputs))
        self.block_table, self.block_hashes, self.prefill_parts = [], [], []
        self.num_computed = self.num_cached_prompt = self.num_preemptions = 0
        self.status = Status.WAITING

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed


class NoDrafts:
    """Speculation allowing `cap` drafted tokens a row and choosing none (what the cost model often does)."""

    def __init__(self, cap: int):
        self.cap_tokens = cap

    def cap(self, seq, max_model_len: int) -> int:
        return self.cap_tokens

    def lookups(self, seqs, caps):
        return [None] * len(seqs)

    def choose_k(self, seqs, caps, found) -> int:
        return 0

    def propose(self, seqs, k, caps, found):
        return [None] * len(seqs)


def _running(scheduler: Scheduler, blocks: BlockManager, computed: int) -> StandInSeq:
    seq = StandInSeq(list(range(computed)), outputs=1)  # a decode row: only its newest token uncomputed
    assert blocks.ensure(seq, computed)
    seq.num_computed, seq.status = computed, Status.RUNNING
    scheduler.running.append(seq)
    return seq


def test_a_rows_drafts_give_way_to_another_rows_next_token():
    """6 blocks of 4, two rows at 8 tokens each (2 blocks each): the first row's room for 4 drafts took the
    last 2 free blocks, and the second row, finding none for its next token, preempted itself."""
    blocks = BlockManager(6, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), blocks, NoDrafts(4))
    a, b = _running(scheduler, blocks, 8), _running(scheduler, blocks, 8)
    rows = scheduler._schedule_decode()
    assert scheduler.num_preemptions == 0 and [row.seq for row in rows] == [a, b]
    assert len(a.block_table) == len(b.block_table) == 3  # each row's next token, no draft room


def test_cached_prompt_count_and_prefix_stats_count_what_the_prompt_found():
    """A request preempted mid-prefill hits its own blocks on re-admission: not cached prompt tokens. A head
    of the queue that cannot be admitted is looked up each step: counted once it is admitted."""
    blocks = BlockManager(4, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=64), blocks, NoDrafts(0))
    seq = StandInSeq(list(range(11)))
    scheduler.add(seq)
    for _ in range(2):  # two 4-token chunks computed and committed
        [row] = scheduler.schedule().prefill
        seq.num_computed += row.num_new
        blocks.commit(seq)
    assert seq.num_computed == 8 and seq.num_cached_prompt == 0
    scheduler.preempt(seq)
    seq.num_preemptions = 1
    scheduler.schedule()
    assert seq.num_computed == 8 and seq.num_cached_prompt == 0  # its own blocks served it; nothing cached
    queries, hits = blocks.prefix.queries, blocks.prefix.hits
    blocker = StandInSeq(list(range(11)))  # 2 blocks hit, 1 more needed and 1 kept spare: 1 is free
    scheduler.add(blocker)
    for _ in range(3):
        scheduler.schedule()
    assert blocker.status is Status.WAITING and not blocker.block_table
    assert (blocks.prefix.queries, blocks.prefix.hits) == (queries, hits)
