//! `onceq new`: a ready handler project in Rust, JavaScript or Python,
//! buildable, checkable and runnable in a few commands.
//!
//! Every project is the same counter (a read-modify-write of one row per
//! event key) with its schema, an `onceq.toml`, a sample message, test
//! cases for `onceq test` (`NAME.test.toml`, run by the language's own test
//! command) and a README. Every project carries its SDK and the WIT, copied
//! from this build of onceq, so it is self-contained: it builds wherever it
//! is moved or cloned (Rust: the `onceq-guest` crate in `onceq-guest/`, or
//! the crate at `--sdk` by path for work on the SDK itself).

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

/// Languages `onceq new` can scaffold (`--lang`).
pub const LANGUAGES: &[&str] = &["rust", "js", "python"];

/// The one WIT, as the host reads it.
const WIT: &str = include_str!("../../wit/handler.wit");
const JS_SDK: &str = include_str!("../../guest-examples/js/onceq-guest.js");
/// `npm run build`: componentize-js, run only when an input changed.
const JS_BUILD: &str = include_str!("../../guest-examples/js/build.mjs");
const JS_SDK_TYPES: &str = include_str!("../../guest-examples/js/onceq-guest.d.ts");
const JS_TSCONFIG: &str = r#"{
  "compilerOptions": {
    "allowJs": true,
    "checkJs": true,
    "noEmit": true,
    "strict": true,
    "target": "es2022",
    "module": "es2022",
    "moduleResolution": "bundler",
    "lib": ["es2022"],
    "types": []
  },
  "files": ["src/app.js", "src/schema.d.ts"]
}
"#;
const PY_SDK: &str = include_str!("../../guest-examples/python/onceq_guest.py");
/// The Rust SDK's source, copied into a project as its `onceq-guest` crate
/// (reading the project's `wit/` instead of onceq's).
const RUST_SDK: &str = include_str!("../../guest-examples/sdk/src/lib.rs");
const RUST_SDK_WIT_PATH: &str = "path: \"../../wit\"";
const RUST_SDK_CARGO_TOML: &str = r#"# The onceq guest SDK, copied here by `onceq new` (a newer onceq writes a
# newer copy). It reads the handler contract from ../wit/handler.wit.
[package]
name = "onceq-guest"
version = "0.1.0"
edition = "2021"
publish = false

[dependencies]
wit-bindgen = "0.61"
serde = { version = "1", features = ["derive"] }
serde_json = "1"
"#;

/// A language's project: what `onceq new` wrote, and how to build it.
#[derive(Debug)]
pub struct Project {
    pub dir: PathBuf,
    pub lang: &'static str,
    /// The built component, relative to `dir`.
    pub component: String,
    /// The commands that build it, run in `dir`.
    pub build: &'static [&'static str],
}

const CARGO_TOML: &str = r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2021"
publish = false

# A handler is its own project, not part of an enclosing workspace.
[workspace]

[lib]
crate-type = ["cdylib"]

# The handler is built for wasm32-wasip2 only. On this machine (`cargo
# test`, which runs tests/handler.rs) the crate is empty and these are not
# compiled: the first test compiles them once, for wasm.
[target.'cfg(target_arch = "wasm32")'.dependencies]
onceq-guest = { path = "{sdk}" }
serde = { version = "1", features = ["derive"] }
serde_json = "1"

[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
strip = true
panic = "abort"
"#;

const CARGO_CONFIG: &str = r#"# Handlers are WebAssembly components: `cargo build --release --target
# wasm32-wasip2` builds one (`cargo handler` for short). `cargo test` runs on
# this machine and tests the built component with `onceq test`.
[alias]
handler = "build --release --target wasm32-wasip2"

# A small shadow stack: less memory to map per fresh instance.
[target.wasm32-wasip2]
rustflags = ["-C", "link-arg=-zstack-size=65536"]
"#;

/// The crate compiles for wasm32-wasip2 only: rust-analyzer analyses it there.
const RUST_EDITOR: &str = r#"{
  "rust-analyzer.cargo.target": "wasm32-wasip2"
}
"#;

const RUST_TEST: &str = r#"//! `cargo test`: builds the component (`cargo handler`) and runs the test
//! cases in {file}.test.toml against it with `onceq test` (on PATH, or at
//! $ONCEQ), which gives the verdicts of a real run without a database.

use std::process::Command;

#[test]
fn handler_test_cases() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Command::new(cargo)
        .current_dir(dir)
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .status()
        .expect("running cargo build");
    assert!(built.success(), "building the component failed");
    let onceq = std::env::var("ONCEQ").unwrap_or_else(|_| "onceq".into());
    let status = Command::new(&onceq)
        .current_dir(dir)
        .arg("test")
        .status()
        .unwrap_or_else(|e| panic!("running {onceq}: {e} (install onceq: see its README, or set ONCEQ)"));
    assert!(status.success(), "onceq test: some cases failed (its report is above)");
}
"#;

const TEST_CASES: &str = r#"# Test cases for the {name} handler. `onceq test` runs each one against the
# built component ({component}) with the grants of onceq.toml and the
# tables of schema.sql, and gives the verdict a real run would; nothing
# needs a database. A case: fixture rows (rows.TABLE), a message, and what
# should come of it: expect = ok (default) | retry | reject | failed |
# invalid-effects, part of the reason, and the writes, follow-ups
# (enqueued) and intents expected. Each expected effect matches on the
# fields it gives; `exact = true` also refuses effects not listed.
queue = "{name}"

[[case]]
name = "counts a new key from zero"
message = { key = "signup" }
writes = [{ table = "counters", op = "upsert", row = { key = "signup", count = 1, updated_at = "2026-01-01T00:00:00Z" } }]

[[case]]
name = "adds to an existing count"
rows.counters = [{ key = "signup", count = 41 }]
message = { key = "signup", by = 1 }
writes = [{ table = "counters", row = { key = "signup", count = 42 } }]
exact = true

[[case]]
name = "refuses a step that is not positive"
message = { key = "signup", by = 0 }
expect = "reject"
reason = "by must be positive"

[[case]]
name = "refuses a payload without a key"
message = { by = 2 }
expect = "reject"
"#;

const RUST_LOCK: &str = include_str!("../../guest-examples/Cargo.lock");

const LIB_RS: &str = r#"//! The `{name}` handler: counts events per key.
//!
//! Payload: `{"key": "signup", "by": 1}`. It reads the key's row, writes the
//! new count, and that write lands together with the message's ack, or not
//! at all: a re-run after a lost commit can never count twice.

// Built for wasm32-wasip2 only (`cargo handler`); empty on this machine,
// where `cargo test` only runs tests/handler.rs. Editors: analyse for that
// target (.vscode/settings.json sets rust-analyzer.cargo.target).
#![cfg(target_arch = "wasm32")]

mod schema; // the tables of schema.sql, typed: `onceq types --lang rust --out src/schema.rs`

use onceq_guest::{Ctx, Error, Handler, Message};
use schema::counters;
use serde::Deserialize;

#[derive(Deserialize)]
struct Event {
    key: String,
    #[serde(default = "one")]
    by: i64,
}

fn one() -> i64 {
    1
}

struct Counter;

impl Handler for Counter {
    fn handle(ctx: &mut Ctx, msg: &Message) -> Result<(), Error> {
        let event: Event = msg.json()?; // a malformed payload is rejected (dead-lettered)
        if event.by <= 0 {
            return Err(Error::reject(format!("by must be positive, got {}", event.by)));
        }
        let count = match counters::get(ctx, &event.key)? {
            Some(row) => row.count,
            None => 0,
        };
        counters::upsert(
            ctx,
            counters::Insert {
                key: event.key,
                count: count + event.by,
                updated_at: Some(msg.now),
            },
        );
        Ok(())
    }
}

onceq_guest::export_handler!(Counter);
"#;

const SCHEMA: &str = "-- Business tables (SQLite DDL), applied by `onceq init`.
CREATE TABLE IF NOT EXISTS counters (
    key TEXT PRIMARY KEY,
    count INTEGER NOT NULL,
    updated_at TIMESTAMP
);
";

const ONCEQ_TOML: &str = r#"store = "sqlite://data/onceq.db"
schema = "schema.sql"

[[queue]]
name = "{name}"
handler = "{component}"
tables = ["counters"]
"#;

const MESSAGE: &str = r#"{"key": "signup", "by": 1}
"#;

const README: &str = r#"# {name}

An onceq handler (Rust, built as a WebAssembly component).

```sh
cargo handler                                            # -> target/wasm32-wasip2/release/{file}.wasm
cargo test                                               # builds it and runs {file}.test.toml with onceq test
onceq check target/wasm32-wasip2/release/{file}.wasm     # fits the handler world?
onceq init                                               # creates data/onceq.db with schema.sql
onceq try target/wasm32-wasip2/release/{file}.wasm --message message.json --queue {name}
onceq send {name} --payload '{"key": "signup"}'
onceq run --until-empty
```

(`cargo handler` is `cargo build --release --target wasm32-wasip2`, an
alias in `.cargo/config.toml`.)

Then, with `onceq run` serving, ship a new version without a restart:
`onceq deploy {name} target/wasm32-wasip2/release/{file}.wasm --label v2`
(set `ONCEQ_ADMIN_TOKEN` for the host and the CLI).

## Tests

`{file}.test.toml` holds test cases: fixture rows, a message, and the
outcome and effects expected. `onceq test` runs them against the built
component with the verdicts of a real run (grants from `onceq.toml`, tables
from `schema.sql`), no database needed; `cargo test` builds the component
and calls it. A failed case prints what was expected and every effect the
handler had.

`src/schema.rs` declares the tables of `schema.sql` as Rust types: a module
per table with its `Row`, an `Insert` (every NOT NULL column without a
DEFAULT), an `Update`, and typed `get`, `scan`, `insert`, `upsert`, `update`
and `delete`, so a wrong table, column or value type does not compile.
After a schema change, write it again:
`onceq types --lang rust --out src/schema.rs` (`onceq test` and
`onceq check` say when it is out of date).

`onceq-guest/` is the onceq SDK (a copy: the project builds wherever it is
moved or cloned); `wit/handler.wit` is the contract the component is built
against.
"#;

const JS_PACKAGE: &str = r#"{
  "name": "{name}",
  "version": "0.1.0",
  "private": true,
  "type": "module",
  "scripts": {
    "types": "${ONCEQ:-onceq} types --lang ts --out src/schema.d.ts",
    "check": "tsc -p tsconfig.json",
    "build": "node build.mjs build/{file}.wasm src/app.js --wit wit -n queue-handler -d stdio http fetch-event",
    "test": "npm run build && ${ONCEQ:-onceq} test"
  },
  "devDependencies": {
    "@bytecodealliance/componentize-js": "0.23.0",
    "@bytecodealliance/jco": "1.35.0",
    "@bytecodealliance/preview2-shim": "0.25.0",
    "typescript": "7.0.2"
  }
}
"#;

const JS_APP: &str = r#"// The `{name}` handler: counts events per key.
//
// Payload: {"key": "signup", "by": 1}. It reads the key's row, writes the
// new count, and that write lands together with the message's ack, or not
// at all: a re-run after a lost commit can never count twice.

import { Timestamp, defineHandler, reject } from './onceq-guest.js';

export const handler = defineHandler((ctx, msg) => {
  const { key, by = 1 } = msg.json(); // a malformed payload is rejected (dead-lettered)
  if (typeof key !== 'string') reject('malformed payload: missing field `key`');
  if (!Number.isInteger(by) || by <= 0) reject(`by must be positive, got ${by}`);
  const row = ctx.get('counters', [key]);
  const count = row === null ? 0 : row.count;
  ctx.upsert('counters', { key, count: count + by, updated_at: new Timestamp(msg.now) });
});
"#;

const PY_APP: &str = r#""""The `{name}` handler: counts events per key.

Payload: {"key": "signup", "by": 1}. It reads the key's row, writes the
new count, and that write lands together with the message's ack, or not
at all: a re-run after a lost commit can never count twice.
"""

from typing import TYPE_CHECKING

from onceq_guest import Timestamp, export, reject

if TYPE_CHECKING:  # for mypy (`make check`): the tables of schema.sql
    from schema_types import Ctx


def handle(ctx: "Ctx", msg):
    event = msg.json()  # a malformed payload is rejected (dead-lettered)
    key, by = event.get("key"), event.get("by", 1)
    if not isinstance(key, str):
        reject("malformed payload: missing field `key`")
    if not isinstance(by, int) or by <= 0:
        reject(f"by must be positive, got {by}")
    counters = ctx.tables.counters
    row = counters.get([key])
    count = 0 if row is None else row["count"]
    counters.upsert(key=key, count=count + by, updated_at=Timestamp(msg.now))


Handler = export(handle)
"#;

/// `make check`'s first step: what a handler cannot do in the sandbox.
const PY_SANDBOX_CHECK: &str = include_str!("../../guest-examples/python/check_sandbox.py");

const PY_MAKEFILE: &str = "# `make` builds build/{file}.wasm with componentize-py (pinned in
# requirements.txt, installed into .venv on first use); `make test` builds
# it and runs {file}.test.toml with `onceq test`.
PYTHON ?= python3
COMPONENTIZE_PY ?= .venv/bin/componentize-py
MYPY ?= .venv/bin/mypy
ONCEQ ?= onceq

build/{file}.wasm: src/app.py src/onceq_guest.py wit/handler.wit | $(COMPONENTIZE_PY)
\tmkdir -p build
\t$(COMPONENTIZE_PY) -d wit -w queue-handler componentize app -p src --stub-wasi -o $@

.PHONY: test check types
test: build/{file}.wasm
\t$(ONCEQ) test

# Name what the sandbox does not offer (open(), sockets, urllib, ...), then
# type-check src/app.py with mypy against src/schema_types.pyi: a wrong
# table, column or value type fails here, before a run.
check: | $(COMPONENTIZE_PY)
\t$(PYTHON) check_sandbox.py
\t$(MYPY)

# After a change to schema.sql: declare its tables again.
types:
\t$(ONCEQ) types --lang py --out src/schema_types.pyi

.venv/bin/componentize-py: requirements.txt
\t$(PYTHON) -m venv .venv
\t.venv/bin/pip install --quiet -r requirements.txt
";

const GITIGNORE: &str = "node_modules/
.venv/
__pycache__/
build/
target/
data/
.onceq/
";

const README_OTHER: &str = r#"# {name}

An onceq handler ({language}, built as a WebAssembly component).

```sh
{build}    # -> {component}
{test}    # builds it and runs {file}.test.toml with onceq test
onceq check {component}     # fits the handler world?
onceq init                  # creates data/onceq.db with schema.sql
onceq try {component} --message message.json --queue {name}
onceq send {name} --payload '{"key": "signup"}'
onceq run --until-empty
```

Then, with `onceq run` serving, ship a new version without a restart:
`onceq deploy {name} {component} --label v2`
(set `ONCEQ_ADMIN_TOKEN` for the host and the CLI).

`src/{sdk}` is the onceq SDK (reads, writes, enqueue, intents, reject and
retry); `wit/handler.wit` is the contract the component is built against.
{extra}The handler's clock and randomness are the message's: {clock}
A re-run of the same message gives the same effects.

## Tests

`{file}.test.toml` holds test cases: fixture rows, a message, and the
outcome and effects expected. `onceq test` runs them against the built
component with the verdicts of a real run (grants from `onceq.toml`, tables
from `schema.sql`), no database needed; `{test}` builds the component and
calls it (`ONCEQ=/path/to/onceq` if onceq is not on PATH). A failed case
prints what was expected and every effect the handler had.
"#;

fn render(t: &str, name: &str, file: &str, sdk: &str) -> String {
    t.replace("{name}", name).replace("{file}", file).replace("{sdk}", sdk)
}

/// What differs between the JavaScript and Python projects' READMEs.
struct OtherLanguage {
    language: &'static str,
    build: &'static str,
    test: &'static str,
    sdk: &'static str,
    extra: &'static str,
    clock: &'static str,
}

const JS: OtherLanguage = OtherLanguage {
    language: "JavaScript",
    build: "npm install && npm run check && npm run build",
    test: "npm test",
    sdk: "onceq-guest.js",
    extra: "`npm run check` type-checks `src/app.js` against the SDK's declarations,\n`src/onceq-guest.d.ts`, and the tables of `schema.sql` as `src/schema.d.ts`\ndeclares them: a wrong table, column or value type fails the check. After a\nschema change, `npm run types` writes `src/schema.d.ts` again (`onceq types`).\n",
    clock: "`Date.now()` is its logical time, and `Math.random()` and `crypto.getRandomValues()` are seeded from its id.",
};

const PYTHON: OtherLanguage = OtherLanguage {
    language: "Python",
    build: "make check && make",
    test: "make test",
    sdk: "onceq_guest.py",
    extra: "`make check` type-checks `src/app.py` with mypy against the tables of\n`schema.sql` as `src/schema_types.pyi` declares them: a wrong table, column or\nvalue type fails the check. After a schema change, `make types` writes\n`src/schema_types.pyi` again (`onceq types --lang py`).\n",
    clock: "`msg.now` and `time.time()` are its logical time, and `random`, `os.urandom()` and `uuid.uuid4()` are seeded from its id (the SDK provides them: the component is built with `--stub-wasi`, without WASI clocks or entropy).",
};

/// Check a project name: it names the folder and the queue.
fn check_name(name: &str) -> anyhow::Result<()> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    if !first_ok || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_') {
        bail!("name {name:?}: use lowercase letters, digits, '-' and '_', starting with a letter (it names the project and the queue)");
    }
    Ok(())
}

/// Write a new handler project `name` in `parent`, in `lang` (see
/// [`LANGUAGES`]; `javascript` and `py` are accepted too). Rust projects
/// carry a copy of the SDK unless `sdk` names a crate to depend on by path.
pub fn new_project(parent: &Path, name: &str, lang: &str, sdk: Option<&Path>) -> anyhow::Result<Project> {
    let lang: &'static str = match lang {
        "rust" | "rs" => "rust",
        "js" | "javascript" => "js",
        "python" | "py" => "python",
        other => bail!("--lang {other}: onceq scaffolds {} handlers", LANGUAGES.join(", ")),
    };
    check_name(name)?;
    let dir = parent.join(name);
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
    let file = name.replace('-', "_");
    let (files, component, build) = match lang {
        "rust" => rust_files(name, &file, sdk)?,
        "js" => js_files(name, &file)?,
        _ => python_files(name, &file)?,
    };
    let common = [
        ("schema.sql", SCHEMA.to_string()),
        ("onceq.toml", ONCEQ_TOML.replace("{name}", name).replace("{component}", &component)),
        ("message.json", MESSAGE.to_string()),
        (".gitignore", GITIGNORE.to_string()),
        ("wit/handler.wit", WIT.to_string()),
    ];
    let tests = (
        format!("{file}.test.toml"),
        TEST_CASES.replace("{name}", name).replace("{component}", &component),
    );
    let files = files.into_iter().map(|(p, t)| (p.to_string(), t));
    let common = common.into_iter().map(|(p, t)| (p.to_string(), t));
    for (rel, text) in files.chain(common).chain([tests]) {
        let p = dir.join(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(Project {
        dir,
        lang,
        component,
        build,
    })
}

type Files = Vec<(&'static str, String)>;

fn rust_files(name: &str, file: &str, sdk: Option<&Path>) -> anyhow::Result<(Files, String, &'static [&'static str])> {
    let mut files = Vec::new();
    let sdk = match sdk {
        // Work on the SDK itself: depend on that crate by path.
        Some(p) => {
            let sdk = std::fs::canonicalize(p).with_context(|| format!("--sdk: no guest SDK at {}", p.display()))?;
            if !sdk.join("Cargo.toml").exists() {
                bail!("--sdk: {} is not the guest SDK (no Cargo.toml)", sdk.display());
            }
            sdk.display().to_string()
        }
        // A copy, so the project builds wherever it goes.
        None => {
            if !RUST_SDK.contains(RUST_SDK_WIT_PATH) {
                bail!("this onceq's copy of the Rust SDK does not read its WIT where expected; give the SDK with --sdk");
            }
            files.push(("onceq-guest/Cargo.toml", RUST_SDK_CARGO_TOML.to_string()));
            files.push(("onceq-guest/src/lib.rs", RUST_SDK.replace(RUST_SDK_WIT_PATH, "path: \"../wit\"")));
            "onceq-guest".to_string()
        }
    };
    files.extend([
        ("Cargo.toml", render(CARGO_TOML, name, file, &sdk)),
        (".cargo/config.toml", CARGO_CONFIG.to_string()),
        ("src/lib.rs", render(LIB_RS, name, file, &sdk)),
        // The versions the examples are built and tested with: the first
        // build resolves nothing (cargo drops the entries it does not use).
        ("Cargo.lock", RUST_LOCK.to_string()),
        (
            "src/schema.rs",
            crate::typegen::rust(&crate::store::sqlite::schema_from_ddl(SCHEMA)?, "schema.sql"),
        ),
        ("tests/handler.rs", render(RUST_TEST, name, file, &sdk)),
        (".vscode/settings.json", RUST_EDITOR.to_string()),
        ("README.md", render(README, name, file, &sdk)),
    ]);
    Ok((
        files,
        format!("target/wasm32-wasip2/release/{file}.wasm"),
        &["cargo handler", "cargo test"],
    ))
}

fn js_files(name: &str, file: &str) -> anyhow::Result<(Files, String, &'static [&'static str])> {
    let component = format!("build/{file}.wasm");
    let schema = crate::store::sqlite::schema_from_ddl(SCHEMA)?;
    let files = vec![
        ("src/schema.d.ts", crate::typegen::typescript(&schema, "schema.sql")),
        ("package.json", render(JS_PACKAGE, name, file, "")),
        ("src/app.js", render(JS_APP, name, file, "")),
        ("src/onceq-guest.js", JS_SDK.to_string()),
        ("src/onceq-guest.d.ts", JS_SDK_TYPES.to_string()),
        ("tsconfig.json", JS_TSCONFIG.to_string()),
        ("build.mjs", JS_BUILD.to_string()),
        ("README.md", other_readme(name, file, &component, &JS)),
    ];
    Ok((files, component, &["npm install", "npm run check", "npm run build", "npm test"]))
}

fn python_files(name: &str, file: &str) -> anyhow::Result<(Files, String, &'static [&'static str])> {
    let component = format!("build/{file}.wasm");
    let schema = crate::store::sqlite::schema_from_ddl(SCHEMA)?;
    let files = vec![
        ("Makefile", render(PY_MAKEFILE, name, file, "")),
        (
            "requirements.txt",
            format!("componentize-py=={COMPONENTIZE_PY_VERSION}\nmypy=={MYPY_VERSION}\n"),
        ),
        ("mypy.ini", MYPY_INI.to_string()),
        ("check_sandbox.py", PY_SANDBOX_CHECK.to_string()),
        ("src/schema_types.pyi", crate::typegen::python(&schema, "schema.sql")),
        ("src/app.py", render(PY_APP, name, file, "")),
        ("src/onceq_guest.py", PY_SDK.to_string()),
        ("README.md", other_readme(name, file, &component, &PYTHON)),
    ];
    Ok((files, component, &["make", "make check", "make test"]))
}

/// The builder and the type checker a Python project pins (the same as the
/// top-level Makefile installs for the examples).
const COMPONENTIZE_PY_VERSION: &str = "0.25.1";
const MYPY_VERSION: &str = "1.18.2";

const MYPY_INI: &str = "# `make check`: mypy on the handler, with the schema's types.
[mypy]
files = src/app.py
mypy_path = src

# The bindings componentize-py generates at build time.
[mypy-wit_world.*,componentize_py_types]
ignore_missing_imports = True
";

fn other_readme(name: &str, file: &str, component: &str, l: &OtherLanguage) -> String {
    README_OTHER
        .replace("{name}", name)
        .replace("{file}", file)
        .replace("{language}", l.language)
        .replace("{build}", l.build)
        .replace("{test}", l.test)
        .replace("{component}", component)
        .replace("{sdk}", l.sdk)
        .replace("{extra}", l.extra)
        .replace("{clock}", l.clock)
}
