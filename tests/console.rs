//! The operator console in a real browser: headless Chromium driven through
//! WebDriver (chromedriver, which `make test` installs when missing) against
//! a real `onceq run`. Screenshots of each page land in
//! `target/console-screenshots/` (`make screenshots` copies them into the
//! docs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::host::Host;
use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use std::os::unix::process::CommandExt as _;
use std::time::{Duration, Instant};

/// A hostile order: markup and script in the payload (and so in the
/// handler's rejection reason).
const HOSTILE: &str =
    r#"{"order_id":"<img src=x onerror=\"window.__pwned=1\"><script>window.__pwned=2</script>","account":"acct-1","amount":-1}"#;

/// chromedriver on a free port, in a process group of its own, stopped
/// (the group killed) on drop.
struct Driver {
    child: std::process::Child,
    port: u16,
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The browsers chromedriver started are in its group: a test that
        // failed before it quit its session leaves no Chromium running
        // (killing chromedriver alone left about ten processes behind).
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn browser(dir: &std::path::Path) -> (Driver, Client) {
    let port = free_port();
    let child = std::process::Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .process_group(0)
        .stdout(std::fs::File::create(dir.join("chromedriver.log")).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("chromedriver (Debian's chromium-driver; `make test` installs it)");
    let driver = Driver { child, port };
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1360,900",
                     format!("--user-data-dir={}", dir.join("chrome").display())],
        }),
    );
    let started = Instant::now();
    loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
        {
            Ok(c) => return (driver, c),
            Err(e) => {
                assert!(started.elapsed() < Duration::from_secs(60), "chromedriver did not start: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Wait (up to 60 s) until `f` holds, saying what was awaited.
async fn until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !f().await {
        assert!(started.elapsed() < Duration::from_secs(60), "waited 60 s for {what}");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

async fn text_of(c: &Client, css: &str) -> String {
    match c.find(Locator::Css(css)).await {
        Ok(e) => e.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The text of a cell of the queues table's row for `queue`.
async fn cell(c: &Client, queue: &str, class: &str) -> String {
    text_of(c, &format!("#queues tr[data-queue=\"{queue}\"] td.{class}")).await
}

async fn shot(c: &Client, name: &str) {
    let dir = repo_root().join("target/console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    let png = c.screenshot().await.unwrap();
    std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
}

async fn click(c: &Client, css: &str) {
    c.find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css}: {e}"))
        .click()
        .await
        .unwrap();
}

/// Accept the confirm() dialog a bulk action or a rollback opens.
async fn confirm(c: &Client) {
    until("the confirmation dialog", || async move { c.get_alert_text().await.is_ok() }).await;
    c.accept_alert().await.unwrap();
}

fn config(tally: &std::path::Path) -> String {
    format!(
        r#"store = "onceq.db"
schema = "schema.sql"

[admin]
listen = "127.0.0.1:0"

[[admin.tokens]]
name = "root"
role = "admin"
secret_file = "root.secret"

[[admin.tokens]]
name = "watcher"
role = "viewer"
secret_file = "viewer.secret"

[[queue]]
name = "payments"
handler = "{payments}"
tables = ["accounts", "orders"]
connectors = ["charge"]
workers = 2
max_attempts = 1

[[queue]]
name = "tally"
handler = "{tally}"
tables = ["tally"]

[[connector]]
name = "charge"
kind = "file"
path = "charges.jsonl"
"#,
        payments = guest("payments").display(),
        tally = tally.display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_replays_pauses_deploys_and_rolls_back_in_the_browser() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    std::fs::write(
        path.join("schema.sql"),
        format!("{PAYMENTS_SQL}\nCREATE TABLE tally (id TEXT PRIMARY KEY, n INTEGER NOT NULL, build TEXT NOT NULL);"),
    )
    .unwrap();
    std::fs::write(path.join("onceq.toml"), config(&guest("tally_v1"))).unwrap();
    std::fs::write(path.join("root.secret"), "root-secret").unwrap();
    std::fs::write(path.join("viewer.secret"), "viewer-secret").unwrap();
    let mut host = Host::new(dir);
    host.token = Some("root-secret".into());
    host.ok(&["init"]).await;
    rusqlite::Connection::open(path.join("onceq.db"))
        .unwrap()
        .execute("INSERT INTO accounts (id, balance) VALUES ('acct-1', 1000000)", [])
        .unwrap();
    // Paused before the host starts (the CLI, on the database): the
    // messages wait on their queue to be browsed.
    let paused = host.ok(&["pause", "payments"]).await;
    assert!(paused.contains("paused payments"), "{paused}");
    let mut lines = Vec::new();
    for i in 0..6 {
        lines.push(order(i, 1, 10 + i as i64));
    }
    for i in 6..10 {
        lines.push(order(i, 1, -(i as i64)));
    }
    for i in 10..12 {
        lines.push(order(i, 9, 5));
    }
    lines.push(HOSTILE.to_string());
    std::fs::write(path.join("orders.jsonl"), lines.join("\n") + "\n").unwrap();
    host.ok(&["send", "payments", "--jsonl", "orders.jsonl"]).await;

    host.start().await;
    let base = host.url("/console/");

    // The page's security headers, and what a session's mutation needs.
    let r = host.http.get(&base).send().await.unwrap();
    let csp = r.headers()["content-security-policy"].to_str().unwrap().to_string();
    assert!(csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"), "{csp}");
    let form_login = host
        .http
        .post(host.url("/console/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("token=root-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(form_login.status(), 415, "a cross-site form cannot log in");
    let login = host
        .http
        .post(host.url("/console/login"))
        .json(&serde_json::json!({ "token": "root-secret" }))
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 200);
    let set_cookie = login.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        set_cookie.contains("HttpOnly") && set_cookie.contains("SameSite=Strict"),
        "{set_cookie}"
    );
    let cookie = set_cookie.split(';').next().unwrap().to_string();
    let csrf = login.json::<serde_json::Value>().await.unwrap()["csrf"]
        .as_str()
        .unwrap()
        .to_string();
    let without = host
        .http
        .post(host.url("/v1/queues/tally/pause"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(without.status(), 403, "a session's change without its CSRF token is refused");
    assert!(without.text().await.unwrap().contains("CSRF"));
    let with = host
        .http
        .post(host.url("/v1/queues/tally/resume"))
        .header("cookie", &cookie)
        .header("x-onceq-csrf", &csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(with.status(), 200);

    let (_driver, client) = browser(&path).await;
    let c = &client;
    let h = &host;

    // Log in.
    c.goto(&base).await.unwrap();
    until("the login form", || async move { c.find(Locator::Css("#token")).await.is_ok() }).await;
    c.find(Locator::Css("#token"))
        .await
        .unwrap()
        .send_keys("root-secret")
        .await
        .unwrap();
    click(c, "#login").await;
    until("the overview", || async move { cell(c, "payments", "ready").await == "13" }).await;
    assert_eq!(text_of(c, "#me").await, "root · admin");
    assert!(text_of(c, "#queues tr[data-queue=\"payments\"]").await.contains("paused"));
    // This host said it is serving: its pid, its queues, seen just now.
    let pid = host.child.as_ref().and_then(|c| c.id()).unwrap().to_string();
    until("this host among the hosts seen", || {
        let pid = pid.clone();
        async move { text_of(c, "#hosts tbody").await.contains(&format!("pid {pid}")) }
    })
    .await;
    let seen = text_of(c, "#hosts tbody").await;
    assert!(
        seen.contains("payments") && seen.contains(" ago") && !seen.contains("gone"),
        "{seen}"
    );
    shot(c, "overview-paused").await;

    // Find a message by a payload field, and open it.
    c.goto(&format!("{base}#/queue/payments")).await.unwrap();
    until("the search form", || async move {
        c.find(Locator::Css("#search input[name=field]")).await.is_ok()
    })
    .await;
    c.find(Locator::Css("#search input[name=field]"))
        .await
        .unwrap()
        .send_keys("order_id")
        .await
        .unwrap();
    c.find(Locator::Css("#search input[name=value]"))
        .await
        .unwrap()
        .send_keys("o-3")
        .await
        .unwrap();
    click(c, "#search button[type=submit]").await;
    until("one match", || async move {
        c.find_all(Locator::Css("#messages tbody tr[data-id]"))
            .await
            .map(|r| r.len())
            .unwrap_or(0)
            == 1
            && text_of(c, "#messages tbody").await.contains("o-3")
    })
    .await;
    assert!(!text_of(c, "#messages tbody").await.contains("o-4"));
    shot(c, "search").await;
    click(c, "#messages tbody tr[data-id] a.id").await;
    until("the message", || async move {
        text_of(c, "#payload").await.contains("\"order_id\": \"o-3\"")
    })
    .await;
    assert_eq!(text_of(c, "#state").await, "ready");

    // Resume: the host works the queue; the bad orders die.
    c.goto(&base).await.unwrap();
    until("the pause button", || async move {
        c.find(Locator::Css("#queues tr[data-queue=\"payments\"] button[data-action=resume]"))
            .await
            .is_ok()
    })
    .await;
    click(c, "#queues tr[data-queue=\"payments\"] button[data-action=resume]").await;
    until("the queue worked: 7 dead, none ready", || async move {
        cell(c, "payments", "ready").await == "0" && cell(c, "payments", "dead").await == "7"
    })
    .await;
    shot(c, "overview").await;

    // The hostile payload is text: no element made, no script run.
    c.goto(&format!("{base}#/queue/payments?state=dead&contains=script")).await.unwrap();
    until("the hostile dead letter", || async move {
        c.find_all(Locator::Css("#messages tbody tr[data-id]"))
            .await
            .map(|r| r.len())
            .unwrap_or(0)
            == 1
    })
    .await;
    click(c, "#messages tbody tr[data-id] a.id").await;
    until("its detail", || async move {
        text_of(c, "#payload").await.contains("<script>window.__pwned=2</script>")
    })
    .await;
    let made = c
        .execute(
            "return [document.querySelectorAll('#main img, #main script').length, window.__pwned === undefined]",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(made, serde_json::json!([0, true]), "hostile markup stays text");
    assert!(text_of(c, "#error").await.contains("<img src=x"));
    shot(c, "hostile").await;

    // Dead letters by reason; replay those of one reason (paused first,
    // so the counts can be seen to move).
    c.goto(&base).await.unwrap();
    until("the pause button", || async move {
        c.find(Locator::Css("#queues tr[data-queue=\"payments\"] button[data-action=pause]"))
            .await
            .is_ok()
    })
    .await;
    click(c, "#queues tr[data-queue=\"payments\"] button[data-action=pause]").await;
    until("paused", || async move {
        text_of(c, "#queues tr[data-queue=\"payments\"]").await.contains("paused")
    })
    .await;
    c.goto(&format!("{base}#/queue/payments?state=dead")).await.unwrap();
    // Grouped with the numbers folded.
    let groups = || async move {
        let rows = c
            .execute(
                "return [...document.querySelectorAll('#reasons tr')].map(r => [r.cells[0].textContent, r.cells[1].textContent])",
                vec![],
            )
            .await
            .unwrap();
        serde_json::from_value::<Vec<(String, String)>>(rows).unwrap()
    };
    until("the reasons", || async move { groups().await.len() == 3 }).await;
    let groups = groups().await;
    assert!(
        groups.contains(&("4".into(), "rejected by handler: order o-#: amount must be positive, got -#".into()))
            && groups.contains(&("2".into(), "rejected by handler: order o-#: unknown account acct-#".into())),
        "{groups:?}"
    );
    shot(c, "dead-letters").await;
    // One group's link filters the dead letters to it.
    click(c, "#reasons a[href*='unknown']").await;
    until("the filtered dead letters", || async move {
        c.find_all(Locator::Css("#messages tbody tr[data-id]"))
            .await
            .map(|r| r.len())
            .unwrap_or(0)
            == 2
    })
    .await;
    click(c, "#replay-matching").await;
    let asked = {
        until("the confirmation", || async move { c.get_alert_text().await.is_ok() }).await;
        c.get_alert_text().await.unwrap()
    };
    assert!(asked.contains("replay 2 dead letters"), "the count is shown before acting: {asked}");
    confirm(c).await;
    c.goto(&base).await.unwrap();
    until("2 back on the queue, 5 dead", || async move {
        cell(c, "payments", "ready").await == "2" && cell(c, "payments", "dead").await == "5"
    })
    .await;
    // Resumed, they die again (the account is still unknown).
    click(c, "#queues tr[data-queue=\"payments\"] button[data-action=resume]").await;
    until("7 dead again", || async move { cell(c, "payments", "dead").await == "7" }).await;

    // Deploy by upload, then roll back.
    c.goto(&format!("{base}#/handlers")).await.unwrap();
    until("the tally deploy form", || async move {
        c.find(Locator::Css("form[data-queue=tally] input[name=component]")).await.is_ok()
    })
    .await;
    let v2 = guest("tally_v2");
    c.find(Locator::Css("form[data-queue=tally] input[name=component]"))
        .await
        .unwrap()
        .send_keys(&v2.display().to_string())
        .await
        .unwrap();
    c.find(Locator::Css("form[data-queue=tally] input[name=label]"))
        .await
        .unwrap()
        .send_keys("v2")
        .await
        .unwrap();
    click(c, "form[data-queue=tally] button[type=submit]").await;
    let h2 = &onceq::deploy::version_of(&std::fs::read(&v2).unwrap());
    until("v2 active", || async move { h.active().await["version"] == h2.as_str() }).await;
    until("the page to show it", || async move {
        text_of(c, "section[data-queue=tally]").await.contains("v2")
    })
    .await;
    // The new version serves; the old one has nothing left in flight.
    assert_eq!(text_of(c, "section[data-queue=tally] tr.active td.drain").await, "serving");
    assert_eq!(text_of(c, "section[data-queue=tally] tr:not(.active) td.drain").await, "idle");
    shot(c, "handlers").await;
    click(c, "form[data-queue=tally] button.rollback").await;
    confirm(c).await;
    until("v1 active again", || async move { h.active().await["version"] != h2.as_str() }).await;

    // The audit trail has all of it, by the token's name. The page is a
    // snapshot: the rollback's entry is written as its request ends, which
    // can be after the switch awaited above, so reload until it shows, as
    // an operator would.
    c.goto(&format!("{base}#/audit")).await.unwrap();
    until("the audit trail", || async move {
        let t = text_of(c, "#audit").await;
        let all = ["login", "pause", "resume", "replay", "deploy", "rollback"]
            .iter()
            .all(|a| t.contains(a));
        if !all {
            c.refresh().await.unwrap();
        }
        all
    })
    .await;
    shot(c, "audit").await;

    // A viewer sees, but is offered nothing to change.
    click(c, "#logout").await;
    until("the login form", || async move { c.find(Locator::Css("#token")).await.is_ok() }).await;
    c.find(Locator::Css("#token"))
        .await
        .unwrap()
        .send_keys("viewer-secret")
        .await
        .unwrap();
    click(c, "#login").await;
    until("the overview", || async move { cell(c, "payments", "dead").await == "7" }).await;
    assert!(
        c.find_all(Locator::Css("#queues button")).await.unwrap().is_empty(),
        "no actions for a viewer"
    );
    c.goto(&format!("{base}#/queue/payments?state=dead")).await.unwrap();
    until("the dead letters", || async move {
        c.find(Locator::Css("#messages tbody tr[data-id]")).await.is_ok()
    })
    .await;
    assert!(
        c.find(Locator::Css("#replay-matching")).await.is_err(),
        "no bulk actions for a viewer"
    );

    client.close().await.unwrap();
    host.stop().await;
}
