//! The house rules of `host/src`, checked on the source: the top-level
//! modules import each other without cycles (data flows one way), and the
//! leaf modules import nothing of onceq's.
//!
//! An edge A -> B is any `crate::B` path (or `B` inside `use crate::{...}`)
//! in code of module A, comments and `#[cfg(test)]` sections left out.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `pub mod X;` and `mod X;` lines of lib.rs.
fn top_modules() -> BTreeSet<String> {
    std::fs::read_to_string(src().join("lib.rs"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("pub mod ").or_else(|| l.strip_prefix("mod "))
        })
        .map(|m| m.trim_end_matches(';').to_string())
        .collect()
}

/// The code of a file: no comments, nothing from `#[cfg(test)]` on.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = match text.find("#[cfg(test)]") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module -> the modules it imports.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mods = top_modules();
    let files = crate::common::files_with_extension(&src(), "rs");
    let mut g: BTreeMap<String, BTreeSet<String>> = mods.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for f in files {
        let rel = f.strip_prefix(src()).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
        let owner = first.trim_end_matches(".rs").to_string();
        if !mods.contains(&owner) {
            continue; // lib.rs, bin/
        }
        let text = code(&f);
        let mut add = |name: &str| {
            if name != owner && mods.contains(name) {
                g.get_mut(&owner).unwrap().insert(name.to_string());
            }
        };
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for part in group[..end].split(',') {
                    add(part.trim().split("::").next().unwrap_or("").trim());
                }
            } else {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                add(&name);
            }
        }
    }
    g
}

/// A cycle through `start`, if any (depth-first).
fn cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(g: &BTreeMap<String, BTreeSet<String>>, n: &str, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for m in &g[n] {
            if let Some(c) = visit(g, m, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for n in g.keys() {
        if let Some(c) = visit(g, n, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn host_modules_import_each_other_without_cycles() {
    let g = graph();
    for (m, deps) in &g {
        eprintln!("{m} -> {}", deps.iter().cloned().collect::<Vec<_>>().join(", "));
    }
    assert!(g.len() >= 10, "found the modules of lib.rs: {g:?}");
    if let Some(c) = cycle(&g) {
        panic!("import cycle among host/src modules: {}", c.join(" -> "));
    }
}

#[test]
fn leaf_modules_import_nothing_of_onceqs() {
    let g = graph();
    for leaf in ["names", "value", "gather", "shutdown", "trace"] {
        assert!(g[leaf].is_empty(), "{leaf} is a leaf, but imports {:?}", g[leaf]);
    }
    // The protocol drives any handler on any store: no Wasm, no outbox, no
    // CLI in it.
    for not in ["runtime", "outbox", "app", "admin", "deploy", "config"] {
        assert!(!g["protocol"].contains(not), "protocol imports {not}");
    }
    // Telemetry is told, it tells nobody: under the protocol and the outbox.
    for not in ["protocol", "runtime", "outbox", "app", "admin", "deploy", "config"] {
        assert!(!g["telemetry"].contains(not), "telemetry imports {not}");
    }
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    assert_eq!(cycle(&g).unwrap(), ["a", "b", "c", "a"]);
    g.get_mut("c").unwrap().clear();
    assert_eq!(cycle(&g), None);
}
