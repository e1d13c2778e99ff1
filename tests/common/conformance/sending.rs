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

pub async fn delayed_messages_become_visible_in_due_order(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let delayed = |p: &str, ms: u64| SendParams {
        delay: Duration::from_millis(ms),
        ..send("q", p)
    };
    s.message_send(vec![delayed("late", 600), delayed("now", 0), delayed("soon", 300)])
        .await
        .unwrap();
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
