//! Many teams, one host: tokens with roles and queues, the audit trail of
//! every mutating action (and of refusals), and signed components, through
//! a real `onceq run` and the CLI.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::host::Host;
use common::*;
use onceq::deploy::version_of;

const TALLY_SQL: &str = "CREATE TABLE tally (id TEXT PRIMARY KEY, n INTEGER NOT NULL, build TEXT NOT NULL);";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A dead letter on `queue`, as the host would have left one.
fn dead_letter(db: &std::path::Path, id: &str, queue: &str) {
    rusqlite::Connection::open(db)
        .unwrap()
        .execute(
            "INSERT INTO onceq_dead_letters (id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, failures)
             VALUES (?1, ?2, ?3, '[]', 1, 1, 2, 'rejected by handler: test', 1)",
            rusqlite::params![id, queue, b"{\"i\": 1}".to_vec()],
        )
        .unwrap();
}

async fn post(host: &Host, path: &str, token: &str, body: Vec<u8>) -> (u16, String) {
    let r = host
        .http
        .post(host.url(path))
        .header("connection", "close")
        .bearer_auth(token)
        .body(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn get_as(host: &Host, path: &str, token: Option<&str>) -> (u16, String) {
    let mut req = host.http.get(host.url(path));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The CLI as the holder of `token`.
async fn onceq_as(host: &Host, token: &str, args: &[&str]) -> (bool, String) {
    let out = host.cmd(args).env("ONCEQ_ADMIN_TOKEN", token).output().await.unwrap();
    (
        out.status.success(),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_act_within_their_role_and_queues_and_every_action_is_audited() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("schema.sql"), TALLY_SQL).unwrap();
    std::fs::write(dir.path().join("deployer.secret"), "deploy-tally\n").unwrap();
    std::fs::write(dir.path().join("operator.secret"), "operate-tally").unwrap();
    let viewer_sha = hex(&onceq::access::digest("view-tally"));
    std::fs::write(
        dir.path().join("onceq.toml"),
        format!(
            r#"store = "onceq.db"
schema = "schema.sql"

[admin]
listen = "127.0.0.1:0"
token = "root"

[[admin.tokens]]
name = "tally-deployer"
role = "deployer"
queues = ["tally"]
secret_file = "deployer.secret"

[[admin.tokens]]
name = "tally-operator"
role = "operator"
queues = ["tal*"]
secret_file = "operator.secret"

[[admin.tokens]]
name = "tally-viewer"
role = "viewer"
queues = ["tally"]
sha256 = "{viewer_sha}"

[[queue]]
name = "tally"
handler = "{v1}"
tables = ["tally"]

[[queue]]
name = "other"
handler = "{v1}"
tables = ["tally"]
"#,
            v1 = guest("tally_v1").display()
        ),
    )
    .unwrap();
    let mut host = Host::new(dir);
    host.ok(&["init"]).await;
    host.start().await;
    let v2 = std::fs::read(guest("tally_v2")).unwrap();
    let h2 = version_of(&v2);

    // Reads need a token once tokens exist, and show the token's queues.
    assert_eq!(get_as(&host, "/v1/stats", None).await.0, 401);
    let (status, stats) = get_as(&host, "/v1/stats", Some("view-tally")).await;
    assert_eq!(status, 200, "{stats}");
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert!(
        stats["active_versions"].get("tally").is_some() && stats["active_versions"].get("other").is_none(),
        "{stats}"
    );
    let (_, all) = get_as(&host, "/v1/stats", Some("root")).await;
    assert!(all.contains("\"other\""), "the admin token sees every queue: {all}");
    assert_eq!(get_as(&host, "/v1/queues/other/versions", Some("view-tally")).await.0, 403);

    // Roles: a viewer may not deploy; a deployer only its queues.
    let (status, why) = post(&host, "/v1/queues/tally/deploy", "view-tally", v2.clone()).await;
    assert_eq!(status, 403, "{why}");
    assert!(
        why.contains("token tally-viewer (role viewer) may not deploy") && why.contains("needs role deployer or admin"),
        "{why}"
    );
    let (status, why) = post(&host, "/v1/queues/tally/rollback", "view-tally", vec![]).await;
    assert_eq!(status, 403, "{why}");
    // An encoded queue name is refused, not matched against the patterns raw.
    let (status, why) = post(&host, "/v1/queues/tall%79/deploy", "deploy-tally", v2.clone()).await;
    assert_eq!(status, 400, "{why}");
    let (status, why) = post(&host, "/v1/queues/other/deploy", "deploy-tally", v2.clone()).await;
    assert_eq!(status, 403, "{why}");
    assert!(
        why.contains("may not touch queue other") && why.contains("its queues are tally"),
        "{why}"
    );
    let (ok, out) = onceq_as(
        &host,
        "deploy-tally",
        &["deploy", "tally", guest("tally_v2").to_str().unwrap(), "--label", "v2"],
    )
    .await;
    assert!(ok && out.contains(&format!("deployed {h2} to tally (v2)")), "{out}");
    let (ok, out) = onceq_as(&host, "deploy-tally", &["versions", "tally", "--json"]).await;
    assert!(ok, "{out}");
    let versions: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(versions[0]["by"], "tally-deployer", "{versions}");

    // Dead letters: an operator of tal* replays and discards; a viewer cannot.
    let db = host.dir.path().join("onceq.db");
    for (id, queue) in [("d-1", "tally"), ("d-2", "tally"), ("d-3", "other")] {
        dead_letter(&db, id, queue);
    }
    let (status, why) = post(&host, "/v1/dead/d-1/discard", "view-tally", vec![]).await;
    assert_eq!(status, 403, "{why}");
    let (ok, out) = onceq_as(&host, "operate-tally", &["dlq", "replay", "d-1", "--admin", &host.url("")]).await;
    assert!(ok && out.contains("replayed d-1 (queue tally)"), "{out}");
    let (status, why) = post(&host, "/v1/dead/d-3/replay", "operate-tally", vec![]).await;
    assert_eq!(status, 403, "{why}");
    assert!(why.contains("may not touch queue other"), "{why}");
    let (status, body) = post(&host, "/v1/dead/d-2/discard", "operate-tally", vec![]).await;
    assert_eq!(status, 200, "{body}");
    let (status, dead) = get_as(&host, "/v1/dead", Some("operate-tally")).await;
    assert_eq!(status, 200);
    assert!(
        !dead.contains("d-2") && !dead.contains("d-3"),
        "discarded, and other's is out of scope: {dead}"
    );
    // Locally, on the database: recorded as local:USER.
    let out = host.ok(&["dlq", "discard", "d-3"]).await;
    assert!(out.contains("discarded d-3 (queue other)"), "{out}");
    let remaining: i64 = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row("SELECT count(*) FROM onceq_dead_letters", [], |r| r.get(0))
        .unwrap();
    assert_eq!(remaining, 0);

    // The trail: every action and every refusal of a known token, newest first.
    let out = host.ok(&["audit", "--json", "--limit", "100"]).await;
    let trail: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let has = |actor: &str, action: &str, queue: &str, result: &str| {
        trail.iter().any(|e| {
            e["actor"].as_str().unwrap_or("").starts_with(actor)
                && e["action"] == action
                && e["queue"] == queue
                && e["result"].as_str().unwrap_or("").starts_with(result)
        })
    };
    assert!(
        has("tally-viewer", "deploy", "tally", "refused: token tally-viewer (role viewer)"),
        "{out}"
    );
    assert!(has("tally-deployer", "deploy", "other", "refused"), "{out}");
    assert!(
        has("tally-viewer", "rollback", "tally", "refused: token tally-viewer (role viewer)"),
        "{out}"
    );
    assert!(has("tally-deployer", "deploy", "tally", "ok"), "{out}");
    assert!(has("tally-operator", "replay", "tally", "ok"), "{out}");
    assert!(has("tally-operator", "discard", "tally", "ok"), "{out}");
    assert!(has("tally-operator", "replay", "other", "refused"), "{out}");
    assert!(has("local:", "discard", "other", "ok"), "{out}");
    assert!(
        trail.iter().any(|e| e["subject"] == h2.as_str()),
        "the deploy names its version: {out}"
    );
    let text = host.ok(&["audit"]).await;
    assert!(
        text.lines().next().unwrap().contains("discard") && text.contains("local:"),
        "newest first: {text}"
    );
    // Through the API, a token sees the entries of its queues only.
    let (status, scoped) = get_as(&host, "/v1/audit?limit=100", Some("view-tally")).await;
    assert_eq!(status, 200);
    let scoped: Vec<serde_json::Value> = serde_json::from_str(&scoped).unwrap();
    assert!(!scoped.is_empty() && scoped.iter().all(|e| e["queue"] == "tally"), "{scoped:?}");
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_components_signed_by_a_trusted_key_are_run_deployed_or_rolled_back_to() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    std::fs::write(d.join("schema.sql"), TALLY_SQL).unwrap();
    std::fs::create_dir(d.join("handlers")).unwrap();
    std::fs::copy(guest("tally_v1"), d.join("v1.wasm")).unwrap();
    std::fs::copy(guest("tally_v2"), d.join("v2.wasm")).unwrap();
    let config = |trusted: &str| {
        format!(
            "store = \"onceq.db\"\nschema = \"schema.sql\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"root\"\n\n\
             [deploy]\nwatch = \"handlers\"\npoll = \"100ms\"\ntrusted_keys = [{trusted}]\nrequire_signature = true\n\n\
             [[queue]]\nname = \"tally\"\nhandler = \"v1.wasm\"\ntables = [\"tally\"]\n"
        )
    };
    let mut host = Host::new(dir);
    host.token = Some("root".into());
    let out = host.ok(&["keygen", "team"]).await;
    let public = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("trusted_keys = [\""))
        .unwrap()
        .trim_end_matches("\"]")
        .to_string();
    let key_id = out
        .lines()
        .find_map(|l| l.strip_prefix("key id "))
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let _ = host.ok(&["keygen", "stranger"]).await;
    std::fs::write(d.join("onceq.toml"), config(&format!("\"{public}\""))).unwrap();
    host.ok(&["init"]).await;

    // An unsigned handler in the config: the host does not start.
    let (ok, out) = host.onceq(&["run", "--until-empty"]).await;
    assert!(!ok && out.contains("v1.wasm refused") && out.contains("not signed"), "{out}");
    let out = host.ok(&["sign", "v1.wasm", "--key", "team.key"]).await;
    assert!(out.contains(&format!("by key {key_id}")), "{out}");
    host.start().await;

    // Deploys: unsigned, signed by a stranger, changed after signing.
    let v2 = d.join("v2.wasm");
    let (ok, out) = host.onceq(&["deploy", "tally", v2.to_str().unwrap()]).await;
    assert!(!ok && out.contains("not signed, and deploy.require_signature is on"), "{out}");
    host.ok(&["sign", "v2.wasm", "--key", "stranger.key"]).await;
    let (ok, out) = host.onceq(&["deploy", "tally", v2.to_str().unwrap()]).await;
    assert!(
        !ok && out.contains("which is not in deploy.trusted_keys") && out.contains(&key_id),
        "{out}"
    );
    host.ok(&["sign", "v2.wasm", "--key", "team.key"]).await;
    let mut changed = std::fs::read(&v2).unwrap();
    changed.extend_from_slice(&[0, 0]);
    std::fs::write(d.join("v2x.wasm"), &changed).unwrap();
    std::fs::copy(d.join("v2.wasm.minisig"), d.join("v2x.wasm.minisig")).unwrap();
    let (ok, out) = host.onceq(&["deploy", "tally", d.join("v2x.wasm").to_str().unwrap()]).await;
    assert!(!ok && out.contains("does not match the component's bytes"), "{out}");
    let h2 = version_of(&std::fs::read(&v2).unwrap());
    let out = host.ok(&["deploy", "tally", v2.to_str().unwrap()]).await;
    assert!(
        out.contains(&format!("deployed {h2}")) && out.contains(&format!("signed by key {key_id}")),
        "{out}"
    );
    assert_eq!(host.active().await["signer"]["key_id"], key_id.as_str());

    // The watched folder: the .minisig beside the file counts, even late.
    std::fs::copy(d.join("v1.wasm"), d.join("handlers/tally.wasm")).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(host.active().await["version"], h2.as_str(), "unsigned in the folder: refused");
    std::fs::copy(d.join("v1.wasm.minisig"), d.join("handlers/tally.wasm.minisig")).unwrap();
    let h1 = version_of(&std::fs::read(d.join("v1.wasm")).unwrap());
    wait_until("the signed watched file to be deployed", std::time::Duration::from_secs(30), || {
        let (h, h1) = (&host, h1.clone());
        async move { h.active().await["version"] == h1.as_str() }
    })
    .await;

    // The audit trail records the signer.
    let out = host.ok(&["audit", "--json"]).await;
    let trail: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert!(
        trail
            .iter()
            .any(|e| e["action"] == "deploy" && e["subject"] == h2.as_str() && e["signer"].as_str().is_some_and(|s| s.contains(&key_id))),
        "{out}"
    );
    assert!(
        trail
            .iter()
            .any(|e| e["action"] == "deploy" && e["result"].as_str().unwrap().contains("not in deploy.trusted_keys")),
        "{out}"
    );
    host.stop().await;

    // A key no longer trusted: the deployed version it signed is refused at
    // the next start.
    let stranger = std::fs::read_to_string(d.join("stranger.pub")).unwrap();
    let stranger_key = stranger.lines().nth(1).unwrap().trim().to_string();
    std::fs::write(d.join("onceq.toml"), config(&format!("\"{stranger_key}\""))).unwrap();
    let (ok, out) = host.onceq(&["run", "--until-empty"]).await;
    assert!(!ok && out.contains("not in deploy.trusted_keys"), "{out}");
}
