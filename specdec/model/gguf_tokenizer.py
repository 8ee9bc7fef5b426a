"""A `tokenizers` tokenizer.json (and tokenizer_config.json) from a GGUF file's tokenizer.ggml.* fields.

Two vocabularies:
  gpt2   byte-level BPE with the file's merges: digits split, GPT-2 regex, as SmolLM2's own
         tokenizer.json (llama.cpp pre-tokenizer "smollm", the only one accepted: Qwen's or Llama 3's
         split text otherwise). Control tokens are special, user-defined ones plain added tokens.
  llama  a SentencePiece BPE vocabulary ("\u2581" for spaces, <0xNN> byte fallback), for gemma3 only. Built
         as transformers' GGUF loader builds Gemma's (integrations/gguf/gguf_tokenizer_mapping.py,
         gemma_tokenizer + GemmaTokenizer): spaces -> "\u2581" by a normalizer, no prefix space, BPE with
         byte_fallback; whitespace-only tokens the file spells with real spaces are respelled with
         "\u2581"; the file has no merges, so they are derived from the vocabulary (every split of a token
         into two tokens, earlier tokens first: Gemma's token order is its merge order). Control
         tokens (type 3) become special added tokens, user-defined ones (type 4: "\n", "\n\n", ...,
         <start_of_image>) plain added tokens matched whole, as llama.cpp does.
The BOS token is added by specdec.model.tokenizer.Tokenizer (add_bos_token), not a post-processor.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from specdec.config import ConfigError

CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"


def tokenizer_files(get: Callable[..., Any], arch: str) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) contents; get(key, default=None) reads a GGUF field."""
    kind = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        pre = get("tokenizer.ggml.pre")
        if pre != "smollm":  # Qwen's, Llama 3's, GPT-2's own regexes split text differently: silently wrong ids
            raise ConfigError(f"GGUF byte-level pre-tokenizer {pre!r} is not supported (SmolLM2's 'smollm' is); "
                              "load the model's Hugging Face directory instead")
    elif kind != "llama" or arch != "gemma3":
        raise ConfigError(f"GGUF tokenizer model {kind!r} is not supported for {arch!r} "
                          "(byte-level BPE 'gpt2' is; SentencePiece 'llama' for gemma3)")
    merges = get("tokenizer.ggml.merges")
    if not all(isinstance(m, str) for m in merges or ()):
        raise ConfigError("GGUF tokenizer: merges must be strings")
    try:
        tok = (_byte_level(tokens, types, merges) if kind == "gpt2"
               else _sentencepiece_bpe(tokens, types, merges, get("tokenizer.ggml.unknown_token_id")))
    except ConfigError:
        raise
    except Exception as e:  # the tokenizers library's own type, e.g. a merge of a token not in the vocabulary
        raise ConfigError(f"GGUF tokenizer: {str(e)[:160]}") from None

    def tok_str(key):
        i = get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_cfg = {
        "chat_template": get("tokenizer.chat_template"),
        "bos_token": tok_str("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_str("tokenizer.ggml.eos_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        "add_bos_token": bool(get("tokenizer.ggml.add_bos_token", kind == "llama")),
    }
    return json.loads(tok.to_str()), tok_cfg


def _byte_level(tokens: list[str], types: list[int], merges: list[str] | None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if not merges:
        raise ConfigError("GGUF byte-level BPE tokenizer without merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)  # kept in decoded text, as llama.cpp keeps them
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


def _sentencepiece_bpe(tokens: list[str], types: list[int], merges: list[str] | None, unk_id: int | None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = [tuple(m.split(" ")) for m in merges] if merges else merges_from_vocab(spelled, vocab)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else "<unk>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, unk_token=unk, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    known = tok.get_vocab(with_added_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in known])
    return tok


def merges_from_vocab(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens; merges of earlier tokens first, then longer
    left parts (transformers' generate_merges with scores = -position)."""
    score = {t: -i for i, t in enumerate(tokens)}  # a repeated token keeps its last position
    merges = []
    for merge, s in score.items():
        local = [(merge[:i], merge[i:], s) for i in range(1, len(merge)) if merge[:i] in vocab and merge[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
