//! `make sim`: onceq on Cloud Spanner at scale, simulated ([`model`]) and
//! priced against Spanner's documented node throughput and recommended
//! CPU headroom. The tables it prints are the scale model that
//! docs/src/spanner.md quotes.

mod model;

/// `writeln!` into the report (a `String` cannot fail to take it).
macro_rules! say {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

use model::{simulate, Outcome, Params};

/// An instance configuration's documented peak per node (reads or writes
/// per second, 1 KB rows; a mix takes its share of each) and the
/// recommended high-priority CPU ceiling.
struct Instance {
    name: &'static str,
    reads: f64,
    writes: f64,
    headroom: f64,
    read_ms: f64,
    commit_ms: f64,
}

const REGIONAL: Instance = Instance {
    name: "regional",
    reads: 22_500.0,
    writes: 3_500.0,
    headroom: 0.65,
    read_ms: 2.0,
    commit_ms: 8.0,
};

const MULTI_REGION: Instance = Instance {
    name: "multi-region (hosts in the leader region)",
    reads: 15_000.0,
    writes: 2_700.0,
    headroom: 0.45,
    read_ms: 3.0,
    commit_ms: 25.0,
};

/// Rows written per payments message, index entries included (lease,
/// ack, account, order, dedup claim, intent insert, lease and ack, key
/// hold, and four entries of the queue's index).
const WRITES_PER_MSG: f64 = 13.0;
/// Reads the outbox adds per message (its lease reads and its delivery
/// ack's re-reads, in batches).
const OUTBOX_READS_PER_MSG: f64 = 1.0;
/// Writes per message at the tail of a `(queue, shard)` key range: the
/// message row (ids grow within a shard), its index entry at send and
/// again at lease (`visible_at` = now + lease).
const TAIL_WRITES_PER_MSG: f64 = 3.0;

struct Priced {
    nodes: f64,
    shards_needed: f64,
}

fn price(o: &Outcome, i: &Instance) -> Priced {
    let reads = o.reads_per_msg + OUTBOX_READS_PER_MSG;
    let cpu = o.msgs_per_s * (reads / i.reads + WRITES_PER_MSG / i.writes);
    Priced {
        nodes: (cpu / i.headroom).ceil().max(1.0),
        // A split is served by one node: its tail takes at most that
        // node's writes at the ceiling.
        shards_needed: (o.msgs_per_s * TAIL_WRITES_PER_MSG / (i.writes * i.headroom)).ceil(),
    }
}

fn shards_for(n: f64) -> usize {
    (n.max(8.0) as usize).next_power_of_two()
}

/// One row of a scale table, for the chart.
struct Point {
    hosts: usize,
    msgs_per_s: f64,
    aborts_per_commit: f64,
}

fn scale_table(out: &mut String, i: &Instance) -> Vec<Point> {
    let mut points = Vec::new();
    say!(
        out,
        "\n## Scale, {}: read {} ms, commit {} ms, CPU ceiling {}%\n",
        i.name,
        i.read_ms,
        i.commit_ms,
        i.headroom * 100.0
    );
    say!(
        out,
        "| hosts | shards | msg/s | per host | lease to commit | batch | aborts / commit | candidates lost | nodes | what limits it |"
    );
    say!(out, "|---|---|---|---|---|---|---|---|---|---|");
    for hosts in [1, 3, 10, 30, 100] {
        let base = Params {
            hosts,
            read_ms: i.read_ms,
            commit_ms: i.commit_ms,
            seconds: if hosts >= 30 { 2.0 } else { 4.0 },
            ..Params::default()
        };
        // Shards enough for the tails at this scale (from a first run).
        let first = simulate(&base);
        let shards = shards_for(price(&first, i).shards_needed);
        let o = simulate(&Params { shards, ..base });
        let p = price(&o, i);
        let limit = if hosts == 1 {
            "the host: 64 messages in flight over a message's round trips".to_string()
        } else {
            format!("Spanner's CPU: {:.0} nodes at {}%", p.nodes, i.headroom * 100.0)
        };
        say!(
            out,
            "| {hosts} | {shards} | {:.0} | {:.0} | {:.0} ms | {:.1} | {:.3} | {:.1}% | {:.0} | {limit} |",
            o.msgs_per_s,
            o.msgs_per_s / hosts as f64,
            o.latency_ms,
            o.batch,
            o.aborts_per_commit,
            o.candidates_lost * 100.0,
            p.nodes,
        );
        points.push(Point {
            hosts,
            msgs_per_s: o.msgs_per_s,
            aborts_per_commit: o.aborts_per_commit,
        });
    }
    points
}

/// A chart's panel: its title, its log10 range, the value it shows.
type Panel = (&'static str, f64, f64, fn(&Point) -> f64);

/// Throughput and aborts by host count, one line per instance
/// configuration, as an SVG (log scales).
fn chart(series: &[(&str, &str, Vec<Point>)]) -> String {
    let (w, h, pad) = (760.0, 300.0, 50.0);
    let panel = (w - 3.0 * pad) / 2.0;
    let x = |hosts: usize, left: f64| left + (hosts as f64).log10() / 2.0 * panel;
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11"><rect width="{w}" height="{h}" fill="white"/>"#
    );
    let top = pad;
    let bottom = h - pad;
    // Left: msg/s, 100 to 1,000,000; right: aborts per commit, 0.0001 to
    // 1 (none is drawn at the floor).
    let panels: [Panel; 2] = [
        ("messages/s", 2.0, 6.0, |p| p.msgs_per_s),
        ("aborts per commit", -4.0, 0.0, |p| p.aborts_per_commit),
    ];
    for (k, (title, lo, hi, value)) in panels.iter().enumerate() {
        let left = pad + k as f64 * (panel + pad);
        let y = |v: f64| bottom - ((v.max(10f64.powf(*lo)).log10() - lo) / (hi - lo)) * (bottom - top);
        out += &format!(
            r##"<text x="{}" y="{}" text-anchor="middle" font-weight="bold">{title}, by hosts</text>"##,
            left + panel / 2.0,
            top - 20.0
        );
        out += &format!(
            r##"<rect x="{left}" y="{top}" width="{panel}" height="{}" fill="none" stroke="#999"/>"##,
            bottom - top
        );
        for e in (*lo as i32)..=(*hi as i32) {
            let v = 10f64.powi(e);
            out += &format!(
                r##"<line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                left + panel,
                left - 4.0,
                y(v) + 4.0,
                match e {
                    0..=2 => format!("{v:.0}"),
                    3..=5 => format!("{:.0}k", v / 1000.0),
                    6.. => format!("{:.0}M", v / 1e6),
                    _ => format!("{v}"),
                },
                y = y(v)
            );
        }
        for hosts in [1, 3, 10, 30, 100] {
            out += &format!(
                r##"<text x="{}" y="{}" text-anchor="middle">{hosts}</text>"##,
                x(hosts, left),
                bottom + 14.0
            );
        }
        for (name, color, points) in series {
            let path: Vec<String> = points
                .iter()
                .map(|p| format!("{:.1},{:.1}", x(p.hosts, left), y(value(p))))
                .collect();
            out += &format!(
                r##"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"##,
                path.join(" ")
            );
            for p in points {
                out += &format!(
                    r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{name}: {} hosts, {:.3}</title></circle>"##,
                    x(p.hosts, left),
                    y(value(p)),
                    p.hosts,
                    value(p)
                );
            }
        }
    }
    for (n, (name, color, _)) in series.iter().enumerate() {
        let lx = pad + n as f64 * 300.0;
        out += &format!(
            r##"<rect x="{lx}" y="{}" width="12" height="4" fill="{color}"/><text x="{}" y="{}">{name}</text>"##,
            h - 18.0,
            lx + 16.0,
            h - 13.0
        );
    }
    out + "</svg>\n"
}

fn hot_rows(out: &mut String) {
    say!(out, "\n## Hot rows: 10 hosts, regional, 100,000 accounts drawn by Zipf's law\n");
    say!(out, "| skew s | the hottest account's share | msg/s | aborts / commit | batch |");
    say!(out, "|---|---|---|---|---|");
    for skew in [0.0, 0.5, 0.8, 1.0] {
        let accounts = 100_000usize;
        let h: f64 = (1..=accounts).map(|k| 1.0 / (k as f64).powf(skew)).sum();
        let o = simulate(&Params {
            hosts: 10,
            shards: 32,
            accounts,
            skew,
            seconds: 3.0,
            ..Params::default()
        });
        say!(
            out,
            "| {skew} | {:.3}% | {:.0} | {:.3} | {:.1} |",
            100.0 / h,
            o.msgs_per_s,
            o.aborts_per_commit,
            o.batch
        );
    }
}

fn counts_rows(out: &mut String) {
    say!(
        out,
        "\n## The processed counts: rows per queue, each commit adding to one at random (100 hosts, regional, 128 shards)\n"
    );
    say!(out, "| rows | msg/s | aborts / commit |");
    say!(out, "|---|---|---|");
    for count_rows in [64, 256, 1_024, 16_384] {
        let o = simulate(&Params {
            hosts: 100,
            shards: 128,
            count_rows,
            seconds: 2.0,
            ..Params::default()
        });
        say!(out, "| {count_rows} | {:.0} | {:.3} |", o.msgs_per_s, o.aborts_per_commit);
    }
}

fn collisions(out: &mut String) {
    say!(
        out,
        "\n## Leasers meeting: 30 hosts, regional; candidates another host took first\n"
    );
    say!(
        out,
        "| shards | candidates lost, oldest (before) | random pick among 4x (now) | msg/s before | msg/s now |"
    );
    say!(out, "|---|---|---|---|---|");
    for shards in [1, 8, 32, 128] {
        let p = |pick_oldest| Params {
            hosts: 30,
            shards,
            seconds: 2.0,
            pick_oldest,
            ..Params::default()
        };
        let (before, now) = (simulate(&p(true)), simulate(&p(false)));
        say!(
            out,
            "| {shards} | {:.1}% | {:.1}% | {:.0} | {:.0} |",
            before.candidates_lost * 100.0,
            now.candidates_lost * 100.0,
            before.msgs_per_s,
            now.msgs_per_s
        );
    }
}

/// `make bench`, run 3 (docs/src/bench/history.csv): one host with 16
/// workers drained payments on the emulator at this many msg/s.
const EMULATOR_ONE_HOST: f64 = 447.0;

/// Where the emulator can answer: the server's time per call is
/// calibrated so that one simulated host runs at the measured pace; what
/// three hosts do is then the model's prediction, against the measured
/// three-host runs.
fn emulator(out: &mut String) {
    say!(
        out,
        "\n## Validation on the emulator: one CPU-bound server, one read-write transaction at a time\n"
    );
    let p = |hosts, read_ms: f64| Params {
        hosts,
        serial: true,
        read_ms,
        commit_ms: 3.0 * read_ms,
        seconds: 4.0,
        ..Params::default()
    };
    // msg/s falls as the call's time grows: bisect for the measured pace.
    let (mut lo, mut hi) = (0.05f64, 20.0f64);
    for _ in 0..30 {
        let mid = (lo + hi) / 2.0;
        if simulate(&p(1, mid)).msgs_per_s > EMULATOR_ONE_HOST {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let read_ms = (lo + hi) / 2.0;
    let one = simulate(&p(1, read_ms));
    let three = simulate(&p(3, read_ms));
    say!(out, "Calibrated: a read {read_ms:.2} ms and a commit {:.2} ms of the server's time make one host run at {EMULATOR_ONE_HOST} msg/s (measured).\n", 3.0 * read_ms);
    say!(
        out,
        "| hosts | msg/s (simulated) | batch | of one host (simulated) | of one host (measured) |"
    );
    say!(out, "|---|---|---|---|---|");
    say!(out, "| 1 | {:.0} | {:.1} | 1 | 1 |", one.msgs_per_s, one.batch);
    say!(
        out,
        "| 3 | {:.0} | {:.1} | {:.2} | 0.90-0.98 (docs/src/spanner.md: 400 orders, default settings, two rounds; make bench hosts row) |",
        three.msgs_per_s,
        three.batch,
        three.msgs_per_s / one.msgs_per_s
    );
}

/// Every table `make sim` prints, and the two scale tables' points.
fn report() -> (String, Vec<Point>, Vec<Point>) {
    let mut out = String::new();
    let out = &mut out;
    say!(out, "# onceq on Cloud Spanner, simulated (make sim)");
    say!(
        out,
        "\nPayments messages, onceq's defaults (16 workers x 4 in flight per host, commit.max_batch 64)."
    );
    say!(
        out,
        "Nodes: the documented peak per node (regional 22,500 reads or 3,500 writes/s; multi-region 15,000 or 2,700),"
    );
    say!(out, "{WRITES_PER_MSG} writes and the simulated reads (+{OUTBOX_READS_PER_MSG} for the outbox) a message, under the recommended CPU ceiling.");
    say!(out, "Shards: enough that no (queue, shard) tail takes more than one node's writes at the ceiling ({TAIL_WRITES_PER_MSG} tail writes a message).");
    let regional = scale_table(out, &REGIONAL);
    let multi = scale_table(out, &MULTI_REGION);
    hot_rows(out);
    counts_rows(out);
    collisions(out);
    emulator(out);
    (std::mem::take(out), regional, multi)
}

fn main() {
    let started = std::time::Instant::now();
    let (text, regional, multi) = report();
    print!("{text}");
    let svg = chart(&[("regional", "#1f77b4", regional), ("multi-region", "#d62728", multi)]);
    // `make sim` passes where the chart goes (the book's).
    if let Some(path) = std::env::args().nth(1) {
        match std::fs::write(&path, svg) {
            Ok(()) => println!("\nThe chart: {path}"),
            Err(e) => eprintln!("writing the chart to {path}: {e}"),
        }
    }
    println!("\n(simulated in {:.1} s)", started.elapsed().as_secs_f64());
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    /// The book and the README quote `make sim`: every table row of
    /// docs/src/spanner.md's simulation section and of the README's scale
    /// section is a row the simulation prints today (the runs are seeded,
    /// so a change to the model shows here until the docs are brought up
    /// to date).
    #[test]
    fn the_book_quotes_what_make_sim_prints() {
        let book = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/src/spanner.md")).unwrap();
        let section = &book[book.find("## Scaling on real Spanner").unwrap()..];
        let (text, _, _) = super::report();
        let printed: std::collections::BTreeSet<&str> = text.lines().filter(|l| l.starts_with("| ")).collect();
        let quoted: Vec<&str> = section
            .lines()
            .skip_while(|l| !l.starts_with("What the simulation says"))
            .filter(|l| l.starts_with("| ") && !l.starts_with("| what |"))
            .collect();
        assert!(quoted.len() >= 20, "{} rows quoted", quoted.len());
        let stale: Vec<&&str> = quoted.iter().filter(|l| !printed.contains(**l)).collect();
        assert!(
            stale.is_empty(),
            "rows of the book that make sim no longer prints (run make sim, update docs/src/spanner.md):\n{stale:#?}"
        );
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
        let section = &readme[readme.find("## On real Spanner, at scale").unwrap()..];
        let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
        let quoted: Vec<&str> = section[..end].lines().filter(|l| l.starts_with("| ")).collect();
        assert!(quoted.len() >= 5, "{} rows in the README", quoted.len());
        let stale: Vec<&&str> = quoted.iter().filter(|l| !printed.contains(**l)).collect();
        assert!(stale.is_empty(), "rows of the README that make sim no longer prints:\n{stale:#?}");
    }
}
