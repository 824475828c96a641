# Two entry points: `make demo` (convert the bundled model, generate under a device budget)
# and `make test` (the GPU kernels compiled for an H100, then the test suite). Both create their
# venvs and install everything on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench gpu gpu-dry-run gpu-compile gpu-compile-jax0.11 docs readme-check clean

$(STAMP): pyproject.toml setup.py $(wildcard cpu_kernels/src/*)
	$(PYTHON) -m venv $(VENV)
	# CPU build of torch first (only the HF-comparison tests use it); a looser spec pulls CUDA wheels.
	# --no-compile: the packages' modules are byte-compiled as they are first imported rather than
	# all of them at install (about 40 s here, most of it modules nothing imports).
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jmoe convert examples/tiny-qwen3-moe -o out/tiny-qwen3-moe --force
	$(BIN)/jmoe generate out/tiny-qwen3-moe "def fibonacci(n):" --max-new-tokens 64 --device-budget 32MiB --stats

# The documentation site (docs/, mkdocs.yml) into site/, failing on any warning: a broken link, a
# docstring mkdocstrings cannot read, or a results table that no longer matches bench/results/*/*.json
# (docs/gen_tables.py writes them). The docs extra's packages go into the main venv without
# reinstalling jmoe itself.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" \
		| xargs $(BIN)/pip install --quiet --no-compile
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python docs/gen_tables.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The README's and the tutorial's runnable blocks (marked <!-- runnable -->), in order, in a
# temporary directory against a fresh conversion of the bundled model (docs/check_readme.py).
readme-check: $(STAMP)
	$(BIN)/python docs/check_readme.py

# PYTHONNODEBUGRANGES: Python 3.11's traceback formatting parses source lines (ast.parse) to place
# its carets, and two threads doing that at once (a library's background thread reporting an error
# while pytest reports a failure) can corrupt the ast module's recursion counter, which turns the
# report of a failing test into a pytest INTERNALERROR that hides it.
# -n 2 --dist loadfile: two worker processes (the CI machine's two cores; most of a test's time is
# XLA compiling, one core each), each test module on one worker so its fixtures are built once;
# --no-loadscope-reorder: modules in collection order, which tests/conftest.py makes slowest first.
# Beside the suite, one after another (mostly one core): the H100 compile check (gpu-compile, below:
# its venv's download, then compiling), the docs site (docs) and the README's commands
# (readme-check), each into its log, printed after the tests; any of them failing fails `make
# test`, whose last line is pytest's summary line again (what CI reads).
TEST_WORKERS ?= 2
TEST_ARGS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
GPU_COMPILE_LOG ?= gpu-compile.log
DOCS_LOG ?= docs.log
README_LOG ?= readme-check.log
TEST_LOG ?= test.log
BESIDE := gpu-compile:$(GPU_COMPILE_LOG) docs:$(DOCS_LOG) readme-check:$(README_LOG)
# The H100 compile check beside the tests: every kernel case, each whole-step case for one model (the
# models in turn), into a file of its own; `make gpu-compile` compiles every step of every model into
# bench/results/gpu_compile/.
TEST_GPU_COMPILE_ARGS ?= --steps-in-turn --out gpu-compile.json
test: $(STAMP)
	@echo "beside the tests, in turn: make gpu-compile, docs and readme-check; their logs: $(GPU_COMPILE_LOG), $(DOCS_LOG), $(README_LOG)"
	@for job in $(BESIDE); do \
		$(MAKE) --no-print-directory -f $(firstword $(MAKEFILE_LIST)) GPU_COMPILE_ARGS="$(TEST_GPU_COMPILE_ARGS)" \
			$${job%%:*} > $${job#*:} 2>&1; \
		echo "$$?" > $${job#*:}.rc; \
	done & beside=$$!; \
	{ PYTHONNODEBUGRANGES=1 $(BIN)/python -m pytest $(TEST_ARGS); echo "$$?" > $(TEST_LOG).rc; } \
		2>&1 | tee $(TEST_LOG); \
	wait $$beside; failed=0; \
	for job in $(BESIDE); do log=$${job#*:}; rc=$$(cat $$log.rc); \
		echo "make $${job%%:*}: exit $$rc; the end of its log:"; tail -n 20 $$log; [ "$$rc" -eq 0 ] || failed=1; done; \
	tail -n 1 $(TEST_LOG); [ "$$(cat $(TEST_LOG).rc)" -eq 0 ] && [ "$$failed" -eq 0 ]

# Every benchmark, in turn (about two hours on a 2-core CPU); each writes bench/results/<benchmark>/*.json.
bench: $(STAMP)
	$(BIN)/python -m bench.speed_vs_transformers
	$(BIN)/python -m bench.perplexity
	$(BIN)/python -m bench.tier_bytes
	$(BIN)/python -m bench.kernels
	$(BIN)/python -m bench.convert_memory
	$(BIN)/python -m bench.convert_speed
	$(BIN)/python -m bench.quality
	$(BIN)/python -m bench.offload_decode
	$(BIN)/python -m bench.paper_headlines
	$(BIN)/python -m bench.overhead
	$(BIN)/python -m bench.host_work
	$(BIN)/python -m bench.policies
	$(BIN)/python -m bench.speculative
	$(BIN)/python -m bench.real_shapes
	$(BIN)/python -m bench.long_context

# On a lent GPU machine (no network, no venv: jax[cuda] and the rest preinstalled), from the tree:
# pytest -m gpu, bandwidths, resident and offloaded decode, then kernel timings until its 540 s budget runs out
# (a lent GPU's 15 minutes include its start; --budget-s); bench/results/gpu_suite/gpu_suite_<device>.json.
gpu:
	PYTHONPATH=. $(PYTHON) -m bench.gpu_suite

# The same suite at toy sizes on any machine (CPU: kernels in interpret mode), to check the suite itself.
gpu-dry-run: $(STAMP)
	PYTHONPATH=. $(BIN)/python -m bench.gpu_suite --dry-run

# The GPU kernels compiled for an H100 without a GPU (bench/gpu_compile.py): a venv of its own holding
# only the CUDA 13 plugin at the main venv's jax version, ptxas and NVVM (about 256 MB to download,
# 720 MB installed); jax, jaxlib and the project's dependencies it reads from the main venv (a .pth
# that adds the main venv's site-packages), as a second copy of them would cost another GB of disk
# beside the running tests. Registers, spills, shared memory, grids and decode-loop checks per
# kernel, and the offloaded decode step's checks (pinned-host stores, async host slices, one command
# buffer), to bench/results/gpu_compile/gpu_compile_h100.json. Fails on any spill, compile error or
# failed check. `make test` runs it beside the tests with each step case for one model
# (TEST_GPU_COMPILE_ARGS).
GPU_AOT_VENV ?= .venv-gpu-aot
GPU_AOT_STAMP := $(GPU_AOT_VENV)/.installed
# What a compile-only venv holds besides the project: $(call gpu_aot_wheels,JAX_VERSION)
gpu_aot_wheels = "jax==$(1)" "jaxlib==$(1)" "jax-cuda13-plugin==$(1)" "jax-cuda13-pjrt==$(1)" nvidia-cuda-nvcc nvidia-nvvm
SITE_PACKAGES = -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'

# The main venv's pip installs into it (--python), so it needs no pip of its own; pip sees the main
# venv's jax and jaxlib as installed and adds only what they lack.
$(GPU_AOT_STAMP): $(STAMP)
	rm -rf $(GPU_AOT_VENV)
	$(PYTHON) -m venv --without-pip $(GPU_AOT_VENV)
	echo "import site; site.addsitedir('$$($(BIN)/python $(SITE_PACKAGES))')" \
		> "$$($(GPU_AOT_VENV)/bin/python $(SITE_PACKAGES))/jmoe-main-venv.pth"
	v=$$($(BIN)/python -c 'import jax; print(jax.__version__)') && \
	$(BIN)/pip --python $(GPU_AOT_VENV)/bin/python install --quiet --no-compile --no-cache-dir $(call gpu_aot_wheels,$$v)
	touch $(GPU_AOT_STAMP)

gpu-compile: $(GPU_AOT_STAMP)
	PYTHONPATH=. JAX_PLATFORMS=cpu $(GPU_AOT_VENV)/bin/python -m bench.gpu_compile $(GPU_COMPILE_ARGS)

# The same against the GPU machines' versions (jax 0.11.2, CUDA 13): jaxlib 0.11 has no wheel for
# Python 3.11, so this needs a Python 3.12 (PYTHON312; with pyenv: PYENV_VERSION=3.12.1). Not part of
# `make test`. Writes bench/results/gpu_compile/gpu_compile_h100_jax0.11.2.json (its XLA dumps no PTX: no loop checks).
PYTHON312 ?= python3.12
GPU_AOT_NEXT_VENV ?= .venv-gpu-aot-jax0.11
$(GPU_AOT_NEXT_VENV)/.installed:
	$(PYTHON312) -m venv $(GPU_AOT_NEXT_VENV)
	$(GPU_AOT_NEXT_VENV)/bin/pip install --quiet $(call gpu_aot_wheels,0.11.2) -e .
	touch $@

gpu-compile-jax0.11: $(GPU_AOT_NEXT_VENV)/.installed
	PYTHONPATH=. JAX_PLATFORMS=cpu $(GPU_AOT_NEXT_VENV)/bin/python -m bench.gpu_compile \
		--out bench/results/gpu_compile/gpu_compile_h100_jax0.11.2.json

clean:
	rm -rf $(VENV) $(GPU_AOT_VENV) $(GPU_AOT_NEXT_VENV) out site .pytest_cache $(GPU_COMPILE_LOG) gpu-compile.json $(TEST_LOG) $(TEST_LOG).rc
