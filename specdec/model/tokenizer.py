"""Tokenizer: a `tokenizers` fast tokenizer plus the chat template and special tokens of a model dir,
and an incremental detokenizer that streams clean text (no split UTF-8 characters)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer

from specdec.config import ConfigError, read_json_object
from specdec.model.chat_template import render_chat
from specdec.model.config import end_token_ids


def valid_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (what surrogateescape makes of bytes that are not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Tokenizer:
    def __init__(self, directory: Path):
        path = directory / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{directory}: no tokenizer.json")
        try:
            self._tok = FastTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type on bad files
            raise ConfigError(f"cannot read {path}: {e}") from None
        cfg_path = directory / "tokenizer_config.json"
        self.config = read_json_object(cfg_path) if cfg_path.exists() else {}
        model_cfg = read_json_object(directory / "config.json")
        self.chat_template: str | None = _chat_template(directory, self.config.get("chat_template"))
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        eos_ids = end_token_ids(directory, model_cfg)  # (what the model's config, ModelConfig, stops at too)
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos_ids.append(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", self._post_processor_adds_bos()))

    def _post_processor_adds_bos(self) -> bool:
        """Whether tokenizer.json's post-processor puts BOS first (Llama 3's files say so only there)."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        special = self._tok.encode("a", add_special_tokens=True).ids
        return self.bos_token_id is not None and special[:1] == [self.bos_token_id] and special[1:] == plain

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:  # the tokenizers library's error for a str it cannot take
            if isinstance(text, str) and not valid_unicode(text):  # argv's undecodable bytes, JSON's \ud800
                raise ValueError("the text is not valid Unicode (it holds a lone surrogate, e.g. from bytes "
                                 "that are not UTF-8)") from None
            raise
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """A conversation's prompt: its chat template's text, and that text encoded with no special tokens
        added (a template writes its own BOS, as Gemma's and Llama's do: HF's apply_chat_template(tokenize=True)
        likewise)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return text, self.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """A conversation's prompt ids (chat_prompt's)."""
        return self.chat_prompt(messages, add_generation_prompt)[1]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        template = chat_template or self.chat_template
        if not template:
            raise ConfigError("this model has no chat template; use generate() with a plain prompt")
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _chat_template(directory: Path, template) -> str | None:
    """tokenizer_config.json's template; of a list of named ones (older files), the one named "default";
    none there: chat_template.jinja beside it (where newer transformers save it)."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise ConfigError(f"{directory}: tokenizer_config.json lists chat templates, none of them named 'default'")
        return named["default"]
    path = directory / "chat_template.jinja"
    if template is None and path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
    return template


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):  # {"content": "<s>", ...} in some tokenizer_config.json files
        return tok.get("content")
    return tok


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # tokens before this index are already final text
        self.read_offset = 0
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append token ids; return the newly completed text."""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete multi-byte character: wait for more tokens
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
