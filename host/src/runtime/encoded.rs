//! The WIT's `encoded` interface: values, rows and effects as JSON text.
//!
//! It carries the same contract as the typed `store` and `handler`, for
//! guests whose generated bindings pay their interpreter for every field
//! of every record (componentize-js lowers a five-column row write with
//! hundreds of thousands of instructions). Decoding is strict: every
//! refusal names what was wrong and where (serde_json's line and column),
//! and the effects of one call are bounded while they are decoded, so a
//! guest cannot make the host hold more than its queue's limits allow.
//!
//! A value is `null`, `true`/`false`, a string (text), an integer (int64),
//! or an object of one key naming its type: `int64` (a number or its
//! decimal text, for integers beyond what a JavaScript number holds),
//! `float64` (a number, or `"NaN"`, `"Infinity"`, `"-Infinity"`), `text`,
//! `bytes` (an array of numbers 0-255), `json` (the document as text) and
//! `timestamp` (microseconds, a number or its text). A bare number with a
//! fraction or an exponent is refused: an integer-valued float written by
//! JavaScript is indistinguishable from an integer, so floats are tagged.

use crate::value::{self, Effect, Row, Value};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Integers a JavaScript number holds exactly: written bare, larger ones
/// as text.
const SAFE_INTEGER: u64 = (1 << 53) - 1;

/// A value as decoded from its encoded form.
struct Decoded(Value);

impl<'de> Deserialize<'de> for Decoded {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor).map(Decoded)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a value: null, a boolean, a string, an integer or an object such as {\"float64\": 1.5}")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int64(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        int64_of(v).map(Value::Int64)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Err(E::custom(format!(
            "bare number {v} has a fraction or an exponent: give a float64 as {{\"float64\": {v}}}, an integer beyond 2^53 as {{\"int64\": \"DIGITS\"}}"
        )))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Value, A::Error> {
        Err(de::Error::custom(
            "an array is not a value: give bytes as {\"bytes\": [...]}, a JSON document as {\"json\": \"TEXT\"}",
        ))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let Some(tag) = map.next_key::<String>()? else {
            return Err(de::Error::custom(
                "an empty object is not a value: name its type, as in {\"float64\": 1.5}",
            ));
        };
        let v = match tag.as_str() {
            "int64" => Value::Int64(map.next_value::<Integer>()?.0),
            "timestamp" => Value::Timestamp(map.next_value::<Integer>()?.0),
            "float64" => Value::Float64(map.next_value::<Float>()?.0),
            "text" => Value::String(map.next_value()?),
            "json" => Value::Json(map.next_value()?),
            "bytes" => Value::Bytes(map.next_value()?),
            other => {
                return Err(de::Error::custom(format!(
                    "unknown value type {}: expected int64, float64, text, bytes, json or timestamp",
                    crate::names::quoted(other, 40)
                )))
            }
        };
        if map.next_key::<de::IgnoredAny>()?.is_some() {
            return Err(de::Error::custom(format!("a {tag} value is an object of one key")));
        }
        Ok(v)
    }
}

/// A JSON integer too large to be negative, as an int64 if it fits.
fn int64_of<E: de::Error>(v: u64) -> Result<i64, E> {
    i64::try_from(v).map_err(|_| E::custom(format!("integer {v} is beyond int64's range")))
}

/// An int64 as a JSON integer or its decimal text.
struct Integer(i64);

impl<'de> Deserialize<'de> for Integer {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = i64;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer, or its decimal text")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<i64, E> {
                Ok(v)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<i64, E> {
                int64_of(v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<i64, E> {
                v.parse()
                    .map_err(|_| E::custom(format!("{} is not an int64", crate::names::quoted(v, 40))))
            }
        }
        d.deserialize_any(V).map(Integer)
    }
}

/// A float64 as a JSON number, or `"NaN"`, `"Infinity"`, `"-Infinity"`.
struct Float(f64);

impl<'de> Deserialize<'de> for Float {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = f64;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number, or \"NaN\", \"Infinity\", \"-Infinity\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
                Ok(v as f64)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
                Ok(v as f64)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
                Ok(v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
                match v {
                    "NaN" => Ok(f64::NAN),
                    "Infinity" => Ok(f64::INFINITY),
                    "-Infinity" => Ok(f64::NEG_INFINITY),
                    other => Err(E::custom(format!(
                        "{} is not a float64: give a number, or \"NaN\", \"Infinity\", \"-Infinity\"",
                        crate::names::quoted(other, 40)
                    ))),
                }
            }
        }
        d.deserialize_any(V).map(Float)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Write {
    table: String,
    op: value::WriteOp,
    columns: Vec<(String, Decoded)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Enqueue {
    queue: String,
    payload: String,
    #[serde(default)]
    attributes: Vec<(String, String)>,
    #[serde(default)]
    delay_ms: Option<u64>,
    #[serde(default)]
    dedup_key: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Intent {
    connector: String,
    idempotency_key: String,
    payload: String,
    #[serde(default)]
    metadata: Vec<(String, String)>,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum Encoded {
    Write(Write),
    Enqueue(Enqueue),
    Intent(Intent),
}

impl From<Encoded> for Effect {
    fn from(e: Encoded) -> Effect {
        match e {
            Encoded::Write(w) => Effect::Write(value::RowWrite {
                table: w.table,
                op: w.op,
                columns: w.columns.into_iter().map(|(k, v)| (k, v.0)).collect(),
            }),
            Encoded::Enqueue(f) => Effect::Enqueue(value::FollowUp {
                queue: f.queue,
                payload: f.payload.into_bytes(),
                attributes: f.attributes,
                delay_ms: f.delay_ms,
                dedup_key: f.dedup_key,
            }),
            Encoded::Intent(i) => Effect::Intent(value::Intent {
                connector: i.connector,
                idempotency_key: i.idempotency_key,
                payload: i.payload.into_bytes(),
                metadata: i.metadata,
            }),
        }
    }
}

/// The effects array, stopped as soon as it holds more than `room`.
struct Effects {
    room: usize,
    limit: usize,
}

impl<'de> DeserializeSeed<'de> for Effects {
    type Value = Vec<Effect>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Effect>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Effects {
    type Value = Vec<Effect>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of effects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Effect>, A::Error> {
        let mut out = Vec::new();
        while let Some(e) = seq.next_element::<Encoded>()? {
            if out.len() == self.room {
                return Err(de::Error::custom(format!(
                    "more than {} effects in one call, over the limit (setting max_effects)",
                    self.limit
                )));
            }
            out.push(e.into());
        }
        Ok(out)
    }
}

/// Decode one `emit`'s effects. `room` is how many more the call may emit
/// under `limit` (`max_effects`); decoding stops at the first one over.
pub fn decode_effects(json: &[u8], room: usize, limit: usize) -> Result<Vec<Effect>, String> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let effects = Effects { room, limit }.deserialize(&mut de).map_err(described)?;
    de.end().map_err(described)?;
    Ok(effects)
}

/// serde_json's words, with a hint where they are cryptic: a lone UTF-16
/// surrogate (which JavaScript strings may hold, and `JSON.stringify`
/// escapes as `\udXXX`) is not text.
fn described(e: serde_json::Error) -> String {
    let text = e.to_string();
    if text.contains("hex escape") || text.contains("surrogate") {
        return format!("{text} (a string holds a lone UTF-16 surrogate, which is not Unicode text)");
    }
    text
}

/// A `get`'s query.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetQuery {
    table: String,
    key: Vec<Decoded>,
}

/// A `scan`'s query.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScanQuery {
    table: String,
    prefix: Vec<Decoded>,
    limit: u32,
}

/// Decode a `get`'s query: the table and the key.
pub fn decode_get(json: &[u8]) -> Result<(String, Vec<Value>), String> {
    let q: GetQuery = serde_json::from_slice(json).map_err(|e| format!("malformed get: {}", described(e)))?;
    Ok((q.table, q.key.into_iter().map(|v| v.0).collect()))
}

/// Decode a `scan`'s query: the table, the prefix and the limit.
pub fn decode_scan(json: &[u8]) -> Result<(String, Vec<Value>, u32), String> {
    let q: ScanQuery = serde_json::from_slice(json).map_err(|e| format!("malformed scan: {}", described(e)))?;
    Ok((q.table, q.prefix.into_iter().map(|v| v.0).collect(), q.limit))
}

struct Encode<'a>(&'a Value);

/// An object of one key: a value with its type named.
fn tagged<S: Serializer, T: Serialize + ?Sized>(s: S, tag: &str, v: &T) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(1))?;
    m.serialize_entry(tag, v)?;
    m.end()
}

impl Serialize for Encode<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Value::Null => s.serialize_unit(),
            Value::Bool(b) => s.serialize_bool(*b),
            Value::Int64(i) if i.unsigned_abs() <= SAFE_INTEGER => s.serialize_i64(*i),
            Value::Int64(i) => tagged(s, "int64", &i.to_string()),
            Value::Timestamp(t) if t.unsigned_abs() <= SAFE_INTEGER => tagged(s, "timestamp", t),
            Value::Timestamp(t) => tagged(s, "timestamp", &t.to_string()),
            Value::Float64(f) if f.is_nan() => tagged(s, "float64", "NaN"),
            Value::Float64(f) if f.is_infinite() => tagged(s, "float64", if *f > 0.0 { "Infinity" } else { "-Infinity" }),
            Value::Float64(f) => tagged(s, "float64", f),
            Value::String(t) => s.serialize_str(t),
            Value::Json(t) => tagged(s, "json", t),
            // serde writes bytes as an array of numbers.
            Value::Bytes(b) => tagged(s, "bytes", b),
        }
    }
}

struct EncodeRow<'a>(&'a Row);

impl Serialize for EncodeRow<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (name, v) in self.0 {
            m.serialize_entry(name, &Encode(v))?;
        }
        m.end()
    }
}

/// A row as a JSON object of its columns' values, in column order.
pub fn encode_row(row: &Row) -> String {
    // Writing to a String cannot fail, and every value serializes.
    serde_json::to_string(&EncodeRow(row)).unwrap_or_default()
}

/// Rows as a JSON array of objects.
pub fn encode_rows(rows: &[Row]) -> String {
    serde_json::to_string(&rows.iter().map(EncodeRow).collect::<Vec<_>>()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn one_write(columns: &str) -> Result<Vec<(String, Value)>, String> {
        let json = format!(r#"[{{"write": {{"table": "t", "op": "upsert", "columns": {columns}}}}}]"#);
        let mut effects = decode_effects(json.as_bytes(), 10, 10)?;
        match effects.pop() {
            Some(Effect::Write(w)) => Ok(w.columns),
            other => panic!("{other:?}"),
        }
    }

    /// Every value type decodes, bare where JSON is unambiguous, tagged
    /// where it is not; what the host encodes decodes to the same row.
    #[test]
    fn every_value_type_round_trips() {
        let row: Row = vec![
            ("null".into(), Value::Null),
            ("yes".into(), Value::Bool(true)),
            ("small".into(), Value::Int64(-42)),
            ("big".into(), Value::Int64(i64::MIN)),
            ("top".into(), Value::Int64(i64::MAX)),
            ("half".into(), Value::Float64(1.5)),
            ("whole".into(), Value::Float64(2.0)),
            ("inf".into(), Value::Float64(f64::NEG_INFINITY)),
            ("text".into(), Value::String("é \"quoted\" \u{1F600}".into())),
            ("bytes".into(), Value::Bytes(vec![0, 1, 255])),
            ("json".into(), Value::Json(r#"{"a":[1,2]}"#.into())),
            ("at".into(), Value::Timestamp(1_796_650_220_993_845)),
            ("far".into(), Value::Timestamp(i64::MAX)),
        ];
        let encoded = encode_row(&row);
        let object: serde_json::Value = serde_json::from_str(&encoded).unwrap();
        assert_eq!(object["small"], serde_json::json!(-42), "a safe integer is bare: {encoded}");
        assert_eq!(object["big"], serde_json::json!({"int64": "-9223372036854775808"}));
        assert_eq!(object["whole"], serde_json::json!({"float64": 2.0}));
        assert_eq!(object["inf"], serde_json::json!({"float64": "-Infinity"}));
        let pairs: Vec<String> = row
            .iter()
            .map(|(k, _)| format!("[{}, {}]", serde_json::json!(k), object[k]))
            .collect();
        let back = one_write(&format!("[{}]", pairs.join(", "))).unwrap();
        assert!(crate::value::rows_same(&back, &row), "{back:?}");
        let nan = one_write(r#"[["f", {"float64": "NaN"}]]"#).unwrap();
        assert!(matches!(nan[0].1, Value::Float64(f) if f.is_nan()));
        assert_eq!(encode_row(&nan), r#"{"f":{"float64":"NaN"}}"#);
        assert_eq!(
            one_write(r#"[["n", {"int64": 7}], ["t", {"text": "7"}], ["s", "7"]]"#).unwrap(),
            vec![
                ("n".into(), Value::Int64(7)),
                ("t".into(), Value::String("7".into())),
                ("s".into(), Value::String("7".into()))
            ]
        );
    }

    /// Each refusal names the problem and where it is.
    #[test]
    fn malformed_values_and_effects_are_refused_by_name() {
        for (columns, needle) in [
            (r#"[["x", 1.5]]"#, "bare number 1.5 has a fraction or an exponent"),
            (r#"[["x", 1e3]]"#, "bare number 1000 has a fraction or an exponent"),
            (
                r#"[["x", 18446744073709551615]]"#,
                "integer 18446744073709551615 is beyond int64's range",
            ),
            (r#"[["x", [1]]]"#, "an array is not a value"),
            (r#"[["x", {}]]"#, "an empty object is not a value"),
            (r#"[["x", {"decimal": "1"}]]"#, "unknown value type \"decimal\""),
            (r#"[["x", {"int64": 1, "text": "a"}]]"#, "a int64 value is an object of one key"),
            (r#"[["x", {"float64": "nan"}]]"#, "\"nan\" is not a float64"),
            (r#"[["x", {"bytes": [256]}]]"#, "invalid value: integer `256`, expected u8"),
            (r#"[["x", {"timestamp": 1.5}]]"#, "expected an integer, or its decimal text"),
            (r#"[["x"]]"#, "invalid length 1"),
        ] {
            let e = one_write(columns).unwrap_err();
            assert!(e.contains(needle) && e.contains("line 1 column"), "{columns}: {e}");
        }
        for (json, needle) in [
            (r#"{"write": {}}"#, "invalid type: map, expected an array of effects"),
            (
                r#"[{"write": {"table": "t", "op": "merge", "columns": []}}]"#,
                "unknown variant `merge`",
            ),
            (
                r#"[{"write": {"table": "t", "op": "insert", "columns": [], "extra": 1}}]"#,
                "unknown field `extra`",
            ),
            (
                r#"[{"intent": {"connector": "c", "payload": "p"}}]"#,
                "missing field `idempotency-key`",
            ),
            (r#"[{"enqueue": {"queue": "q", "payload": "p", "delay-ms": -1}}]"#, "expected u64"),
            ("[] []", "trailing characters"),
            ("[\"\\ud800\"]", "a string holds a lone UTF-16 surrogate"),
        ] {
            let e = decode_effects(json.as_bytes(), 10, 10).unwrap_err();
            assert!(e.contains(needle), "{json}: {e}");
        }
        assert!(decode_effects(b"[\"\xff\"]", 10, 10).unwrap_err().contains("invalid unicode"));
    }

    /// Decoding stops at the first effect past the call's room.
    #[test]
    fn decoding_stops_past_the_room_left() {
        let one = r#"{"enqueue": {"queue": "q", "payload": "{}", "attributes": [["a", "b"]], "delay-ms": 5, "dedup-key": "d"}}"#;
        let three = format!("[{one}, {one}, {one}]");
        assert_eq!(decode_effects(three.as_bytes(), 3, 10).unwrap().len(), 3);
        let e = decode_effects(three.as_bytes(), 2, 10).unwrap_err();
        assert!(e.contains("more than 10 effects in one call"), "{e}");
        match &decode_effects(three.as_bytes(), 3, 3).unwrap()[0] {
            Effect::Enqueue(f) => {
                assert_eq!(f.payload, b"{}");
                assert_eq!((f.delay_ms, f.dedup_key.as_deref()), (Some(5), Some("d")));
                assert_eq!(f.attributes, vec![("a".to_string(), "b".to_string())]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn queries_decode_with_their_table() {
        assert_eq!(
            decode_get(br#"{"table": "accounts", "key": ["a", 1]}"#).unwrap(),
            ("accounts".to_string(), vec![Value::String("a".into()), Value::Int64(1)])
        );
        assert_eq!(
            decode_scan(br#"{"table": "kv", "prefix": [], "limit": 5}"#).unwrap(),
            ("kv".to_string(), vec![], 5)
        );
        let e = decode_get(br#"{"table": "accounts"}"#).unwrap_err();
        assert!(e.contains("malformed get: missing field `key`"), "{e}");
        assert_eq!(encode_rows(&[]), "[]");
    }
}
