"""The queue of rows an EAGLE head has yet to digest (a request's state.draft["pending"]): the features and
next tokens of the rows the target accepted since the request last drafted, bounded to the newest
PROMPT_WINDOW. The proposer (eagle.py) queues rows in begin / on_verified and takes them when it drafts."""
from __future__ import annotations

import torch

# The head digests at most this many of the newest context rows (their features and next tokens) at
# once, at their true positions; before its first draft, and after a long stretch of plain steps, it
# restarts from them (trim_pending): a rag prompt of 464-867 tokens through the head cost ~10%
# of a 64-token bf16 answer, and adaptive k drafts that once per request to measure the head (run S16:
# eagle3 0.87x on rag). The drafts may change; verification keeps the output exact.
PROMPT_WINDOW = 128
# A prompt whose prefix was cached (the offline kept prefix, the engine's prefix cache) is computed from
# there on, and the head would see none of the cached rows: a chat's system prompt, an earlier turn.
# The features of the last request's rows (at most KEPT_ROWS, from position 0) are kept for the next
# request that shares its prefix. Without them (the system prompt cached), a chain of 5 on MT-bench's
# first turns gave 1.78 tokens a pass instead of 1.85, on held-out ShareGPT 2.23 instead of 2.27 (fp32).
# Memory: 3H floats a row (an eagle3 head's features), ~15% of the target's KV for SmolLM2, for the last
# request and for each request in flight.
KEPT_ROWS = 4096


def trim_pending(st: dict) -> None:
    """Keep at most PROMPT_WINDOW queued rows. A long stretch without drafts (a prompt, or the steps
    adaptive k made plain: a busy server's rows for thousands of steps) keeps only its newest rows,
    and the head restarts from them at their true positions: its committed rows would no longer be
    followed by the next ones. Bounds the queue's memory and the digest that ends such a stretch."""
    pending = st["pending"]
    over = st["queued"] - PROMPT_WINDOW
    if over <= 0:
        return
    st["offset"] += st["len"] + over  # the position of the first kept row: the restarted cache's row 0
    st["len"], st["queued"] = 0, PROMPT_WINDOW
    while over >= len(pending[0][1]):
        over -= len(pending.pop(0)[1])
    if over:
        feats, toks = pending[0]
        pending[0] = (feats[over:], toks[over:])


def take_pending(st: dict) -> tuple[torch.Tensor, list[int]] | None:
    """The rows the target accepted since the request last drafted (features [n, .], next tokens), taken
    off its queue; None if there are none."""
    pending = st.get("pending")
    if not pending:
        return None
    feats = torch.cat([f for f, _ in pending])  # [n, H] or [n, 3H]: n <= PROMPT_WINDOW (trim_pending)
    tokens = [t for _, toks in pending for t in toks]
    pending.clear()
    st["queued"] = 0
    return feats, tokens
