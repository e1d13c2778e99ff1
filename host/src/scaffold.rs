//! `onceq new`: a ready handler project in Rust, JavaScript or Python,
//! buildable, checkable and runnable in a few commands.
//!
//! Every project is the same counter (a read-modify-write of one row per
//! event key) with its schema, an `onceq.toml`, a sample message and a
//! README. JavaScript and Python projects carry their SDK file and the WIT
//! (copied from this build of onceq, so they are self-contained); Rust
//! projects depend on the `onceq-guest` crate by path.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

/// The guest SDK next to this build of onceq (the default `--sdk`).
pub const DEFAULT_SDK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../guest-examples/sdk");

/// Languages `onceq new` can scaffold (`--lang`).
pub const LANGUAGES: &[&str] = &["rust", "js", "python"];

/// The one WIT, as the host reads it.
const WIT: &str = include_str!("../../wit/handler.wit");
const JS_SDK: &str = include_str!("../../guest-examples/js/onceq-guest.js");
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
  "files": ["src/app.js"]
}
"#;
const PY_SDK: &str = include_str!("../../guest-examples/python/onceq_guest.py");

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

[dependencies]
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

const CARGO_CONFIG: &str = r#"# Handlers are WebAssembly components: `cargo build --release` builds one.
[build]
target = "wasm32-wasip2"

# A small shadow stack: less memory to map per fresh instance.
[target.wasm32-wasip2]
rustflags = ["-C", "link-arg=-zstack-size=65536"]
"#;

const LIB_RS: &str = r#"//! The `{name}` handler: counts events per key.
//!
//! Payload: `{"key": "signup", "by": 1}`. It reads the key's row, writes the
//! new count, and that write lands together with the message's ack, or not
//! at all: a re-run after a lost commit can never count twice.

use onceq_guest::{Ctx, Error, Handler, Message, Value};
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
        let count = match ctx.get("counters", &[Value::from(event.key.as_str())])? {
            Some(row) => row.i64("count")?,
            None => 0,
        };
        ctx.upsert(
            "counters",
            [
                ("key", Value::from(event.key.as_str())),
                ("count", Value::from(count + event.by)),
                ("updated_at", Value::Timestamp(msg.now)),
            ],
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
cargo build --release                                    # -> target/wasm32-wasip2/release/{file}.wasm
onceq check target/wasm32-wasip2/release/{file}.wasm     # fits the handler world?
onceq init                                               # creates data/onceq.db with schema.sql
onceq try target/wasm32-wasip2/release/{file}.wasm --message message.json --queue {name}
onceq send {name} --payload '{"key": "signup"}'
onceq run --until-empty
```

Then, with `onceq run` serving, ship a new version without a restart:
`onceq deploy {name} target/wasm32-wasip2/release/{file}.wasm --label v2`
(set `ONCEQ_ADMIN_TOKEN` for the host and the CLI).

Test it without a database with the handler test kit, `onceq-testkit`
(see onceq's `tests/testkit.rs`).
"#;

const JS_PACKAGE: &str = r#"{
  "name": "{name}",
  "version": "0.1.0",
  "private": true,
  "type": "module",
  "scripts": {
    "check": "tsc -p tsconfig.json",
    "build": "mkdir -p build && componentize-js src/app.js --wit wit -n queue-handler -d stdio http fetch-event -o build/{file}.wasm"
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

from onceq_guest import Timestamp, export, reject


def handle(ctx, msg):
    event = msg.json()  # a malformed payload is rejected (dead-lettered)
    key, by = event.get("key"), event.get("by", 1)
    if not isinstance(key, str):
        reject("malformed payload: missing field `key`")
    if not isinstance(by, int) or by <= 0:
        reject(f"by must be positive, got {by}")
    row = ctx.get("counters", [key])
    count = 0 if row is None else row["count"]
    ctx.upsert("counters", key=key, count=count + by, updated_at=Timestamp(msg.now))


Handler = export(handle)
"#;

const PY_MAKEFILE: &str = "# `make` builds build/{file}.wasm with componentize-py (pinned in
# requirements.txt, installed into .venv on first use).
PYTHON ?= python3
COMPONENTIZE_PY ?= .venv/bin/componentize-py

build/{file}.wasm: src/app.py src/onceq_guest.py wit/handler.wit | $(COMPONENTIZE_PY)
\tmkdir -p build
\t$(COMPONENTIZE_PY) -d wit -w queue-handler componentize app -p src --stub-wasi -o $@

.venv/bin/componentize-py: requirements.txt
\t$(PYTHON) -m venv .venv
\t.venv/bin/pip install --quiet -r requirements.txt
";

const GITIGNORE: &str = "node_modules/
.venv/
build/
target/
data/
.onceq/
";

const README_OTHER: &str = r#"# {name}

An onceq handler ({language}, built as a WebAssembly component).

```sh
{build}    # -> {component}
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
(JavaScript: `npm run check` type-checks `src/app.js` against the SDK's
declarations, `src/onceq-guest.d.ts`.)
The handler's clock and randomness are the message's: {clock}
A re-run of the same message gives the same effects.

Test it without a database with the handler test kit, `onceq-testkit`
(see onceq's `tests/testkit.rs`), which loads the built component.
"#;

fn render(t: &str, name: &str, file: &str, sdk: &str) -> String {
    t.replace("{name}", name).replace("{file}", file).replace("{sdk}", sdk)
}

/// Write a new handler project `name` in `parent`, in `lang` (see
/// [`LANGUAGES`]; `javascript` and `py` are accepted too).
pub fn new_project(parent: &Path, name: &str, lang: &str, sdk: Option<&Path>) -> anyhow::Result<Project> {
    let lang: &'static str = match lang {
        "rust" | "rs" => "rust",
        "js" | "javascript" => "js",
        "python" | "py" => "python",
        other => bail!("--lang {other}: onceq scaffolds {} handlers", LANGUAGES.join(", ")),
    };
    if name.is_empty()
        || !name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
    {
        bail!("name {name:?}: use lowercase letters, digits, '-' and '_', starting with a letter (it names the project and the queue)");
    }
    let dir = parent.join(name);
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
    let file = name.replace('-', "_");
    let (files, component, build) = match lang {
        "rust" => rust_files(name, &file, sdk)?,
        "js" => {
            let component = format!("build/{file}.wasm");
            let build: &'static [&'static str] = &["npm install", "npm run check", "npm run build"];
            let files = vec![
                ("package.json", render(JS_PACKAGE, name, &file, "")),
                ("src/app.js", render(JS_APP, name, &file, "")),
                ("src/onceq-guest.js", JS_SDK.to_string()),
                ("src/onceq-guest.d.ts", JS_SDK_TYPES.to_string()),
                ("tsconfig.json", JS_TSCONFIG.to_string()),
                (
                    "README.md",
                    other_readme(
                        name,
                        "JavaScript",
                        "npm install && npm run check && npm run build",
                        &component,
                        "onceq-guest.js",
                        "`Date.now()` is its logical time, and `Math.random()` and `crypto.getRandomValues()` are seeded from its id.",
                    ),
                ),
            ];
            (files, component, build)
        }
        _ => {
            let component = format!("build/{file}.wasm");
            let build: &'static [&'static str] = &["make"];
            let files = vec![
                ("Makefile", render(PY_MAKEFILE, name, &file, "")),
                ("requirements.txt", "componentize-py==0.25.1\n".to_string()),
                ("src/app.py", render(PY_APP, name, &file, "")),
                ("src/onceq_guest.py", PY_SDK.to_string()),
                (
                    "README.md",
                    other_readme(
                        name,
                        "Python",
                        "make",
                        &component,
                        "onceq_guest.py",
                        "`msg.now` and `time.time()` are its logical time, and `random`, `os.urandom()` and `uuid.uuid4()` are seeded from its id (the SDK provides them: the component is built with `--stub-wasi`, without WASI clocks or entropy).",
                    ),
                ),
            ];
            (files, component, build)
        }
    };
    let common = [
        ("schema.sql", SCHEMA.to_string()),
        ("onceq.toml", ONCEQ_TOML.replace("{name}", name).replace("{component}", &component)),
        ("message.json", MESSAGE.to_string()),
        (".gitignore", GITIGNORE.to_string()),
    ];
    let wit = if lang == "rust" {
        None
    } else {
        Some(("wit/handler.wit", WIT.to_string()))
    };
    for (rel, text) in files.into_iter().chain(common).chain(wit) {
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
    let sdk = match sdk {
        Some(p) => p.to_path_buf(),
        None => PathBuf::from(DEFAULT_SDK),
    };
    let sdk =
        std::fs::canonicalize(&sdk).with_context(|| format!("the guest SDK is not at {} (give its folder with --sdk)", sdk.display()))?;
    if !sdk.join("Cargo.toml").exists() {
        bail!("{} is not the guest SDK (no Cargo.toml)", sdk.display());
    }
    let sdk = sdk.display().to_string();
    let files = vec![
        ("Cargo.toml", render(CARGO_TOML, name, file, &sdk)),
        (".cargo/config.toml", CARGO_CONFIG.to_string()),
        ("src/lib.rs", render(LIB_RS, name, file, &sdk)),
        ("README.md", render(README, name, file, &sdk)),
    ];
    Ok((
        files,
        format!("target/wasm32-wasip2/release/{file}.wasm"),
        &["cargo build --release"],
    ))
}

fn other_readme(name: &str, language: &str, build: &str, component: &str, sdk: &str, clock: &str) -> String {
    README_OTHER
        .replace("{name}", name)
        .replace("{language}", language)
        .replace("{build}", build)
        .replace("{component}", component)
        .replace("{sdk}", sdk)
        .replace("{clock}", clock)
}
