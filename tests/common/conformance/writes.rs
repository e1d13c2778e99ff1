//! Business-table writes: every value type round trip, scans, and a transaction applied whole or not at all.

use super::*;

pub async fn typed_values_round_trip(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let typed = table(s, "typed");
    let rows = vec![
        vec![
            ("id", Value::String("all".into())),
            ("b", Value::Bool(true)),
            ("i", Value::Int64(i64::MIN)),
            ("f", Value::Float64(-1.5e300)),
            ("s", Value::String("héllo \"quoted\" ' \u{1F600}".into())),
            ("by", Value::Bytes(vec![0, 1, 2, 255, 0])),
            ("j", Value::Json(r#"{"a":[1,2,{"b":null}]}"#.into())),
            ("t", Value::Timestamp(-1_234_567)),
        ],
        vec![
            ("id", Value::String("nulls".into())),
            ("b", Value::Null),
            ("i", Value::Null),
            ("f", Value::Null),
            ("s", Value::Null),
            ("by", Value::Null),
            ("j", Value::Null),
            ("t", Value::Null),
        ],
        vec![
            ("id", Value::String("big".into())),
            ("by", Value::Bytes(vec![7; 1 << 20])),
            ("i", Value::Int64(i64::MAX)),
            ("b", Value::Bool(false)),
        ],
    ];
    let mut tx = s.transaction_begin().await.unwrap();
    for r in &rows {
        let w = RowWrite {
            table: "typed".into(),
            op: WriteOp::Insert,
            columns: r.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
        };
        tx.row_write(typed.check_write(&w).unwrap());
    }
    tx.commit().await.unwrap();
    let mut tx = s.transaction_begin().await.unwrap();
    for r in &rows {
        let got = tx.row_get(&typed, &[r[0].1.clone()]).await.unwrap().expect("row exists");
        for (k, v) in r {
            let g = &got.iter().find(|(n, _)| n == k).unwrap().1;
            assert!(g.same(v), "column {k}: wrote {v:?}, read {g:?}");
        }
    }
    assert!(tx.row_get(&typed, &[Value::String("missing".into())]).await.unwrap().is_none());
    tx.rollback().await;
    // a large payload survives the queue
    let big = vec![b'x'; 2 << 20];
    s.message_send(vec![SendParams {
        queue: "big".into(),
        payload: big.clone(),
        ..Default::default()
    }])
    .await
    .unwrap();
    assert_eq!(lease(s, "big", 1, 10_000).await[0].message.payload, big);
}

pub async fn writes_scans_and_atomicity(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let pairs = table(s, "pairs");
    let w = |op, a: &str, n: i64, v: Option<&str>| {
        let mut cols = vec![("a".to_string(), Value::String(a.into())), ("n".to_string(), Value::Int64(n))];
        if let Some(v) = v {
            cols.push(("v".into(), Value::String(v.into())));
        }
        pairs
            .check_write(&RowWrite {
                table: "pairs".into(),
                op,
                columns: cols,
            })
            .unwrap()
    };
    let mut tx = s.transaction_begin().await.unwrap();
    for n in 0..5 {
        tx.row_write(w(WriteOp::Insert, "x", n, Some("v0")));
    }
    tx.row_write(w(WriteOp::Insert, "y", 0, Some("other")));
    tx.commit().await.unwrap();
    let mut tx = s.transaction_begin().await.unwrap();
    let x = tx.row_scan(&pairs, &[Value::String("x".into())], 3).await.unwrap();
    assert_eq!(x.len(), 3, "limit honoured");
    assert_eq!(
        x.iter().map(|r| r[1].1.clone()).collect::<Vec<_>>(),
        vec![Value::Int64(0), Value::Int64(1), Value::Int64(2)],
        "key order"
    );
    assert_eq!(tx.row_scan(&pairs, &[], 100).await.unwrap().len(), 6);
    tx.rollback().await;
    // update, upsert, delete; update of a missing row is refused
    let mut tx = s.transaction_begin().await.unwrap();
    tx.row_write(w(WriteOp::Update, "x", 0, Some("v1")));
    tx.row_write(w(WriteOp::Upsert, "x", 1, Some("v2")));
    tx.row_write(w(WriteOp::Upsert, "z", 9, Some("new")));
    tx.row_write(w(WriteOp::Delete, "x", 4, None));
    tx.commit().await.unwrap();
    let rows = s.table_rows("pairs").await.unwrap();
    let v = |a: &str, n: i64| {
        rows.iter()
            .find(|r| r[0].1 == Value::String(a.into()) && r[1].1 == Value::Int64(n))
            .map(|r| r[2].1.clone())
    };
    assert_eq!(v("x", 0), Some(Value::String("v1".into())));
    assert_eq!(v("x", 1), Some(Value::String("v2".into())));
    assert_eq!(v("z", 9), Some(Value::String("new".into())));
    assert_eq!(v("x", 4), None);
    let mut tx = s.transaction_begin().await.unwrap();
    tx.row_write(w(WriteOp::Update, "nope", 1, Some("v")));
    assert!(matches!(tx.commit().await, Err(StoreError::WriteRefused(_))));
    let mut tx = s.transaction_begin().await.unwrap();
    tx.row_write(w(WriteOp::Insert, "x", 0, Some("dup")));
    assert!(
        matches!(tx.commit().await, Err(StoreError::WriteRefused(_))),
        "insert of an existing key is refused"
    );
    // an ack that fails rolls back the writes buffered with it
    s.message_send(vec![send("q", "m")]).await.unwrap();
    let m = lease(s, "q", 1, 10_000).await.remove(0);
    ack(s, &m.lease).await.unwrap();
    let mut tx = s.transaction_begin().await.unwrap();
    tx.row_write(w(WriteOp::Insert, "ghost", 1, Some("must not exist")));
    tx.message_enqueue(outbox::intent_message(&m.message, intent("c", "ghost")));
    tx.message_ack(&m.lease);
    assert!(matches!(tx.commit().await, Err(StoreError::LeaseLost { .. })));
    assert_eq!(
        s.table_rows("pairs").await.unwrap().len(),
        6,
        "nothing of the failed transaction is visible"
    );
    assert!(s.message_list(Queues::Prefix(outbox::QUEUE_PREFIX), 10).await.unwrap().is_empty());
    // a conflicting write between read and commit aborts the reader
    let mut reader = s.transaction_begin().await.unwrap();
    reader.row_get(&pairs, &[Value::String("y".into()), Value::Int64(0)]).await.unwrap();
    reader.row_write(w(WriteOp::Upsert, "y", 0, Some("reader")));
    let mut writer = s.transaction_begin().await.unwrap();
    writer.row_write(w(WriteOp::Upsert, "y", 0, Some("writer")));
    writer.commit().await.unwrap();
    assert!(matches!(reader.commit().await, Err(StoreError::Aborted(_))));
}
