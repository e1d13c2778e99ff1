//! The docs say what the code does: the book (`docs/src`) and the READMEs
//! link only to pages and headings that exist, every page is in the book's
//! table of contents, every configuration key the code accepts is in the
//! configuration reference and every key there is accepted, every TOML
//! block is a configuration onceq accepts the keys of, and every `onceq`
//! command shown parses.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every Markdown file of the book, the READMEs included.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md"), root().join("tests/README.md")];
    out.extend(crate::common::files_with_extension(&root().join("docs/src"), "md"));
    out.sort();
    out
}

/// `[text](target)` targets of a Markdown text, outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (line, _) in prose_lines(text) {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

/// Lines outside fenced code blocks, with inline code removed.
fn prose_lines(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            let mut kept = String::new();
            for (i, part) in line.split('`').enumerate() {
                if i % 2 == 0 {
                    kept.push_str(part);
                }
            }
            out.push((kept, n + 1));
        }
    }
    out
}

/// Fenced code blocks: (language, body).
fn blocks(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(lang) = t.strip_prefix("```") {
            match current.take() {
                Some(block) => out.push(block),
                None => current = Some((lang.trim().to_string(), String::new())),
            }
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

/// mdBook's anchor for a heading: lower case, spaces to `-`, only
/// letters, digits, `-` and `_` kept; repeats get `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let Some(heading) = line.strip_prefix('#') else { continue };
        if fenced {
            continue;
        }
        let heading = heading.trim_start_matches('#').trim();
        let id: String = heading
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
                _ => None,
            })
            .collect::<String>()
            .to_lowercase();
        let n = seen.entry(id.clone()).or_insert(0);
        out.insert(if *n == 0 { id.clone() } else { format!("{id}-{n}") });
        *n += 1;
    }
    out
}

#[test]
fn every_link_leads_to_a_page_and_heading_that_exist() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", page.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let text = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&text).contains(anchor) {
                    broken.push(format!("{}: {link} (no such heading)", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_page_of_the_book_is_in_its_table_of_contents() {
    let src = root().join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<PathBuf> = links(&summary).iter().map(|l| src.join(l)).collect();
    let missing: Vec<_> = pages()
        .into_iter()
        .filter(|p| p.starts_with(&src) && !p.ends_with("SUMMARY.md") && !listed.contains(p))
        .collect();
    assert!(missing.is_empty(), "pages the book would not build: {missing:?}");
    assert!(listed.len() >= 10, "the table of contents lists the pages ({})", listed.len());
}

/// The keys onceq accepts in one section (`""` for the top level), as its
/// "unknown field" error lists them.
fn accepted_keys(section: &str) -> Vec<String> {
    let toml = match section {
        "" => "zz_not_a_key = 1\n".to_string(),
        "queue" | "connector" => format!("store = \"x.db\"\n[[{section}]]\nzz_not_a_key = 1\n"),
        s => format!("store = \"x.db\"\n[{s}]\nzz_not_a_key = 1\n"),
    };
    let err = format!("{:#}", onceq::config::Config::parse(&toml, Path::new(".")).err().unwrap());
    assert!(err.contains("zz_not_a_key"), "the unknown key is named: {err}");
    let expected = err
        .split("expected one of ")
        .nth(1)
        .or_else(|| err.split("expected ").nth(1))
        .unwrap_or_else(|| panic!("the error lists the keys: {err}"));
    // serde: "expected `a`", "expected `a` or `b`", "expected one of `a`, `b`, `c`".
    let expected = expected.lines().next().unwrap_or("");
    expected.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// The keys the configuration reference's tables document, as written
/// (`commit.max_batch`, `queue.name`, `store`).
fn documented_keys() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("docs/src/configuration.md")).unwrap();
    let mut out = BTreeSet::new();
    for line in text.lines().filter(|l| l.starts_with("| `")) {
        let first = line.split('|').nth(1).unwrap_or("");
        for key in first.split('`').skip(1).step_by(2) {
            out.insert(key.to_string());
        }
    }
    out
}

#[test]
fn the_configuration_reference_documents_exactly_the_keys_onceq_accepts() {
    let documented = documented_keys();
    let sections = [
        "",
        "sqlite",
        "spanner",
        "commit",
        "runtime",
        "admin",
        "deploy",
        "audit",
        "outbox",
        "telemetry",
        "queue",
        "connector",
    ];
    let mut accepted = BTreeSet::new();
    for section in sections {
        for key in accepted_keys(section) {
            accepted.insert(if section.is_empty() { key } else { format!("{section}.{key}") });
        }
    }
    // `[defaults]` takes the queue settings (documented once, as queue.*).
    let queue_keys: BTreeSet<String> = accepted
        .iter()
        .filter_map(|k| k.strip_prefix("queue."))
        .map(str::to_string)
        .collect();
    for key in accepted_keys("defaults") {
        assert!(queue_keys.contains(&key), "defaults.{key} is a queue setting too");
    }
    // Sections are keys of the top level, documented by their keys.
    let undocumented: Vec<_> = accepted
        .iter()
        .filter(|k| !documented.contains(*k) && !sections.contains(&k.as_str()) && k.as_str() != "defaults")
        .collect();
    assert!(
        undocumented.is_empty(),
        "keys onceq accepts that docs/src/configuration.md does not document: {undocumented:?}"
    );
    let unknown: Vec<_> = documented
        .iter()
        .filter(|k| !accepted.contains(*k) && k.as_str() != "defaults.*")
        .collect();
    assert!(unknown.is_empty(), "documented keys onceq refuses: {unknown:?}");
    assert!(accepted.len() >= 30, "{} keys found", accepted.len());
}

#[test]
fn every_toml_block_is_a_configuration_whose_keys_onceq_accepts() {
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (lang, body) in blocks(&text) {
            if lang != "toml" {
                continue;
            }
            // Handler projects show their Cargo.toml: not onceq's.
            if body.contains("[package]") || body.contains("[dependencies]") || body.contains("[lib]") {
                continue;
            }
            // A test-case file (`onceq test`): loaded as `onceq test` loads it.
            if body.contains("[[case]]") {
                let dir = tempfile::tempdir().unwrap();
                let file = dir.path().join("shown.test.toml");
                std::fs::write(&file, &body).unwrap();
                if let Err(e) = onceq::testcases::load(&file) {
                    panic!("{}: a test-case file onceq test refuses:\n{body}\n{e:#}", page.display());
                }
                checked += 1;
                continue;
            }
            let with_store = if body.lines().any(|l| l.trim_start().starts_with("store")) {
                body.clone()
            } else {
                format!("store = \"x.db\"\n{body}")
            };
            if let Err(e) = onceq::config::Config::parse(&with_store, Path::new(".")) {
                let e = format!("{e:#}");
                assert!(
                    !e.contains("unknown field") && !e.contains("TOML parse error"),
                    "{}: a TOML block onceq does not accept:\n{body}\n{e}",
                    page.display()
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 2, "{checked} blocks checked");
}

/// A command line split as a POSIX shell would (quotes, no expansion).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

#[test]
fn every_onceq_command_shown_parses() {
    let mut checked = 0;
    let mut bad = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (lang, body) in blocks(&text) {
            if !matches!(lang.as_str(), "" | "sh" | "bash" | "console" | "shell") {
                continue;
            }
            for line in body.lines() {
                let line = line.trim().trim_start_matches("$ ");
                // The part before a comment, a pipe, a redirection or `&&`.
                let line = line.split(" #").next().unwrap_or("");
                let line = line.split(['|', '>', '<', ';']).next().unwrap_or("");
                let line = line.split("&&").next().unwrap_or("").trim();
                let line = line.trim_end_matches('\\').trim();
                let Some(rest) = line.strip_prefix("onceq ") else { continue };
                // `$(...)` expands; `onceq demo: 10000 messages` is output.
                if rest.contains("$(") || rest.split_whitespace().next().is_some_and(|w| w.ends_with(':')) {
                    continue;
                }
                let mut args = vec!["onceq".to_string()];
                args.extend(words(rest));
                if let Err(e) = onceq::cli::check_args(&args) {
                    bad.push(format!("{}: `{line}`: {e}", page.display()));
                }
                checked += 1;
            }
        }
    }
    assert!(bad.is_empty(), "commands the CLI refuses:\n{}", bad.join("\n"));
    assert!(checked >= 10, "{checked} commands checked");
}

#[test]
fn the_checks_catch_what_they_check() {
    // The helpers above find what they look for (a check that finds
    // nothing passes anything).
    assert_eq!(links("see [a](b.md#c) and `[x](y)`"), vec!["b.md#c"]);
    let a = anchors("# What a message is charged\n## Hot swap (`deploy`)\n## Hot swap (`deploy`)\n");
    assert!(a.contains("what-a-message-is-charged") && a.contains("hot-swap-deploy") && a.contains("hot-swap-deploy-1"));
    assert_eq!(
        words(r#"send payments '{"a": 1}' --dedup-key "k 1""#),
        vec!["send", "payments", r#"{"a": 1}"#, "--dedup-key", "k 1"]
    );
    assert!(onceq::cli::check_args(["onceq", "no-such-command"]).is_err());
    assert_eq!(
        accepted_keys("commit"),
        vec!["max_batch", "max_wait", "handoff"],
        "three keys, as serde words them"
    );
}
