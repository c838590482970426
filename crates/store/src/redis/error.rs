//! Store errors: what failed, whether a retry may help, and their text with no password.

use std::time::Duration;

use leasehold_core::model::ProtocolError;
use redis::RedisError;

use crate::secret::redact_in;

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The request was refused before it was sent: it can never succeed as written.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The store refused the request (`LH_*` error from the library).
    #[error("store refused the request: {code} {message}")]
    Refused {
        /// `LH_CAPACITY`, `LH_STALE` or `LH_ARG`.
        code: String,
        /// The store's explanation.
        message: String,
    },
    /// The store could not be reached or did not answer in time. The request may or may
    /// not have been applied; retrying it with the same `(agent, seq)` is safe.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] RedisError),
    /// No answer within the call timeout. As for `Unavailable`, a retry is safe.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// The embedded store was switched off (simulated outage).
    #[error("store offline")]
    Offline,
    /// The store answered with an error of its own: out of memory (`OOM`), no permission
    /// (`NOPERM`), a read-only replica (`READONLY`), a key of another type (`WRONGTYPE`).
    #[error("store error {code}: {message}")]
    Server {
        /// The error code Redis gave.
        code: String,
        /// Its explanation, truncated.
        message: String,
    },
    /// A grant that fewer replicas than the rule's `replicas` acknowledged within its
    /// `replica_timeout`: a failover now could lose it, so it is not spent and counts as
    /// an unknown outcome (the failure policy decides; the next acquire declares what
    /// the agent holds, which returns the grant to the bucket).
    #[error("grant of {granted} acknowledged by {acked} of {wanted} replicas in time")]
    NotReplicated {
        /// Tokens the primary granted.
        granted: u64,
        /// Replicas that acknowledged.
        acked: u64,
        /// Replicas the rule asks for.
        wanted: u32,
    },
    /// The store answered in a way that needs an operator: an unexpected reply, a bad
    /// address.
    #[error("store misconfigured: {0}")]
    Misconfigured(String),
}

/// What kind of store error, as counted in `leasehold_store_errors_by_kind_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No answer in time.
    Timeout,
    /// Connection refused, dropped or reset; the node is loading or the cluster down.
    Unavailable,
    /// The embedded store is switched off.
    Offline,
    /// `OOM`: Redis is at `maxmemory` and refuses writes.
    OutOfMemory,
    /// `NOPERM` or `NOAUTH`: the user may not run the library.
    NoPermission,
    /// `READONLY`: the node is a replica.
    ReadOnly,
    /// `LH_*`: the library refused the request itself.
    Refused,
    /// Refused before sending: the request can never succeed as written.
    Protocol,
    /// A grant that too few replicas acknowledged in time (rules with `replicas`).
    NotReplicated,
    /// Any other error reply or unexpected answer.
    Other,
}

impl ErrorKind {
    /// Every kind, in `repr` order.
    pub const ALL: [ErrorKind; 10] = [
        Self::Timeout,
        Self::Unavailable,
        Self::Offline,
        Self::OutOfMemory,
        Self::NoPermission,
        Self::ReadOnly,
        Self::Refused,
        Self::Protocol,
        Self::NotReplicated,
        Self::Other,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Unavailable => "unavailable",
            Self::Offline => "offline",
            Self::OutOfMemory => "oom",
            Self::NoPermission => "noperm",
            Self::ReadOnly => "readonly",
            Self::Refused => "refused",
            Self::Protocol => "protocol",
            Self::NotReplicated => "not_replicated",
            Self::Other => "other",
        }
    }
}

impl StoreError {
    /// True when the outcome of the request is unknown and a retry with the same
    /// sequence number is the right move.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Unavailable(_) | Self::Timeout(_) | Self::Offline
        )
    }

    /// What kind of error this is, for metrics.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Protocol(_) => ErrorKind::Protocol,
            Self::Refused { .. } => ErrorKind::Refused,
            Self::Unavailable(_) => ErrorKind::Unavailable,
            Self::Timeout(_) => ErrorKind::Timeout,
            Self::Offline => ErrorKind::Offline,
            Self::Server { code, .. } => match code.as_str() {
                "OOM" => ErrorKind::OutOfMemory,
                "NOPERM" | "NOAUTH" | "WRONGPASS" => ErrorKind::NoPermission,
                "READONLY" => ErrorKind::ReadOnly,
                _ => ErrorKind::Other,
            },
            Self::NotReplicated { .. } => ErrorKind::NotReplicated,
            Self::Misconfigured(_) => ErrorKind::Other,
        }
    }
}

/// At most this many bytes of a store's error text are kept: a request carrying a
/// megabyte must not come back as a megabyte of error message.
pub(super) const MAX_ERROR_TEXT: usize = 256;

pub(super) fn truncated(text: &str) -> String {
    if text.len() <= MAX_ERROR_TEXT {
        return text.to_owned();
    }
    let mut end = MAX_ERROR_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &text[..end], text.len())
}

pub(super) fn is_missing_library(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// `e` with `address`'s secrets taken out of its text.
pub(super) fn redacted(e: StoreError, address: &str) -> StoreError {
    match e {
        StoreError::Misconfigured(text) => StoreError::Misconfigured(redact_in(&text, address)),
        other => other,
    }
}

pub(super) fn classify(e: RedisError) -> StoreError {
    if let Some(code) = e.code()
        && code.starts_with("LH_")
    {
        let detail = e.detail().unwrap_or_default();
        // Redis appends " script: NAME, on @user_function:LINE." to errors from functions.
        let message = truncated(detail.split(" script: ").next().unwrap_or(detail));
        return StoreError::Refused {
            code: code.to_owned(),
            message,
        };
    }
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.code(),
            Some("LOADING" | "CLUSTERDOWN" | "TRYAGAIN" | "MASTERDOWN")
        )
    {
        return StoreError::Unavailable(e);
    }
    if let Some(code) = e.code() {
        return StoreError::Server {
            code: code.to_owned(),
            message: truncated(e.detail().unwrap_or_default()),
        };
    }
    StoreError::Misconfigured(truncated(&e.to_string()))
}

#[cfg(test)]
mod redact_tests {
    use crate::secret::redact;
    use crate::{RedisStore, StoreConfig};

    #[test]
    fn connect_errors_carry_no_password() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        for url in [
            "redis://:hunter2-secret@127.0.0.1:notaport",
            "redis://user:hunter2-secret@127.0.0.1:1",
        ] {
            let config = StoreConfig {
                connect_timeout: std::time::Duration::from_millis(200),
                ..StoreConfig::default()
            };
            let text = match rt.block_on(RedisStore::connect(url, config)) {
                Ok(_) => panic!("{} connected", redact(url)),
                Err(e) => e.to_string(),
            };
            assert!(!text.contains("hunter2"), "{text}");
        }
    }
}
