"""Continuous batching: which sequences run this step, with how many tokens, and who is preempted.

A step schedules two kinds of rows, run as separate forwards (padding a 1-token decode row to a
256-token prefill chunk would waste 255 rows of compute):
  decode  every running sequence whose only uncomputed token is its newest, with its drafts;
  prefill chunks of prompts (or of preempted sequences being recomputed), at most
          max_num_batched_tokens in all; waiting sequences are admitted first-come first-served
          while there are free sequence slots, tokens in the budget and KV blocks. The engine packs
          the chunks into forwards of similar lengths (specdec.engine.model_runner.pack_rows).
When a decode row cannot get its blocks, its draft is dropped first, then the drafts of the rows already
placed, then the most recently admitted other sequence is preempted (blocks freed, recomputed later), then
the row itself.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdec.engine.block_manager import BlockManager
from specdec.engine.model_runner import Row
from specdec.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class ScheduledBatch:
    prefill: list[Row] = field(default_factory=list)
    decode: list[Row] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, speculation):
        self.config = config
        self.blocks = blocks
        self.spec = speculation
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        if seq.begun and seq.spec.proposer is not None:  # what the drafter kept in the blocks is gone too
            seq.spec.proposer.on_preempted(seq.state)
        seq.prefill_parts.clear()
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(decode=self._schedule_decode())
        batch.prefill = self._schedule_prefill()
        if not batch and self.running:  # every running sequence is stuck mid-prefill without blocks
            self.preempt(self.running[-1])
            return self.schedule()
        return batch

    def _schedule_decode(self) -> list[Row]:
        """Blocks first (room for the row's longest allowed draft), then K, then the drafts."""
        seqs = [s for s in self.running if s.num_uncomputed == 1]
        caps = {s: self.spec.cap(s, self.config.max_model_len) for s in seqs}
        ready: list[Sequence] = []
        while seqs:
            seq = seqs.pop(0)
            while not self.blocks.ensure(seq, seq.num_computed + 1 + caps[seq]):
                if caps[seq]:
                    caps[seq] = 0  # no room for drafts: plain decoding this step
                    continue
                if self._reclaim_drafts(ready, caps):  # a row's next token before other rows' drafts
                    continue
                victim = self.running[-1]
                seqs = [s for s in seqs if s is not victim]
                ready = [s for s in ready if s is not victim]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                ready.append(seq)
        row_caps = [caps[s] for s in ready]
        found = self.spec.lookups(ready, row_caps)  # free: asked first, priced by their match lengths
        k = self.spec.choose_k(ready, row_caps, found)
        proposals = self.spec.propose(ready, k, row_caps, found)
        return [Row(s, 1, p) for s, p in zip(ready, proposals)]

    def _reclaim_drafts(self, ready: list[Sequence], caps: dict) -> bool:
        """Take the rows already placed off drafting this step and give back the blocks held for their drafts
        alone; whether any block came back."""
        freed = False
        for seq in ready:
            held = len(seq.block_table)
            if caps[seq] and self.blocks.blocks_for(seq.num_computed + 1) < held:  # (else its drafts cost no block)
                caps[seq] = 0
                self.blocks.trim(seq, seq.num_computed + 1)
                freed = True
        return freed

    @staticmethod
    def _chunk_limit(seq) -> int:
        """A chunk ends where the prompt does: prompt tokens and recomputed outputs are never in one
        chunk (a prompt's pass may run its matmuls in bf16, as LLM.generate's prefill does)."""
        left = len(seq.prompt_ids) - seq.num_computed
        return left if left > 0 else seq.num_uncomputed

    def _schedule_prefill(self) -> list[Row]:
        budget = self.config.max_num_batched_tokens
        rows: list[Row] = []
        used = 0
        for seq in self.running:  # chunked prefills (and recomputations) already running
            n = min(seq.num_uncomputed, budget - used, self._chunk_limit(seq))
            if seq.num_uncomputed > 1 and n > 0 and self.blocks.ensure(seq, seq.num_computed + n):
                rows.append(Row(seq, n))
                used += n
        while self.waiting and len(self.running) < self.config.max_num_seqs and used < budget:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq) if not seq.block_table else 0
            n = min(seq.num_uncomputed, budget - used, self._chunk_limit(seq))
            need = self.blocks.blocks_for(seq.num_computed + n) - len(seq.block_table)
            reserve = len(self.running)  # one spare block per running sequence for its decode growth
            if need + reserve > self.blocks.num_free or not self.blocks.ensure(seq, seq.num_computed + n):
                self.blocks.free(seq)  # give back the prefix hits; admitted again on a later step
                break
            self.waiting.popleft()
            self.blocks.count_prefix_lookup(seq, cached)  # counted once admitted: a blocked head is looked up anew
            if not seq.num_preemptions:  # a re-admission hits its own blocks: not what the prompt found cached
                seq.num_cached_prompt = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            rows.append(Row(seq, n))
            used += n
        return rows
