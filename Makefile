# onceq: `make run` (the demo on embedded SQLite) and `make test` (every test).
# Every tool the build needs is installed from here.

CARGO        ?= cargo
GUEST_TARGET := wasm32-wasip2
GUEST_DIR    := guest-examples
GUEST_OUT    := $(GUEST_DIR)/target/$(GUEST_TARGET)/release
ONCEQ        := target/release/onceq
# Tests build with Cargo's bench profile: release (same compiled
# dependencies, in target/release) with onceq's own crate at opt-level 1
# (Cargo.toml says why). Benchmarks and the demo use the release profile.
TEST_PROFILE := --profile bench
PYTHON       ?= python3
PY_TOOLS     := tools/python
COMPONENTIZE_PY_VERSION := 0.25.1
COMPONENTIZE_PY := $(PY_TOOLS)/bin/componentize-py
# The type checker scaffolded Python projects pin (tests/cli.rs runs it).
MYPY_VERSION := 1.18.2
MYPY         := $(PY_TOOLS)/bin/mypy
PY_OUT       := $(GUEST_DIR)/target/python
PY_GUESTS    := payments inventory fixtures/sdk
NPM          ?= npm
JS_DIR       := $(GUEST_DIR)/js
COMPONENTIZE_JS := $(JS_DIR)/node_modules/.bin/componentize-js
JS_OUT       := $(GUEST_DIR)/target/js
JS_GUESTS    := payments inventory fixtures/sdk
# The book (docs/): mdBook, pinned, installed into tools/mdbook by `make docs`.
MDBOOK_VERSION := 0.4.52
MDBOOK       := tools/mdbook/bin/mdbook

.PHONY: all tools browser screenshots trace-picture guests guests-python guests-js build install run run-spanner test test-build chaos bench sim docs lint fmt clean emulator

all: build guests

## tools: install the Wasm target the guests build for
tools:
	@rustup target list --installed | grep -qx $(GUEST_TARGET) || rustup target add $(GUEST_TARGET)

## browser: headless Chromium and its WebDriver for the console's browser
## tests (Debian's chromium and chromium-driver), installed when missing
browser:
	@command -v chromedriver >/dev/null && command -v chromium >/dev/null || { \
		echo "== installing chromium and chromium-driver (the console's browser tests)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver; }

## screenshots: the console's pages as the browser test saw them, into the docs
screenshots: browser guests
	$(CARGO) test $(TEST_PROFILE) --test integration -- console::
	mkdir -p docs/src/console
	cp target/console-screenshots/*.png docs/src/console/

## trace-picture: one message's trace as the telemetry test received it,
## into the docs
trace-picture: guests
	$(CARGO) test $(TEST_PROFILE) --test integration -- telemetry::one_trace
	mkdir -p docs/src/tracing
	cp target/telemetry/trace.svg docs/src/tracing/

## guests: build the guest SDK, the examples and the test fixtures (own
## workspace), the Python examples when python3 is present and the
## JavaScript examples when npm is present
guests: tools
	cd $(GUEST_DIR) && $(CARGO) build --release --target $(GUEST_TARGET)
	@if command -v $(PYTHON) >/dev/null 2>&1; then $(MAKE) --no-print-directory guests-python; \
	 else echo "python3 not found: skipping the Python guests"; fi
	@if command -v $(NPM) >/dev/null 2>&1; then $(MAKE) --no-print-directory guests-js; \
	 else echo "npm not found: skipping the JavaScript guests"; fi

## guests-python: componentize-py (pinned, in tools/python) builds the Python
## examples; mypy (pinned, same place) type-checks scaffolded projects in tests
guests-python: $(PY_GUESTS:%=$(PY_OUT)/%.wasm) $(MYPY)

## guests-js: componentize-js (pinned in guest-examples/js/package-lock.json,
## installed there by npm ci, with TypeScript for the type check) builds the
## JavaScript examples. Only the
## deterministic WASI stays imported (clocks, random, stderr): stdio (which
## brings the filesystem) and http are disabled.
guests-js: $(JS_OUT)/.typechecked $(JS_GUESTS:%=$(JS_OUT)/%.wasm)

# The examples type-check against the SDK's declarations (onceq-guest.d.ts).
$(JS_OUT)/.typechecked: $(JS_DIR)/tsconfig.json $(JS_DIR)/onceq-guest.d.ts $(JS_DIR)/payments/app.js $(JS_DIR)/inventory/app.js | $(COMPONENTIZE_JS)
	cd $(JS_DIR) && node_modules/.bin/tsc -p tsconfig.json
	@mkdir -p $(JS_OUT) && touch $@

$(COMPONENTIZE_JS): $(JS_DIR)/package.json $(JS_DIR)/package-lock.json
	cd $(JS_DIR) && $(NPM) ci --no-audit --no-fund --loglevel=error
	@touch $@

$(JS_OUT)/%.wasm: $(JS_DIR)/%/app.js $(JS_DIR)/onceq-guest.js wit/handler.wit | $(COMPONENTIZE_JS)
	@mkdir -p $(dir $@)
	$(COMPONENTIZE_JS) $< --wit wit -n queue-handler -d stdio http fetch-event -o $@

$(COMPONENTIZE_PY):
	$(PYTHON) -m venv $(PY_TOOLS)
	$(PY_TOOLS)/bin/pip install --quiet componentize-py==$(COMPONENTIZE_PY_VERSION)

$(MYPY): | $(COMPONENTIZE_PY)
	$(PY_TOOLS)/bin/pip install --quiet mypy==$(MYPY_VERSION)

$(PY_OUT)/%.wasm: $(GUEST_DIR)/python/%/app.py $(GUEST_DIR)/python/onceq_guest.py wit/handler.wit | $(COMPONENTIZE_PY)
	@mkdir -p $(dir $@)
	$(COMPONENTIZE_PY) -d wit -w queue-handler componentize app \
		-p $(GUEST_DIR)/python/$* -p $(GUEST_DIR)/python --stub-wasi -o $@

## build: the host (release; tests and benchmarks share these artifacts)
build:
	$(CARGO) build --release

## install: the onceq CLI into cargo's bin folder (~/.cargo/bin, on PATH
## with rustup), for handler projects anywhere (`onceq new`, `onceq test`)
install:
	$(CARGO) install --locked --path host --bin onceq

## run: the demo: fresh SQLite database, example handlers, 10,000 messages, summary;
## it prints the console's URL (STAY=1: processing waits 10 s for you to open it,
## and it stays open after the summary; MESSAGES=N for a longer run)
run: guests build
	$(ONCEQ) demo --guests $(GUEST_OUT) $(if $(STAY),--stay) $(if $(MESSAGES),--messages $(MESSAGES))

## run-spanner: the same demo on a Spanner emulator (started and stopped here)
run-spanner: guests build
	tests/with-spanner-emulator.sh $(ONCEQ) demo --guests $(GUEST_OUT) --dir .onceq/demo-spanner \
		--store spanner://projects/onceq/instances/demo/databases/demo --messages $${MESSAGES:-1000}

## test: every test: real SQLite files, built components, and a Cloud Spanner
## emulator started on free ports and stopped by pid (tests/with-spanner-emulator.sh)
test:
	@# The guests (wasm, componentize-js/py) and the host's test build share
	@# nothing: built side by side, then every test runs.
	$(MAKE) --no-print-directory -j2 guests test-build browser
	tests/with-spanner-emulator.sh $(CARGO) test $(TEST_PROFILE) --workspace
	@echo "== exactly-once and outbox again with every message committed alone (commit.max_batch = 1)"
	ONCEQ_TEST_MAX_BATCH=1 $(CARGO) test $(TEST_PROFILE) --test integration -- exactly_once:: outbox::
	@echo "== again on an emulator that aborts commits at random (--enable_fault_injection)"
	SPANNER_EMULATOR_ARGS=--enable_fault_injection tests/with-spanner-emulator.sh \
		$(CARGO) test $(TEST_PROFILE) --test integration -- spanner::spanner_payments_exactly_once spanner::spanner_lease_and_ack spanner::spanner_writes_scans_and_atomicity

## test-build: the host and every test binary, built but not run
test-build:
	$(CARGO) test $(TEST_PROFILE) --workspace --no-run

## chaos: the long chaos runs (tests/chaos.rs): on SQLite 100,000 messages,
## hosts SIGKILLed at random for two minutes; on the Spanner emulator 1,000
## messages, hosts behind fault proxies and SIGKILLed for two minutes; then
## drained and audited from the database; `make test` runs short ones
chaos: guests
	ONCEQ_CHAOS_MESSAGES=$${ONCEQ_CHAOS_MESSAGES:-100000} ONCEQ_CHAOS_SECONDS=$${ONCEQ_CHAOS_SECONDS:-120} \
	ONCEQ_CHAOS_SPANNER_MESSAGES=$${ONCEQ_CHAOS_SPANNER_MESSAGES:-1000} ONCEQ_CHAOS_SPANNER_SECONDS=$${ONCEQ_CHAOS_SPANNER_SECONDS:-120} \
		tests/with-spanner-emulator.sh $(CARGO) test $(TEST_PROFILE) --test integration -- chaos:: --nocapture --test-threads 1

## bench: throughput and latency, Wasm vs native vs raw SQLite, in one run
bench: guests
	tests/with-spanner-emulator.sh $(CARGO) bench --profile release --bench pipeline

## sim: onceq on Cloud Spanner at scale, simulated (sim/, CPU only, seconds):
## the tables docs/src/spanner.md quotes, and their chart
sim:
	$(CARGO) run --release -p onceq-sim -- docs/src/bench/scale.svg

## docs: the book (docs/, mdBook) into docs/book; open docs/book/index.html.
## `make test` checks its links, configuration keys and commands (tests/docs.rs)
docs: $(MDBOOK)
	$(MDBOOK) build docs
	@echo "the book: docs/book/index.html"

$(MDBOOK):
	$(CARGO) install mdbook --locked --version $(MDBOOK_VERSION) --no-default-features --root tools/mdbook

## lint: clippy (unwrap/expect/panic denied outside tests) and rustfmt
lint:
	$(CARGO) fmt --check
	cd $(GUEST_DIR) && $(CARGO) fmt --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	cd $(GUEST_DIR) && $(CARGO) clippy --release --target $(GUEST_TARGET) -- -D warnings

## emulator: a shell with a Spanner emulator running (SPANNER_EMULATOR_HOST set)
emulator:
	tests/with-spanner-emulator.sh $${SHELL:-bash}

fmt:
	$(CARGO) fmt --all
	cd $(GUEST_DIR) && $(CARGO) fmt --all

clean:
	$(CARGO) clean
	cd $(GUEST_DIR) && $(CARGO) clean
	rm -rf .onceq
