//! Leasing, acking, renewing, releasing and fencing by lease token; retries and dead letters with what each message was charged.

use super::*;

pub async fn lease_and_ack(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.message_send(vec![send("q", "1"), send("q", "2"), send("q", "3"), send("other", "x")])
        .await
        .unwrap();
    let got = lease(s, "q", 2, 10_000).await;
    assert_eq!(got.len(), 2);
    assert!(got.iter().all(|m| m.message.attempt == 1 && m.message.queue == "q"));
    assert!(
        got[0].message.enqueued_at > 1_600_000_000_000_000,
        "enqueued_at is database time in µs"
    );
    let stats = s.stats().await.unwrap();
    let q = stats.queues.iter().find(|q| q.queue == "q").unwrap();
    assert_eq!((q.ready, q.leased, q.delayed), (1, 2, 0));
    let other = stats.queues.iter().find(|q| q.queue == "other").unwrap();
    assert_eq!((other.ready, other.leased, other.delayed), (1, 0, 0), "every queue is counted");
    // What `run --until-empty` asks: the same message counts.
    let backlog = s.backlog().await.unwrap();
    let counts = |st: &onceq::store::Stats| -> Vec<_> {
        st.queues
            .iter()
            .map(|q| (q.queue.clone(), q.ready, q.leased, q.delayed, q.expired_leases))
            .collect()
    };
    assert_eq!(counts(&backlog), counts(&stats), "the backlog counts what stats counts");
    ack(s, &got[0].lease).await.unwrap();
    assert!(
        matches!(ack(s, &got[0].lease).await, Err(StoreError::LeaseLost { .. })),
        "a second ack fails"
    );
    let stats = s.stats().await.unwrap();
    let q = stats.queues.iter().find(|q| q.queue == "q").unwrap();
    assert_eq!(q.processed, 1, "the ack is counted once, the refused one not at all");
    assert!(q.last_processed_at.is_some_and(|t| t > 1_600_000_000_000_000), "{q:?}");
    let other = stats.queues.iter().find(|q| q.queue == "other").unwrap();
    assert_eq!((other.processed, other.last_processed_at), (0, None));
    let rest = lease(s, "q", 10, 10_000).await;
    assert_eq!(rest.len(), 1, "leased messages are invisible");
    assert_eq!(lease(s, "other", 10, 10_000).await.len(), 1, "queues are separate");
    ack(s, &rest[0].lease).await.unwrap();
    let stats = s.stats().await.unwrap();
    let q = stats.queues.iter().find(|q| q.queue == "q").unwrap();
    assert_eq!(q.processed, 2, "a later ack adds to the count");
}

pub async fn expiry_and_token_fencing(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.message_send(vec![send("q", "m")]).await.unwrap();
    let first = lease(s, "q", 1, 200).await.remove(0);
    let mut second = Vec::new();
    for _ in 0..500 {
        second = lease(s, "q", 1, 10_000).await;
        if !second.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = second.pop().expect("re-leased after the lease expired");
    assert_eq!(second.message.id, first.message.id);
    assert_eq!(second.message.attempt, 2);
    assert_ne!(second.lease.token, first.lease.token);
    let stale = &first.lease;
    assert!(matches!(ack(s, stale).await, Err(StoreError::LeaseLost { .. })));
    assert!(matches!(
        s.message_retry_later(stale, retry(Duration::ZERO, "x", true)).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_eq!(
        s.message_lease_renew(&[stale.clone(), second.lease.clone()], Duration::from_secs(1))
            .await
            .unwrap(),
        vec![false, true],
        "a renewal says which leases are lost"
    );
    assert!(matches!(s.message_release(stale).await, Err(StoreError::LeaseLost { .. })));
    let dl = DeadLetterParams {
        reason: "x".into(),
        handler_version: None,
        failed: true,
    };
    assert!(matches!(s.message_dead_letter(stale, dl).await, Err(StoreError::LeaseLost { .. })));
    ack(s, &second.lease).await.unwrap();
}

pub async fn renew_keeps_the_lease(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.message_send(vec![send("renewed", "r"), send("control", "c")]).await.unwrap();
    let renewed = lease(s, "renewed", 1, 300).await.remove(0);
    let _control = lease(s, "control", 1, 300).await.remove(0);
    assert_eq!(
        s.message_lease_renew(std::slice::from_ref(&renewed.lease), Duration::from_secs(30))
            .await
            .unwrap(),
        vec![true]
    );
    let st = store.clone();
    wait_until("the control lease to expire", Duration::from_secs(10), || {
        let st = st.clone();
        async move { !lease(st.as_ref(), "control", 1, 10_000).await.is_empty() }
    })
    .await;
    assert!(
        lease(s, "renewed", 1, 10_000).await.is_empty(),
        "a renewed lease does not expire with the original deadline"
    );
    ack(s, &renewed.lease).await.unwrap();
}

pub async fn retry_later_and_release(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.message_send(vec![send("q", "m")]).await.unwrap();
    let m = lease(s, "q", 1, 10_000).await.remove(0);
    // Long enough that the stats and the lease below finish inside it on a
    // loaded machine (200 ms was not, on the emulator during the full suite).
    s.message_retry_later(&m.lease, retry(Duration::from_secs(2), "busy", true))
        .await
        .unwrap();
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.queues[0].delayed, 1);
    assert!(stats.queues[0].next_due_ms.is_some_and(|ms| ms <= 2_000));
    assert!(lease(s, "q", 1, 10_000).await.is_empty(), "not visible during the backoff");
    let st = store.clone();
    wait_until("the retry to become visible", Duration::from_secs(10), || {
        let st = st.clone();
        async move { st.stats().await.unwrap().queues[0].ready == 1 }
    })
    .await;
    let again = lease(s, "q", 1, 10_000).await.remove(0);
    assert_eq!((again.message.attempt, again.failures), (2, 1));
    s.message_release(&again.lease).await.unwrap();
    let third = lease(s, "q", 1, 10_000).await.remove(0);
    assert_eq!(
        (third.message.attempt, third.failures),
        (2, 1),
        "a release does not count a delivery"
    );
}

/// Failures and deliveries are two counts: a lease is a delivery; only a
/// retry that says it failed, or a dead letter for a failure, is a
/// failure. Listings and dead letters show both.
pub async fn failures_and_deliveries_are_counted_apart(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.message_send(vec![send("q", "m")]).await.unwrap();
    // A lease that expires without a verdict (a crashed host).
    let first = lease(s, "q", 1, 100).await.remove(0);
    assert_eq!((first.message.attempt, first.failures), (1, 0));
    let st = store.clone();
    wait_until("the lease to expire", Duration::from_secs(10), || {
        let st = st.clone();
        async move { st.stats().await.unwrap().queues[0].ready == 1 }
    })
    .await;
    let q = &s.stats().await.unwrap().queues[0];
    assert_eq!(
        (q.ready, q.expired_leases, q.leased),
        (1, 1, 0),
        "the ready message's lease expired"
    );
    // Deferred for the host's trouble: not a failure.
    let second = lease(s, "q", 1, 10_000).await.remove(0);
    assert_eq!((second.message.attempt, second.failures), (2, 0));
    s.message_retry_later(&second.lease, retry(Duration::ZERO, "store trouble", false))
        .await
        .unwrap();
    // A failure of its own.
    let third = lease(s, "q", 1, 10_000).await.remove(0);
    assert_eq!((third.message.attempt, third.failures), (3, 0));
    s.message_retry_later(&third.lease, retry(Duration::from_secs(60), "handler crashed", true))
        .await
        .unwrap();
    let listed = s.message_get(&third.message.id).await.unwrap().expect("still queued");
    assert_eq!((listed.deliveries, listed.failures), (3, 1));
    assert_eq!(listed.last_error.as_deref(), Some("handler crashed"));
    let listed = s.message_list(Queues::Named("q"), 10).await.unwrap();
    assert_eq!((listed[0].deliveries, listed[0].failures), (3, 1));
}

/// A dead letter records the deliveries and the failures: one more for a
/// failure, none more for a message parked without a verdict.
pub async fn dead_letters_count_failures_and_deliveries(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.message_send(vec![send("failed", "f"), send("parked", "p")]).await.unwrap();
    let f = lease(s, "failed", 1, 10_000).await.remove(0);
    s.message_retry_later(&f.lease, retry(Duration::ZERO, "boom", true)).await.unwrap();
    let f = lease(s, "failed", 1, 10_000).await.remove(0);
    let dead = |failed| DeadLetterParams {
        reason: "gave up".into(),
        handler_version: None,
        failed,
    };
    s.message_dead_letter(&f.lease, dead(true)).await.unwrap();
    let p = lease(s, "parked", 1, 10_000).await.remove(0);
    s.message_dead_letter(&p.lease, dead(false)).await.unwrap();
    let d = s.dead_letter_get(&f.message.id).await.unwrap().unwrap();
    assert_eq!((d.deliveries, d.failures), (2, 2));
    let d = s.dead_letter_get(&p.message.id).await.unwrap().unwrap();
    assert_eq!((d.deliveries, d.failures), (1, 0));
    // A replay starts both counts again.
    s.dead_letter_replay(&f.message.id).await.unwrap();
    let back = lease(s, "failed", 1, 10_000).await.remove(0);
    assert_eq!((back.message.attempt, back.failures), (1, 0));
}

fn retry(delay: Duration, reason: &str, failed: bool) -> RetryParams {
    RetryParams {
        delay,
        reason: reason.into(),
        failed,
    }
}

pub async fn dead_letter_and_replay(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.message_send(vec![SendParams {
        attributes: vec![("k".into(), "v".into())],
        ..send("q", "poison")
    }])
    .await
    .unwrap();
    let m = lease(s, "q", 1, 10_000).await.remove(0);
    s.message_dead_letter(
        &m.lease,
        DeadLetterParams {
            reason: "it is poison".into(),
            handler_version: Some("v1".into()),
            failed: true,
        },
    )
    .await
    .unwrap();
    assert!(lease(s, "q", 1, 10_000).await.is_empty());
    let dead = s.dead_letter_list(Queues::Named("q"), 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!(
        (d.id.as_str(), d.reason.as_str(), d.deliveries, d.failures, d.payload.as_slice()),
        (m.message.id.as_str(), "it is poison", 1, 1, b"poison".as_slice())
    );
    assert_eq!(d.attributes, vec![("k".to_string(), "v".to_string())]);
    assert_eq!(d.handler_version.as_deref(), Some("v1"));
    assert_eq!(s.stats().await.unwrap().queues[0].dead, 1);
    assert!(s.dead_letter_get(&d.id).await.unwrap().is_some());
    assert_eq!(s.dead_letter_replay(&d.id).await.unwrap().as_deref(), Some(d.id.as_str()));
    assert_eq!(s.dead_letter_replay(&d.id).await.unwrap(), None);
    let back = lease(s, "q", 1, 10_000).await.remove(0);
    assert_eq!((back.message.attempt, back.message.payload.as_slice()), (1, b"poison".as_slice()));

    // Discarded, with its audit entry in the same transaction; a discard
    // of nothing records nothing.
    use onceq::store::{AuditEntry, Settle};
    s.message_dead_letter(
        &back.lease,
        DeadLetterParams {
            reason: "poison again".into(),
            handler_version: None,
            failed: true,
        },
    )
    .await
    .unwrap();
    let entry = AuditEntry::now("ops", "discard", Some("q"), &d.id);
    assert_eq!(
        s.dead_letter_settle(&d.id, Settle::Discard, Some(&entry)).await.unwrap().as_deref(),
        Some(d.id.as_str())
    );
    assert_eq!(s.dead_letter_settle(&d.id, Settle::Discard, Some(&entry)).await.unwrap(), None);
    assert!(s.dead_letter_get(&d.id).await.unwrap().is_none());
    assert!(lease(s, "q", 1, 10_000).await.is_empty(), "a discarded letter is not replayed");
    s.audit_append(&AuditEntry::now("deployer", "deploy", None, "v2").with_signer(Some("key 1234".into())))
        .await
        .unwrap();
    let trail = s.audit_list(Queues::All, 10).await.unwrap();
    assert_eq!(trail.len(), 2, "{trail:?}");
    assert_eq!((trail[0].action.as_str(), trail[0].signer.as_deref()), ("deploy", Some("key 1234")));
    assert_eq!(trail[1], entry);
    assert_eq!(s.audit_list(Queues::Named("q"), 10).await.unwrap(), vec![entry]);
    assert_eq!(
        s.audit_prune(std::time::Duration::from_secs(3600)).await.unwrap(),
        0,
        "recent entries are kept"
    );
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    assert_eq!(s.audit_prune(std::time::Duration::ZERO).await.unwrap(), 2);
    assert!(s.audit_list(Queues::All, 10).await.unwrap().is_empty());
}

/// The console's paging: each state of a queue browsed page by page along
/// its index, every message once; dead letters newest first; a queue
/// paused and resumed, audited in the same transaction.
pub async fn browse_and_pause(store: Arc<dyn Store>) {
    use onceq::store::{AuditEntry, BrowseKey, LiveState};
    let s = store.as_ref();
    let mut sends: Vec<SendParams> = (0..5).map(|i| send("b", &format!("ready {i}"))).collect();
    sends.extend((0..2).map(|i| SendParams {
        delay: std::time::Duration::from_secs(3600),
        ..send("b", &format!("later {i}"))
    }));
    sends.push(send("other", "elsewhere"));
    s.message_send(sends).await.unwrap();
    let held = lease(s, "b", 1, 60_000).await.remove(0);

    let mut seen = Vec::new();
    let mut after: Option<BrowseKey> = None;
    loop {
        let page = s.message_browse("b", LiveState::Ready, after.as_ref(), 2).await.unwrap();
        assert!(page.len() <= 2);
        let Some(last) = page.last() else { break };
        after = Some(BrowseKey {
            at: last.visible_at,
            id: last.id.clone(),
        });
        seen.extend(page.iter().map(|m| m.id.clone()));
    }
    assert_eq!(seen.len(), 4, "every ready message once: {seen:?}");
    assert!(!seen.contains(&held.message.id), "the leased one is not ready");
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 4);
    let delayed = s.message_browse("b", LiveState::Delayed, None, 10).await.unwrap();
    assert_eq!(delayed.len(), 2);
    assert!(delayed.iter().all(|m| m.payload_text.starts_with("later")));
    let leased = s.message_browse("b", LiveState::Leased, None, 10).await.unwrap();
    assert_eq!(
        leased.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        vec![held.message.id.as_str()]
    );
    assert!(leased[0].leased);

    s.message_dead_letter(
        &held.lease,
        DeadLetterParams {
            reason: "browse me".into(),
            handler_version: None,
            failed: true,
        },
    )
    .await
    .unwrap();
    let more = lease(s, "b", 1, 60_000).await.remove(0);
    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    s.message_dead_letter(
        &more.lease,
        DeadLetterParams {
            reason: "and me".into(),
            handler_version: None,
            failed: true,
        },
    )
    .await
    .unwrap();
    let first = s.dead_letter_browse("b", None, 1).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].reason, "and me", "newest first");
    let next = s
        .dead_letter_browse(
            "b",
            Some(&BrowseKey {
                at: first[0].failed_at,
                id: first[0].id.clone(),
            }),
            10,
        )
        .await
        .unwrap();
    assert_eq!(next.iter().map(|d| d.reason.as_str()).collect::<Vec<_>>(), vec!["browse me"]);
    assert!(s.message_browse("b", LiveState::Leased, None, 10).await.unwrap().is_empty());

    let entry = AuditEntry::now("ops", "pause", Some("b"), "");
    assert!(s.queue_pause("b", true, Some(&entry)).await.unwrap());
    assert!(
        !s.queue_pause("b", true, None).await.unwrap(),
        "pausing a paused queue changes nothing"
    );
    let paused = s.queue_paused().await.unwrap();
    assert_eq!(
        paused.iter().map(|p| (p.queue.as_str(), p.by.as_str())).collect::<Vec<_>>(),
        vec![("b", "ops")]
    );
    assert!(paused[0].paused_at > 1_600_000_000_000_000);
    assert!(s.audit_list(Queues::Named("b"), 10).await.unwrap().contains(&entry));
    assert!(s.queue_pause("b", false, None).await.unwrap());
    assert!(s.queue_paused().await.unwrap().is_empty());
}

/// Hosts say they are serving: one row per host, updated in place,
/// listed within a time, most recently seen first.
pub async fn host_heartbeats(store: Arc<dyn Store>) {
    use onceq::store::HostBeat;
    let s = store.as_ref();
    let mut beat = HostBeat {
        id: "h1".into(),
        name: "box-1".into(),
        pid: 42,
        version: "0.1.0".into(),
        started_at: 1,
        seen_at: 0,
        queues: vec!["q".into(), "onceq.outbox.hook".into()],
        in_flight: 2,
        finished: 5,
    };
    s.host_beat(&beat).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let other = HostBeat {
        id: "h2".into(),
        name: "box-2".into(),
        ..beat.clone()
    };
    s.host_beat(&other).await.unwrap();
    beat.finished = 9;
    beat.in_flight = 0;
    tokio::time::sleep(Duration::from_millis(5)).await;
    s.host_beat(&beat).await.unwrap();
    let seen = s.hosts_seen(Duration::from_secs(600)).await.unwrap();
    assert_eq!(
        seen.iter().map(|h| h.id.as_str()).collect::<Vec<_>>(),
        ["h1", "h2"],
        "one row per host, latest first"
    );
    let h1 = &seen[0];
    assert_eq!((h1.finished, h1.in_flight, h1.pid, h1.started_at), (9, 0, 42, 1));
    assert_eq!((h1.name.as_str(), h1.version.as_str()), ("box-1", "0.1.0"));
    assert_eq!(h1.queues, ["q", "onceq.outbox.hook"]);
    assert!(
        h1.seen_at > 1_600_000_000_000_000 && h1.seen_at > seen[1].seen_at,
        "database time: {seen:?}"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        s.hosts_seen(Duration::from_millis(20)).await.unwrap().is_empty(),
        "not seen within the last 20 ms"
    );
    // The purge chore forgets hosts silent for longer than its age.
    assert_eq!(s.hosts_prune(Duration::from_secs(600)).await.unwrap(), 0, "both seen recently");
    assert_eq!(s.hosts_prune(Duration::from_millis(20)).await.unwrap(), 2);
    assert!(s.hosts_seen(Duration::from_secs(600)).await.unwrap().is_empty());
}
