"""Prompt lookup's incremental n-gram index proposes what a full scan of the context would."""
import random

import numpy as np

from specdec.proposers.ngram import NgramIndex


def scan(tokens: list[int], n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
    """The reference: scan the whole context for the latest earlier match of its last n tokens."""
    arr, L = np.asarray(tokens), len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k], n
    return [], 0


def test_index_grown_step_by_step_equals_a_full_scan():
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([3, 5, 20])  # small vocabularies: many repeats, overlapping matches
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        output: list[int] = []
        n_min, n_max = rng.choice([(1, 4), (2, 3), (1, 1), (3, 6), (1, 64)])
        index = NgramIndex(n_min, n_max)
        for step in range(40):
            assert index.follows(prompt, output)
            index.extend(prompt, output)
            k = rng.randrange(1, 6)
            assert index.lookup(n_min, n_max, k) == scan(prompt + output, n_min, n_max, k)
            # a stricter minimum match (a pairing's lookup) from the same index
            assert index.lookup(min(n_min + 1, n_max), n_max, k) == scan(prompt + output, min(n_min + 1, n_max), n_max, k)
            output.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))  # accepted drafts + bonus


def test_a_context_that_does_not_extend_the_index_is_not_followed():
    index = NgramIndex(1, 3)
    prompt, output = [1, 2, 3, 1, 2], [3, 4]
    index.extend(prompt, output)
    assert index.lookup(1, 3, 2) == ([], 0)  # the last token, 4, never occurred before
    assert not index.follows(prompt, [3])  # shorter than what was indexed
    assert not index.follows(prompt, [3, 5])  # the last indexed token changed
    assert not index.follows(prompt + [9], output)  # another prompt
    assert index.follows(prompt, output + [1])
    index.extend(prompt, output + [1])
    assert index.lookup(1, 3, 2) == ([2, 3], 1)  # [1] last seen at 3, followed by 2, 3


def test_a_wide_match_range_indexes_a_long_prompt_in_little_memory_and_time():
    """prompt_lookup_max 64 on a 2,048-token prompt: the index once held a tuple of every n-gram (45 MB,
    0.76 s); keyed by rolling hash it holds one int a window. A forced collision costs a missed draft, never a
    wrong one."""
    import sys
    import time

    rng = random.Random(1)
    prompt = [rng.randrange(50) for _ in range(2048)]
    index = NgramIndex(1, 64)
    t0 = time.perf_counter()
    index.extend(prompt, [])
    assert time.perf_counter() - t0 < 2.0
    assert all(type(key) is int for key in index.latest)
    assert sys.getsizeof(index.latest) < 20e6
    assert index.lookup(1, 64, 3) == scan(prompt, 1, 64, 3)
    # every window of a length hashed alike: each probe finds the latest window of that length ([9, 2], [2]),
    # whose tokens differ from the suffix's: no draft, where unchecked it would have drafted what followed them
    index = NgramIndex(1, 4)
    index._key = lambda start, end: end - start
    index.extend([1, 2, 3, 9, 2, 3], [])
    assert index.lookup(1, 4, 2) == ([], 0)
