"""An upper bound on the size of a regex's automaton, computed before anything builds it.

A client's response_format becomes a regex that outlines-core compiles against the whole vocabulary, at
about 0.5 ms a state for SmolLM2's 49k tokens (a 2-vCPU Xeon): `(a|b)*c{20000}` took 11 s, and
`c{1000000}` ran for minutes while the server grew past 8 GB. The bound counts each literal, escape and
character class as one state, a group as the sum of its alternatives, and a counted repetition {m,n} as
its operand times max(m, n); `*`, `+` and `?` add nothing. It never shares states, so it over-estimates,
which is the safe side: the generic JSON object's regex (json_object) counts about 6,900.

The verbose flag `(?x)` is refused (`uses_verbose_flag`): under it the compiler skips whitespace and `#`
comments anywhere, so `a{1 0 0 0 0 0 0}` is a counted repetition of a million that this count would
read as a handful of literals.
"""
from __future__ import annotations

import re

# (whitespace may pad a count, as the compiler reads `a{ 5000 }` and `a{100, 3000}`; a count read here that
# the compiler refuses only over-counts)
_COUNTED = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")
_VERBOSE = re.compile(r"\(\?[A-Za-z-]*x")  # an inline flag group that turns the verbose flag on (or off)
_HUGE = 10**9  # a count of more digits than this has is read as this (int() refuses 4,300+ digits)


def uses_verbose_flag(regex: str) -> bool:
    return _VERBOSE.search(regex) is not None


def _count(digits: str) -> int:
    return int(digits) if len(digits) < 10 else _HUGE


def _class_end(regex: str, i: int) -> int:
    """The index after the character class opening at regex[i] ('[')."""
    j = i + 1
    if regex.startswith("^", j):
        j += 1
    if regex.startswith("]", j):  # a leading ']' is a member
        j += 1
    while j < len(regex) and regex[j] != "]":
        j += 2 if regex[j] == "\\" else 1
    return j + 1


def regex_size(regex: str) -> int:
    """The bound on regex's states (see the module docstring). Iterative: nesting depth costs no stack."""
    frames = [[0, 0, 0]]  # per open group: [finished alternatives, this alternative, its last atom]
    i = 0
    while i < len(regex):
        c, frame = regex[i], frames[-1]
        counted = _COUNTED.match(regex, i) if c == "{" else None
        if counted:
            lo, hi = _count(counted.group(1)), counted.group(3)
            count = max(lo, _count(hi) if hi else lo, 1)
            frame[1] += frame[2] * (count - 1)
            frame[2] *= count
            i = counted.end()
            continue
        if c in "*+?":
            i += 1
            continue
        if c == "|":
            frame[0], frame[1], frame[2] = frame[0] + frame[1], 0, 0
            i += 1
            continue
        if c == "(":
            frames.append([0, 0, 0])
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            done = frames.pop()
            atom, i = done[0] + done[1], i + 1
        elif c == "[":
            atom, i = 1, _class_end(regex, i)
        elif c == "\\":
            atom, i = 1, i + 2
        else:
            atom, i = 1, i + 1
        frames[-1][1] += atom
        frames[-1][2] = atom
    while len(frames) > 1:  # unclosed groups (the compiler will refuse them): count what they hold
        done = frames.pop()
        frames[-1][1] += done[0] + done[1]
    return frames[0][0] + frames[0][1]
