PY ?= .venv/bin/python
PIP ?= .venv/bin/pip

.PHONY: install test lint format tiny smollm2 demo demo-real demo-real-long clean

install: .venv/.installed

.venv/.installed: requirements.txt constraints.txt requirements-nodeps.txt setup.py
	python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dflash2 needs Python >= 3.11 (python3 is " + sys.version.split()[0] + ")")'
	python3 -m venv .venv
	$(PIP) install -q -r requirements.txt -c constraints.txt
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --no-deps -e .
	touch $@

# Two pytest workers, each taking whole test files (so a file's module fixtures run once): most tests
# launch one or two single-threaded processes, so one after another they kept 1.2 of 2 cores busy.
# More cores: make test TEST_WORKERS=4. The 20 slowest tests are listed at the end (the suite's budget).
# A worker that dies is not replaced (--max-worker-restart=0): the run ends at once, naming the test
# it died in. pytest-xdist 3.8.0 replaces it otherwise, and under --dist loadfile the replacement can
# wait forever for work at the end of the run (a CI run hung that way until its 90-minute limit).
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --durations=20 tests

tiny: install
	$(PY) data_prep/build_tiny_default.py --out artifacts/tiny

smollm2: install
	$(PY) data_prep/build_smollm2.py --out artifacts/smollm2

demo: install
	$(PY) launch/demo.py

demo-real: smollm2
	$(PY) launch/demo_real.py

# the longer budget (docs/real-target.md, "The longer budget end to end"): 1500 replies, 3-layer drafts, 2500 steps
demo-real-long: smollm2
	$(PY) launch/demo_real.py --out runs/demo-real-long --regen-samples 1500 --draft-layers 3 --steps 2500

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf runs artifacts .pytest_cache
