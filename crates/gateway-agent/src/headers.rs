//! The headers every front end answers with, made in one place: `RateLimit-Policy`
//! (`"NAME";q=B;w=W`, W the seconds an empty bucket takes to fill), `RateLimit`
//! (`"NAME";r=REMAINING;t=SECONDS`, the seconds until the bucket is full again) from the
//! IETF draft, and `Retry-After` in whole seconds. The tower layer, `leasehold serve`'s
//! HTTP API and its Envoy responses all use these functions, so a rule is described the
//! same way whichever way a request came in.
//!
//! A rule is described as a whole: a rule with a local share reports its capacity and
//! rate, not those of the global part the store keeps.

use std::sync::Arc;
use std::time::Duration;

use leasehold_core::Rate;

use crate::limiter::Decision;

/// A rule as clients see it: its name, capacity and rate (the whole rule's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    name: Arc<str>,
    capacity: u64,
    rate: Rate,
}

impl Policy {
    /// The policy of a rule of `capacity` tokens refilled at `rate`.
    pub fn new(name: impl Into<Arc<str>>, capacity: u64, rate: Rate) -> Self {
        Self {
            name: name.into(),
            capacity,
            rate,
        }
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Capacity B.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// This rule's `RateLimit-Policy` item.
    pub fn item(&self) -> String {
        policy_item(
            &self.name,
            self.capacity,
            leasehold_core::refill_secs(self.capacity, self.rate),
        )
    }

    /// This rule's `RateLimit` item after `d`; `None` when the store's count did not
    /// decide (an admission by fail open, the emergency limit or shadow mode, a refusal
    /// because the store is unreachable): nothing honest to say of what is left.
    pub fn limit_item(&self, d: Decision) -> Option<String> {
        let (remaining, t) = self.left(d)?;
        Some(limit_item(&self.name, remaining, t))
    }

    /// What `d` leaves: tokens remaining, and seconds until the bucket is full again (a
    /// refusal: until the caller may come back).
    pub fn left(&self, d: Decision) -> Option<(u64, u64)> {
        match d {
            Decision::Allowed { via, .. } if !via.is_metered() => None,
            Decision::Allowed { remaining, .. } => {
                let remaining = remaining.min(self.capacity);
                let missing = self.capacity - remaining;
                Some((remaining, leasehold_core::refill_secs(missing, self.rate)))
            }
            Decision::Denied { retry_after } => Some((0, retry_secs(retry_after))),
            Decision::Unavailable { .. } => None,
        }
    }
}

/// A `RateLimit-Policy` item: `"NAME";q=QUOTA;w=WINDOW_SECONDS`.
pub fn policy_item(name: &str, quota: u64, window_secs: u64) -> String {
    format!("\"{name}\";q={quota};w={window_secs}")
}

/// A `RateLimit` item: `"NAME";r=REMAINING;t=SECONDS`.
pub fn limit_item(name: &str, remaining: u64, reset_secs: u64) -> String {
    let mut v = Vec::with_capacity(name.len() + 32);
    // Writing to a Vec cannot fail.
    let _ = write_limit_item(&mut v, name, remaining, reset_secs);
    String::from_utf8(v).unwrap_or_default()
}

/// [`limit_item`] written to `w` (a response's buffer, without an allocation).
pub fn write_limit_item(
    w: &mut impl std::io::Write,
    name: &str,
    remaining: u64,
    reset_secs: u64,
) -> std::io::Result<()> {
    write!(w, "\"{name}\";r={remaining};t={reset_secs}")
}

/// `Retry-After` in whole seconds: rounded up, at least 1.
pub fn retry_secs(wait: Duration) -> u64 {
    leasehold_core::retry_after_secs(wait.as_micros().min(u128::from(u64::MAX)) as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Admission;

    #[test]
    fn items_say_quota_window_remaining_and_reset() {
        let p = Policy::new("api", 100, "10/s".parse().unwrap());
        assert_eq!(p.item(), "\"api\";q=100;w=10");
        let allowed = |remaining, via| Decision::Allowed { remaining, via };
        assert_eq!(
            p.limit_item(allowed(40, Admission::Lease)).as_deref(),
            Some("\"api\";r=40;t=6")
        );
        assert_eq!(p.limit_item(allowed(0, Admission::FailOpen)), None);
        let denied = Decision::Denied {
            retry_after: Duration::from_millis(1_200),
        };
        assert_eq!(p.limit_item(denied).as_deref(), Some("\"api\";r=0;t=2"));
        let unavailable = Decision::Unavailable {
            retry_after: Duration::from_secs(1),
        };
        assert_eq!(
            p.limit_item(unavailable),
            None,
            "the bucket's level is not known"
        );
        assert_eq!(retry_secs(Duration::from_micros(1)), 1);
    }
}
