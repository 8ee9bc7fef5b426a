"""Per target pass cost of two heads at a fixed draft shape (tree 9, topk 3, depth 3; and chain 3), same run."""
import sys, time
from specdec import LLM, SamplingParams
from specdec.bench.prompts import build_prompts
heads = {"old": sys.argv[1], "new": sys.argv[2]}
shapes = {"tree9": {"eagle_topk": 3, "num_steps": 3, "num_draft_tokens": 9}, "chain3": {"eagle_topk": 1, "num_steps": 3, "num_draft_tokens": 3}}
systems = {}
for hn, h in heads.items():
    for sn, sh in shapes.items():
        systems[(hn, sn)] = LLM("smollm2-135m", dtype="bfloat16", num_threads=2, progress=False, amx=True,
                                speculative_config={"method": "eagle3", "model": h, "adaptive": False, **sh})
prompts = build_prompts(next(iter(systems.values())).tokenizer, 4, ("multi_turn", "qa"))
params = SamplingParams(temperature=0.0, max_tokens=96)
acc = {k: [0.0, 0, 0, 0.0, 0.0] for k in systems}
for rnd in range(2):
    for i, p in enumerate(prompts):
        keys = list(systems) if (i + rnd) % 2 == 0 else list(systems)[::-1]
        for k in keys:
            t = time.perf_counter()
            r = systems[k].generate({"prompt_token_ids": p.token_ids}, params)[0]
            dt = time.perf_counter() - t
            m = r.metrics if hasattr(r, "metrics") else r.outputs[0].metrics
            acc[k][0] += dt; acc[k][1] += m["target_forward_passes"]; acc[k][2] += len(r.outputs[0].token_ids); acc[k][3] += m["speculative"]["draft_time_s"]; acc[k][4] += m["speculative"]["verify_time_s"]
for k, (t, passes, toks, dr, ve) in acc.items():
    print(k, f"ms/pass {1000 * t / passes:.2f}  draft ms/pass {1000 * dr / passes:.2f}  verify ms/pass {1000 * ve / passes:.2f}  tokens/pass {toks / passes:.3f}  tok/s {toks / t:.1f}")
