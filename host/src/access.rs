//! Who may do what through the admin API: named tokens, each with a role
//! and the queues it may touch.
//!
//! | role | may |
//! |---|---|
//! | `viewer` | read: stats, versions, dead letters, the audit trail (of its queues) |
//! | `operator` | read, and replay or discard dead letters and dead intents |
//! | `deployer` | read, and deploy or roll back handlers |
//! | `admin` | everything, on the queues it names (`["*"]`: all) |
//!
//! A token's `queues` are names or patterns with `*` (any run of
//! characters): `payments`, `payments-*`, `onceq.outbox.charge` (an
//! outbox's dead intents). Secrets are kept as their SHA-256 and compared
//! in constant time, every configured token each time.

use sha2::Digest;

/// A token's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Admin,
    Deployer,
    Operator,
    Viewer,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "admin" => Role::Admin,
            "deployer" => Role::Deployer,
            "operator" => Role::Operator,
            "viewer" => Role::Viewer,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Deployer => "deployer",
            Role::Operator => "operator",
            Role::Viewer => "viewer",
        }
    }
}

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Read,
    /// Deploy or roll back a handler.
    Deploy,
    /// Replay or discard dead letters.
    Operate,
    /// Send a message through the admin API.
    Send,
}

impl Action {
    fn verb(self) -> &'static str {
        match self {
            Action::Read => "read",
            Action::Deploy => "deploy or roll back",
            Action::Operate => "replay or discard dead letters",
            Action::Send => "send messages",
        }
    }

    /// The roles that may.
    fn roles(self) -> &'static str {
        match self {
            Action::Read => "any role",
            Action::Deploy => "role deployer or admin",
            Action::Operate | Action::Send => "role operator or admin",
        }
    }
}

/// One configured token.
#[derive(Clone)]
pub struct Token {
    pub name: String,
    pub role: Role,
    /// Queue names or `*` patterns.
    pub queues: Vec<String>,
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("queues", &self.queues)
            .finish()
    }
}

/// SHA-256 of a secret.
pub fn digest(secret: &str) -> [u8; 32] {
    sha2::Sha256::digest(secret.as_bytes()).into()
}

/// Constant-time equality of two digests.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `name` matches `pattern` (`*`: any run of characters).
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(i) => rest = &rest[i + middle.len()..],
            None => return false,
        }
    }
    true
}

impl Token {
    /// A token whose secret has this SHA-256. The name is shown in
    /// refusals and the audit trail: printable, at most 64 bytes.
    pub fn new(name: &str, role: Role, queues: Vec<String>, digest: [u8; 32]) -> Result<Token, String> {
        if name.is_empty() || name.len() > 64 || crate::names::printable(name) != name || name.contains(' ') {
            return Err(format!(
                "token name {}: 1 to 64 printable bytes without spaces",
                crate::names::quoted(name, 40)
            ));
        }
        for q in &queues {
            let plain = q.replace('*', "");
            if q.is_empty() || (!plain.is_empty() && crate::names::check_chars("queue pattern", &plain).is_err()) {
                return Err(format!(
                    "token {name}: queue pattern {} may hold letters, digits, '.', '-', '_' and '*'",
                    crate::names::quoted(q, 40)
                ));
            }
        }
        Ok(Token {
            name: name.to_string(),
            role,
            queues,
            digest,
        })
    }

    /// Whether this token may touch `queue`.
    pub fn covers(&self, queue: &str) -> bool {
        self.queues.iter().any(|p| pattern_matches(p, queue))
    }

    /// Whether this token may do `action` (on `queue`, if it names one);
    /// the refusal says what is missing.
    pub fn check(&self, action: Action, queue: Option<&str>) -> Result<(), String> {
        let allowed = matches!(
            (self.role, action),
            (Role::Admin, _) | (_, Action::Read) | (Role::Deployer, Action::Deploy) | (Role::Operator, Action::Operate | Action::Send)
        );
        if !allowed {
            return Err(format!(
                "token {} (role {}) may not {}: that needs {}",
                self.name,
                self.role.name(),
                action.verb(),
                action.roles()
            ));
        }
        if let Some(q) = queue {
            if !self.covers(q) {
                return Err(format!(
                    "token {} may not touch queue {}: its queues are {}",
                    self.name,
                    crate::names::printable(q),
                    self.queues.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// The configured tokens.
#[derive(Debug, Clone, Default)]
pub struct Tokens(pub Vec<Token>);

impl Tokens {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The token whose secret is `presented`. Every token is compared,
    /// in constant time each, whichever matches.
    pub fn find(&self, presented: &str) -> Option<&Token> {
        let d = digest(presented);
        let mut found = None;
        for t in &self.0 {
            if same(&t.digest, &d) && found.is_none() {
                found = Some(t);
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn patterns_match_as_globs() {
        for (p, n, m) in [
            ("payments", "payments", true),
            ("payments", "payments-eu", false),
            ("payments-*", "payments-eu", true),
            ("payments-*", "payments", false),
            ("*", "anything", true),
            ("*-eu", "payments-eu", true),
            ("p*s-*u", "payments-eu", true),
            ("p*x*", "payments", false),
            ("onceq.outbox.*", "onceq.outbox.charge", true),
        ] {
            assert_eq!(pattern_matches(p, n), m, "{p} ~ {n}");
        }
    }

    #[test]
    fn roles_and_scopes_refuse_naming_what_is_missing() {
        let t = |role, queues: &[&str]| Token::new("t", role, queues.iter().map(|s| s.to_string()).collect(), digest("s")).unwrap();
        let viewer = t(Role::Viewer, &["*"]);
        assert!(viewer.check(Action::Read, Some("payments")).is_ok());
        let e = viewer.check(Action::Deploy, Some("payments")).unwrap_err();
        assert!(e.contains("role viewer") && e.contains("needs role deployer or admin"), "{e}");
        let deployer = t(Role::Deployer, &["payments-*"]);
        assert!(deployer.check(Action::Deploy, Some("payments-eu")).is_ok());
        let e = deployer.check(Action::Deploy, Some("orders")).unwrap_err();
        assert!(e.contains("may not touch queue orders") && e.contains("payments-*"), "{e}");
        assert!(deployer.check(Action::Operate, Some("payments-eu")).is_err());
        let operator = t(Role::Operator, &["payments"]);
        assert!(operator.check(Action::Operate, Some("payments")).is_ok());
        assert!(operator.check(Action::Deploy, Some("payments")).is_err());
        assert!(t(Role::Admin, &["*"]).check(Action::Deploy, Some("x")).is_ok());
        assert!(Token::new("a b", Role::Admin, vec![], digest("s")).is_err());
        assert!(Token::new("ok", Role::Admin, vec!["bad/name".into()], digest("s")).is_err());
        let tokens = Tokens(vec![viewer, deployer]);
        assert_eq!(tokens.find("s").map(|t| t.role), Some(Role::Viewer));
        assert!(tokens.find("wrong").is_none());
    }
}
