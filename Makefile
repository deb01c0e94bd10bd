# Each target sets itself up from nothing: a .venv with the project and its test extras.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo tour finetune test bench clean

$(STAMP): pyproject.toml setup.py $(wildcard fucina/runtime/*.c fucina/runtime/*.h)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.spirals --plot build/spirals.png

tour: $(STAMP)
	$(PY) -m examples.tour

finetune: $(STAMP)
	$(PY) -m fucina finetune

test: $(STAMP)
	$(PY) -m pytest -q -x tests

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf .venv build *.egg-info
