//! The bench's history: each whole `make bench` appends its headline
//! figures to `docs/src/bench/history.csv` (one row per figure: run, date,
//! commit, source, metric, value) and redraws `docs/src/bench/history.svg`
//! from the whole file, the chart the README and the book show.
//! `ONCEQ_BENCH_HISTORY=off` leaves both alone (a run to try something).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Mutex;

static RECORDS: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());
static COMMIT: Mutex<Option<String>> = Mutex::new(None);

/// Note the checked-out commit as the run starts (the bench binary is
/// built from it; edits made while it runs are not in it).
pub fn start(root: &Path) {
    *COMMIT.lock().unwrap() = Some(commit(root));
}

/// Keep `value` as this run's `metric`.
pub fn record(metric: &str, value: f64) {
    if value.is_finite() {
        RECORDS.lock().unwrap().push((metric.to_owned(), value));
    }
}

const HEADER: &str = "run,date,commit,source,metric,value";

/// Append this run's records to the history and redraw the chart.
pub fn append_and_draw(root: &Path) {
    let records = std::mem::take(&mut *RECORDS.lock().unwrap());
    if records.is_empty() || std::env::var("ONCEQ_BENCH_HISTORY").as_deref() == Ok("off") {
        return;
    }
    let dir = root.join("docs/src/bench");
    let csv = dir.join("history.csv");
    let old = std::fs::read_to_string(&csv).unwrap_or_else(|_| format!("{HEADER}\n"));
    let rows = parse(&old);
    let run = rows.iter().map(|r| r.run).max().map_or(1, |r| r + 1);
    let commit = COMMIT.lock().unwrap().clone().unwrap_or_else(|| commit(root));
    let date = today();
    let mut text = old;
    if !text.ends_with('\n') {
        text.push('\n');
    }
    for (metric, value) in &records {
        writeln!(text, "{run},{date},{commit},make bench,{metric},{value:.3}").unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&csv, &text).unwrap();
    std::fs::write(dir.join("history.svg"), draw(&parse(&text))).unwrap();
    println!("\nhistory: run {run} appended to {} and drawn in history.svg", csv.display());
}

/// Redraw the chart from the history as it is (after editing it by hand):
/// `ONCEQ_BENCH_ONLY=history`.
pub fn redraw(root: &Path) {
    let dir = root.join("docs/src/bench");
    let text = std::fs::read_to_string(dir.join("history.csv")).unwrap();
    std::fs::write(dir.join("history.svg"), draw(&parse(&text))).unwrap();
}

#[derive(Debug, Clone)]
struct HistoryRow {
    run: u32,
    label: String,
    metric: String,
    value: f64,
}

fn parse(text: &str) -> Vec<HistoryRow> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let [run, date, commit, _source, metric, value] = f.as_slice() else {
                return None;
            };
            Some(HistoryRow {
                run: run.parse().ok()?,
                label: format!("{} {}", date.get(5..).unwrap_or(date), commit),
                metric: (*metric).to_owned(),
                value: value.parse().ok()?,
            })
        })
        .collect()
}

/// UTC date, YYYY-MM-DD.
fn today() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()[..10].to_owned()
}

/// The checked-out commit, `-dirty` when the tree has changes.
fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .current_dir(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(c) if git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty()) => format!("{c}-dirty"),
        Some(c) => c,
        None => "unknown".into(),
    }
}

struct Panel {
    title: &'static str,
    log: bool,
    series: &'static [(&'static str, &'static str, Option<f64>)],
}

const PANELS: [Panel; 5] = [
    Panel {
        title: "ratios in one run (higher is better; dashed: target)",
        log: false,
        series: &[
            ("cli_over_raw_full", "CLI with delivery / raw full-work loop", Some(0.8)),
            ("exactly_once_over_at_least_once", "exactly-once / at-least-once", Some(0.9)),
        ],
    },
    Panel {
        title: "messages/s (log scale)",
        log: true,
        series: &[
            ("cli_msgs_per_s", "CLI, Rust payments, with delivery", None),
            ("raw_full_msgs_per_s", "raw full-work loop", None),
            ("js_pipeline_msgs_per_s", "JavaScript pipeline, 1 worker", None),
            ("python_pipeline_msgs_per_s", "Python pipeline, 1 worker", None),
            ("emulator_16_workers_msgs_per_s", "Spanner emulator, 16 workers", None),
        ],
    },
    Panel {
        title: "dispatch median, µs (log scale; lower is better; dashed: target)",
        log: true,
        series: &[
            ("rust_dispatch_us", "Rust", Some(10.0)),
            ("js_dispatch_us", "JavaScript", Some(200.0)),
            ("python_dispatch_us", "Python", Some(500.0)),
        ],
    },
    Panel {
        title: "written per message through the CLI, 4 KiB pages (lower is better; dashed: target)",
        log: false,
        series: &[("cli_pages_per_message", "CLI, Rust payments, with delivery", Some(12.0))],
    },
    Panel {
        title: "an intent's latency on an idle host, median ms (lower is better)",
        log: false,
        series: &[("intent_latency_idle_ms", "send to delivered, file connector", None)],
    },
];

const COLOURS: [&str; 5] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The history as an SVG: one panel per kind of figure, runs along x.
fn draw(rows: &[HistoryRow]) -> String {
    let runs: Vec<u32> = {
        let mut r: Vec<u32> = rows.iter().map(|r| r.run).collect();
        r.sort_unstable();
        r.dedup();
        r
    };
    let labels: BTreeMap<u32, &str> = rows.iter().map(|r| (r.run, r.label.as_str())).collect();
    let (w, ph, left, right, top) = (860.0, 230.0, 70.0, 300.0, 30.0);
    let plot_w = w - left - right;
    let h = top + PANELS.len() as f64 * (ph + 60.0);
    let x = |run: u32| {
        let i = runs.iter().position(|&r| r == run).unwrap_or(0) as f64;
        left + 24.0
            + if runs.len() > 1 {
                i * (plot_w - 48.0) / (runs.len() - 1) as f64
            } else {
                plot_w / 2.0 - 24.0
            }
    };
    let mut svg = String::new();
    writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    )
    .unwrap();
    writeln!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#).unwrap();
    for (p, panel) in PANELS.iter().enumerate() {
        let y0 = top + p as f64 * (ph + 60.0);
        let values: Vec<f64> = rows
            .iter()
            .filter(|r| panel.series.iter().any(|s| s.0 == r.metric))
            .map(|r| r.value)
            .chain(panel.series.iter().filter_map(|s| s.2))
            .filter(|v| !panel.log || *v > 0.0)
            .collect();
        let f = |v: f64| if panel.log { v.log10() } else { v };
        let (mut lo, mut hi) = values.iter().fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(f(*v)), b.max(f(*v))));
        if values.is_empty() {
            (lo, hi) = (0.0, 1.0);
        }
        if !panel.log {
            lo = lo.min(0.0);
        }
        let pad = ((hi - lo) * 0.08).max(0.05);
        let (lo, hi) = (if panel.log { lo - pad } else { lo }, hi + pad);
        let y = |v: f64| y0 + ph - (f(v) - lo) / (hi - lo) * ph;
        writeln!(
            svg,
            r#"<text x="{left}" y="{}" font-weight="bold">{}</text>"#,
            y0 - 8.0,
            escape(panel.title)
        )
        .unwrap();
        writeln!(
            svg,
            r##"<rect x="{left}" y="{y0}" width="{plot_w}" height="{ph}" fill="none" stroke="#999"/>"##
        )
        .unwrap();
        // y ticks: 5 even steps (values at those steps on a log panel).
        for i in 0..=4 {
            let t = lo + (hi - lo) * i as f64 / 4.0;
            let v = if panel.log { 10f64.powf(t) } else { t };
            let yy = y0 + ph - ph * i as f64 / 4.0;
            let text = if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.2}") };
            writeln!(
                svg,
                r##"<line x1="{left}" x2="{}" y1="{yy}" y2="{yy}" stroke="#eee"/>"##,
                left + plot_w
            )
            .unwrap();
            writeln!(svg, r#"<text x="{}" y="{}" text-anchor="end">{text}</text>"#, left - 4.0, yy + 4.0).unwrap();
        }
        for run in &runs {
            let label = labels.get(run).copied().unwrap_or("");
            writeln!(
                svg,
                r#"<text x="{}" y="{}" text-anchor="end" transform="rotate(-30 {} {})" font-size="9">{}</text>"#,
                x(*run),
                y0 + ph + 14.0,
                x(*run),
                y0 + ph + 14.0,
                escape(label)
            )
            .unwrap();
        }
        for (i, (metric, name, target)) in panel.series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.metric == *metric && (!panel.log || r.value > 0.0))
                .map(|r| (x(r.run), y(r.value)))
                .collect();
            if points.len() > 1 {
                let path: Vec<String> = points.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
                writeln!(
                    svg,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
                    path.join(" ")
                )
                .unwrap();
            }
            for (a, b) in &points {
                writeln!(svg, r#"<circle cx="{a:.1}" cy="{b:.1}" r="3" fill="{colour}"/>"#).unwrap();
            }
            if let Some(t) = target {
                let yy = y(*t);
                writeln!(
                    svg,
                    r#"<line x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="{colour}" stroke-dasharray="5,4"/>"#,
                    left + plot_w
                )
                .unwrap();
            }
            let ly = y0 + 14.0 + i as f64 * 16.0;
            let lx = left + plot_w + 12.0;
            writeln!(svg, r#"<rect x="{lx}" y="{}" width="10" height="10" fill="{colour}"/>"#, ly - 9.0).unwrap();
            writeln!(svg, r#"<text x="{}" y="{ly}">{}</text>"#, lx + 14.0, escape(name)).unwrap();
        }
    }
    svg.push_str("</svg>\n");
    svg
}
