//! Signed components, in minisign's format (Ed25519; the `minisign` CLI
//! many teams already use reads and writes the same files).
//!
//! `onceq keygen` makes a key pair, `onceq sign` writes `COMPONENT.minisig`
//! beside a component. A host with `deploy.trusted_keys` checks every
//! component it is given (the config's handlers, the admin API, the
//! watched folder, a rollback, a restart onto a deployed version): a
//! signature must be by a trusted key and match the bytes; with
//! `deploy.require_signature` an unsigned component is refused too. The
//! refusal names the key id. The signer (key id and trusted comment) is
//! kept with the deployment and in the audit trail.

use anyhow::{bail, Context};
use std::io::Cursor;
use std::path::{Path, PathBuf};

/// Who signed a component.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Signer {
    /// The key id, as minisign prints it (16 hex digits).
    pub key_id: String,
    /// The signature's trusted comment (signed with it).
    pub comment: String,
}

impl std::fmt::Display for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "key {} ({})", self.key_id, crate::names::printable(&self.comment))
    }
}

/// Why a component's signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the component is not signed, and deploy.require_signature is on: sign it with `onceq sign` (or `minisign -S`) and give its .minisig with it")]
    Missing,
    #[error("the signature is not a minisign signature: {0}")]
    Malformed(String),
    #[error("signed by key {key_id}, which is not in deploy.trusted_keys (trusted: {trusted})")]
    Untrusted { key_id: String, trusted: String },
    #[error("the signature by key {key_id} does not match the component's bytes (changed after signing, or signed another file)")]
    Mismatch { key_id: String },
}

/// The keys a host trusts (`deploy.trusted_keys`) and whether a signature
/// is required (`deploy.require_signature`).
#[derive(Clone, Default)]
pub struct Trust {
    keys: Vec<(String, minisign::PublicKey)>,
    pub required: bool,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trust")
            .field("keys", &self.keys.iter().map(|(id, _)| id).collect::<Vec<_>>())
            .field("required", &self.required)
            .finish()
    }
}

fn key_id(keynum: &[u8]) -> String {
    // minisign prints the 8-byte key number as a little-endian u64.
    let mut n = [0u8; 8];
    for (d, s) in n.iter_mut().zip(keynum) {
        *d = *s;
    }
    format!("{:016X}", u64::from_le_bytes(n))
}

impl Trust {
    /// Each entry is a public key as minisign prints it (`RW...`) or the
    /// path of a minisign `.pub` file (relative to `base`).
    pub fn parse(entries: &[String], required: bool, base: &Path) -> anyhow::Result<Trust> {
        let mut keys = Vec::new();
        for e in entries {
            let e = e.trim();
            let pk = match minisign::PublicKey::from_base64(e) {
                Ok(pk) => pk,
                Err(_) => {
                    let path = base.join(e);
                    let text = std::fs::read_to_string(&path).with_context(|| {
                        format!("deploy.trusted_keys: {e:?} is neither a minisign public key (RW...) nor a readable .pub file")
                    })?;
                    minisign::PublicKeyBox::from_string(&text)
                        .and_then(|b| b.into_public_key())
                        .map_err(|err| {
                            anyhow::anyhow!("deploy.trusted_keys: {} is not a minisign public key file: {err}", path.display())
                        })?
                }
            };
            keys.push((key_id(pk.keynum()), pk));
        }
        if required && keys.is_empty() {
            bail!("deploy.require_signature is on but deploy.trusted_keys is empty: no component could be deployed");
        }
        Ok(Trust { keys, required })
    }

    /// Whether components are checked at all.
    pub fn is_active(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Check `bytes` against `signature` (a `.minisig` file's text): the
    /// signer if it is signed by a trusted key, `None` if unsigned and
    /// that is allowed (or no key is trusted: nothing is checked).
    pub fn check(&self, bytes: &[u8], signature: Option<&str>) -> Result<Option<Signer>, SignatureError> {
        if !self.is_active() {
            return Ok(None);
        }
        let Some(text) = signature else {
            return if self.required { Err(SignatureError::Missing) } else { Ok(None) };
        };
        let sig = minisign::SignatureBox::from_string(text).map_err(|e| SignatureError::Malformed(e.to_string()))?;
        let id = key_id(sig.keynum());
        let Some((_, pk)) = self.keys.iter().find(|(k, _)| *k == id) else {
            return Err(SignatureError::Untrusted {
                key_id: id,
                trusted: self.keys.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(", "),
            });
        };
        minisign::verify(pk, &sig, Cursor::new(bytes), true, false, false).map_err(|_| SignatureError::Mismatch { key_id: id.clone() })?;
        let comment = sig.trusted_comment().unwrap_or_default();
        Ok(Some(Signer { key_id: id, comment }))
    }
}

/// Where a component's signature is kept: `COMPONENT.minisig`, as minisign
/// writes it.
pub fn signature_path(component: &Path) -> PathBuf {
    let mut p = component.as_os_str().to_owned();
    p.push(".minisig");
    PathBuf::from(p)
}

/// The signature beside `component`, if there is one (at most 64 KiB).
pub fn read_beside(component: &Path) -> std::io::Result<Option<String>> {
    let path = signature_path(component);
    match std::fs::metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
        Ok(m) if !m.is_file() || m.len() > 64 << 10 => Err(std::io::Error::other(format!(
            "{} is not a signature file (not a regular file of at most 64 KiB)",
            path.display()
        ))),
        Ok(_) => std::fs::read_to_string(&path).map(Some),
    }
}

/// Read a minisign secret key file, decrypting it with `password` when it
/// is protected by one.
fn secret_key(path: &Path, password: Option<String>) -> anyhow::Result<minisign::SecretKey> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the secret key {}", path.display()))?;
    let parse =
        || minisign::SecretKeyBox::from_string(&text).map_err(|e| anyhow::anyhow!("{} is not a minisign secret key: {e}", path.display()));
    let sk_box = parse()?;
    let plain = minisign::SecretKey::from_unencrypted_box(parse()?)
        .ok()
        .filter(|k| !k.is_encrypted());
    if let Some(sk) = plain {
        return Ok(sk);
    }
    {
        let Some(password) = password else {
            bail!(
                "{} is protected by a password: put it in the variable named by --password-env (default ONCEQ_SIGN_PASSWORD)",
                path.display()
            );
        };
        minisign::SecretKey::from_box(sk_box, Some(password)).map_err(|e| anyhow::anyhow!("decrypting {}: {e}", path.display()))
    }
}

/// `onceq sign`: sign `component` with the secret key at `key`, writing
/// `COMPONENT.minisig`; the trusted comment names the file and its
/// version. Returns the signature's path and the signer.
pub fn sign(component: &Path, key: &Path, password: Option<String>) -> anyhow::Result<(PathBuf, Signer)> {
    let sk = secret_key(key, password)?;
    let bytes = crate::runtime::read_component(component).with_context(|| format!("reading {}", component.display()))?;
    let name = component.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let comment = format!("file:{name} sha256:{}", {
        use sha2::Digest;
        crate::names::hex(&sha2::Sha256::digest(&bytes))
    });
    let sig = minisign::sign(None, &sk, Cursor::new(&bytes), Some(&comment), Some("signature from onceq sign"))
        .map_err(|e| anyhow::anyhow!("signing {}: {e}", component.display()))?;
    let path = signature_path(component);
    std::fs::write(&path, sig.to_string()).with_context(|| format!("writing {}", path.display()))?;
    Ok((
        path,
        Signer {
            key_id: key_id(sig.keynum()),
            comment,
        },
    ))
}

/// `onceq keygen`: a new key pair written as `PREFIX.key` (secret; with a
/// password if one is given) and `PREFIX.pub`. Returns the public key as
/// `deploy.trusted_keys` takes it, and its id.
pub fn keygen(prefix: &Path, password: Option<String>) -> anyhow::Result<(String, String)> {
    let (sk_path, pk_path) = (prefix.with_extension("key"), prefix.with_extension("pub"));
    for p in [&sk_path, &pk_path] {
        if p.exists() {
            bail!("{} exists already: not overwritten", p.display());
        }
    }
    let encrypted = password.is_some();
    let pair = match password {
        Some(p) => minisign::KeyPair::generate_encrypted_keypair(Some(p)),
        None => minisign::KeyPair::generate_unencrypted_keypair(),
    }
    .map_err(|e| anyhow::anyhow!("generating a key pair: {e}"))?;
    write_pair(&sk_path, &pk_path, pair.pk, pair.sk, encrypted)
}

fn write_pair(
    sk_path: &Path,
    pk_path: &Path,
    pk: minisign::PublicKey,
    sk: minisign::SecretKey,
    encrypted: bool,
) -> anyhow::Result<(String, String)> {
    let id = key_id(pk.keynum());
    let comment = if encrypted {
        "onceq secret key (password-protected)"
    } else {
        "onceq secret key (no password)"
    };
    let sk_text = sk.to_box(Some(comment)).map_err(|e| anyhow::anyhow!("{e}"))?.to_string();
    let pk_text = pk.to_box().map_err(|e| anyhow::anyhow!("{e}"))?.to_string();
    write_private(sk_path, sk_text.as_bytes())?;
    std::fs::write(pk_path, pk_text).with_context(|| format!("writing {}", pk_path.display()))?;
    Ok((pk.to_base64(), id))
}

/// Write a file only its owner can read.
fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    o.mode(0o600);
    let mut f = o.open(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn signed_by_a_trusted_key_passes_and_every_other_case_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let component = dir.path().join("h.wasm");
        std::fs::write(&component, b"\0asm component bytes").unwrap();
        let (public, id) = keygen(&dir.path().join("team"), None).unwrap();
        let (other_public, other_id) = keygen(&dir.path().join("other"), Some("pw".into())).unwrap();
        let (sig_path, signer) = sign(&component, &dir.path().join("team.key"), None).unwrap();
        assert_eq!(signer.key_id, id);
        let sig = std::fs::read_to_string(&sig_path).unwrap();
        let bytes = std::fs::read(&component).unwrap();

        let trust = Trust::parse(std::slice::from_ref(&public), true, dir.path()).unwrap();
        let got = trust.check(&bytes, Some(&sig)).unwrap().unwrap();
        assert_eq!(got.key_id, id);
        assert!(got.comment.starts_with("file:h.wasm sha256:"), "{}", got.comment);
        // A .pub file works as well as the key's text.
        let by_file = Trust::parse(&["team.pub".into()], true, dir.path()).unwrap();
        assert!(by_file.check(&bytes, Some(&sig)).unwrap().is_some());

        assert_eq!(trust.check(&bytes, None), Err(SignatureError::Missing));
        let mut changed = bytes.clone();
        changed.push(0);
        assert_eq!(
            trust.check(&changed, Some(&sig)),
            Err(SignatureError::Mismatch { key_id: id.clone() })
        );
        let only_other = Trust::parse(&[other_public], false, dir.path()).unwrap();
        let e = only_other.check(&bytes, Some(&sig)).unwrap_err();
        assert_eq!(
            e,
            SignatureError::Untrusted {
                key_id: id.clone(),
                trusted: other_id.clone()
            }
        );
        assert!(e.to_string().contains(&id) && e.to_string().contains(&other_id), "{e}");
        assert!(matches!(
            trust.check(&bytes, Some("not a signature")),
            Err(SignatureError::Malformed(_))
        ));
        // Not required: unsigned passes, a bad signature still does not.
        let optional = Trust::parse(&[public], false, dir.path()).unwrap();
        assert_eq!(optional.check(&bytes, None), Ok(None));
        assert!(optional.check(&changed, Some(&sig)).is_err());

        // A password-protected key needs its password.
        let e = sign(&component, &dir.path().join("other.key"), None).unwrap_err();
        assert!(e.to_string().contains("protected by a password"), "{e}");
        let (_, s) = sign(&component, &dir.path().join("other.key"), Some("pw".into())).unwrap();
        assert_eq!(s.key_id, other_id);
        assert!(keygen(&dir.path().join("team"), None)
            .unwrap_err()
            .to_string()
            .contains("exists already"));
        assert!(Trust::parse(&[], true, dir.path())
            .unwrap_err()
            .to_string()
            .contains("trusted_keys is empty"));
        assert!(Trust::parse(&["nope".into()], false, dir.path()).is_err());
    }
}
