# Data Parallelism from Scratch: every command sets itself up.
#   make book   build the website, every notebook executed  -> _build/html/index.html
#   make test   lint, build the book strictly (-W: a cell that raises fails it), run every test
#   make lab    open the notebooks in JupyterLab
#   make browser-test  load every built page in headless Chromium, network closed (after make book)
# For instructors:
#   make student                          student website and notebooks, without solutions
#   make grade SUBMISSIONS=dir OUT=f.csv  execute submitted notebooks, write a score table
# Uses the active virtual environment if there is one, else creates .venv here.

PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
BIN := $(VENV)/bin
STAMP := $(VENV)/.dpcourse-installed
PYTEST_ARGS ?=

.PHONY: setup vendor book student grade test unit lint test-notebooks bench lab clean browser-test

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
	DPCOURSE_CHECKS_STRICT=1 $(BIN)/jupyter-book build . --all -W --keep-going || { \
	  echo "The book did not build: see the WARNINGs above (a failing cell's traceback is"; \
	  echo "printed there and saved under _build/html/reports/)."; exit 1; }
	@echo "Open _build/html/index.html in a browser."

# The student edition: sources in _build/student (its chapters/ are the hand-out notebooks),
# website in _build/student/_build/html. Unsolved exercises show "not attempted".
student: $(STAMP) vendor
	$(BIN)/python -m dpcourse.exercises student --out _build/student
	$(BIN)/jupyter-book build _build/student --all -W --keep-going
	@echo "Student website: _build/student/_build/html/index.html; notebooks: _build/student/chapters/"

SUBMISSIONS ?= submissions
OUT ?= scores.csv
grade: $(STAMP)
	$(BIN)/python -m dpcourse.exercises grade $(SUBMISSIONS) --out $(OUT)

lint: $(STAMP)
	$(BIN)/ruff check src tests chapters

unit: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The full check, as CI runs it: the built site is then tested too (tests/test_site.py).
test: lint book student
	DPCOURSE_REQUIRE_SITE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# Each notebook as a test of its own, cell by cell (the book build already runs them all).
test-notebooks: $(STAMP)
	$(BIN)/python -m pytest --nbval-lax chapters $(PYTEST_ARGS)

# The website in a real browser (tests/test_browser.py) and its internal links (tests/test_links.py).
browser-test: $(STAMP)
	$(BIN)/python -m pytest tests/test_browser.py tests/test_links.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m dpcourse.bench launch

lab: $(STAMP)
	$(BIN)/jupyter lab chapters/

clean:
	rm -rf _build .pytest_cache
