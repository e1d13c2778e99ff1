//! The business tables' schema, read from the database itself, and the
//! validation of every handler write and read against it.
//!
//! Identifiers that reach SQL only ever come from here (the database's own
//! catalog), never from a handler; values are always bound as parameters.

use crate::value::{RowWrite, Value, WriteOp};
use std::collections::BTreeMap;

/// A column type onceq knows how to bind and read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ColumnType {
    Bool,
    Int64,
    Float64,
    String,
    Bytes,
    Json,
    Timestamp,
}

impl ColumnType {
    /// Does `v` fit a column of this type? (NULL is checked separately.)
    pub fn accepts(self, v: &Value) -> bool {
        matches!(
            (self, v),
            (ColumnType::Bool, Value::Bool(_))
                | (ColumnType::Int64, Value::Int64(_))
                | (ColumnType::Float64, Value::Float64(_))
                | (ColumnType::String, Value::String(_))
                | (ColumnType::Bytes, Value::Bytes(_))
                | (ColumnType::Json, Value::Json(_))
                | (ColumnType::Timestamp, Value::Timestamp(_))
        )
    }

    /// The type as a schema file writes it (SQLite's spelling).
    pub fn sql(self) -> &'static str {
        match self {
            ColumnType::Bool => "BOOL",
            ColumnType::Int64 => "INTEGER",
            ColumnType::Float64 => "REAL",
            ColumnType::String => "TEXT",
            ColumnType::Bytes => "BLOB",
            ColumnType::Json => "JSON",
            ColumnType::Timestamp => "TIMESTAMP",
        }
    }

    /// A literal of the type, for a DEFAULT the rows already there get.
    fn example_default(self) -> &'static str {
        match self {
            ColumnType::Bool => "FALSE",
            ColumnType::Int64 | ColumnType::Float64 | ColumnType::Timestamp => "0",
            ColumnType::String => "''",
            ColumnType::Bytes => "X''",
            ColumnType::Json => "'null'",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ColumnType::Bool => "bool",
            ColumnType::Int64 => "int64",
            ColumnType::Float64 => "float64",
            ColumnType::String => "string",
            ColumnType::Bytes => "bytes",
            ColumnType::Json => "json",
            ColumnType::Timestamp => "timestamp",
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ColumnSchema {
    pub name: String,
    pub ty: ColumnType,
    pub nullable: bool,
    /// The column has a DEFAULT: an insert (or upsert) may leave it out.
    pub has_default: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TableSchema {
    pub name: String,
    /// In table order.
    pub columns: Vec<ColumnSchema>,
    /// Indexes into `columns`, in primary-key order.
    pub primary_key: Vec<usize>,
}

/// Why a read's key or a write does not fit the schema, naming the table
/// and the column.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    #[error("unknown table {table}{hint}")]
    UnknownTable { table: String, hint: String },
    #[error("table {table} has no column {column}{hint}")]
    UnknownColumn { table: String, column: String, hint: String },
    #[error("table {table}: column {column} given twice")]
    ColumnTwice { table: String, column: String },
    #[error("table {table}: column {column} is NOT NULL, got null")]
    NullInNotNull { table: String, column: String },
    #[error("table {table}: column {column} is {expected}, got {got}")]
    WrongType {
        table: String,
        column: String,
        expected: &'static str,
        got: &'static str,
    },
    #[error("table {table}: column {column}: NaN cannot be stored (use null for \"no value\")")]
    NaN { table: String, column: String },
    #[error("table {table}: column {column}: invalid JSON: {error}")]
    InvalidJson { table: String, column: String, error: String },
    #[error("table {table}: {op} needs primary-key column {column}")]
    MissingKey { table: String, op: String, column: String },
    #[error("table {table}: delete takes only the primary-key columns")]
    DeleteTakesKeyOnly { table: String },
    #[error("table {table}: {op} needs NOT NULL column {column} (it has no DEFAULT){why}")]
    InsertNeedsColumn {
        table: String,
        op: &'static str,
        column: String,
        why: &'static str,
    },
    #[error("table {table}: primary key has {columns} column(s) ({names}), got {got} value(s)")]
    KeyArity {
        table: String,
        columns: usize,
        names: String,
        got: usize,
    },
    #[error("table {table}: key column {column} is {expected}, got {got}")]
    KeyType {
        table: String,
        column: String,
        expected: &'static str,
        got: &'static str,
    },
}

impl TableSchema {
    pub fn column(&self, name: &str) -> Option<(usize, &ColumnSchema)> {
        self.columns.iter().enumerate().find(|(_, c)| c.name == name)
    }

    pub fn key_columns(&self) -> impl Iterator<Item = &ColumnSchema> {
        self.primary_key.iter().filter_map(|i| self.columns.get(*i))
    }

    /// Check a key (or key prefix) for a read: arity and types.
    pub fn check_key(&self, key: &[Value], prefix: bool) -> Result<(), SchemaError> {
        let n = self.primary_key.len();
        if key.len() > n || (!prefix && key.len() != n) {
            return Err(SchemaError::KeyArity {
                table: self.name.clone(),
                columns: n,
                names: self.key_columns().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
                got: key.len(),
            });
        }
        for (col, v) in self.key_columns().zip(key) {
            if !col.ty.accepts(v) {
                return Err(SchemaError::KeyType {
                    table: self.name.clone(),
                    column: col.name.clone(),
                    expected: col.ty.name(),
                    got: v.type_name(),
                });
            }
        }
        Ok(())
    }

    /// Check a write against the table: known columns, types, NULLs, keys.
    /// Returns the write with its columns in table order.
    pub fn check_write(&self, w: &RowWrite) -> Result<ValidWrite, SchemaError> {
        let table = || self.name.clone();
        let mut values: Vec<Option<Value>> = vec![None; self.columns.len()];
        for (name, v) in &w.columns {
            let column = || name.clone();
            let Some((i, col)) = self.column(name) else {
                return Err(SchemaError::UnknownColumn {
                    table: table(),
                    column: column(),
                    hint: crate::names::did_you_mean(name, self.columns.iter().map(|c| c.name.as_str())),
                });
            };
            if values[i].is_some() {
                return Err(SchemaError::ColumnTwice {
                    table: table(),
                    column: column(),
                });
            }
            if matches!(v, Value::Null) {
                if !col.nullable {
                    return Err(SchemaError::NullInNotNull {
                        table: table(),
                        column: column(),
                    });
                }
            } else if !col.ty.accepts(v) {
                return Err(SchemaError::WrongType {
                    table: table(),
                    column: column(),
                    expected: col.ty.name(),
                    got: v.type_name(),
                });
            }
            if let Value::Float64(f) = v {
                if f.is_nan() {
                    // SQLite would store NULL (even in a NOT NULL column's
                    // place), Spanner NaN: refused, so both stores agree.
                    return Err(SchemaError::NaN {
                        table: table(),
                        column: column(),
                    });
                }
            }
            if let Value::Json(text) = v {
                if let Err(e) = serde_json::from_str::<serde_json::Value>(text) {
                    return Err(SchemaError::InvalidJson {
                        table: table(),
                        column: column(),
                        error: e.to_string(),
                    });
                }
            }
            values[i] = Some(v.clone());
        }
        for &k in &self.primary_key {
            if values[k].is_none() {
                return Err(SchemaError::MissingKey {
                    table: table(),
                    op: format!("{:?}", w.op),
                    column: self.columns.get(k).map_or_else(|| "?".to_string(), |c| c.name.clone()),
                });
            }
        }
        if w.op == WriteOp::Delete && w.columns.len() != self.primary_key.len() {
            return Err(SchemaError::DeleteTakesKeyOnly { table: table() });
        }
        // An upsert is an insert that may find its row: SQLite checks the
        // row it would insert before it looks for the key, and Spanner's
        // insert_or_update wants every NOT NULL column "even when the row
        // already exists". Both refuse it at commit; refused here, the
        // message is told why at once (and `onceq try` and `onceq test` say
        // the same).
        if matches!(w.op, WriteOp::Insert | WriteOp::Upsert) {
            for (i, c) in self.columns.iter().enumerate() {
                if values[i].is_none() && !c.nullable && !c.has_default {
                    return Err(SchemaError::InsertNeedsColumn {
                        table: table(),
                        op: if w.op == WriteOp::Insert { "insert" } else { "upsert" },
                        column: c.name.clone(),
                        why: if w.op == WriteOp::Upsert {
                            "; an upsert needs it even when the row exists, as the database does"
                        } else {
                            ""
                        },
                    });
                }
            }
        }
        Ok(ValidWrite {
            table: self.name.clone(),
            op: w.op,
            values,
        })
    }
}

/// A write checked against its table: `values[i]` is column `i`'s new value,
/// `None` for a column the write leaves alone.
#[derive(Debug, Clone)]
pub struct ValidWrite {
    pub table: String,
    pub op: WriteOp,
    pub values: Vec<Option<Value>>,
}

/// All business tables, by name.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Schema {
    pub tables: BTreeMap<String, TableSchema>,
}

impl Schema {
    pub fn table(&self, name: &str) -> Result<&TableSchema, SchemaError> {
        self.tables.get(name).ok_or_else(|| SchemaError::UnknownTable {
            table: name.to_string(),
            hint: crate::names::did_you_mean(name, self.tables.keys().map(String::as_str)),
        })
    }
}

/// How the database's business tables differ from the schema files: one
/// line each, and whether `onceq init` should refuse (a table of the files
/// lacks a column or has another type or key in the database; init never
/// alters an existing table). Tables and columns only the database has are
/// reported but not refused.
pub fn drift(files: &Schema, database: &Schema) -> (Vec<String>, bool) {
    let mut lines = Vec::new();
    let mut refuse = false;
    for (name, want) in &files.tables {
        let Some(have) = database.tables.get(name) else {
            lines.push(format!("table {name} is in the schema files but not in the database"));
            refuse = true;
            continue;
        };
        for c in &want.columns {
            match have.column(&c.name) {
                None => {
                    refuse = true;
                    // A NOT NULL column needs a DEFAULT for the rows already
                    // there, or the database refuses the ALTER.
                    let add = if c.nullable {
                        format!("ALTER TABLE {name} ADD COLUMN {} {}", c.name, c.ty.sql())
                    } else {
                        format!(
                            "ALTER TABLE {name} ADD COLUMN {} {} NOT NULL DEFAULT {} \
                             (choose the DEFAULT the rows already there get)",
                            c.name,
                            c.ty.sql(),
                            c.ty.example_default()
                        )
                    };
                    lines.push(format!(
                        "table {name}: column {} {}{} is in the schema files but not in the database: add it with {add}",
                        c.name,
                        c.ty.sql(),
                        if c.nullable { "" } else { " NOT NULL" },
                    ));
                }
                Some((_, d)) if d.ty != c.ty || d.nullable != c.nullable => {
                    refuse = true;
                    let null = |n: bool| if n { "" } else { " NOT NULL" };
                    lines.push(format!(
                        "table {name}: column {} is {}{} in the schema files, {}{} in the database",
                        c.name,
                        c.ty.sql(),
                        null(c.nullable),
                        d.ty.sql(),
                        null(d.nullable)
                    ));
                }
                Some(_) => {}
            }
        }
        let key = |t: &TableSchema| t.key_columns().map(|c| c.name.clone()).collect::<Vec<_>>();
        if key(want) != key(have) {
            refuse = true;
            lines.push(format!(
                "table {name}: primary key ({}) in the schema files, ({}) in the database",
                key(want).join(", "),
                key(have).join(", ")
            ));
        }
        for d in &have.columns {
            if want.column(&d.name).is_none() {
                lines.push(format!(
                    "table {name}: column {} is in the database but not in the schema files",
                    d.name
                ));
            }
        }
    }
    for name in database.tables.keys().filter(|t| !files.tables.contains_key(*t)) {
        lines.push(format!("table {name} is in the database but in no schema file"));
    }
    (lines, refuse)
}

/// Map a declared SQL column type (SQLite or GoogleSQL spelling) to ours.
pub fn column_type_from_decl(decl: &str) -> Option<ColumnType> {
    let d = decl.trim().to_ascii_uppercase();
    let base = d.split('(').next().unwrap_or("").trim();
    Some(match base {
        "BOOL" | "BOOLEAN" => ColumnType::Bool,
        "INT" | "INTEGER" | "INT64" | "BIGINT" | "SMALLINT" => ColumnType::Int64,
        "REAL" | "FLOAT" | "FLOAT64" | "DOUBLE" | "DOUBLE PRECISION" => ColumnType::Float64,
        "TEXT" | "STRING" | "VARCHAR" | "CHAR" | "CLOB" => ColumnType::String,
        "BLOB" | "BYTES" => ColumnType::Bytes,
        "JSON" => ColumnType::Json,
        "TIMESTAMP" | "DATETIME" => ColumnType::Timestamp,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn accounts() -> TableSchema {
        let col = |name: &str, ty, nullable| ColumnSchema {
            name: name.into(),
            ty,
            nullable,
            has_default: false,
        };
        TableSchema {
            name: "accounts".into(),
            columns: vec![
                col("id", ColumnType::String, false),
                col("balance", ColumnType::Int64, false),
                col("meta", ColumnType::Json, true),
                ColumnSchema {
                    has_default: true,
                    ..col("tier", ColumnType::String, false)
                },
            ],
            primary_key: vec![0],
        }
    }

    fn write(op: WriteOp, cols: &[(&str, Value)]) -> RowWrite {
        RowWrite {
            table: "accounts".into(),
            op,
            columns: cols.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
        }
    }

    #[test]
    fn writes_are_checked_against_the_table() {
        let t = accounts();
        let id = ("id", Value::String("a".into()));
        let ok = t
            .check_write(&write(WriteOp::Insert, &[id.clone(), ("balance", Value::Int64(1))]))
            .unwrap();
        assert_eq!(ok.values[2], None);
        let err = |w: RowWrite| t.check_write(&w).unwrap_err().to_string();
        assert_eq!(
            err(write(WriteOp::Insert, &[id.clone(), ("nope", Value::Int64(1))])),
            "table accounts has no column nope"
        );
        assert_eq!(
            err(write(WriteOp::Update, &[id.clone(), ("balance", Value::String("x".into()))])),
            "table accounts: column balance is int64, got string"
        );
        assert_eq!(
            err(write(WriteOp::Update, &[("balance", Value::Int64(1))])),
            "table accounts: Update needs primary-key column id"
        );
        assert_eq!(
            err(write(WriteOp::Insert, std::slice::from_ref(&id))),
            "table accounts: insert needs NOT NULL column balance (it has no DEFAULT)"
        );
        // An upsert inserts when the row is missing: both databases want
        // every NOT NULL column without a DEFAULT, as for an insert.
        assert_eq!(
            err(write(WriteOp::Upsert, std::slice::from_ref(&id))),
            "table accounts: upsert needs NOT NULL column balance (it has no DEFAULT); an upsert needs it even when the row exists, as the database does"
        );
        assert!(t
            .check_write(&write(WriteOp::Upsert, &[id.clone(), ("balance", Value::Int64(1))]))
            .is_ok());
        assert!(t.check_write(&write(WriteOp::Update, &[id.clone(), ("meta", Value::Null)])).is_ok());
        assert_eq!(
            err(write(WriteOp::Update, &[id.clone(), ("balance", Value::Null)])),
            "table accounts: column balance is NOT NULL, got null"
        );
        assert!(err(write(WriteOp::Upsert, &[id.clone(), ("meta", Value::Json("{oops".into()))])).contains("invalid JSON"));
        assert_eq!(
            err(write(WriteOp::Delete, &[id.clone(), ("balance", Value::Int64(1))])),
            "table accounts: delete takes only the primary-key columns"
        );
        assert!(t
            .check_key(&[Value::Int64(1)], false)
            .unwrap_err()
            .to_string()
            .contains("key column id is string, got int64"));
        assert!(t.check_key(&[], true).is_ok());
    }

    #[test]
    fn declared_types_map_from_sqlite_and_googlesql_spellings() {
        assert_eq!(column_type_from_decl("INTEGER"), Some(ColumnType::Int64));
        assert_eq!(column_type_from_decl("STRING(MAX)"), Some(ColumnType::String));
        assert_eq!(column_type_from_decl("bool"), Some(ColumnType::Bool));
        assert_eq!(column_type_from_decl("TIMESTAMP"), Some(ColumnType::Timestamp));
        assert_eq!(column_type_from_decl("GEOGRAPHY"), None);
    }
}
