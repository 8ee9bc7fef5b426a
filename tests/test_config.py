"""SpeculativeConfig: a value out of range, or a key the method does not read, is one ConfigError (a
typo must not turn speculation off or change nothing silently)."""
import pytest

from specdec.config import ConfigError, SpeculativeConfig


@pytest.mark.parametrize("config,message", [
    ({"method": "ngram", "max_speculative_tokens": -3}, "max_speculative_tokens"),  # k_max -3 crashed the cost model
    ({"method": "ngram", "max_speculative_tokens": 0}, "max_speculative_tokens"),   # turned speculation off
    ({"method": "suffix", "suffix_decoding_min_token_prob": 5.0}, "min_token_prob"),  # would never draft
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
    ({"method": "eagle3", "extra": {"sceme": "int8"}}, "does not read extra"),
    ({"method": "ngram", "num_steps": 5}, "does not read num_steps"),
    ({"method": "ngram", "lookahead_window": 3}, "does not read lookahead_window"),
    ({"method": "qdraft", "lookup": "ngram", "suffix_decoding_max_tree_depth": 30}, "with lookup 'ngram'"),
    ({"method": "eagle3", "skip_layers": [1, 2]}, "does not read skip_layers"),
    # more tokens a step than the head drafts (they were cut silently)
    ({"method": "eagle3", "num_steps": 3, "num_speculative_tokens": 5}, "drafts at most 3 tokens a step"),
    ({"method": "eagle3", "eagle_topk": 3, "num_steps": 3, "num_draft_tokens": 8, "num_speculative_tokens": 8},
     "drafts at most 7 tokens"),
    ({"method": "medusa", "num_draft_tokens": 4, "num_speculative_tokens": 5}, "drafts at most 3 tokens"),
    ({"method": "eagle", "num_speculative_tokens": 17}, r"in \[1, 16\] for eagle \(its chain's length"),
    ({"method": "eagle3", "max_speculative_tokens": 5}, "does not read max_speculative_tokens"),  # k_max: its step
    ({"method": "eagle3", "eagle_topk": 3, "num_steps": 3, "draft_confidence_threshold": 0.2},
     "does not read draft_confidence_threshold"),  # a tree: only chains stop at a threshold
    # keys only other methods, or a pairing, or an adaptive k read
    ({"method": "suffix", "prompt_lookup_max": 3}, "does not read prompt_lookup_max"),
    ({"method": "ngram", "lookup_min_match": 3}, "does not read lookup_min_match"),
    ({"method": "ngram", "num_speculative_tokens": 3, "max_speculative_tokens": 5}, "does not read max_speculative"),
    ({"method": "suffix", "draft_confidence_threshold": 0.3}, "does not read draft_confidence_threshold"),
    ({"method": "medusa", "num_steps": 2}, "does not read num_steps"),
])
def test_bad_values_and_keys_the_method_ignores_are_config_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(config)


@pytest.mark.parametrize("config", [
    {"method": "qdraft", "lookup": "suffix", "suffix_decoding_max_tree_depth": 30, "extra": {"scheme": "int8"}},
    {"method": "eagle3", "lookup": "ngram", "num_steps": 3, "eagle_topk": 3, "num_draft_tokens": 9},
    {"method": "draft_model", "model": "d", "extra": {"universal_tokenizer": True}},
    {"method": "medusa", "num_draft_tokens": 5},
    {"method": "layerskip", "skip_layers": [1, 2]},
    {"method": "lookahead", "lookahead_window": 3, "lookahead_ngram": 2},
    {"method": "suffix", "suffix_decoding_max_cached_requests": 0, "max_speculative_tokens": 64},
    {"method": "qdraft", "lookup": "ngram", "prompt_lookup_max": 3, "lookup_min_match": 3,
     "draft_confidence_threshold": 0.3},
    {"method": "eagle3", "draft_confidence_threshold": 0.3},
])
def test_keys_their_methods_read_are_taken(config):
    cfg = SpeculativeConfig.from_dict(config)
    assert all(getattr(cfg, k) == (tuple(v) if isinstance(v, list) else v) for k, v in config.items())


def test_num_speculative_tokens_alone_shapes_a_learned_heads_step():
    """vLLM's meaning: EAGLE's num_speculative_tokens is its chain's length (num_steps), Medusa's its tree's
    nodes; our own shape keys, or a lookup pairing (whose chains draft up to k), keep theirs."""
    eagle = SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 6})
    assert (eagle.num_steps, eagle.eagle_topk, eagle.num_draft_tokens, eagle.step_limit) == (6, 1, 7, 6)
    medusa = SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 6})
    assert (medusa.num_draft_tokens, medusa.step_limit) == (7, 6)
    paired = SpeculativeConfig.from_dict({"method": "eagle3", "lookup": "ngram", "num_steps": 3,
                                          "num_speculative_tokens": 6})
    assert (paired.num_steps, paired.step_limit, paired.k_max) == (3, 3, 6)
    chain = SpeculativeConfig.from_dict({"method": "eagle", "num_draft_tokens": 10})  # a chain of num_steps 3
    assert chain.k_max == chain.step_limit == 3
    assert SpeculativeConfig.from_dict({"method": "ngram"}).step_limit is None
