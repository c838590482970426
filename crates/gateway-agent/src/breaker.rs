//! Circuit breakers and bulkheads between decisions and the store.
//!
//! Keys are grouped by Redis Cluster slot range (16 groups of 1024 slots), so a slow or
//! dead shard opens the breakers of the groups it serves and bounds their in-flight
//! calls, while decisions for keys on other shards go on. A breaker opens after
//! consecutive failures, lets one probe through after a cooldown (half-open), and closes
//! on the probe's success.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Slot groups.
pub(crate) const GROUPS: usize = 16;

/// Breaker settings.
#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    /// Consecutive failures that open a breaker.
    pub failures_to_open: u32,
    /// How long it stays open before a probe.
    pub cooldown: Duration,
    /// In-flight store calls per slot group.
    pub max_in_flight: usize,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures_to_open: 3,
            cooldown: Duration::from_millis(500),
            max_in_flight: 512,
        }
    }
}

#[derive(Debug)]
struct Breaker {
    failures: AtomicU32,
    open_until_ns: AtomicU64,
    probing: AtomicBool,
    in_flight: Arc<Semaphore>,
}

/// Why a call may not go to the store now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The breaker is open.
    Open,
    /// Too many calls in flight for this group.
    Saturated,
}

/// Permission to call the store; a probe closes or reopens the breaker by its outcome.
#[derive(Debug)]
pub(crate) struct Permit {
    _slot: OwnedSemaphorePermit,
}

/// One breaker and bulkhead per slot group.
#[derive(Debug)]
pub(crate) struct Breakers {
    groups: Vec<Breaker>,
    config: BreakerConfig,
}

impl Breakers {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            groups: (0..GROUPS)
                .map(|_| Breaker {
                    failures: AtomicU32::new(0),
                    open_until_ns: AtomicU64::new(0),
                    probing: AtomicBool::new(false),
                    in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
                })
                .collect(),
            config,
        }
    }

    pub(crate) fn group(slot: u16) -> usize {
        usize::from(slot) * GROUPS / usize::from(lease_core::key::SLOTS)
    }

    /// Asks to call the store for a key in `group` at `now_ns`.
    pub(crate) fn enter(&self, group: usize, now_ns: u64) -> Result<Permit, Refusal> {
        let b = &self.groups[group];
        let until = b.open_until_ns.load(Ordering::Acquire);
        if until != 0 {
            // Open: refuse until the cooldown ends, then let exactly one probe through.
            if now_ns < until || b.probing.swap(true, Ordering::AcqRel) {
                return Err(Refusal::Open);
            }
        }
        match b.in_flight.clone().try_acquire_owned() {
            Ok(p) => Ok(Permit { _slot: p }),
            Err(_) => {
                b.probing.store(false, Ordering::Release);
                Err(Refusal::Saturated)
            }
        }
    }

    pub(crate) fn success(&self, group: usize) {
        let b = &self.groups[group];
        b.failures.store(0, Ordering::Relaxed);
        b.open_until_ns.store(0, Ordering::Release);
        b.probing.store(false, Ordering::Release);
    }

    pub(crate) fn failure(&self, group: usize, now_ns: u64) {
        let b = &self.groups[group];
        let n = b.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let probing = b.probing.swap(false, Ordering::AcqRel);
        if probing || n >= self.config.failures_to_open {
            let until = now_ns + self.config.cooldown.as_nanos() as u64;
            b.open_until_ns.store(until.max(1), Ordering::Release);
        }
    }

    /// True when the group's breaker is open at `now_ns` (no probe due yet).
    pub(crate) fn is_open(&self, group: usize, now_ns: u64) -> bool {
        let until = self.groups[group].open_until_ns.load(Ordering::Acquire);
        until != 0 && now_ns < until
    }

    /// How long until the group's breaker lets a probe through.
    pub(crate) fn retry_in(&self, group: usize, now_ns: u64) -> Duration {
        let until = self.groups[group].open_until_ns.load(Ordering::Acquire);
        Duration::from_nanos(until.saturating_sub(now_ns)).max(Duration::from_millis(100))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_failures_probes_once_and_closes_on_success() {
        let b = Breakers::new(BreakerConfig {
            failures_to_open: 2,
            cooldown: Duration::from_nanos(100),
            max_in_flight: 4,
        });
        assert!(b.enter(3, 0).is_ok());
        b.failure(3, 0);
        assert!(b.enter(3, 1).is_ok());
        b.failure(3, 1);
        assert_eq!(b.enter(3, 50).unwrap_err(), Refusal::Open);
        assert!(b.enter(4, 50).is_ok(), "other groups are not affected");
        let probe = b.enter(3, 200);
        assert!(probe.is_ok());
        assert_eq!(
            b.enter(3, 200).unwrap_err(),
            Refusal::Open,
            "one probe at a time"
        );
        b.failure(3, 200);
        assert_eq!(
            b.enter(3, 250).unwrap_err(),
            Refusal::Open,
            "a failed probe reopens"
        );
        assert!(b.enter(3, 400).is_ok());
        b.success(3);
        assert!(b.enter(3, 401).is_ok());
        assert!(b.enter(3, 401).is_ok());
    }

    #[test]
    fn bounds_in_flight_calls_per_group() {
        let b = Breakers::new(BreakerConfig {
            max_in_flight: 2,
            ..BreakerConfig::default()
        });
        let p1 = b.enter(0, 0).unwrap();
        let _p2 = b.enter(0, 0).unwrap();
        assert_eq!(b.enter(0, 0).unwrap_err(), Refusal::Saturated);
        drop(p1);
        assert!(b.enter(0, 0).is_ok());
    }
}
