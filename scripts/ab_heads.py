"""Same-run A/B of two EAGLE-3 heads against plain decoding: bf16 on AMX tiles, 2 threads, MT-bench
multi_turn + qa, greedy, adaptive defaults; prompt by prompt interleaved, two rounds."""
import statistics, sys, time
from specdec import LLM, SamplingParams
from specdec.bench.prompts import build_prompts

heads = {"old": sys.argv[1], "new": sys.argv[2]}
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
systems = {"plain": LLM("smollm2-135m", dtype="bfloat16", num_threads=2, progress=False, amx=True)}
for name, h in heads.items():
    systems[name] = LLM("smollm2-135m", dtype="bfloat16", num_threads=2, progress=False, amx=True,
                        speculative_config={"method": "eagle3", "model": h})
prompts = build_prompts(systems["plain"].tokenizer, 8, ("multi_turn", "qa"))
params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
times = {k: {} for k in systems}
passes = {k: {} for k in systems}
outs = {}
for rnd in range(2):
    for i, p in enumerate(prompts):
        order = list(systems) if (i + rnd) % 2 == 0 else list(systems)[::-1]
        for k in order:
            t = time.perf_counter()
            r = systems[k].generate({"prompt_token_ids": p.token_ids}, params)[0]
            dt = time.perf_counter() - t
            times[k].setdefault(i, []).append(dt)
            o = r.outputs[0]
            outs.setdefault(i, {})[k] = o.token_ids
            m = getattr(r, "metrics", None) or {}
            passes[k][i] = (len(o.token_ids), m)
for i in outs:
    assert outs[i]["old"] == outs[i]["plain"] == outs[i]["new"], i
for cat in ("multi_turn", "qa", "all"):
    idx = [i for i, p in enumerate(prompts) if cat == "all" or p.category == cat]
    tot = {k: sum(min(times[k][i]) for i in idx) for k in systems}
    per = {k: [min(times["plain"][i]) / min(times[k][i]) for i in idx] for k in ("old", "new")}
    print(cat, {k: f"{tot['plain'] / tot[k]:.3f}x (per-prompt median {statistics.median(per[k]):.3f})" for k in ("old", "new")})
print("outputs equal: all")
