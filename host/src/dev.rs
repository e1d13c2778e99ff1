//! `onceq dev`: the handler author's loop. Watch the project's files; on a
//! change, rebuild with the project's own build command, load each queue's
//! component as a deploy would (validated, compiled into the cache, with
//! progress while a large one compiles), run the project's test cases
//! (`onceq test`), and when they pass, hot-swap the component into the
//! local host if one is running (`onceq run` in another terminal).
//!
//! The build command is the project's: `cargo build --release --target
//! wasm32-wasip2` next to a `Cargo.toml`, `npm run build` next to a
//! `package.json`, `make` next to a `Makefile`, or `--build CMD`.

use crate::config::Config;
use anyhow::Context;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// Folders never watched: build outputs, dependencies, state.
const SKIPPED: &[&str] = &["target", "build", "node_modules", ".venv", "data", ".onceq", ".git", "__pycache__"];
/// Files never watched: a local database and logs change while a host runs.
const SKIPPED_SUFFIXES: &[&str] = &[".db", ".db-wal", ".db-shm", ".db-journal", ".sqlite", ".log"];

/// How `onceq dev` runs.
#[derive(Debug, Clone)]
pub struct DevOptions {
    /// The build command (default: from the project's files).
    pub build: Option<String>,
    /// How often files are checked for changes.
    pub poll: Duration,
    /// One round, then exit (its verdict is the exit status).
    pub once: bool,
    /// Deploy to the running host when the tests pass.
    pub deploy: bool,
}

/// The build command for a project, from the files it has.
pub fn build_command(project: &Path) -> Option<String> {
    if project.join("Cargo.toml").exists() {
        Some("cargo build --release --target wasm32-wasip2".into())
    } else if project.join("package.json").exists() {
        Some("npm run build".into())
    } else if project.join("Makefile").exists() {
        Some("make".into())
    } else {
        None
    }
}

/// Every watched file with its modification time and size.
fn snapshot(dir: &Path, out: &mut BTreeMap<PathBuf, (SystemTime, u64)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(meta) = e.metadata() else { continue };
        let name = e.file_name();
        if meta.is_dir() {
            if !SKIPPED.iter().any(|s| name == *s) {
                snapshot(&path, out);
            }
        } else if meta.is_file() && !SKIPPED_SUFFIXES.iter().any(|s| name.to_string_lossy().ends_with(s)) {
            out.insert(path, (meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), meta.len()));
        }
    }
}

/// What one round did.
#[derive(Debug, Default)]
pub struct Round {
    pub built: bool,
    pub cases: usize,
    pub failed: usize,
    pub deployed: Vec<String>,
}

impl Round {
    pub fn ok(&self) -> bool {
        self.built && self.failed == 0
    }
}

/// Run the build command in `project`, its output going to the terminal.
async fn build(project: &Path, command: &str) -> anyhow::Result<bool> {
    println!("building: {command}");
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .current_dir(project)
        .kill_on_drop(true)
        .status()
        .await
        .with_context(|| format!("running {command}"))?;
    Ok(status.success())
}

/// One round: build, load, test, deploy.
pub async fn round(cfg: &Config, project: &Path, command: &str, opts: &DevOptions) -> anyhow::Result<Round> {
    let mut r = Round::default();
    if !build(project, command).await? {
        println!("build failed (its output is above): nothing tested or deployed");
        return Ok(r);
    }
    r.built = true;
    if let Ok(schema) = crate::testcases::schema(cfg) {
        for stale in crate::typegen::stale(project, &schema) {
            println!("warning: {stale}");
        }
    }
    let files = crate::testcases::discover(project);
    // Per queue, the component versions its test cases ran: only those
    // are deployed (None: no test files, every loaded component goes).
    let mut tested: Option<BTreeMap<String, std::collections::BTreeSet<String>>> = None;
    if files.is_empty() {
        println!("no test files (NAME.test.toml): the components are only loaded");
        let runtime = crate::runtime::Runtime::new(crate::runtime::RuntimeConfig {
            max_instances: 2,
            ..cfg.runtime.clone()
        })?;
        for q in &cfg.queues {
            if let Err(e) = runtime.load_file(&q.handler, q.limits) {
                println!("queue {}: {} refused: {e}", q.name, q.handler.display());
                r.failed += 1;
            }
        }
    } else {
        match crate::testcases::run(cfg, &files, None, &|m| println!("{m}")).await {
            Ok(results) => {
                print!("{}", crate::testcases::render(&results));
                r.cases = results.iter().map(|f| f.cases.len()).sum();
                r.failed = results.iter().map(|f| f.failed()).sum();
                let mut ran: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
                for f in &results {
                    for c in &f.cases {
                        if let Some(report) = &c.report {
                            ran.entry(f.queue.clone()).or_default().insert(report.version.clone());
                        }
                    }
                }
                tested = Some(ran);
            }
            Err(e) => {
                println!("tests could not run: {e:#}");
                r.failed += 1;
            }
        }
    }
    if r.failed > 0 || !opts.deploy {
        return Ok(r);
    }
    let client = match crate::app::admin_client(cfg, None) {
        Ok(c) => c,
        Err(e) => {
            println!("not deployed: {e:#}");
            return Ok(r);
        }
    };
    for q in &cfg.queues {
        // A component not built yet (another queue's) is skipped, not the
        // end of the watch.
        let bytes = match crate::runtime::read_component(&q.handler) {
            Ok(b) => b,
            Err(e) => {
                println!("not deployed to {}: reading {}: {e}", q.name, q.handler.display());
                continue;
            }
        };
        if let Some(ran) = &tested {
            let version = crate::deploy::version_of(&bytes);
            if !ran.get(&q.name).is_some_and(|v| v.contains(&version)) {
                println!(
                    "not deployed to {}: no test case ran {} as built now ({version}); a case of this queue must run the queue's own handler",
                    q.name,
                    q.handler.display()
                );
                continue;
            }
        }
        match client.deploy(&q.name, bytes, Some("dev")).await {
            Ok(d) => {
                println!("deployed {} to {} on the running host", d.version, q.name);
                r.deployed.push(q.name.clone());
            }
            Err(e) => {
                println!(
                    "not deployed to {}: {e:#} (start `onceq run` in another terminal to hot-swap each passing build)",
                    q.name
                );
                break;
            }
        }
    }
    Ok(r)
}

/// Watch and rebuild until `shutdown` (or after one round with `once`).
pub async fn run(cfg: &Config, project: &Path, opts: DevOptions, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<Round> {
    let command = match opts.build.clone().or_else(|| build_command(project)) {
        Some(c) => c,
        None => anyhow::bail!(
            "{}: no Cargo.toml, package.json or Makefile to build with: give the command with --build",
            project.display()
        ),
    };
    tokio::pin!(shutdown);
    loop {
        let r = round(cfg, project, &command, &opts).await?;
        if opts.once {
            return Ok(r);
        }
        println!(
            "{} watching {} for changes (Ctrl-C to stop)",
            if r.ok() { "ok:" } else { "FAILED:" },
            project.display()
        );
        // Files the build itself wrote are not a change of the author's.
        let mut seen = BTreeMap::new();
        snapshot(project, &mut seen);
        loop {
            tokio::select! {
                _ = &mut shutdown => return Ok(r),
                _ = tokio::time::sleep(opts.poll) => {}
            }
            let mut now = BTreeMap::new();
            snapshot(project, &mut now);
            if now != seen {
                // Let an editor finish writing before building.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let changed: Vec<&PathBuf> = now
                    .iter()
                    .filter(|(p, m)| seen.get(*p) != Some(m))
                    .map(|(p, _)| p)
                    .chain(seen.keys().filter(|p| !now.contains_key(*p)))
                    .collect();
                let shown: Vec<String> = changed
                    .iter()
                    .take(3)
                    .map(|p| p.strip_prefix(project).unwrap_or(p).display().to_string())
                    .collect();
                println!("\nchanged: {}{}", shown.join(", "), if changed.len() > 3 { ", ..." } else { "" });
                break;
            }
        }
    }
}
