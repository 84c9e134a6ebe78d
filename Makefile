# Data Parallelism from Scratch: every command sets itself up.
#   make book   build the website, every notebook executed  -> _build/html/index.html
#   make test   lint; every notebook run once under nbval, the website and the student website
#               rendered from that run (-W); the unit tests and the tests of the built sites
#   make lab    open the notebooks in JupyterLab
#   make browser-test  load every built page in headless Chromium, network closed (after make book)
#   make gpu-check     on a machine with GPUs: GPU tests, the notebooks on CUDA, GPU benchmarks
#   make audit  the notebooks again under the device audit: on this CPU, as on GPU machines
#   make audit-quick  one pass, each notebook on one machine (CI)
#   make audit-unit  the unit tests under the device audit, likewise
#   make faults      faults injected into the emulated cluster, repeated and timed (as root)
# For instructors:
#   make student                          student website and notebooks, without solutions
#   make grade CHAPTER=7                  grade the notebooks in submissions/ (SUBMISSIONS=): scores,
#              totals and a feedback page per student in grades/ (GRADES=), which git ignores;
#              STUDENT=alice regrades one student
#   make autograder CHAPTER=7             a Gradescope autograder for chapter 7: grades/autograder.zip
# Uses the active virtual environment if there is one, else creates .venv here.

PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
BIN := $(VENV)/bin
STAMP := $(VENV)/.dpcourse-installed
PYTEST_ARGS ?=
# The unit tests run on two workers: rank processes wait on each other often enough that a
# second test process fills the gaps, even on two cores. Set JOBS=0 to run them in one process.
# Each test file runs on one worker (loadfile), so that a module-scoped fixture (the trainer's
# runs of every strategy) is computed once. (loadgroup would not do: with pytest 9, pytest-xdist
# 3.8 cannot tag the items of a group, and it silently schedules them one by one.)
JOBS ?= 2
XDIST = $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)
# Every notebook under nbval, each cell a test with a time limit (seconds). Each notebook's
# run_ranks calls keep their ranks for the next call of the same size (DPCOURSE_KEEP_RANKS, up
# to 8 sizes), although ranks forked from the kernel's fork server start in about 0.1 s.
CELL_TIMEOUT ?= 600
NBVAL = --nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT) --timeout=0 --durations=20
# Two notebooks at a time (NOTEBOOK_JOBS=0: one): a kernel alone leaves a core idle a third of
# the time (ranks waiting on each other, cells waiting on the emulated cluster's slow links);
# on the 2-core CI machine all notebooks took 302 s one at a time and 271 s two at a time.
NOTEBOOK_JOBS ?= 2
NBXDIST = $(if $(filter 0,$(NOTEBOOK_JOBS)),,-n $(NOTEBOOK_JOBS) --dist loadfile)
# One OpenMP thread per test process (kernel, test worker): two processes that each start as
# many threads as there are cores fight over them. Chapter 1 uses torch's default threads, and
# next to another notebook its Transformer cell took 95 s instead of 9 s. Measured on the 2-core
# CI machine: all notebooks 300 s -> 252 s, the unit tests 395 s -> 332 s. Rank processes set
# their own threads (dpcourse.harness.launch); THREADS= (empty) leaves torch's default.
THREADS ?= 1
OMP = $(if $(THREADS),OMP_NUM_THREADS=$(THREADS) MKL_NUM_THREADS=$(THREADS),)
# The kernels that execute the notebooks for the website record each figure's smallest text in its
# PNG (tools/notebook_startup.py), for the browser test's check of the text's size on the page.
STARTUP = PYTHONSTARTUP=$(CURDIR)/tools/notebook_startup.py
# This machine sets PYTHONDONTWRITEBYTECODE=1: every new interpreter (a kernel, a fork server, a
# torchrun worker, a test's subprocess) would compile the course's modules again, 0.7 s each for
# dpcourse's main modules here, and a run starts a few hundred. An empty value lets Python cache
# them in __pycache__ (git-ignored), as it does by default.
export PYTHONDONTWRITEBYTECODE :=
# Where `make notebooks` keeps each notebook as it ran (the websites are rendered from these).
EXECUTED := _build/executed

.PHONY: setup vendor book notebooks site student grade autograder test unit lint test-notebooks bench lab \
	clean browser-test gpu-check audit audit-quick audit-unit faults

# Not --no-compile: it saves half a minute of install, but this machine sets
# PYTHONDONTWRITEBYTECODE=1, so modules pip did not compile would be compiled again by every
# process that imports them (the notebooks took 405 s instead of about 185 in a CI run).
$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	@touch $(STAMP)

setup: $(STAMP)

# MathJax and the widget scripts, from the npm registry into the git-ignored _vendor/static/
# (reused when present), so that the website needs no network when it is read.
vendor:
	@bash tools/vendor_assets.sh

book: $(STAMP) vendor
	@rm -rf _build/html/reports
	$(STARTUP) DPCOURSE_CHECKS_STRICT=1 $(BIN)/jupyter-book build . --all -W --keep-going || { \
	  echo "The book did not build: see the WARNINGs above (a failing cell's traceback is"; \
	  echo "printed there and saved under _build/html/reports/)."; exit 1; }
	@echo "Open _build/html/index.html in a browser."

# Every chapter notebook as a test, cell by cell (nbval), run once; each is kept with its
# outputs in _build/executed/, and a notebook whose cells raised gets a .err.log beside it.
notebooks: $(STAMP)
	@rm -rf $(EXECUTED)
	$(OMP) $(STARTUP) DPCOURSE_CHECKS_STRICT=1 DPCOURSE_KEEP_RANKS=8 $(BIN)/python -m pytest chapters \
	  $(NBVAL) $(NBXDIST) --executed-dir=$(EXECUTED) $(PYTEST_ARGS)
test-notebooks: notebooks

$(EXECUTED)/chapters: $(wildcard chapters/*.ipynb) $(shell find src -name '*.py')
	$(MAKE) --no-print-directory notebooks

# The website (_build/html) and the student website rendered from the executed notebooks,
# without running a cell again. A notebook whose cells raised shows the traceback on its page,
# and its report is copied to _build/html/reports/. The two builds run side by side (each
# uses one core); the student build's log follows the other's.
site: $(STAMP) vendor
	@rm -rf _build/html/reports
	$(BIN)/python -m dpcourse.harness.exercises edition --executed $(EXECUTED) --out _build/full
	@status=0; \
	$(MAKE) --no-print-directory student-site > _build/student-site.log 2>&1 & student=$$!; \
	$(BIN)/jupyter-book build _build/full --path-output . --all -W --keep-going || status=1; \
	wait $$student || status=1; \
	echo "--- the student website's build:"; cat _build/student-site.log; \
	for log in $$(cd $(EXECUTED) && find . -name '*.err.log'); do \
	  mkdir -p _build/html/reports/$$(dirname $$log); cp $(EXECUTED)/$$log _build/html/reports/$$log; \
	  echo "A cell raised: see _build/html/reports/$$log"; status=1; done; \
	exit $$status

# The student edition: hand-out notebooks without outputs in _build/student/chapters/, and its
# website in _build/student/_build/html, rendered from the executed notebooks (solutions and
# their outputs removed; the checks of the stubs say "not attempted").
student-site: $(STAMP)
	$(BIN)/python -m dpcourse.harness.exercises student --out _build/student
	$(BIN)/python -m dpcourse.harness.exercises student --executed $(EXECUTED) --out _build/student-executed
	$(BIN)/jupyter-book build _build/student-executed --path-output _build/student --all -W \
	  --keep-going
	@echo "Student website: _build/student/_build/html/index.html; notebooks: _build/student/chapters/"

student: $(STAMP) vendor $(EXECUTED)/chapters
	$(MAKE) --no-print-directory student-site

# The instructor guide's "Grading" says more (the assignment, points, students' names, Gradescope).
SUBMISSIONS ?= submissions
GRADES ?= grades
CHAPTER ?=
STUDENT ?=
grade: $(STAMP)
	$(BIN)/python -m dpcourse.harness.exercises grade $(SUBMISSIONS) --out $(GRADES) \
	  $(if $(CHAPTER),--chapter $(CHAPTER)) $(if $(STUDENT),--only $(STUDENT))

autograder: $(STAMP)
	$(BIN)/python -m dpcourse.harness.exercises autograder --chapter $(CHAPTER) \
	  --out $(GRADES)/autograder.zip

lint: $(STAMP)
	$(BIN)/ruff check src tests chapters
	$(BIN)/lint-imports --no-cache

unit: $(STAMP)
	$(OMP) $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The full check, as CI runs it. It goes on after a failing step, so that one run reports
# every failure (a cell that raised also shows on its page), then fails if any step did.
test: $(STAMP) vendor
	@failed=""; times=""; t=$$(date +%s); \
	lap() { now=$$(date +%s); times="$$times $$1 $$((now - t)) s,"; t=$$now; }; \
	$(MAKE) --no-print-directory lint || failed="$$failed lint"; lap lint; \
	$(MAKE) --no-print-directory notebooks || failed="$$failed notebooks"; lap notebooks; \
	$(MAKE) --no-print-directory site || failed="$$failed site"; lap "websites"; \
	$(OMP) DPCOURSE_REQUIRE_SITE=1 $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS) \
	  || failed="$$failed tests"; lap "tests"; \
	echo "make test took:$${times%,}"; \
	if [ -n "$$failed" ]; then echo "make test failed:$$failed"; exit 1; fi

# The website in a real browser (tests/test_browser.py) and its internal links (tests/test_links.py).
browser-test: $(STAMP)
	$(BIN)/python -m pytest tests/test_browser.py tests/test_links.py $(PYTEST_ARGS)

# On a machine with GPUs: the GPU tests, every notebook on CUDA and the GPU benchmarks, with logs
# and a summary, in benchmarks/<gpu-name>-<count>/ (tools/gpu_check.sh says what, how long, and
# its settings); without a GPU it says so and fails. Where the virtual environment exists it is
# kept up to date and used; where it does not, the machine's own python3 and its torch (2.11 to
# 2.13, as on a GPU image with no network), with what it lacks from a folder of wheels (WHEELS=,
# default .gpu/whl): nothing is installed from the network.
gpu-check: $(if $(wildcard $(BIN)/python),$(STAMP))
	BIN=$(BIN) bash tools/gpu_check.sh

# The notebooks under the device audit (dpcourse.harness.device_audit): on this CPU, the notebook and its
# ranks put their tensors where a machine with GPUs would, and a cell fails where that machine
# would (a batch left on the host, a host tensor in an NCCL collective, a GPU tensor in gloo's
# send). Once per machine of AUDIT_MACHINES: a GPU per rank (NCCL) runs every notebook; one GPU
# shared by the ranks (gloo with GPU tensors; a lone rank gets NCCL) and two GPUs (Kaggle's T4 x2:
# NCCL for 2 ranks, gloo for more) run the notebooks that start ranks (chapters 1-4 run in the
# kernel alone, the same on each). The executed copies are not kept: the websites come from
# `make test`'s run, whose timings the audit's bookkeeping would distort (a Transformer step:
# 6.9 -> 12.1 ms). Not part of `make test`, which runs each notebook once; CI (.ci/run) runs it
# after make test. tests/test_device_audit.py (in `make test`) checks the audit itself.
AUDIT_MACHINES ?= gpu-per-rank one-gpu two-gpus
# The device audit's sitecustomize: on PYTHONPATH, it starts the audit in every Python process the
# audit's runs start (the notebooks' kernels, fork servers, torchrun's workers), where
# DPCOURSE_DEVICE_AUDIT asks for it; lesson code never imports the audit.
AUDIT_SITE := PYTHONPATH=$(CURDIR)/src/dpcourse/harness/device_audit/site$${PYTHONPATH:+:$$PYTHONPATH}
RANK_NOTEBOOKS := $(shell grep -l 'run_ranks\|RankPool\|run_torchrun\|bug_hunt' chapters/*.ipynb)
AUDIT_NOTEBOOKS_gpu-per-rank := chapters
AUDIT_NOTEBOOKS_one-gpu := $(RANK_NOTEBOOKS)
# Two GPUs: the chapters whose 2-rank cells get NCCL there and whose larger runs share the GPUs
# over gloo (chapter 11's 2 x 2 meshes: 29 cells passed in 39 s here).
AUDIT_NOTEBOOKS_two-gpus ?= chapters/05_collectives.ipynb chapters/07_ddp.ipynb \
	chapters/09_sharded_optimizers.ipynb chapters/11_sharding_at_scale.ipynb
audit: $(STAMP)
	@failed=""; for machine in $(AUDIT_MACHINES); do \
	  case $$machine in \
	    gpu-per-rank) notebooks="$(AUDIT_NOTEBOOKS_gpu-per-rank)";; \
	    one-gpu) notebooks="$(AUDIT_NOTEBOOKS_one-gpu)";; \
	    two-gpus) notebooks="$(AUDIT_NOTEBOOKS_two-gpus)";; \
	    *) echo "AUDIT_MACHINES: no machine $$machine (gpu-per-rank, one-gpu, two-gpus)"; exit 2;; \
	  esac; \
	  echo "== the device audit, modelling $$machine: $$notebooks"; t=$$(date +%s); \
	  $(OMP) $(AUDIT_SITE) DPCOURSE_DEVICE_AUDIT=$$machine DPCOURSE_CHECKS_STRICT=1 DPCOURSE_KEEP_RANKS=8 \
	    $(BIN)/python -m pytest $$notebooks $(NBVAL) $(NBXDIST) -p no:cacheprovider $(PYTEST_ARGS) \
	    || failed="$$failed $$machine"; \
	  echo "== $$machine took $$(( $$(date +%s) - t )) s"; \
	done; \
	if [ -n "$$failed" ]; then echo "make audit failed on:$$failed"; exit 1; fi

# One pass of the notebooks under the audit, each notebook on one machine (AUDIT_PLAN; the others
# on a GPU per rank), in the time of one run: what CI runs, within its budget. Chapters 5, 7 and
# 9 on two GPUs (NCCL for their 2-rank cells, gloo on shared GPUs for 3 ranks and more), the lab
# and the bug hunt on one GPU; `make audit` runs every machine on every notebook it concerns.
# Without emulated clusters (DPCOURSE_NO_CLUSTER=1: their cells show the recorded runs): the
# audit's bookkeeping slows the steps whose times those cells check (chapter 7's slow link).
# AUDIT_QUICK_NOTEBOOKS: the notebooks that the first GPU run (one H200, 2026-11-26) found
# failing and that the audit models a machine for beyond a GPU per rank: chapters 5, 7 and 9 on
# two GPUs, the lab on one. Chapters 6 and 8 failed there too (ex-6-ring's send of GPU tensors
# over gloo, chapter 8's resume of a checkpoint loaded onto the GPU): tests/test_device_audit.py
# keeps both failing on the CPU as unit tests, the third GPU run (commit 2314378) passed every
# notebook, and `make audit` runs them. Leaving them out of CI saves it about 45 s; the other
# notebooks, left out before, save about 90 s (chapter 1's and chapter 10's training loops run
# twice as slowly under the audit's bookkeeping), in a run over its 12 minutes.
AUDIT_PLAN ?= 05_collectives=two-gpus 07_ddp=two-gpus 09_sharded_optimizers=two-gpus \
	diagnosis_lab=one-gpu bug_hunt=one-gpu
AUDIT_QUICK_NOTEBOOKS ?= chapters/05_collectives.ipynb chapters/07_ddp.ipynb \
	chapters/09_sharded_optimizers.ipynb chapters/diagnosis_lab.ipynb
audit-quick: $(STAMP)
	$(OMP) $(AUDIT_SITE) DPCOURSE_DEVICE_AUDIT=gpu-per-rank DPCOURSE_AUDIT_PLAN="$(AUDIT_PLAN)" \
	  DPCOURSE_NO_CLUSTER=1 DPCOURSE_CHECKS_STRICT=1 DPCOURSE_KEEP_RANKS=8 $(BIN)/python -m pytest \
	  $(AUDIT_QUICK_NOTEBOOKS) $(NBVAL) $(NBXDIST) -p no:cacheprovider $(PYTEST_ARGS)

# The unit tests under the device audit, once per machine of AUDIT_MACHINES: the tests' own rank
# code puts its tensors where each machine would (on this 2-core machine the whole suite takes
# about 4 minutes per machine; AUDIT_TESTS= picks files). Not in CI, whose 12 minutes the
# notebooks' audit and tests/test_device_audit.py fill; run it after changing a test's rank code.
AUDIT_TESTS ?= tests
audit-unit: $(STAMP)
	@failed=""; for machine in $(AUDIT_MACHINES); do \
	  echo "== the unit tests under the device audit, modelling $$machine"; \
	  $(OMP) $(AUDIT_SITE) DPCOURSE_DEVICE_AUDIT=$$machine $(BIN)/python -m pytest $(AUDIT_TESTS) $(XDIST) \
	    -p no:cacheprovider $(PYTEST_ARGS) || failed="$$failed $$machine"; \
	done; \
	if [ -n "$$failed" ]; then echo "make audit-unit failed on:$$failed"; exit 1; fi

bench: $(STAMP)
	$(BIN)/python -m dpcourse.harness.bench launch

# Issue 32's faults on the emulated cluster, out of CI (as root; about 12 minutes here): the cut
# link 20 times on 2 and 3 nodes (each run on a fresh cluster: the error within the collective
# timeout, the node and the collective named, nothing left behind), the killed node 20 times,
# a link restored within the timeout, a straggler node against the model; then torchrun agents
# on two emulated nodes surviving a killed node, a cut link and (--nnodes=1:2) a lost node,
# recorded, and the same three as tests (tests/test_elastic.py, which `make test` skips).
# Records in FAULTS_JSON and ELASTIC_JSON, which chapter 8 shows where it cannot build the
# cluster.
FAULTS_JSON ?= benchmarks/cpu-2core/faults.json
ELASTIC_JSON ?= benchmarks/cpu-2core/elastic.json
faults: $(STAMP)
	$(OMP) $(BIN)/python -m dpcourse.harness.bench faults --repeats 20 --json $(FAULTS_JSON)
	$(OMP) $(BIN)/python -m dpcourse.harness.bench elastic --json $(ELASTIC_JSON)
	$(OMP) DPCOURSE_LONG_TESTS=1 $(BIN)/python -m pytest -p no:cacheprovider tests/test_elastic.py \
	  $(PYTEST_ARGS)

lab: $(STAMP)
	$(BIN)/jupyter lab chapters/

clean:
	rm -rf _build .pytest_cache
