//! Group commit: messages committed in one batch stay isolated from each other.

use super::*;

/// Group commit: five message transactions committed in one batch (the
/// store is opened with a `commit.max_wait` long enough to group them).
/// Each gets its own outcome and nothing of a losing one remains:
/// - two read-modify-writes of one counter: the first commits, the second
///   read a value the first changed in the same batch and is aborted (the
///   counter comes out exact when it is re-run);
/// - an ack whose lease is gone: lease lost, its write absent;
/// - an insert of an existing key: refused, its ack rolled back (the
///   message stays leased);
/// - a clean one: committed.
pub async fn batched_commits_isolate_each_message(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let pairs = table(s, "pairs");
    let w = |op, a: &str, n: i64, v: &str| {
        pairs
            .check_write(&RowWrite {
                table: "pairs".into(),
                op,
                columns: vec![
                    ("a".to_string(), Value::String(a.into())),
                    ("n".to_string(), Value::Int64(n)),
                    ("v".to_string(), Value::String(v.into())),
                ],
            })
            .unwrap()
    };
    let mut tx = s.transaction_begin().await.unwrap();
    tx.row_write(w(WriteOp::Insert, "counter", 0, "0"));
    tx.row_write(w(WriteOp::Insert, "taken", 0, "first"));
    tx.commit().await.unwrap();
    s.message_send((0..5).map(|i| send("b", &format!("m{i}"))).collect()).await.unwrap();
    let mut ms = lease(s, "b", 5, 60_000).await;
    assert_eq!(ms.len(), 5);
    ms.sort_by(|a, b| a.message.payload.cmp(&b.message.payload));
    // m2's lease is gone: acked by someone else first.
    ack(s, &ms[2].lease).await.unwrap();

    let counter_key = [Value::String("counter".into()), Value::Int64(0)];
    let mut incr = Vec::new();
    for m in &ms[0..2] {
        let mut tx = s.transaction_begin().await.unwrap();
        let row = tx.row_get(&pairs, &counter_key).await.unwrap().unwrap();
        assert_eq!(row[2].1, Value::String("0".into()));
        tx.row_write(w(WriteOp::Upsert, "counter", 0, "1"));
        tx.message_ack(&m.lease);
        incr.push(tx);
    }
    let mut lost = s.transaction_begin().await.unwrap();
    lost.row_write(w(WriteOp::Insert, "lost", 0, "must not exist"));
    lost.message_ack(&ms[2].lease);
    let mut refused = s.transaction_begin().await.unwrap();
    refused.row_write(w(WriteOp::Insert, "taken", 0, "duplicate"));
    refused.message_ack(&ms[3].lease);
    let mut clean = s.transaction_begin().await.unwrap();
    clean.row_write(w(WriteOp::Insert, "clean", 0, "yes"));
    clean.message_ack(&ms[4].lease);
    let (second, first) = (incr.pop().unwrap(), incr.pop().unwrap());

    let (r1, r2, r3, r4, r5) = tokio::join!(first.commit(), second.commit(), lost.commit(), refused.commit(), clean.commit());
    assert!(r1.is_ok(), "first increment: {r1:?}");
    assert!(
        matches!(r2, Err(StoreError::Aborted(_))),
        "second increment read a changed row: {r2:?}"
    );
    assert!(matches!(r3, Err(StoreError::LeaseLost { .. })), "lost lease: {r3:?}");
    assert!(matches!(r4, Err(StoreError::WriteRefused(_))), "duplicate insert: {r4:?}");
    assert!(r5.is_ok(), "clean: {r5:?}");

    let rows = s.table_rows("pairs").await.unwrap();
    let v = |a: &str| rows.iter().find(|r| r[0].1 == Value::String(a.into())).map(|r| r[2].1.clone());
    assert_eq!(v("counter"), Some(Value::String("1".into())), "one increment landed");
    assert_eq!(v("lost"), None);
    assert_eq!(v("taken"), Some(Value::String("first".into())));
    assert_eq!(v("clean"), Some(Value::String("yes".into())));
    assert_eq!(
        payloads(s, "b").await,
        ["m1", "m3"],
        "the aborted and the refused message stay on the queue"
    );

    // The aborted increment, re-run on fresh data, makes the counter exact.
    let mut tx = s.transaction_begin().await.unwrap();
    let row = tx.row_get(&pairs, &counter_key).await.unwrap().unwrap();
    assert_eq!(row[2].1, Value::String("1".into()));
    tx.row_write(w(WriteOp::Upsert, "counter", 0, "2"));
    tx.message_ack(&ms[1].lease);
    tx.commit().await.unwrap();
    let rows = s.table_rows("pairs").await.unwrap();
    let counter = rows.iter().find(|r| r[0].1 == Value::String("counter".into())).unwrap();
    assert_eq!(counter[2].1, Value::String("2".into()));
    // Processed counts move with the batch's own transaction: m2's ack
    // alone, then m0 and m4 of the batch (not the three that lost), then m1.
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.queues.iter().find(|x| x.queue == "b").unwrap().processed, 4);
}

/// One batch (the store is set to group commits) of three messages that
/// send with dedup keys and scan: a key claimed by an earlier message of
/// the batch drops a later message's send of it, as if committed one after
/// the other; a scan over rows an earlier message of the batch wrote is
/// aborted (re-run on fresh data) and sends nothing; a read of a missing
/// row and a scan of rows nobody wrote commit.
pub async fn batched_dedup_keys_and_scans(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let pairs = table(s, "pairs");
    let w = |a: &str, n: i64| {
        pairs
            .check_write(&RowWrite {
                table: "pairs".into(),
                op: WriteOp::Upsert,
                columns: vec![
                    ("a".to_string(), Value::String(a.into())),
                    ("n".to_string(), Value::Int64(n)),
                    ("v".to_string(), Value::String("x".into())),
                ],
            })
            .unwrap()
    };
    let mut tx = s.transaction_begin().await.unwrap();
    tx.row_write(w("s", 0));
    tx.row_write(w("s", 1));
    tx.commit().await.unwrap();
    s.message_send((0..3).map(|i| send("d", &format!("m{i}"))).collect()).await.unwrap();
    let mut ms = lease(s, "d", 3, 60_000).await;
    assert_eq!(ms.len(), 3);
    ms.sort_by(|a, b| a.message.payload.cmp(&b.message.payload));
    let keyed = |key: &str, from: &str| SendParams {
        dedup_key: Some(key.into()),
        ..send("out", &format!("{key} from {from}"))
    };

    // m0 scans s (two rows), writes s/5, claims k1.
    let mut t0 = s.transaction_begin().await.unwrap();
    assert_eq!(t0.row_scan(&pairs, &[Value::String("s".into())], 10).await.unwrap().len(), 2);
    t0.row_write(w("s", 5));
    t0.message_enqueue(keyed("k1", "m0"));
    t0.message_ack(&ms[0].lease);
    // m1 reads a missing row, sends k1 (claimed by m0 first) and k2.
    let mut t1 = s.transaction_begin().await.unwrap();
    let missing = [Value::String("nobody".into()), Value::Int64(0)];
    assert!(t1.row_get(&pairs, &missing).await.unwrap().is_none());
    t1.message_enqueue(keyed("k1", "m1"));
    t1.message_enqueue(keyed("k2", "m1"));
    t1.message_ack(&ms[1].lease);
    // m2 scans s too (m0 writes s/5 before it) and sends k3.
    let mut t2 = s.transaction_begin().await.unwrap();
    assert_eq!(t2.row_scan(&pairs, &[Value::String("s".into())], 10).await.unwrap().len(), 2);
    t2.message_enqueue(keyed("k3", "m2"));
    t2.message_ack(&ms[2].lease);

    let (r0, r1, r2) = tokio::join!(t0.commit(), t1.commit(), t2.commit());
    assert!(r0.is_ok(), "m0: {r0:?}");
    assert!(r1.is_ok(), "m1: {r1:?}");
    assert!(
        matches!(r2, Err(StoreError::Aborted(_))),
        "m2 scanned rows m0 wrote in the same batch: {r2:?}"
    );
    assert_eq!(
        payloads(s, "out").await,
        ["k1 from m0", "k2 from m1"],
        "each key sent once, by its first claimer; nothing of m2"
    );
    assert_eq!(payloads(s, "d").await, ["m2"], "the aborted message stays on its queue");
}
