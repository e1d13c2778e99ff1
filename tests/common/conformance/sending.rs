//! Sending: producer dedup keys within their window, delayed messages.

use super::*;

pub async fn dedup_window(store: Arc<dyn Store>, window: Duration) {
    let s = store.as_ref();
    let with_key = |k: &str| SendParams {
        dedup_key: Some(k.into()),
        ..send("q", "d")
    };
    let first = s.message_send(vec![with_key("k1")]).await.unwrap().remove(0);
    let SendOutcome::Sent { id } = first else {
        panic!("first send must be sent")
    };
    assert_eq!(
        s.message_send(vec![with_key("k1")]).await.unwrap()[0],
        SendOutcome::Duplicate { existing_id: id.clone() }
    );
    assert!(
        matches!(
            s.message_send(vec![SendParams {
                queue: "other".into(),
                ..with_key("k1")
            }])
            .await
            .unwrap()[0],
            SendOutcome::Sent { .. }
        ),
        "keys are per queue"
    );
    // a follow-up with the same key inside a message transaction is dropped too
    let mut tx = s.transaction_begin().await.unwrap();
    tx.message_enqueue(with_key("k1"));
    tx.commit().await.unwrap();
    assert_eq!(s.stats().await.unwrap().queues.iter().find(|q| q.queue == "q").unwrap().ready, 1);
    let st = store.clone();
    wait_until("the dedup window to pass", window * 20, || {
        let st = st.clone();
        async move { matches!(st.message_send(vec![with_key("k1")]).await.unwrap()[0], SendOutcome::Sent { .. }) }
    })
    .await;
    s.dedup_purge().await.unwrap();
}

/// The purge forgets every expired key, however many (on Spanner in
/// Partitioned DML), and keeps the live ones:
/// an expired key can be sent again, a live one is still a duplicate.
pub async fn purge_forgets_every_expired_key_and_keeps_the_live_ones(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let keyed = |k: String, window: Duration| SendParams {
        dedup_key: Some(k),
        dedup_window: Some(window),
        ..send("q", "d")
    };
    let short = Duration::from_millis(200);
    s.message_send((0..25).map(|i| keyed(format!("old-{i}"), short)).collect())
        .await
        .unwrap();
    s.message_send((0..5).map(|i| keyed(format!("live-{i}"), Duration::from_secs(3600))).collect())
        .await
        .unwrap();
    let purged = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (st, count) = (store.clone(), purged.clone());
    wait_until("the expired keys to be purged", Duration::from_secs(60), move || {
        let (st, count) = (st.clone(), count.clone());
        async move {
            let n = st.dedup_purge().await.unwrap();
            count.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n >= 25
        }
    })
    .await;
    assert_eq!(purged.load(std::sync::atomic::Ordering::Relaxed), 25, "only the expired keys");
    assert_eq!(s.dedup_purge().await.unwrap(), 0, "nothing left to purge");
    assert!(matches!(
        s.message_send(vec![keyed("old-7".into(), short)]).await.unwrap()[0],
        SendOutcome::Sent { .. }
    ));
    assert!(matches!(
        s.message_send(vec![keyed("live-3".into(), short)]).await.unwrap()[0],
        SendOutcome::Duplicate { .. }
    ));
}

pub async fn delayed_messages_become_visible_in_due_order(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let delayed = |p: &str, ms: u64| SendParams {
        delay: Duration::from_millis(ms),
        ..send("q", p)
    };
    s.message_send(vec![delayed("late", 600), delayed("now", 0), delayed("soon", 300)])
        .await
        .unwrap();
    let backlog = s.backlog().await.unwrap();
    let q = backlog.queues.iter().find(|q| q.queue == "q").unwrap();
    assert_eq!((q.ready, q.leased, q.delayed), (1, 0, 2), "{q:?}");
    assert!(q.next_due_ms.is_some_and(|ms| ms <= 300), "the next due in at most 300 ms: {q:?}");
    let mut order = Vec::new();
    for _ in 0..1000 {
        for m in lease(s, "q", 1, 10_000).await {
            order.push(String::from_utf8(m.message.payload.clone()).unwrap());
            ack(s, &m.lease).await.unwrap();
        }
        if order.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(order, ["now", "soon", "late"]);
}
