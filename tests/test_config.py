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
])
def test_keys_their_methods_read_are_taken(config):
    cfg = SpeculativeConfig.from_dict(config)
    assert all(getattr(cfg, k) == (tuple(v) if isinstance(v, list) else v) for k, v in config.items())
