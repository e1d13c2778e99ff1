//! `onceq new`: a ready handler project (Rust), buildable, checkable and
//! runnable in a few commands.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

/// The guest SDK next to this build of onceq (the default `--sdk`).
pub const DEFAULT_SDK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../guest-examples/sdk");

/// Languages `onceq new` can scaffold.
pub const LANGUAGES: &[&str] = &["rust"];

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
handler = "target/wasm32-wasip2/release/{file}.wasm"
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

fn render(t: &str, name: &str, file: &str, sdk: &str) -> String {
    t.replace("{name}", name).replace("{file}", file).replace("{sdk}", sdk)
}

/// Write a new handler project `name` in `parent`; returns its folder.
pub fn new_project(parent: &Path, name: &str, lang: &str, sdk: Option<&Path>) -> anyhow::Result<PathBuf> {
    if !LANGUAGES.contains(&lang) {
        bail!(
            "--lang {lang}: this onceq scaffolds {} handlers only (JavaScript and Python guests are not supported yet)",
            LANGUAGES.join(", ")
        );
    }
    if name.is_empty()
        || !name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
    {
        bail!("name {name:?}: use lowercase letters, digits, '-' and '_', starting with a letter (it names the crate and the queue)");
    }
    let dir = parent.join(name);
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
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
    let file = name.replace('-', "_");
    let files: [(&str, String); 7] = [
        ("Cargo.toml", render(CARGO_TOML, name, &file, &sdk)),
        (".cargo/config.toml", CARGO_CONFIG.to_string()),
        ("src/lib.rs", render(LIB_RS, name, &file, &sdk)),
        ("schema.sql", SCHEMA.to_string()),
        ("onceq.toml", render(ONCEQ_TOML, name, &file, &sdk)),
        ("message.json", MESSAGE.to_string()),
        ("README.md", render(README, name, &file, &sdk)),
    ];
    for (rel, text) in files {
        let p = dir.join(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(dir)
}
