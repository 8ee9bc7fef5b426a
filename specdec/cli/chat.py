"""`specdec chat`: an interactive, streaming chat with the model's chat template."""
from __future__ import annotations

import sys

from specdec.cli._common import StreamPrinter, add_model_args, add_spec_args, make_llm
from specdec.cli.generate import add_sampling_args, sampling_from_args
from specdec.model.tokenizer import valid_unicode


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat (empty line or Ctrl-D to quit)")
    add_model_args(p)
    add_spec_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=run)


def run(args) -> int:
    llm = make_llm(args)
    params = sampling_from_args(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if hasattr(sys.stdin, "reconfigure"):  # a line of bytes that are not UTF-8 reads (and is refused) alone
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        if not valid_unicode(user):  # bytes that are not UTF-8: this line is refused, the conversation goes on
            print("specdec: that line is not valid UTF-8; type it again", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": user})
        ids = llm.tokenizer.encode_chat(messages)
        if len(ids) >= llm.model.max_len:
            print("specdec: the conversation no longer fits the context; start a new one", file=sys.stderr)
            break
        stream = StreamPrinter(params.stop)
        r = llm.generate_one(ids, params, on_delta=stream)
        stream.finish(r.text)
        cached = f", {r.num_cached_tokens} cached" if r.num_cached_tokens else ""
        print(f"\n[{r.decode_tokens_per_s:.1f} tok/s; prompt {len(ids)} tokens{cached}, {r.prefill_time:.2f} s]",
              file=sys.stderr)
        messages.append({"role": "assistant", "content": r.text})
    return 0
