//! Values between onceq and Spanner: typed values, column types, rows,
//! statements and mutations.

use super::*;

pub(super) fn to_svalue(v: &Value) -> SValue {
    match v {
        Value::Null => SValue::null(),
        Value::Bool(b) => SValue::from(*b),
        Value::Int64(i) => SValue::from(*i),
        Value::Float64(f) => SValue::from(*f),
        Value::String(s) | Value::Json(s) => SValue::from(s.clone()),
        Value::Bytes(b) => SValue::from(b.clone()),
        Value::Timestamp(t) => {
            let ts = wkt::Timestamp::new(t.div_euclid(1_000_000), (t.rem_euclid(1_000_000) * 1000) as i32).unwrap_or_default();
            SValue::from(ts)
        }
    }
}

pub(super) fn spanner_type(ty: ColumnType) -> google_cloud_spanner::types::Type {
    use google_cloud_spanner::types;
    match ty {
        ColumnType::Bool => types::bool(),
        ColumnType::Int64 => types::int64(),
        ColumnType::Float64 => types::float64(),
        ColumnType::String => types::string(),
        ColumnType::Bytes => types::bytes(),
        ColumnType::Json => types::json(),
        ColumnType::Timestamp => types::timestamp(),
    }
}

pub(super) fn read_value(table: &str, col: &ColumnSchema, row: &google_cloud_spanner::result::Row, i: usize) -> StoreResult<Value> {
    let bad = |e: google_cloud_spanner::Error| StoreError::Permanent(format!("table {table}: column {}: {e}", col.name));
    Ok(match col.ty {
        ColumnType::Bool => row.get::<Option<bool>>(i).map_err(bad)?.map_or(Value::Null, Value::Bool),
        ColumnType::Int64 => row.get::<Option<i64>>(i).map_err(bad)?.map_or(Value::Null, Value::Int64),
        ColumnType::Float64 => row.get::<Option<f64>>(i).map_err(bad)?.map_or(Value::Null, Value::Float64),
        ColumnType::String => row.get::<Option<String>>(i).map_err(bad)?.map_or(Value::Null, Value::String),
        ColumnType::Bytes => row.get::<Option<Vec<u8>>>(i).map_err(bad)?.map_or(Value::Null, Value::Bytes),
        ColumnType::Json => row
            .get::<Option<serde_json::Value>>(i)
            .map_err(bad)?
            .map_or(Value::Null, |j| Value::Json(j.to_string())),
        ColumnType::Timestamp => row
            .get::<Option<wkt::Timestamp>>(i)
            .map_err(bad)?
            .map_or(Value::Null, |t| Value::Timestamp(micros_of(&t))),
    })
}

/// A Spanner timestamp in microseconds since the epoch.
pub(super) fn micros_of(t: &wkt::Timestamp) -> i64 {
    t.seconds().saturating_mul(1_000_000).saturating_add(i64::from(t.nanos()) / 1000)
}

pub(super) fn quote(ident: &str) -> String {
    format!("`{}`", ident.replace('`', ""))
}

pub(super) fn select_stmt(table: &TableSchema, key: &[Value], limit: Option<usize>) -> Statement {
    let cols: Vec<String> = table.columns.iter().map(|c| quote(&c.name)).collect();
    let keys: Vec<&ColumnSchema> = table.key_columns().collect();
    let mut sql = format!("SELECT {} FROM {}", cols.join(", "), quote(&table.name));
    if !key.is_empty() {
        let conds: Vec<String> = keys
            .iter()
            .take(key.len())
            .enumerate()
            .map(|(i, k)| format!("{} = @k{i}", quote(&k.name)))
            .collect();
        sql.push_str(&format!(" WHERE {}", conds.join(" AND ")));
    }
    if let Some(n) = limit {
        sql.push_str(&format!(
            " ORDER BY {} LIMIT {n}",
            keys.iter().map(|k| quote(&k.name)).collect::<Vec<_>>().join(", ")
        ));
    }
    let mut b = Statement::builder(sql);
    for (i, (v, k)) in key.iter().zip(keys).enumerate() {
        b = b.add_typed_param(format!("k{i}"), to_svalue(v), spanner_type(k.ty));
    }
    b.build()
}

pub(super) async fn collect(table: &TableSchema, mut rs: google_cloud_spanner::result::ResultSet) -> StoreResult<Vec<Row>> {
    let mut out = Vec::new();
    while let Some(r) = rs.next().await {
        let r = r.map_err(classify)?;
        let mut row = Vec::with_capacity(table.columns.len());
        for (i, col) in table.columns.iter().enumerate() {
            row.push((col.name.clone(), read_value(&table.name, col, &r, i)?));
        }
        out.push(row);
    }
    Ok(out)
}

pub(super) fn mutation(table: &TableSchema, w: &ValidWrite) -> Mutation {
    if w.op == WriteOp::Delete {
        let key: Vec<SValue> = table
            .primary_key
            .iter()
            .map(|&k| w.values.get(k).cloned().flatten().map_or(SValue::null(), |v| to_svalue(&v)))
            .collect();
        return Mutation::delete(table.name.clone(), KeySetBuilder::new().add_key(Key::new(key)).build());
    }
    let mut b = match w.op {
        WriteOp::Insert => Mutation::new_insert_builder(table.name.clone()),
        WriteOp::Update => Mutation::new_update_builder(table.name.clone()),
        _ => Mutation::new_insert_or_update_builder(table.name.clone()),
    };
    for (i, v) in w.values.iter().enumerate() {
        if let (Some(v), Some(col)) = (v, table.columns.get(i)) {
            b = b.set(col.name.clone()).to(to_svalue(v));
        }
    }
    b.build()
}
