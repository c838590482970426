//! Redis keys of global buckets, safe against hostile subjects (invariant I7).
//!
//! A bucket's key is `lh:{RULE|SUBJECT}`. The braces are a Redis Cluster hash tag, so the
//! slot is a function of the whole `RULE|SUBJECT` and each script touches exactly one key.
//! The subject is escaped before it goes inside the tag: every byte outside a small safe
//! set (and so every `{`, `}`, `|`, `%`, NUL, non-ASCII byte) becomes `%XX`. A subject
//! therefore cannot close the tag early, pick the slot or the key of another bucket, or
//! collide with another subject: the encoding is injective. Subjects whose escaped form
//! is longer than [`MAX_INLINE`] bytes are replaced by `#` and the hex SHA-256 of their
//! bytes (`#` is never produced by escaping), which keeps keys short for 1 MB inputs.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::rule::RuleName;

/// Longest escaped subject kept verbatim in a key.
pub const MAX_INLINE: usize = 96;

/// The number of Redis Cluster hash slots.
pub const SLOTS: u16 = 16384;

/// The Redis key of one global bucket (rule, subject).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey(String);

/// A subject that cannot name a bucket.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubjectError {
    /// The subject is empty: usually a missing header or identity upstream.
    #[error("subject is empty; identify the caller (API key, tenant) before checking a limit")]
    Empty,
}

impl BucketKey {
    /// The key for `subject` under `rule`. Any bytes are accepted except an empty string.
    pub fn new(rule: &RuleName, subject: impl AsRef<[u8]>) -> Result<Self, SubjectError> {
        Self::build(rule, subject.as_ref())
    }

    fn build(rule: &RuleName, subject: &[u8]) -> Result<Self, SubjectError> {
        if subject.is_empty() {
            return Err(SubjectError::Empty);
        }
        let mut key =
            String::with_capacity(8 + rule.as_str().len() + subject.len().min(MAX_INLINE));
        key.push_str("lh:{");
        // Rule names are [A-Za-z0-9._-]: nothing in them needs escaping.
        key.push_str(rule.as_str());
        key.push('|');
        let start = key.len();
        // Escaping never shortens: a subject longer than MAX_INLINE is hashed without
        // first escaping its megabyte.
        if subject.len() <= MAX_INLINE {
            escape_into(&mut key, subject);
        }
        if subject.len() > MAX_INLINE || key.len() - start > MAX_INLINE {
            key.truncate(start);
            key.push('#');
            for b in Sha256::digest(subject) {
                key.push_str(&format!("{b:02x}"));
            }
        }
        key.push('}');
        Ok(Self(key))
    }

    /// The key of sub-bucket `part` of this bucket when split with `salt`: the parent's
    /// hash tag plus `|salt.part`, so each part has its own slot (the coordinator picks a
    /// salt that puts the parts on distinct shards).
    pub fn part_of(&self, salt: u64, part: u64) -> Self {
        let tag_end = self.0.len() - 1;
        Self(format!("{}|{salt}.{part}}}", &self.0[..tag_end]))
    }

    /// The key of this bucket's share in a region's own store, for a rule of global scope
    /// (see [`crate::model::region`]): the hash tag plus `|region`. A different key from
    /// the bucket's own, so a region's store never mixes the two kinds.
    pub fn region_of(&self) -> Self {
        let tag_end = self.0.len() - 1;
        Self(format!("{}|region}}", &self.0[..tag_end]))
    }

    /// Whether this is a region's bucket of a global key ([`BucketKey::region_of`]).
    pub fn is_region(&self) -> bool {
        self.0.ends_with("|region}")
    }

    /// The global bucket a region's bucket draws from (the key itself for any other).
    pub fn global_of(&self) -> Self {
        match self.0.strip_suffix("|region}") {
            Some(head) => Self(format!("{head}}}")),
            None => self.clone(),
        }
    }

    /// A key as stored (in an agent's report, say), with its rule; `None` unless it has
    /// the shape [`BucketKey::new`] or [`BucketKey::region_of`] gives (parts of split
    /// buckets are not accepted).
    pub fn parse(text: &str) -> Option<(Self, RuleName)> {
        let tag = text.strip_prefix("lh:{")?.strip_suffix('}')?;
        let tag = tag.strip_suffix("|region").unwrap_or(tag);
        let (rule, subject) = tag.split_once('|')?;
        let safe = |c: char| c.is_ascii_graphic() && !matches!(c, '{' | '}' | '|');
        if subject.is_empty() || subject.len() > MAX_INLINE || !subject.chars().all(safe) {
            return None;
        }
        let rule = RuleName::new(rule).ok()?;
        Some((Self(text.to_owned()), rule))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The hash tag: the text between the braces, which alone decides the slot.
    pub fn hash_tag(&self) -> &str {
        // Built with exactly one '{' after "lh:" and one trailing '}'.
        &self.0[4..self.0.len() - 1]
    }

    /// The Redis Cluster slot of this key (CRC16/XMODEM of the hash tag mod 16384).
    pub fn slot(&self) -> u16 {
        slot_of(self.0.as_bytes())
    }

    /// The SHA-256 of the subject's bytes, read back from the key (unescaped when it is
    /// inline, the hash itself when the subject was long; a region's bucket's is its global
    /// key's); `None` for a part's key or
    /// anything [`BucketKey::new`] does not produce.
    pub fn subject_sha256(&self) -> Option<[u8; 32]> {
        if self.is_region() {
            return self.global_of().subject_sha256();
        }
        let (_, subject) = self.hash_tag().split_once('|')?;
        if subject.contains('|') {
            return None;
        }
        if let Some(hex) = subject.strip_prefix('#') {
            return parse_sha256_hex(hex);
        }
        let mut raw = Vec::with_capacity(subject.len());
        let mut bytes = subject.bytes();
        while let Some(b) = bytes.next() {
            if b == b'%' {
                let hi = (bytes.next()? as char).to_digit(16)?;
                let lo = (bytes.next()? as char).to_digit(16)?;
                raw.push((hi * 16 + lo) as u8);
            } else {
                raw.push(b);
            }
        }
        Some(sha256(&raw))
    }

    /// How the key appears in logs: the rule and a short hash of the subject
    /// (`lh:{api.write|#3fa2c1d0}`), since a subject may be a secret such as an API key.
    /// The same subject always shows the same hash, so log lines can still be grouped.
    pub fn for_logs(&self) -> LogKey<'_> {
        LogKey(self)
    }
}

/// A [`BucketKey`] shown without its subject; see [`BucketKey::for_logs`].
#[derive(Clone, Copy, Debug)]
pub struct LogKey<'a>(&'a BucketKey);

impl fmt::Display for LogKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = self.0.hash_tag();
        let (rule, rest) = tag.split_once('|').unwrap_or((tag, ""));
        // A part key's `|salt.part` suffix is not secret and tells parts apart.
        let (subject, part) = match rest.rsplit_once('|') {
            Some((s, p)) => (s, Some(p)),
            None => (rest, None),
        };
        let digest = Sha256::digest(subject.as_bytes());
        write!(f, "lh:{{{rule}|#")?;
        for b in &digest[..4] {
            write!(f, "{b:02x}")?;
        }
        if let Some(p) = part {
            write!(f, "|{p}")?;
        }
        f.write_str("}")
    }
}

impl fmt::Display for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn escape_into(out: &mut String, subject: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in subject {
        if b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.' | b'_' | b'~' | b':' | b'@' | b'/' | b'+' | b'='
            )
        {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        }
        if out.len() > MAX_INLINE + 64 {
            // Already too long to inline; the caller hashes instead.
            return;
        }
    }
}

/// The SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// 64 hex digits (either case) as 32 bytes.
pub fn parse_sha256_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Which subjects an override applies to, as its name in the rules file says:
/// `sha256:<64 hex digits>` for the subject with that SHA-256, anything else for that
/// exact subject.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SubjectMatch {
    /// This subject.
    Exact(Box<[u8]>),
    /// The subject whose SHA-256 this is.
    Sha256([u8; 32]),
}

impl SubjectMatch {
    /// Reads an override's name; `Err` says what is wrong with a `sha256:` name.
    pub fn parse(name: &str) -> Result<Self, String> {
        if name.is_empty() {
            return Err("an override's subject must not be empty".into());
        }
        match name.strip_prefix("sha256:") {
            Some(hex) => parse_sha256_hex(hex).map(Self::Sha256).ok_or_else(|| {
                format!(
                    "\"sha256:\" must be followed by 64 hex digits (got {} characters)",
                    hex.len()
                )
            }),
            None => Ok(Self::Exact(name.as_bytes().into())),
        }
    }
}

/// The slot Redis Cluster gives `key`, following the hash tag rules.
pub fn slot_of(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16(tagged) % SLOTS
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subject_digest_reads_back_from_every_key_shape() {
        let rule = RuleName::new("api").unwrap();
        for subject in [
            b"tenant-42".to_vec(),
            b"{a|b} %".to_vec(),
            vec![0u8, 255, 7],
            vec![b'x'; 1000],
        ] {
            let key = BucketKey::new(&rule, &subject).unwrap();
            assert_eq!(key.subject_sha256(), Some(sha256(&subject)), "{key}");
        }
        let key = BucketKey::new(&rule, "t").unwrap();
        assert_eq!(key.part_of(1, 0).subject_sha256(), None);
    }

    #[test]
    fn override_names_are_exact_subjects_or_digests() {
        let d = sha256(b"secret-key");
        let hex: String = d.iter().map(|b| format!("{b:02X}")).collect();
        assert_eq!(
            SubjectMatch::parse(&format!("sha256:{hex}")),
            Ok(SubjectMatch::Sha256(d))
        );
        assert_eq!(
            SubjectMatch::parse("tenant-42"),
            Ok(SubjectMatch::Exact(b"tenant-42".to_vec().into()))
        );
        let e = SubjectMatch::parse("sha256:9f86d0").unwrap_err();
        assert!(e.contains("64 hex digits") && e.contains("got 6"), "{e}");
        assert!(SubjectMatch::parse("").is_err());
    }

    fn rule() -> RuleName {
        RuleName::new("api.write").unwrap()
    }

    #[test]
    fn crc16_matches_the_redis_cluster_spec() {
        // The reference value from the Redis Cluster specification.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(slot_of(b"foo{}{bar}"), slot_of(b"foo{}{bar}"));
    }

    #[test]
    fn logs_show_the_rule_and_a_hash_never_the_subject() {
        let k = BucketKey::new(&rule(), "sk_live_secret").unwrap();
        let shown = k.for_logs().to_string();
        assert!(!shown.contains("secret"), "{shown}");
        assert!(
            shown.starts_with("lh:{api.write|#") && shown.len() == 24,
            "{shown}"
        );
        assert_eq!(shown, k.for_logs().to_string());
        let other = BucketKey::new(&rule(), "sk_live_other").unwrap();
        assert_ne!(shown, other.for_logs().to_string());
        let part = k.part_of(7, 2).for_logs().to_string();
        assert!(
            part.starts_with(&shown[..shown.len() - 1]) && part.ends_with("|7.2}"),
            "{part}"
        );
    }

    #[test]
    fn plain_subjects_stay_readable() {
        let k = BucketKey::new(&rule(), "tenant-42").unwrap();
        assert_eq!(k.as_str(), "lh:{api.write|tenant-42}");
        assert_eq!(k.hash_tag(), "api.write|tenant-42");
        assert_eq!(k.slot(), slot_of(k.hash_tag().as_bytes()));
    }

    #[test]
    fn hostile_subjects_cannot_leave_their_tag() {
        let victim = BucketKey::new(&rule(), "victim").unwrap();
        for s in [
            "}{victim".as_bytes(),
            b"{victim}",
            b"x}",
            b"{",
            b"}",
            b"%7D",
            b"a|b",
            b"\0\xff\xfe",
            "héllo ✓".as_bytes(),
        ] {
            let k = BucketKey::new(&rule(), s).unwrap();
            assert_ne!(k, victim);
            let tag = k.hash_tag();
            assert!(!tag.contains('{') && !tag.contains('}'), "{k}");
            assert_eq!(k.slot(), slot_of(tag.as_bytes()), "{k}");
        }
        assert_ne!(
            BucketKey::new(&rule(), "%7D").unwrap(),
            BucketKey::new(&rule(), "}").unwrap()
        );
    }

    #[test]
    fn long_subjects_are_hashed_and_stay_distinct() {
        let a = vec![b'a'; 1 << 20];
        let mut b = a.clone();
        b[500_000] = b'b';
        let (ka, kb) = (
            BucketKey::new(&rule(), &a).unwrap(),
            BucketKey::new(&rule(), &b).unwrap(),
        );
        assert!(ka.as_str().len() < 100 && ka.as_str().contains("|#"));
        assert_ne!(ka, kb);
        // A subject exactly at the inline limit is not hashed.
        let edge = "x".repeat(MAX_INLINE);
        assert!(
            !BucketKey::new(&rule(), &edge)
                .unwrap()
                .as_str()
                .contains('#')
        );
        assert_eq!(BucketKey::new(&rule(), ""), Err(SubjectError::Empty));
    }

    #[test]
    fn stored_keys_parse_back_and_nothing_else_does() {
        for subject in ["t", "{x}|y", "é", &"z".repeat(500)] {
            let k = BucketKey::new(&rule(), subject).unwrap();
            assert_eq!(BucketKey::parse(k.as_str()), Some((k.clone(), rule())));
        }
        let part = BucketKey::new(&rule(), "t").unwrap().part_of(1, 2);
        for bad in [
            "lh:{api.write}",
            "lh:{|t}",
            "x:{api.write|t}",
            "lh:{api.write|t",
            part.as_str(),
        ] {
            assert_eq!(BucketKey::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_region_bucket_key_parses_back_and_leads_to_its_global_key() {
        for subject in ["t", "{x}|y", &"z".repeat(500)] {
            let global = BucketKey::new(&rule(), subject).unwrap();
            let k = global.region_of();
            assert!(k.is_region() && !global.is_region());
            assert_ne!(k, global);
            assert_eq!(k.global_of(), global);
            assert_eq!(BucketKey::parse(k.as_str()), Some((k.clone(), rule())));
            assert_eq!(k.subject_sha256(), global.subject_sha256());
        }
        // A subject cannot produce a region key: its `|` is escaped.
        let sneaky = BucketKey::new(&rule(), "t|region").unwrap();
        assert!(!sneaky.is_region());
    }

    #[test]
    fn parts_of_a_split_key_have_their_own_tags() {
        let parent = BucketKey::new(&rule(), "{hot}").unwrap();
        let parts: Vec<_> = (0..3).map(|i| parent.part_of(7, i)).collect();
        assert_ne!(parts[0], parts[1]);
        assert_eq!(parts[2].as_str(), "lh:{api.write|%7Bhot%7D|7.2}");
        assert!(
            parts
                .iter()
                .all(|k| k.hash_tag().starts_with(parent.hash_tag()))
        );
        assert_ne!(parts[0].slot(), parts[1].slot());
    }
}
