//! Keys: their identity in the map (rule and subject bytes) and each key's state.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use leasehold_core::key::BucketKey;
use leasehold_core::local::SeatBucket;
use leasehold_core::rule::{BucketParams, Leasing};
use leasehold_core::{KeyPolicy, Refill};
use tokio::sync::Mutex as AsyncMutex;

use crate::counters::RuleCounters;

use super::degraded::Emergency;
use super::keymap;
use super::route::Route;
use super::table::RuleEntry;

/// Longest subject a key of the map keeps as it is. A longer one is kept as its SHA-256,
/// in [`HASHED_LEN`] bytes (a length no subject kept as it is has, so the two forms never
/// meet), as its bucket's Redis key does past [`leasehold_core::key::MAX_INLINE`]: a key's
/// memory does not grow with what callers send (a 1 MB descriptor value was 1 MB of the
/// agent's memory for as long as its key lived).
pub(super) const SUBJECT_INLINE: usize = 64;

/// The length of a subject kept as its SHA-256: the digest, then zeros.
pub(super) const HASHED_LEN: usize = SUBJECT_INLINE + 1;

/// The SHA-256 of the subject a key of the map keeps in its hashed form, or `None` for
/// one kept as it is.
pub(super) fn hashed_subject(kept: &[u8]) -> Option<[u8; 32]> {
    (kept.len() == HASHED_LEN).then(|| kept[..32].try_into().unwrap_or([0; 32]))
}

/// The longest subject whose digest a thread remembers (see [`hashed`]).
const REMEMBERED_MAX: usize = 4 << 20;

std::thread_local! {
    /// The last long subject hashed on this thread, and its SHA-256. One check looks its
    /// key up two to four times (the hot path, the rule's entry, the insertion), and a
    /// SHA-256 of 1 MB costs about 0.8 ms where comparing it with the last costs 0.05:
    /// without it, serve took 8.5 ms instead of 5.7 for a 1 MB descriptor value.
    static LAST_HASHED: std::cell::RefCell<(Vec<u8>, [u8; 32])> =
        const { std::cell::RefCell::new((Vec::new(), [0; 32])) };
}

/// `subject` as a key of the map keeps it (see [`SUBJECT_INLINE`]).
fn hashed(subject: &[u8]) -> [u8; HASHED_LEN] {
    let digest = LAST_HASHED.with(|last| {
        let mut last = last.borrow_mut();
        if last.0 == subject {
            return last.1;
        }
        let digest = leasehold_core::key::sha256(subject);
        if subject.len() <= REMEMBERED_MAX {
            last.0.clear();
            last.0.extend_from_slice(subject);
            last.1 = digest;
        }
        digest
    });
    let mut out = [0u8; HASHED_LEN];
    out[..32].copy_from_slice(&digest);
    out
}

/// A key of the agent's map: rule name and subject (as the map keeps it), hashed in the
/// same two pieces as the borrowed [`KeyRef`]. The map's slot keeps the bytes inline when
/// short (no pointer to follow on a lookup).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct KeyId {
    pub(super) bytes: smallvec::SmallVec<[u8; 40]>,
    pub(super) rule_len: usize,
}

impl KeyId {
    pub(super) fn new(rule: &str, subject: &[u8]) -> Self {
        // The subject as the borrowed key keeps it: one place decides which form.
        let key = KeyRef::new(rule, subject);
        let subject = key.subject();
        let mut bytes = smallvec::SmallVec::with_capacity(rule.len() + subject.len());
        bytes.extend_from_slice(rule.as_bytes());
        bytes.extend_from_slice(subject);
        Self {
            bytes,
            rule_len: rule.len(),
        }
    }
}

impl std::hash::Hash for KeyId {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        KeyRef::of(&self.bytes, self.rule_len).hash(h);
    }
}

/// A key borrowed: rule name and subject as the map keeps it (a long one hashed, see
/// [`SUBJECT_INLINE`]). Every key of the map hashes as one of these.
pub(super) struct KeyRef<'a> {
    pub(super) rule: &'a [u8],
    subject: Subject<'a>,
}

enum Subject<'a> {
    AsIs(&'a [u8]),
    Hashed([u8; HASHED_LEN]),
}

impl std::hash::Hash for KeyRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write(self.rule);
        h.write(self.subject());
    }
}

impl<'a> KeyRef<'a> {
    #[inline]
    pub(super) fn new(rule: &'a str, subject: &'a [u8]) -> Self {
        let subject = if subject.len() > SUBJECT_INLINE {
            Subject::Hashed(hashed(subject))
        } else {
            Subject::AsIs(subject)
        };
        Self {
            rule: rule.as_bytes(),
            subject,
        }
    }

    /// The key stored as `bytes`, the rule's name being the first `rule_len`.
    pub(super) fn of(bytes: &'a [u8], rule_len: usize) -> Self {
        let (rule, subject) = bytes.split_at(rule_len);
        Self {
            rule,
            subject: Subject::AsIs(subject),
        }
    }

    /// The subject as the map keeps it.
    #[inline]
    pub(super) fn subject(&self) -> &[u8] {
        match &self.subject {
            Subject::AsIs(s) => s,
            Subject::Hashed(h) => h,
        }
    }

    #[inline]
    pub(super) fn matches(&self, key: &[u8], rule_len: usize) -> bool {
        let (rule, subject) = key.split_at(rule_len);
        bytes_eq(self.rule, rule) && bytes_eq(self.subject(), subject)
    }
}

/// `a == b`, comparing slices of 4 to 16 bytes (most rule names and subjects) with two
/// overlapping word loads each instead of a call to `memcmp`.
#[inline]
pub(super) fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let w8 = |s: &[u8], i: usize| <[u8; 8]>::try_from(&s[i..i + 8]).map_or(0, u64::from_ne_bytes);
    let w4 = |s: &[u8], i: usize| <[u8; 4]>::try_from(&s[i..i + 4]).map_or(0, u32::from_ne_bytes);
    match n {
        8..=16 => w8(a, 0) == w8(b, 0) && w8(a, n - 8) == w8(b, n - 8),
        4..=7 => w4(a, 0) == w4(b, 0) && w4(a, n - 4) == w4(b, n - 4),
        _ => a == b,
    }
}

/// What drives a key's store calls, touched only under its lock (one call at a time per
/// key): the policy (lease-core) and where calls go while the bucket is split.
#[derive(Debug, Default)]
pub(super) struct Driver {
    pub(super) policy: KeyPolicy,
    /// The split part this key's calls go to (boxed: most keys are never split).
    pub(super) route: Option<Box<Route>>,
}

/// One key's state. What the hot path reads is in its [`keymap::Hot`] cell, in an arena
/// shared with other keys; the rest is touched only off the hot path.
pub(super) struct KeyState {
    pub(super) cell: keymap::Cell,
    /// The key's bucket of this agent's seat, when its rule has a local share.
    pub(super) seat: SeatBucket,
    pub(super) counters: Arc<RuleCounters>,
    pub(super) prefetching: AtomicBool,
    pub(super) rule: Box<str>,
    pub(super) bucket: BucketKey,
    pub(super) slot: u16,
    /// What the local decision reads once the cell's lease and cached denial did not
    /// decide: the refill denial, a refused prefetch's wait, this agent's share (also
    /// the emergency limit's).
    pub(super) refill: Refill,
    /// Tokens admitted without the store (emergency, fail-open, a leasing key's seat) not
    /// yet reported.
    pub(super) without_store: AtomicU64,
    /// Tokens the global bucket had left at the store's last answer, and when (agent
    /// clock): with what the lease holds, the quota a leased admission reports.
    pub(super) store_left: AtomicU64,
    pub(super) store_left_at_ns: AtomicU64,
    /// Odd while a store reply is being installed (the lease, then `store_left`), so
    /// `quota_left` never adds a new lease to the level from before its grant, or the
    /// other way round.
    quota_seq: AtomicU64,
    pub(super) last_io_ns: AtomicU64,
    pub(super) driver: Arc<AsyncMutex<Driver>>,
    pub(super) queue: AsyncMutex<()>,
    pub(super) waiters: AtomicUsize,
    pub(super) in_emergency: AtomicBool,
    /// Boxed: a key needs it only while its store is unreachable.
    pub(super) emergency: parking_lot::Mutex<Option<Box<Emergency>>>,
    /// Made for one decision while the key map was full; never in the map, never leased.
    pub(super) transient: bool,
    /// The rule, or the subject's override, in force for this key; replaced on reload.
    pub(super) entry: ArcSwap<RuleEntry>,
    /// Exact decisions take the per-key path until then (the key was found split).
    pub(super) batch_after_ns: AtomicU64,
    /// In [`Inner::swept`], the keys the sweep visits every tick.
    pub(super) in_sweep: AtomicBool,
    /// A region's bucket of a global key, announced to the region's broker.
    pub(super) announced: AtomicBool,
    /// The bucket is a region's (`lh:{RULE|SUBJECT|region}`).
    pub(super) region: bool,
    /// A key of a `leasing = "rate"` rule: its rate lease, from its first call.
    pub(super) rate: super::rate::RateSlot,
}

impl KeyState {
    /// The fields the hot path reads.
    #[inline]
    pub(super) fn hot(&self) -> &keymap::Hot {
        self.cell.get()
    }

    /// How long a caller of `cost` is denied without the store, if the key's cached
    /// denial covers it.
    pub(super) fn cached_wait(&self, cost: u64, now: u64) -> Option<u64> {
        (self.hot()).cached_wait(cost, now, self.entry.load().params.rate)
    }

    /// The store answered that the global bucket has `left` tokens.
    pub(super) fn saw_store_left(&self, left: u64, now: u64) {
        self.store_left.store(left, Ordering::Relaxed);
        self.store_left_at_ns.store(now, Ordering::Relaxed);
    }

    /// About how many tokens the key has left for this agent's callers: what the lease
    /// holds plus what the global bucket had at the store's last answer, refilled since
    /// at the rule's rate, at most its capacity, plus what the agent's seat of the key
    /// holds when the rule has a local share. (Other agents' leases are not seen: on a
    /// key many agents lease, the bucket's own level is low while their leases hold
    /// tokens.) A rate lease's key: what its cell holds plus the level its last grant
    /// left, which a dry cell borrows from, not refilled (the level refills at what the
    /// fleet's shares leave of the rate, which the agent does not know).
    pub(super) fn quota_left(&self, now: u64) -> u64 {
        let entry = self.entry.load();
        let rate_lease = entry.rule.leasing() == leasehold_core::rule::Leasing::Rate;
        let BucketParams { capacity, rate, .. } = entry.params;
        // A reply being installed takes a few instructions; a reader that keeps meeting
        // one (its writer preempted) takes the figure as it reads it.
        let mut tries = 0;
        loop {
            let seq = self.quota_seq.load(Ordering::Acquire);
            let at = self.store_left_at_ns.load(Ordering::Relaxed);
            let left = self.store_left.load(Ordering::Relaxed);
            let held = self.hot().lease.held();
            std::sync::atomic::fence(Ordering::Acquire);
            let settled = seq.is_multiple_of(2) && self.quota_seq.load(Ordering::Relaxed) == seq;
            if settled || tries == 64 {
                let elapsed_us = if rate_lease {
                    0
                } else {
                    now.saturating_sub(at) / 1000
                };
                let refilled = u128::from(elapsed_us) * u128::from(rate.tokens())
                    / u128::from(rate.period_us().max(1));
                let left = u128::from(left) + refilled + u128::from(held);
                return left.min(u128::from(capacity)) as u64 + self.seat_level(now);
            }
            tries += 1;
            std::thread::yield_now();
        }
    }

    /// Installs what a store reply changed, as one step for `quota_left`: the lease (by
    /// `install`) and, when the reply names it, the global bucket's level.
    pub(super) fn saw_reply<R>(
        &self,
        install: impl FnOnce() -> R,
        left: Option<u64>,
        now: u64,
    ) -> R {
        self.quota_seq.fetch_add(1, Ordering::AcqRel);
        let r = install();
        if let Some(left) = left {
            self.saw_store_left(left, now);
        }
        self.quota_seq.fetch_add(1, Ordering::Release);
        r
    }

    /// What the key's bucket of this agent's seat holds now (0 without a seat).
    pub(super) fn seat_level(&self, now: u64) -> u64 {
        let entry = self.entry.load();
        let Some((share, seat)) = &entry.local else {
            return 0;
        };
        seat.tenure
            .since(now)
            .map_or(0, |since| self.seat.level(share, now, since))
    }

    /// Whether the sweep visits this key every tick and the coordinator's report covers
    /// it: it leases or holds tokens, admitted without the store since the last report,
    /// or is a region's bucket used lately (its broker feeds the keys reported).
    pub(super) fn active(&self, now: u64) -> bool {
        self.hot().leases()
            || self.hot().lease.held() > 0
            || self.without_store.load(Ordering::SeqCst) > 0
            || (self.region
                && now.saturating_sub(self.last_io_ns.load(Ordering::Relaxed))
                    < crate::report::REPORT_TTL_MS * 1_000_000)
    }

    /// Reads what [`KeyState::idle_if_evictable`] reads of the state, to bring it into the
    /// cache along with other keys' states.
    #[inline]
    pub(super) fn warm(&self) -> u64 {
        self.without_store.load(Ordering::Relaxed)
            ^ self.last_io_ns.load(Ordering::Relaxed)
            ^ self.waiters.load(Ordering::Relaxed) as u64
            ^ u64::from(self.seat.full_at(0))
            ^ u64::from(self.region)
    }

    /// How long the key has been idle, if it may leave the map to make room: inactive
    /// (no lease, no tokens held or unreported) and no caller waiting on it.
    pub(super) fn idle_if_evictable(&self, now: u64) -> Option<u64> {
        (self.forgettable(now) && self.waiters.load(Ordering::Acquire) == 0)
            .then(|| now.saturating_sub(self.last_io_ns.load(Ordering::Relaxed)))
    }

    /// Whether forgetting the key loses nothing: inactive, and its seat bucket full again
    /// (a key not held is taken as full: forgetting a spent seat would mint tokens).
    pub(super) fn forgettable(&self, now: u64) -> bool {
        !self.active(now) && self.seat.full_at(now)
    }

    pub(super) fn new(
        cells: &Arc<keymap::Cells>,
        rule: &str,
        entry: &Arc<RuleEntry>,
        bucket: BucketKey,
        now: u64,
        transient: bool,
    ) -> Self {
        let region = bucket.is_region();
        Self {
            rule: rule.into(),
            cell: cells.take(
                entry.params.capacity,
                !transient && matches!(entry.rule.leasing(), Leasing::Lease | Leasing::Rate),
                entry.shadow,
                entry.local.is_some() && !transient,
            ),
            seat: SeatBucket::new(),
            counters: entry.counters.clone(),
            slot: bucket.slot(),
            bucket,
            refill: Refill::new(),
            prefetching: AtomicBool::new(false),
            without_store: AtomicU64::new(0),
            store_left: AtomicU64::new(entry.params.capacity),
            store_left_at_ns: AtomicU64::new(now),
            quota_seq: AtomicU64::new(0),
            last_io_ns: AtomicU64::new(now),
            driver: Arc::new(AsyncMutex::new(Driver::default())),
            queue: AsyncMutex::new(()),
            waiters: AtomicUsize::new(0),
            in_emergency: AtomicBool::new(false),
            emergency: parking_lot::Mutex::new(None),
            transient,
            entry: ArcSwap::new(entry.clone()),
            batch_after_ns: AtomicU64::new(0),
            announced: AtomicBool::new(false),
            in_sweep: AtomicBool::new(false),
            region,
            rate: parking_lot::Mutex::new(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bytes_eq;

    #[test]
    fn bytes_eq_agrees_with_slice_equality_at_every_length_and_position() {
        for n in 0..40usize {
            let a: Vec<u8> = (0..n as u8).collect();
            assert!(bytes_eq(&a, &a.clone()), "length {n}");
            assert!(
                !bytes_eq(&a, &[a.as_slice(), &[0]].concat()),
                "length {n} vs {}",
                n + 1
            );
            for i in 0..n {
                let mut b = a.clone();
                b[i] ^= 0x80;
                assert!(!bytes_eq(&a, &b), "length {n}, byte {i} differs");
            }
        }
    }
}
