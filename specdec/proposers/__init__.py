"""Built-in proposers; importing this package registers them."""
import importlib

for _name in ("ngram", "draft_model", "layer_skip", "suffix", "lookahead", "medusa", "eagle", "qdraft", "recycle"):
    try:
        importlib.import_module(f"specdec.proposers.{_name}")
    except ModuleNotFoundError as e:  # a proposer module not written yet is simply absent
        if e.name != f"specdec.proposers.{_name}":
            raise
