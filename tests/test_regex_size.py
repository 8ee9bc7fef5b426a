"""regex_size: the bound on a response_format regex's automaton that the server checks before compiling."""
import pytest

from specdec.engine.regex_size import regex_size, uses_verbose_flag


@pytest.mark.parametrize("regex,size", [
    ("abc", 3), ("a|bc", 3), ("(ab){3}", 6), ("a{2,5}", 5), ("a{5,}", 5), ("[a-z]{10}", 10),
    (r"\d{3}-\d{4}", 8), ("((a{10}){10}){10}", 1000), ("(a|b)*c{1000000}", 1000002), ("[]a]{4}", 4),
    ("x*y+z?", 3), ("a{", 2),
    # whitespace may pad a count: the compiler reads these as counted repetitions too
    ("a{ 5000}", 5000), ("a{5000 }", 5000), ("a{100, 3000}", 3000), ("a{ 10 , 20 }", 20), ("a{\u00a0500}", 500),
])
def test_regex_size_counts_states_and_multiplies_counted_repetitions(regex, size):
    assert regex_size(regex) == size


def test_regex_size_is_iterative_and_bounds_an_unclosed_group():
    assert regex_size("(" * 5000 + "a" + ")" * 5000) == 1  # no recursion: any nesting depth
    assert regex_size("(unclosed") == 8


def test_a_count_of_thousands_of_digits_is_read_as_huge_not_an_error():
    assert regex_size("a{" + "9" * 5000 + "}") >= 10**9  # int() refuses 4,300+ digits: a 500 before


@pytest.mark.parametrize("regex,verbose", [
    ("(?x)a{1 0 0 0 0 0 0}", True), ("(?ix:a)", True), ("a(?-x)b", True), ("(?i)abc", False), ("x?y", False),
    ("(?:x)", False),
])
def test_the_verbose_flag_is_spotted(regex, verbose):
    """Under (?x) the compiler skips whitespace, so a{1 0 0 0 0 0 0} is a repetition of a million that
    regex_size reads as a few literals: the compiler refuses such a regex before sizing it."""
    assert uses_verbose_flag(regex) == verbose
