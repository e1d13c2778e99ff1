//! What names are: queue and connector names, onceq's reserved prefix and
//! attribute names, idempotency keys, and how text a handler or a producer
//! chose is made safe to show.
//!
//! A leaf module: it imports nothing of onceq's, so the protocol, the outbox,
//! the config and the CLI can all ask it without depending on each other.
//! Every check here is applied where the name enters the host (a config
//! file, `onceq send`, a handler's effect), so a name that would park a
//! message where no queue serves it is refused with the reason, not stored.

/// Bytes as lowercase hex: how digests, versions and ids are shown.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

/// Queue names starting with this (in any case) are onceq's own.
pub const RESERVED_PREFIX: &str = "onceq.";
/// A connector's outbox queue is this followed by the connector's name.
pub const OUTBOX_QUEUE_PREFIX: &str = "onceq.outbox.";
/// Attribute carrying an intent's idempotency key.
pub const KEY_ATTRIBUTE: &str = "onceq.idempotency-key";
/// Attribute naming the queue whose message emitted an intent or a follow-up.
pub const SOURCE_QUEUE_ATTRIBUTE: &str = "onceq.source-queue";
/// Attribute naming the message that emitted an intent or a follow-up.
pub const SOURCE_MESSAGE_ATTRIBUTE: &str = "onceq.source-message";
/// Attribute naming the handler version that emitted an intent.
pub const VERSION_ATTRIBUTE: &str = "onceq.handler-version";

/// Longest queue or connector name, in bytes.
pub const MAX_NAME_LEN: usize = 128;
/// Longest idempotency key or dedup key, in bytes.
pub const MAX_KEY_LEN: usize = 512;
/// Longest reason (retry, reject, failure) kept with a message or a dead
/// letter; a longer one is cut, saying how long it was.
pub const MAX_REASON_LEN: usize = 4096;

/// The outbox queue of a connector.
pub fn outbox_queue(connector: &str) -> String {
    format!("{OUTBOX_QUEUE_PREFIX}{connector}")
}

/// The connector of an outbox queue.
pub fn outbox_connector(queue: &str) -> Option<&str> {
    queue.strip_prefix(OUTBOX_QUEUE_PREFIX)
}

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("{what} name is empty")]
    Empty { what: &'static str },
    #[error("{what} name {shown} is {len} bytes long, over the limit of {MAX_NAME_LEN}")]
    TooLong { what: &'static str, shown: String, len: usize },
    #[error("{what} name {shown}: use letters, digits, '-', '_' or '.'")]
    BadCharacter { what: &'static str, shown: String },
    #[error("{what} name {shown}: names starting with \"onceq.\" (in any case) are reserved for onceq")]
    Reserved { what: &'static str, shown: String },
}

/// Is `name` in onceq's reserved namespace? Case-insensitive, so
/// `ONCEQ.outbox.x` cannot pass for a user queue either.
pub fn is_reserved(name: &str) -> bool {
    name.len() >= RESERVED_PREFIX.len() && name.as_bytes()[..RESERVED_PREFIX.len()].eq_ignore_ascii_case(RESERVED_PREFIX.as_bytes())
}

/// The first table that `ddl` creates with a name in onceq's own table
/// namespace, `onceq_` in any case (`Onceq_Orders`): such a table would be
/// taken for one of onceq's, left out of the schema, the types and the
/// grants. Both dialects' quoting (`"x"`, `` `x` ``, `[x]`) is read.
pub fn reserved_table_in_ddl(ddl: &str) -> Option<String> {
    let words: Vec<&str> = ddl
        .split(|c: char| c.is_whitespace() || c == '(' || c == ';')
        .filter(|w| !w.is_empty())
        .collect();
    let mut i = 0;
    while i < words.len() {
        if words[i].eq_ignore_ascii_case("create") && words.get(i + 1).is_some_and(|w| w.eq_ignore_ascii_case("table")) {
            let mut j = i + 2;
            if words.get(j).is_some_and(|w| w.eq_ignore_ascii_case("if"))
                && words.get(j + 1).is_some_and(|w| w.eq_ignore_ascii_case("not"))
                && words.get(j + 2).is_some_and(|w| w.eq_ignore_ascii_case("exists"))
            {
                j += 3;
            }
            if let Some(name) = words.get(j) {
                // `schema.table` or a quoted name: the table's own part.
                let last = name.rsplit('.').next().unwrap_or(name);
                let bare = last.trim_matches(|c| matches!(c, '"' | '`' | '[' | ']'));
                if bare.len() >= 6 && bare.as_bytes()[..6].eq_ignore_ascii_case(b"onceq_") {
                    return Some(bare.to_string());
                }
            }
        }
        i += 1;
    }
    None
}

/// Check the characters and length of a queue or connector name, without
/// the reserved-prefix rule (outbox queues are onceq's own names).
pub fn check_chars(what: &'static str, name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { what });
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong {
            what,
            shown: quoted(name, 40),
            len: name.len(),
        });
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
        return Err(NameError::BadCharacter {
            what,
            shown: quoted(name, 40),
        });
    }
    Ok(())
}

/// A name a user may give a queue (config, `onceq send`, a follow-up):
/// letters, digits, `-`, `_`, `.`, at most [`MAX_NAME_LEN`] bytes, not in
/// the reserved namespace.
pub fn check_queue(name: &str) -> Result<(), NameError> {
    check_chars("queue", name)?;
    if is_reserved(name) {
        return Err(NameError::Reserved {
            what: "queue",
            shown: quoted(name, 40),
        });
    }
    Ok(())
}

/// A connector name (its outbox queue is `onceq.outbox.<name>`).
pub fn check_connector(name: &str) -> Result<(), NameError> {
    check_chars("connector", name)
}

/// Why a key (an idempotency key, a dedup key) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("{what} is empty")]
    Empty { what: String },
    #[error("{what} is {len} bytes long, over the limit of {MAX_KEY_LEN}")]
    TooLong { what: String, len: usize },
    #[error("{what} {shown} must be visible ASCII (letters, digits, punctuation; no control characters, no leading or trailing space)")]
    NotVisible { what: String, shown: String },
}

/// An idempotency key travels as an HTTP header value and is shown in
/// terminals: visible ASCII (and spaces inside), at most [`MAX_KEY_LEN`]
/// bytes.
pub fn check_key(what: &str, key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty { what: what.to_string() });
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            what: what.to_string(),
            len: key.len(),
        });
    }
    if key.starts_with(' ') || key.ends_with(' ') || !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(KeyError::NotVisible {
            what: what.to_string(),
            shown: quoted(key, 40),
        });
    }
    Ok(())
}

/// `text` with every control character (ANSI/OSC escapes, carriage
/// returns, bells...) shown as an escape (`\u{1b}`), so what a handler or a
/// producer chose cannot drive a terminal. Newlines and tabs are escaped
/// too: one record, one line.
pub fn printable(text: &str) -> String {
    if !text.chars().any(needs_escape) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if needs_escape(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// What a terminal must not get raw, by Unicode's general category (the
/// `unicode-properties` crate's tables, not a hand list): controls (Cc),
/// format characters (Cf: zero-width characters and joiners, bidi marks,
/// embeddings, overrides and isolates, the byte-order mark, invisible
/// operators, the soft hyphen, interlinear annotations, tag characters),
/// line and paragraph separators (Zl, Zp), private use (Co) and
/// unassigned code points (Cn, which a newer terminal may draw as
/// anything); and the default-ignorable code points of other categories
/// that render as nothing: the combining grapheme joiner U+034F, the
/// Hangul fillers U+115F, U+1160, U+3164, U+FFA0, and the Mongolian
/// variation selectors. (Emoji variation selectors stay: they only pick
/// a glyph's style, and emoji use them everywhere.)
fn needs_escape(c: char) -> bool {
    use unicode_properties::{GeneralCategory as G, UnicodeGeneralCategory};
    matches!(
        c.general_category(),
        G::Control | G::Format | G::LineSeparator | G::ParagraphSeparator | G::PrivateUse | G::Unassigned | G::Surrogate
    ) || matches!(
        c,
        '\u{034f}' | '\u{115f}' | '\u{1160}' | '\u{3164}' | '\u{ffa0}' | '\u{180b}'..='\u{180f}'
    )
}

/// `text` cut to at most `max` bytes (on a character boundary), saying how
/// long it was when cut.
pub fn truncated(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… (cut: {} bytes in all)", &text[..end], text.len())
}

/// A reason as stored with a message or a dead letter: at most
/// [`MAX_REASON_LEN`] bytes.
pub fn reason(text: &str) -> String {
    truncated(text, MAX_REASON_LEN)
}

/// A duration as a person writes it in `onceq.toml`: the largest whole unit
/// (`365d`, `1h`, `90s`, `250ms`), else humantime's spelling.
/// `n` with thousands separated by commas: 12,500,000.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub fn duration(d: std::time::Duration) -> String {
    const UNITS: [(u128, &str); 5] = [(86_400_000, "d"), (3_600_000, "h"), (60_000, "m"), (1000, "s"), (1, "ms")];
    let ms = d.as_millis();
    if d.subsec_nanos().is_multiple_of(1_000_000) {
        if ms == 0 {
            return "0s".into();
        }
        for (unit, name) in UNITS {
            if ms.is_multiple_of(unit) {
                return format!("{}{name}", ms / unit);
            }
        }
    }
    humantime::format_duration(d).to_string()
}

/// `"name"`, printable and cut to `max` characters, for error messages.
pub fn quoted(name: &str, max: usize) -> String {
    let shown: String = name.chars().take(max).collect();
    let more = if name.chars().count() > max { "…" } else { "" };
    format!("\"{}{more}\"", printable(&shown))
}

/// Microseconds since the Unix epoch as RFC 3339 UTC text, for people
/// (to the microsecond: a handler's timestamps are in microseconds).
pub fn time(us: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_micros(us.max(0) as u64);
    humantime::format_rfc3339_micros(t).to_string()
}

/// `" (did you mean X?)"` when one of `known` is close to `name` (a typo,
/// a missing plural, another case), else `""`: appended to "unknown table",
/// "unknown column" and "unknown queue" errors.
pub fn did_you_mean<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    let lower = name.to_ascii_lowercase();
    let best = known
        .into_iter()
        .filter(|k| *k != name)
        .map(|k| (strsim::jaro_winkler(&lower, &k.to_ascii_lowercase()), k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match best {
        Some((_, k)) => format!(" (did you mean {k}?)"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn hex_is_lowercase_two_digits_a_byte() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        assert_eq!(hex(&[]), "");
    }

    #[test]
    fn tables_in_onceqs_namespace_are_found_in_any_case_and_quoting() {
        use super::reserved_table_in_ddl as r;
        assert_eq!(
            r("CREATE TABLE Onceq_Orders (id TEXT PRIMARY KEY);").as_deref(),
            Some("Onceq_Orders")
        );
        assert_eq!(r("create table if not exists \"ONCEQ_x\"(a INT)").as_deref(), Some("ONCEQ_x"));
        assert_eq!(r("CREATE TABLE `onceq_y` (a INT64) PRIMARY KEY (a)").as_deref(), Some("onceq_y"));
        assert_eq!(r("CREATE TABLE main.[onceq_z] (a)").as_deref(), Some("onceq_z"));
        assert_eq!(r("CREATE TABLE orders (id TEXT PRIMARY KEY, onceq_note TEXT);"), None);
        assert_eq!(r("CREATE TABLE onceqorders (id TEXT PRIMARY KEY);"), None);
        assert_eq!(r(""), None);
    }

    #[test]
    fn did_you_mean_suggests_only_close_names() {
        let tables = ["users", "orders", "accounts"];
        assert_eq!(did_you_mean("user", tables), " (did you mean users?)");
        assert_eq!(did_you_mean("acounts", tables), " (did you mean accounts?)");
        assert_eq!(did_you_mean("Orders", tables), " (did you mean orders?)");
        assert_eq!(did_you_mean("inventory", tables), "");
        assert_eq!(did_you_mean("users", tables), "", "a known name needs no suggestion");
    }

    #[test]
    fn queue_names_are_checked_with_the_reason() {
        assert!(check_queue("payments").is_ok());
        assert!(check_queue("a.b-c_D9").is_ok());
        assert_eq!(check_queue(""), Err(NameError::Empty { what: "queue" }));
        for bad in ["a b", "../../etc/passwd", "ümlaut", "new\nline"] {
            let e = check_queue(bad).unwrap_err().to_string();
            assert!(e.contains("use letters, digits"), "{bad}: {e}");
        }
        let long = "q".repeat(100_000);
        let e = check_queue(&long).unwrap_err().to_string();
        assert!(e.contains("100000 bytes long, over the limit of 128") && e.len() < 200, "{e}");
        for reserved in ["onceq.outbox.x", "ONCEQ.outbox.x", "Onceq.anything"] {
            let e = check_queue(reserved).unwrap_err().to_string();
            assert!(e.contains("reserved"), "{reserved}: {e}");
        }
        assert!(check_queue("onceqx").is_ok(), "only the prefix with its dot is reserved");
    }

    #[test]
    fn durations_print_in_whole_units() {
        use std::time::Duration;
        assert_eq!(duration(Duration::from_secs(365 * 86_400)), "365d");
        assert_eq!(duration(Duration::from_secs(3600)), "1h");
        assert_eq!(duration(Duration::from_secs(90)), "90s");
        assert_eq!(duration(Duration::from_millis(250)), "250ms");
        assert_eq!(duration(Duration::ZERO), "0s");
        assert_eq!(duration(Duration::from_micros(1500)), "1ms 500us");
    }

    #[test]
    fn keys_must_be_visible_ascii() {
        assert!(check_key("idempotency key", "order-42:charge").is_ok());
        assert!(check_key("idempotency key", "").is_err());
        assert!(check_key("idempotency key", "a\r\nx-forged: 1").is_err());
        assert!(check_key("idempotency key", " padded").is_err());
        assert!(check_key("idempotency key", "é").is_err());
        assert!(check_key("idempotency key", &"k".repeat(513)).is_err());
    }

    #[test]
    fn control_characters_are_escaped_and_long_text_is_cut() {
        assert_eq!(printable("plain text"), "plain text");
        let evil = "ok\u{1b}]8;;http://x\u{7}click\u{1b}[2J\r";
        let shown = printable(evil);
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
        assert!(shown.contains("\\u{1b}]8;;http://x\\u{7}click"), "{shown}");
        assert!(!printable("a\u{202e}b").contains('\u{202e}'));
        let cut = truncated(&"é".repeat(10), 5);
        assert_eq!(cut, "éé… (cut: 20 bytes in all)");
        assert_eq!(
            reason(&"x".repeat(10 << 20)).len(),
            MAX_REASON_LEN + "… (cut: 10485760 bytes in all)".len()
        );
    }

    #[test]
    fn invisible_and_text_moving_characters_are_escaped() {
        for c in [
            '\u{061c}',
            '\u{2028}',
            '\u{2029}',
            '\u{feff}',
            '\u{2060}',
            '\u{2064}',
            '\u{00ad}',
            '\u{115f}',
            '\u{180e}',
            '\u{fff9}',
            '\u{e0041}',
            '\u{202e}',
            '\u{200b}',
            '\u{1b}',
        ] {
            let shown = printable(&format!("a{c}b"));
            assert!(!shown.contains(c), "U+{:04X} left raw: {shown:?}", c as u32);
            assert!(shown.starts_with('a') && shown.ends_with('b'), "{shown:?}");
        }
        assert_eq!(printable("plain ümlaut ok"), "plain ümlaut ok", "ordinary text unchanged");
    }

    /// By category, not by list: every format character, separator,
    /// private-use and unassigned code point in the Basic Multilingual
    /// Plane and the tags block is escaped; letters of every script,
    /// marks and emoji (with their variation selector) are left alone.
    #[test]
    fn every_invisible_or_unassigned_code_point_is_escaped_and_text_is_not() {
        use unicode_properties::{GeneralCategory as G, UnicodeGeneralCategory};
        let hidden = |c: char| {
            matches!(
                c.general_category(),
                G::Format | G::LineSeparator | G::ParagraphSeparator | G::PrivateUse | G::Unassigned
            )
        };
        let mut checked = 0;
        for c in ('\u{80}'..='\u{ffff}').chain('\u{e0000}'..='\u{e007f}').filter(|&c| hidden(c)) {
            assert!(!printable(&c.to_string()).contains(c), "U+{:04X} left raw", c as u32);
            checked += 1;
        }
        assert!(checked > 7_000, "{checked} code points");
        for text in ["Grüße, Ελλάδα, Россия, עברית, العربية, 日本語, 한국어", "e\u{301} ❤\u{fe0f} 👍"] {
            assert_eq!(printable(text), text);
        }
    }
}
