//! W3C trace context carried by messages: a message's creation context
//! travels as the reserved attribute `onceq.traceparent` (and
//! `onceq.tracestate`), so one trace can be followed from `onceq send`
//! through every follow-up and intent to the webhook that receives it
//! (`traceparent` header).
//!
//! Who sets it: `onceq send` (a child of the `TRACEPARENT` variable when
//! it is set, else a new trace per message); the host, for each follow-up
//! and intent a handler emits, derived from the source message's context.
//! Handlers cannot set it (`onceq.*` attributes are refused on effects)
//! and do not see it. The derived context is a function of the source's
//! context, its id and the effect's position, so a re-run after an
//! unknown outcome emits byte-identical effects.
//!
//! A leaf module: it imports nothing of onceq's but the attribute names.

use sha2::{Digest, Sha256};

/// Attribute carrying a message's W3C `traceparent`.
pub const TRACEPARENT_ATTRIBUTE: &str = "onceq.traceparent";
/// Attribute carrying a message's W3C `tracestate`, when it has one.
pub const TRACESTATE_ATTRIBUTE: &str = "onceq.tracestate";

/// A W3C `traceparent`: version 00, a trace id, a parent (span) id and
/// the trace flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceParent {
    /// Parse a `traceparent` header value (W3C Trace Context level 1):
    /// `00-<32 hex>-<16 hex>-<2 hex>`, lowercase, ids not all zero. A
    /// later version is read by its first four fields, as the
    /// specification asks; version `ff` is invalid.
    pub fn parse(text: &str) -> Option<TraceParent> {
        let text = text.trim();
        let mut parts = text.split('-');
        let version = parts.next()?;
        let (trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || !lower_hex(version) || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let mut t = TraceParent {
            trace_id: [0; 16],
            span_id: [0; 8],
            flags: 0,
        };
        decode(trace, &mut t.trace_id)?;
        decode(span, &mut t.span_id)?;
        let mut f = [0u8; 1];
        decode(flags, &mut f)?;
        t.flags = f[0];
        (t.trace_id != [0; 16] && t.span_id != [0; 8]).then_some(t)
    }

    /// A new trace, sampled.
    pub fn root() -> TraceParent {
        TraceParent {
            trace_id: nonzero(rand::random()),
            span_id: nonzero(rand::random()),
            flags: 1,
        }
    }

    /// A new span in the same trace (what a producer's send is).
    pub fn child(&self) -> TraceParent {
        TraceParent {
            span_id: nonzero(rand::random()),
            ..*self
        }
    }

    /// The context of the `index`th effect of message `message_id`: the
    /// same trace and flags, a span id that is a function of the three
    /// (the same on every re-run).
    pub fn derived(&self, message_id: &str, index: usize) -> TraceParent {
        let mut h = Sha256::new();
        h.update(self.span_id);
        h.update(message_id.as_bytes());
        h.update((index as u64).to_be_bytes());
        let digest = h.finalize();
        let mut span_id = [0u8; 8];
        span_id.copy_from_slice(&digest[..8]);
        TraceParent {
            span_id: nonzero(span_id),
            ..*self
        }
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The span id as 16 lowercase hex digits.
    pub fn span_id_hex(&self) -> String {
        hex(&self.span_id)
    }
}

impl std::fmt::Display for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "00-{}-{}-{:02x}", hex(&self.trace_id), hex(&self.span_id), self.flags)
    }
}

/// A message's creation context, from its attributes.
pub fn of(attributes: &[(String, String)]) -> Option<TraceParent> {
    attributes
        .iter()
        .find(|(k, _)| k == TRACEPARENT_ATTRIBUTE)
        .and_then(|(_, v)| TraceParent::parse(v))
}

/// Give an effect emitted while handling a message (its `index`th) the
/// message's trace: a derived `onceq.traceparent`, and its
/// `onceq.tracestate` as it is. A message without a context passes none on.
pub fn inherit(source: &[(String, String)], message_id: &str, index: usize, attributes: &mut Vec<(String, String)>) {
    let Some(parent) = of(source) else { return };
    attributes.push((TRACEPARENT_ATTRIBUTE.to_string(), parent.derived(message_id, index).to_string()));
    if let Some((_, state)) = source.iter().find(|(k, _)| k == TRACESTATE_ATTRIBUTE) {
        attributes.push((TRACESTATE_ATTRIBUTE.to_string(), state.clone()));
    }
}

fn nonzero<const N: usize>(mut id: [u8; N]) -> [u8; N] {
    if id == [0; N] {
        id[N - 1] = 1;
    }
    id
}

fn lower_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn decode(s: &str, out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 || !lower_hex(s) {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_prints_the_w3c_example() {
        let t = TraceParent::parse(EXAMPLE).unwrap();
        assert_eq!(t.to_string(), EXAMPLE);
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.flags, 1);
    }

    #[test]
    fn refuses_what_the_specification_refuses() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        // A later version: its first four fields.
        assert!(TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-next").is_some());
    }

    #[test]
    fn children_and_derived_contexts_stay_in_the_trace() {
        let t = TraceParent::parse(EXAMPLE).unwrap();
        let c = t.child();
        assert_eq!((c.trace_id, c.flags), (t.trace_id, t.flags));
        assert_ne!(c.span_id, t.span_id);
        let d = t.derived("m-1", 0);
        assert_eq!(d, t.derived("m-1", 0), "the same on a re-run");
        assert_ne!(d, t.derived("m-1", 1));
        assert_ne!(d, t.derived("m-2", 0));
        assert_eq!(d.trace_id, t.trace_id);
    }

    #[test]
    fn effects_inherit_the_context_and_the_state() {
        let source = vec![
            ("a".to_string(), "b".to_string()),
            (TRACEPARENT_ATTRIBUTE.to_string(), EXAMPLE.to_string()),
            (TRACESTATE_ATTRIBUTE.to_string(), "vendor=1".to_string()),
        ];
        let mut attrs = vec![("x".to_string(), "y".to_string())];
        inherit(&source, "m-1", 2, &mut attrs);
        assert_eq!(attrs.len(), 3);
        assert_eq!(of(&attrs).unwrap().trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(attrs[2], (TRACESTATE_ATTRIBUTE.to_string(), "vendor=1".to_string()));
        let mut none = Vec::new();
        inherit(&[], "m-1", 0, &mut none);
        assert!(none.is_empty());
    }
}
