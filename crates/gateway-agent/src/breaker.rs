//! Circuit breakers and bulkheads between decisions and the store, one per shard.
//!
//! On Redis Cluster each primary gets its own breaker and its own bound on in-flight
//! calls, found by slot from the cluster's slot map (read at start and refreshed by the
//! agent's background task, so failovers and reshardings are followed): a slow or dead
//! shard costs its own keys one timeout, then nothing, and never stalls decisions for
//! keys on the other shards. A single Redis or the embedded store is one shard.
//!
//! A breaker opens after consecutive failures, lets one probe through after a cooldown
//! (half-open), and closes on the probe's success; the probe is the next decision's call,
//! or, when none comes within a second, a `PING` to the shard from the agent's background
//! task (readiness comes back on an idle gateway too). Every way out of a call ends it: the
//! `Permit` is resolved as a success or a failure, and a permit dropped unresolved (the
//! caller's future was cancelled, or the call never reached the store) frees the probe
//! place, so a breaker never stays open longer than its cooldown once the store answers.
//!
//! A failure counts only when nothing on the shard succeeded since the failed call was
//! sent. A timeout while other calls to the same shard are being answered says the agent
//! (or its machine) is slow, not that the shard is down; opening the breaker then would
//! turn our own CPU load into an outage for every key of the shard.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use leasehold_core::key::SLOTS;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long after its cooldown an open breaker waits for a decision to probe it before
/// the agent's background task probes it with a `PING`.
pub(crate) const IDLE_PROBE_AFTER: Duration = Duration::from_secs(1);

/// Breaker settings.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct BreakerConfig {
    /// Consecutive failures that open a breaker.
    pub failures_to_open: u32,
    /// How long it stays open before a probe.
    pub cooldown: Duration,
    /// In-flight store calls per shard.
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

/// The breaker and bulkhead of one shard, and what its user keeps per shard beside them
/// (`Q`: the limiter's queue of exact decisions).
#[derive(Debug)]
pub(crate) struct Breaker<Q = ()> {
    /// The shard, for log lines.
    name: Box<str>,
    failures: AtomicU32,
    open_until_ns: AtomicU64,
    probing: AtomicBool,
    /// An idle shard's `PING` is under way (see [`Breakers::idle_due`]).
    pub(crate) idle_check: AtomicBool,
    last_success_ns: AtomicU64,
    in_flight: Arc<Semaphore>,
    config: BreakerConfig,
    /// What the user keeps per shard.
    pub(crate) queue: Q,
}

/// Why a call may not go to the store now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The breaker is open.
    Open,
    /// Too many calls in flight for this shard.
    Saturated,
}

/// Permission to call the store: one of the shard's in-flight places, and the probe when
/// the breaker is half-open. Resolve it with [`Permit::succeeded`] or [`Permit::failed`];
/// dropping it unresolved ends a probe without a verdict, so the next call probes again.
#[derive(Debug)]
pub(crate) struct Permit<'a, Q> {
    breaker: &'a Breaker<Q>,
    sent_ns: u64,
    probe: bool,
    _place: OwnedSemaphorePermit,
}

impl<Q> Permit<'_, Q> {
    /// The store answered (an error reply about the request itself is an answer too).
    pub(crate) fn succeeded(mut self, now_ns: u64) {
        self.probe = false;
        self.breaker.success(now_ns);
    }

    /// The call failed: no answer in time, a lost connection, or a store that cannot
    /// serve (out of memory, read-only, no permission).
    pub(crate) fn failed(mut self, now_ns: u64) {
        let probe = std::mem::take(&mut self.probe);
        self.breaker.failure(now_ns, self.sent_ns, probe);
    }
}

impl<Q> Drop for Permit<'_, Q> {
    fn drop(&mut self) {
        if self.probe {
            self.breaker.probing.store(false, Ordering::Release);
        }
    }
}

impl<Q: Default> Breaker<Q> {
    fn new(name: &str, config: BreakerConfig) -> Self {
        Self {
            name: name.into(),
            failures: AtomicU32::new(0),
            open_until_ns: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            idle_check: AtomicBool::new(false),
            last_success_ns: AtomicU64::new(0),
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            config,
            queue: Q::default(),
        }
    }
}

impl<Q> Breaker<Q> {
    /// Asks to call the store at `now_ns`.
    pub(crate) fn enter(&self, now_ns: u64) -> Result<Permit<'_, Q>, Refusal> {
        let until = self.open_until_ns.load(Ordering::Acquire);
        // Open: refuse until the cooldown ends, then let exactly one probe through.
        let probe = until != 0;
        if probe && (now_ns < until || self.probing.swap(true, Ordering::AcqRel)) {
            return Err(Refusal::Open);
        }
        match self.in_flight.clone().try_acquire_owned() {
            Ok(place) => Ok(Permit {
                breaker: self,
                sent_ns: now_ns,
                probe,
                _place: place,
            }),
            Err(_) => {
                if probe {
                    self.probing.store(false, Ordering::Release);
                }
                Err(Refusal::Saturated)
            }
        }
    }

    fn success(&self, now_ns: u64) {
        self.last_success_ns.fetch_max(now_ns, Ordering::AcqRel);
        self.failures.store(0, Ordering::Relaxed);
        if self.open_until_ns.swap(0, Ordering::AcqRel) != 0 {
            tracing::warn!(shard = %self.name, "store answers again: breaker closed");
        }
        self.probing.store(false, Ordering::Release);
    }

    /// A call sent at `sent_ns` failed at `now_ns`. It counts towards opening only when
    /// no call on this shard succeeded since it was sent; a failed probe reopens at once.
    pub(crate) fn failure(&self, now_ns: u64, sent_ns: u64, probe: bool) {
        if probe {
            self.probing.store(false, Ordering::Release);
        } else if self.last_success_ns.load(Ordering::Acquire) > sent_ns {
            return;
        }
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let until = (now_ns + self.config.cooldown.as_nanos() as u64).max(1);
        let opened = if probe {
            // A failed probe reopens for a whole cooldown.
            self.open_until_ns.swap(until, Ordering::AcqRel) == 0
        } else {
            // Enough failures open a closed breaker; a call sent before it opened and
            // failing after does not put the next probe off.
            n >= self.config.failures_to_open
                && (self.open_until_ns)
                    .compare_exchange(0, until, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
        };
        if opened {
            tracing::warn!(
                shard = %self.name,
                failures = n,
                "store unreachable: breaker open; each rule's failure policy decides \
                 until a probe succeeds"
            );
        }
    }

    /// True when open at `now_ns` with no probe due yet.
    pub(crate) fn is_open(&self, now_ns: u64) -> bool {
        let until = self.open_until_ns.load(Ordering::Acquire);
        until != 0 && now_ns < until
    }

    /// How long until a probe is let through.
    pub(crate) fn retry_in(&self, now_ns: u64) -> Duration {
        let until = self.open_until_ns.load(Ordering::Acquire);
        Duration::from_nanos(until.saturating_sub(now_ns)).max(Duration::from_millis(100))
    }
}

pub(crate) use leasehold_store::ShardRange;

#[derive(Debug)]
struct Topology<Q> {
    by_slot: Vec<u16>,
    shards: Vec<(String, Arc<Breaker<Q>>)>,
}

/// The breakers of every shard, found by slot.
#[derive(Debug)]
pub(crate) struct Breakers<Q = ()> {
    topology: ArcSwap<Topology<Q>>,
    config: BreakerConfig,
}

impl<Q: Default> Breakers<Q> {
    /// One shard serving every slot.
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            topology: ArcSwap::from_pointee(Topology {
                by_slot: vec![0; usize::from(SLOTS)],
                shards: vec![("all".to_owned(), Arc::new(Breaker::new("all", config)))],
            }),
            config,
        }
    }

    /// Installs a slot map; shards already known keep their breaker state. Slots no
    /// range covers go to a shard of their own.
    pub(crate) fn set_topology(&self, ranges: &[ShardRange]) {
        let old = self.topology.load();
        let known: HashMap<&str, &Arc<Breaker<Q>>> =
            old.shards.iter().map(|(n, b)| (n.as_str(), b)).collect();
        let mut shards: Vec<(String, Arc<Breaker<Q>>)> = Vec::new();
        let mut index: HashMap<String, u16> = HashMap::new();
        let mut shard_of = |name: &str, shards: &mut Vec<(String, Arc<Breaker<Q>>)>| {
            *index.entry(name.to_owned()).or_insert_with(|| {
                let b = known.get(name).map_or_else(
                    || Arc::new(Breaker::new(name, self.config)),
                    |b| Arc::clone(b),
                );
                shards.push((name.to_owned(), b));
                (shards.len() - 1) as u16
            })
        };
        let unassigned = shard_of("unassigned", &mut shards);
        let mut by_slot = vec![unassigned; usize::from(SLOTS)];
        for (start, end, name) in ranges {
            let i = shard_of(name, &mut shards);
            for slot in *start..=(*end).min(SLOTS - 1) {
                by_slot[usize::from(slot)] = i;
            }
        }
        // Shards gone from the map (`all` before the store's topology was known) stop
        // being reported: their gauge would stay at its last value for ever.
        for (name, b) in old.shards.iter() {
            if shards.iter().any(|(n, _)| n == name) {
                continue;
            }
            if b.open_until_ns.load(Ordering::Acquire) != 0 {
                tracing::info!(shard = %name, "breaker closed: the shard is replaced by the store's topology");
            }
            metrics::gauge!("leasehold_breaker_open", "shard" => name.clone()).set(0.0);
        }
        self.topology.store(Arc::new(Topology { by_slot, shards }));
    }

    /// The breaker of the shard serving `slot`.
    pub(crate) fn for_slot(&self, slot: u16) -> Arc<Breaker<Q>> {
        self.with_slot(slot, Arc::clone)
    }

    /// `f` of the breaker of the shard serving `slot`, without a reference count (which
    /// every thread deciding on the shard would write).
    #[inline]
    pub(crate) fn with_slot<R>(&self, slot: u16, f: impl FnOnce(&Arc<Breaker<Q>>) -> R) -> R {
        let t = self.topology.load();
        let i = t.by_slot[usize::from(slot % SLOTS)];
        f(&t.shards[usize::from(i)].1)
    }

    /// Whether the breaker of the shard serving `slot` is open at `now_ns`.
    pub(crate) fn is_open(&self, slot: u16, now_ns: u64) -> bool {
        self.with_slot(slot, |b| b.is_open(now_ns))
    }

    /// The name of the shard serving `slot` (`host:port`, `single`, `all`).
    pub(crate) fn shard_name(&self, slot: u16) -> String {
        let t = self.topology.load();
        let i = t.by_slot[usize::from(slot % SLOTS)];
        t.shards[usize::from(i)].0.clone()
    }

    /// Each shard's name and whether its breaker is open at `now_ns`.
    pub(crate) fn states(&self, now_ns: u64) -> Vec<(String, bool)> {
        self.topology
            .load()
            .shards
            .iter()
            .map(|(n, b)| (n.clone(), b.is_open(now_ns)))
            .collect()
    }

    /// The shards whose breaker is not closed: open, or half-open waiting for a probe to
    /// succeed (what readiness reports: between probes an open breaker looks closed).
    pub(crate) fn tripped(&self) -> Vec<String> {
        self.topology
            .load()
            .shards
            .iter()
            .filter(|(_, b)| b.open_until_ns.load(Ordering::Acquire) != 0)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The shards whose breaker is open with its cooldown over for [`IDLE_PROBE_AFTER`]
    /// at `now_ns` and no probe under way, each with a slot it serves: what a probe with
    /// no decision may test. The grace leaves the probe to the next decision on a gateway
    /// with traffic (a decision's probe answers its caller, a `PING` answers nobody).
    pub(crate) fn probes_due(&self, now_ns: u64) -> Vec<(u16, Arc<Breaker<Q>>)> {
        let t = self.topology.load();
        let grace = IDLE_PROBE_AFTER.as_nanos() as u64;
        (t.shards.iter().enumerate())
            .filter(|(_, (_, b))| {
                let until = b.open_until_ns.load(Ordering::Acquire);
                until != 0 && now_ns >= until + grace && !b.probing.load(Ordering::Acquire)
            })
            .filter_map(|(i, (_, b))| {
                let slot = t.by_slot.iter().position(|&s| usize::from(s) == i)?;
                Some((slot as u16, Arc::clone(b)))
            })
            .collect()
    }

    /// The shards whose breaker is closed and that answered nothing for
    /// [`IDLE_PROBE_AFTER`] at `now_ns`, with no check of theirs under way, each with a
    /// slot it serves: an idle gateway checks them with a `PING`, so a store that died
    /// while no decision needed it opens the breaker (and readiness says so) before the
    /// next request finds out.
    pub(crate) fn idle_due(&self, now_ns: u64) -> Vec<(u16, Arc<Breaker<Q>>)> {
        let t = self.topology.load();
        let idle = IDLE_PROBE_AFTER.as_nanos() as u64;
        (t.shards.iter().enumerate())
            .filter(|(_, (_, b))| {
                b.open_until_ns.load(Ordering::Acquire) == 0
                    && b.last_success_ns.load(Ordering::Acquire) + idle <= now_ns
                    && !b.idle_check.load(Ordering::Acquire)
            })
            .filter_map(|(i, (_, b))| {
                let slot = t.by_slot.iter().position(|&s| usize::from(s) == i)?;
                Some((slot as u16, Arc::clone(b)))
            })
            .collect()
    }

    /// The shards known, by name.
    pub(crate) fn shard_names(&self) -> Vec<String> {
        self.topology
            .load()
            .shards
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(failures_to_open: u32, max_in_flight: usize) -> BreakerConfig {
        BreakerConfig {
            failures_to_open,
            cooldown: Duration::from_nanos(100),
            max_in_flight,
        }
    }

    #[test]
    fn opens_after_failures_probes_once_and_closes_on_success() {
        let b = Breaker::<()>::new("test", config(2, 4));
        b.enter(0).unwrap().failed(0);
        b.enter(1).unwrap().failed(1);
        assert_eq!(b.enter(50).unwrap_err(), Refusal::Open);
        let probe = b.enter(200).expect("a probe after the cooldown");
        assert_eq!(
            b.enter(200).unwrap_err(),
            Refusal::Open,
            "one probe at a time"
        );
        probe.failed(200);
        assert_eq!(
            b.enter(250).unwrap_err(),
            Refusal::Open,
            "a failed probe reopens"
        );
        b.enter(400).unwrap().succeeded(400);
        assert!(b.enter(401).is_ok());
        assert!(b.enter(401).is_ok());
    }

    #[test]
    fn a_call_failing_after_the_breaker_opened_does_not_put_the_probe_off() {
        let b = Breaker::<()>::new("test", config(2, 4));
        let late = b.enter(0).unwrap();
        b.enter(1).unwrap().failed(1);
        b.enter(2).unwrap().failed(2);
        assert_eq!(b.enter(50).unwrap_err(), Refusal::Open);
        // Sent before the breaker opened, it fails now: the probe stays due at 102.
        late.failed(90);
        assert!(
            b.enter(102).is_ok(),
            "the probe is due a cooldown after opening"
        );
    }

    #[test]
    fn a_cancelled_probe_ends_the_probe() {
        let b = Breaker::<()>::new("test", config(1, 4));
        b.enter(0).unwrap().failed(0);
        let probe = b.enter(200).expect("a probe after the cooldown");
        // The caller's future is dropped mid-call: no verdict, but the probe is over.
        drop(probe);
        b.enter(201)
            .expect("the next call probes again")
            .succeeded(202);
        assert!(!b.is_open(203));
        assert!(b.enter(203).is_ok(), "closed");
    }

    #[test]
    fn a_probe_refused_for_saturation_ends_the_probe() {
        let b = Breaker::<()>::new("test", config(1, 1));
        let busy = b.enter(0).unwrap();
        b.failure(0, 0, false);
        assert_eq!(b.enter(200).unwrap_err(), Refusal::Saturated);
        drop(busy);
        assert!(b.enter(200).is_ok(), "the probe place was not kept");
    }

    #[test]
    fn a_timeout_while_the_shard_answers_others_does_not_count() {
        let b = Breaker::<()>::new("test", config(2, 4));
        let slow1 = b.enter(0).unwrap();
        let slow2 = b.enter(1).unwrap();
        b.enter(5).unwrap().succeeded(10);
        // Both were sent before a success: the shard is alive, the caller was slow.
        slow1.failed(60);
        slow2.failed(61);
        assert!(!b.is_open(62));
        // Sent after the last success, with no answer since: these count.
        b.enter(70).unwrap().failed(120);
        b.enter(71).unwrap().failed(121);
        assert!(b.is_open(122));
    }

    #[test]
    fn bounds_in_flight_calls() {
        let b = Breaker::<()>::new("test", config(3, 2));
        let p1 = b.enter(0).unwrap();
        let _p2 = b.enter(0).unwrap();
        assert_eq!(b.enter(0).unwrap_err(), Refusal::Saturated);
        drop(p1);
        assert!(b.enter(0).is_ok());
    }

    #[test]
    fn shards_are_found_by_slot_and_keep_their_state_across_refreshes() {
        let b = Breakers::<()>::new(config(1, 4));
        let ranges = vec![
            (0, 5460, "a:1".to_owned()),
            (5461, 10922, "b:1".to_owned()),
            (10923, 16383, "c:1".to_owned()),
        ];
        b.set_topology(&ranges);
        b.for_slot(100).failure(0, 0, false);
        assert!(b.for_slot(5000).is_open(10), "same shard");
        assert!(
            !b.for_slot(6000).is_open(10),
            "another shard is not affected"
        );
        // A resharding moves slots 0-99 to b; a's state stays with a.
        let mut moved = ranges.clone();
        moved[0].0 = 100;
        moved.push((0, 99, "b:1".to_owned()));
        b.set_topology(&moved);
        assert!(b.for_slot(5000).is_open(10));
        assert!(!b.for_slot(50).is_open(10));
        assert_eq!(
            b.shard_names().len(),
            4,
            "three primaries and the unassigned slots"
        );
    }

    #[test]
    fn an_idle_probe_waits_a_grace_for_a_decision_to_probe_first() {
        let b = Breakers::<()>::new(config(1, 4));
        b.for_slot(0).failure(0, 0, false);
        let grace = IDLE_PROBE_AFTER.as_nanos() as u64;
        assert!(b.probes_due(200).is_empty(), "a decision probes first");
        assert!(b.probes_due(100 + grace - 1).is_empty());
        let due = b.probes_due(100 + grace);
        assert_eq!(due.len(), 1, "no decision came: the agent probes");
        let probe = due[0].1.enter(100 + grace).expect("the idle probe");
        assert!(b.probes_due(200 + grace).is_empty(), "one probe at a time");
        probe.succeeded(300 + grace);
        assert!(b.probes_due(400 + grace).is_empty(), "closed");
    }
}
