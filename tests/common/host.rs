//! A real `onceq run` process in a temp folder, driven through its CLI and
//! its admin API.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::onceq_command;
use std::collections::BTreeMap;
use std::time::Duration;

pub fn parse_prometheus(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            assert!(
                line.is_empty()
                    || line.starts_with("# HELP ")
                    || line.starts_with("# TYPE ")
                    || line.starts_with("# UNIT ")
                    || line == "# EOF",
                "bad comment line: {line}"
            );
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "unclosed labels: {line}");
            for pair in series[name_end + 1..series.len() - 1].split("\",").filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once("=\"").unwrap_or_else(|| panic!("bad label {pair} in {line}"));
                assert!(k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "bad label name {k}");
                assert!(!v.contains('\n'));
            }
        }
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        out.insert(series.to_string(), v);
    }
    assert!(text.trim_end().ends_with("# EOF"), "OpenMetrics text ends with # EOF");
    out
}

pub struct Host {
    pub dir: tempfile::TempDir,
    pub child: Option<tokio::process::Child>,
    pub http: reqwest::Client,
    /// The bearer token [`Host::get`] sends (a host with tokens configured
    /// answers `/v1` reads only with one).
    pub token: Option<String>,
}

impl Host {
    pub fn cmd(&self, args: &[&str]) -> tokio::process::Command {
        onceq_command(self.dir.path(), args)
    }

    pub async fn onceq(&self, args: &[&str]) -> (bool, String) {
        let out = self.cmd(args).output().await.unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    }

    pub async fn ok(&self, args: &[&str]) -> String {
        let (ok, text) = self.onceq(args).await;
        assert!(ok, "onceq {args:?} failed: {text}");
        text
    }

    /// A host for the `onceq.toml` already written in `dir`.
    pub fn new(dir: tempfile::TempDir) -> Host {
        Host {
            dir,
            child: None,
            http: reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap(),
            token: None,
        }
    }

    /// Start `onceq run` and wait until `/readyz` answers 200 (not merely
    /// until the admin API listens: on a loaded machine the host answers
    /// 503 "starting" for a while).
    pub async fn start(&mut self) {
        let addr_file = self.dir.path().join(".onceq/admin.addr");
        let _ = std::fs::remove_file(&addr_file);
        let log = std::fs::File::create(self.dir.path().join("host.log")).unwrap();
        self.child = Some(self.cmd(&["run"]).stderr(log).spawn().unwrap());
        let started = std::time::Instant::now();
        loop {
            if addr_file.exists() {
                if let Ok(r) = self.http.get(self.url("/readyz")).send().await {
                    if r.status().as_u16() == 200 {
                        return;
                    }
                }
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("onceq run exited ({status}): {}", self.log());
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the host was not ready within 120 s: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What the host logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("host.log")).unwrap_or_default()
    }

    /// The host's resident memory, from /proc (Linux).
    pub fn rss_bytes(&self) -> u64 {
        let pid = self.child.as_ref().and_then(|c| c.id()).expect("host running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status");
        kb * 1024
    }

    pub async fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = c.id().unwrap().to_string();
            std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
            let status = tokio::time::timeout(Duration::from_secs(30), c.wait()).await.unwrap().unwrap();
            assert!(status.success(), "exit 0 after SIGTERM: {status}");
        }
    }

    pub fn url(&self, path: &str) -> String {
        let addr = std::fs::read_to_string(self.dir.path().join(".onceq/admin.addr")).unwrap();
        format!("http://{}{path}", addr.trim())
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let mut req = self.http.get(self.url(path));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let r = req.send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    pub async fn metrics(&self) -> BTreeMap<String, f64> {
        let (status, text) = self.get("/metrics").await;
        assert_eq!(status, 200);
        parse_prometheus(&text)
    }

    pub async fn active(&self) -> serde_json::Value {
        let (_, text) = self.get("/v1/queues/tally/versions").await;
        let list: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        list.into_iter().find(|v| v["active"] == true).unwrap()
    }
}
