//! The transactional outbox: intents committed with the ack, leased, delivered and their keys held.

use super::*;

/// Intents are outbox-queue messages: emitted in the message's transaction,
/// deduplicated by key while undelivered, and after delivery for the
/// retention window only.
pub async fn outbox_intents(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let emit = |keys: &[&str]| {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        async move {
            let mut tx = s.transaction_begin().await.unwrap();
            for k in &keys {
                tx.message_enqueue(outbox::intent_message(&source(), intent("charge", k)));
            }
            tx.commit().await.unwrap();
        }
    };
    emit(&["k1", "k2"]).await;
    emit(&["k1"]).await;
    let mut tx = s.transaction_begin().await.unwrap();
    tx.message_enqueue(outbox::intent_message(&source(), intent("charge", "rolled-back")));
    tx.rollback().await;
    let queued = s.message_list(Queues::Prefix(outbox::QUEUE_PREFIX), 10).await.unwrap();
    let intents: Vec<outbox::Intent> = queued.iter().filter_map(outbox::Intent::from_queued).collect();
    let mut keys: Vec<&str> = intents.iter().map(|i| i.idempotency_key.as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["k1", "k2"], "a re-emitted key is kept once; a rolled-back one never appears");
    let k1 = intents.iter().find(|i| i.idempotency_key == "k1").unwrap();
    assert_eq!((k1.connector.as_str(), k1.payload_text().as_str()), ("charge", r#"{"amount": 5}"#));
    assert_eq!(
        k1.metadata,
        vec![("m".to_string(), "1".to_string())],
        "onceq's own attributes are not metadata"
    );
    assert_eq!((k1.source_queue.as_str(), k1.source_message_id.as_str()), ("payments", "m-1"));
    let got = s.message_get(&k1.id).await.unwrap().expect("message_get finds an intent by id");
    assert_eq!(got.queue, outbox::queue_of("charge"));
    assert!(s.message_get("no-such-id").await.unwrap().is_none());
    let q = outbox::queue_of("charge");
    let stats = s.stats().await.unwrap();
    let st = stats.queues.iter().find(|x| x.queue == q).unwrap();
    assert_eq!((st.ready, st.dedup_keys), (2, 2));
    let retention = Duration::from_millis(1500);
    assert!(
        s.dedup_list(Queues::Named(&q), retention, 10).await.unwrap().is_empty(),
        "keys held until delivery are not among the delivered"
    );

    // Delivered (the dispatcher's ack): the key is kept for the retention
    // window only.
    let leased = lease(s, &q, 10, 10_000).await;
    assert_eq!(leased.len(), 2);
    for m in &leased {
        let key = outbox::Intent::from_message(&m.message).unwrap().idempotency_key;
        let mut tx = s.transaction_begin().await.unwrap();
        tx.message_ack(&m.lease);
        tx.dedup_hold(&q, &key, retention);
        tx.commit().await.unwrap();
    }
    let delivered = s.dedup_list(Queues::Named(&q), retention, 10).await.unwrap();
    let mut keys: Vec<&str> = delivered.iter().map(|k| k.key.as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["k1", "k2"], "the delivered intents' keys: {delivered:?}");
    assert!(delivered.iter().all(|k| leased.iter().any(|m| m.message.id == k.message_id)));
    let stats = s.stats().await.unwrap();
    assert_eq!(
        stats.queues.iter().find(|x| x.queue == q).unwrap().processed,
        2,
        "two deliveries counted"
    );
    emit(&["k1"]).await;
    assert!(
        s.message_list(Queues::Named(&q), 10).await.unwrap().is_empty(),
        "a delivered key emitted again within the retention window is dropped"
    );
    assert_eq!(s.dedup_purge().await.unwrap(), 0, "keys within retention are not purged");
    tokio::time::sleep(retention + Duration::from_millis(300)).await;
    assert_eq!(s.dedup_purge().await.unwrap(), 2, "both delivered keys purged after the retention");
    emit(&["k1"]).await;
    assert_eq!(
        s.message_list(Queues::Named(&q), 10).await.unwrap().len(),
        1,
        "after the retention window the key is new again"
    );
}
