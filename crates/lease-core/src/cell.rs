//! A key's cell and the local decision: what an agent decides on one key without the
//! store, in one function both the agent and the fleet tests call.
//!
//! The order is the design's: the lease; the cached denial (the store's last refusal,
//! until the time it named); the denial while a refill comes (a dry, contended key, see
//! [`KeyPolicy::deny_while_refilling_until`]); the agent's seat of the rule's local
//! share; and only then the store. Each step that admits or refuses says why in the
//! [`Verdict`]; what the agent does around the cell (its seat, queueing a refill, whether
//! the store is reachable) is asked through [`Around`], so the function stays sans-io.
//!
//! [`Cell`] is the part every decision reads: one cache line, atomics only, spent by many
//! threads at once. [`Refill`] is read only once the lease and the cached denial did not
//! decide. [`KeyPolicy::granted`] writes both after an acquire.

use crate::bucket::Level;
use crate::lease::{LocalLease, Spend};
use crate::policy::KeyPolicy;
use crate::rate::Rate;
use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// What a decision on a key reads and writes without the store: its lease, its cached
/// denial, when to prefetch, and the flags that route a decision. One cache line, so a
/// decision on a leased key touches one line of the key's state.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Cell {
    /// The lease the key spends from.
    pub lease: LocalLease,
    /// The rule's capacity, so the hot path needs no rule lookup; 0 once the rule is
    /// removed, which sends every check to the full path and its error.
    capacity: AtomicU64,
    /// Prefetch when the lease falls below this.
    low_water: AtomicU64,
    /// Callers of at least `deny_cost` are denied without the store until then (agent
    /// clock): the time the store named in its last refusal, of that cost.
    deny_until_ns: AtomicU64,
    /// Tokens denied on this key (offered demand = spent + denied), counted while it
    /// leases, so a cold key's cached denials do not write a shared word.
    denied_tokens: AtomicU64,
    /// The key leases (a cold key of an `auto` rule turns hot when it is busy).
    leases: AtomicBool,
    /// The caller's flag for the key's rule: in shadow mode, refusals are let through.
    shadow: AtomicBool,
    /// The key's rule has a local share: a caller the lease does not cover tries the
    /// agent's seat before a denial or the store.
    local: AtomicBool,
    /// The least cost the cached denial covers (a smaller one may fit what is left).
    deny_cost: AtomicU32,
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Cell>() == 64);

/// What a decision reads once the lease and the cached denial did not decide, and what
/// the last acquire set for prefetching.
#[derive(Debug, Default)]
pub struct Refill {
    /// [`KeyPolicy::deny_while_refilling_until`] as of the last acquire.
    denies_until_ns: AtomicU64,
    /// A refused prefetch is not tried again before this time.
    prefetch_after_ns: AtomicU64,
    /// This agent's share of the key at the last answer, thousandths of a token per
    /// second (0: none known).
    share_milli: AtomicU64,
}

/// What the decision asks of the agent around the cell.
pub trait Around {
    /// The rule's rate (a Retry-After for a cost above what a cached denial covered).
    fn rate(&self) -> Rate;

    /// Takes `cost` from the agent's seat of the key's local share: the tokens it holds
    /// after, or how long until it covers `cost` (`u64::MAX`: no seat). Called only for
    /// a cell whose rule has a local share.
    fn seat(&mut self, cost: u64, now_ns: u64) -> Result<u64, u64> {
        let _ = (cost, now_ns);
        Err(u64::MAX)
    }

    /// Starts a refill of the lease unless one is in flight; whether one is in flight
    /// after (false: none could be started). A refill may also complete at once (a
    /// virtual store without a round trip): the decision then looks at the lease again.
    fn refill(&mut self, now_ns: u64) -> bool;

    /// Whether a caller the lease does not cover may be denied while a refill comes: the
    /// key leases now and its store is reachable (else the store path and its failure
    /// policy decide).
    fn may_await_refill(&mut self, now_ns: u64) -> bool;
}

/// What the cell decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Admitted from the lease, which holds `left` after.
    Lease {
        /// Tokens the lease holds.
        left: u64,
    },
    /// Admitted from the agent's seat, which holds `left` after.
    Seat {
        /// Tokens the seat's bucket of the key holds.
        left: u64,
    },
    /// Refused without the store; `cost` tokens may exist in `wait_ns` (never 0).
    Denied {
        /// Nanoseconds until the caller may come back.
        wait_ns: u64,
        /// Why.
        why: DenialKind,
    },
    /// Only the store can decide.
    Store,
}

/// Why a cell refused without the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenialKind {
    /// The store refused this cost (or less) lately, until the time it named.
    Cached,
    /// The bucket is dry and contended: denied while this agent's refill comes.
    Refilling,
}

impl Default for Cell {
    fn default() -> Self {
        Self::new()
    }
}

impl Cell {
    /// An empty cell of no rule (capacity 0: every cost is invalid until [`Cell::reset`]).
    pub fn new() -> Self {
        Self {
            lease: LocalLease::new(),
            capacity: AtomicU64::new(0),
            low_water: AtomicU64::new(1),
            deny_until_ns: AtomicU64::new(0),
            denied_tokens: AtomicU64::new(0),
            leases: AtomicBool::new(false),
            shadow: AtomicBool::new(false),
            local: AtomicBool::new(false),
            deny_cost: AtomicU32::new(0),
        }
    }

    /// Empties the cell for a new key of a rule of `capacity`, which `leases` or not, in
    /// `shadow` mode or not, with a `local` share or not.
    pub fn reset(&self, capacity: u64, leases: bool, shadow: bool, local: bool) {
        self.lease.reset();
        self.capacity.store(capacity, Ordering::Relaxed);
        self.low_water.store(1, Ordering::Relaxed);
        self.deny_until_ns.store(0, Ordering::Relaxed);
        self.denied_tokens.store(0, Ordering::Relaxed);
        self.shadow.store(shadow, Ordering::Relaxed);
        self.local.store(local, Ordering::Relaxed);
        self.leases.store(leases, Ordering::Release);
    }

    /// Whether `cost` is neither 0 nor more than the rule's capacity (never once the rule
    /// is removed).
    #[inline(always)]
    pub fn valid_for(&self, cost: u64) -> bool {
        cost != 0 && cost <= self.capacity.load(Ordering::Relaxed)
    }

    /// Sets the rule's capacity (0: the rule was removed).
    pub fn set_capacity(&self, capacity: u64) {
        self.capacity.store(capacity, Ordering::Relaxed);
    }

    /// Whether the key leases.
    #[inline(always)]
    pub fn leases(&self) -> bool {
        self.leases.load(Ordering::Acquire)
    }

    /// The key starts (a busy cold key) or stops (it went idle) leasing.
    pub fn set_leases(&self, leases: bool) {
        self.leases.store(leases, Ordering::Release);
    }

    /// The caller's shadow flag.
    #[inline(always)]
    pub fn shadow(&self) -> bool {
        self.shadow.load(Ordering::Relaxed)
    }

    /// Sets the rule's shadow and local-share flags (a reload).
    pub fn set_rule_flags(&self, shadow: bool, local: bool) {
        self.shadow.store(shadow, Ordering::Relaxed);
        self.local.store(local, Ordering::Relaxed);
    }

    /// Prefetch when the lease falls below this.
    pub fn low_water(&self) -> u64 {
        self.low_water.load(Ordering::Relaxed)
    }

    /// Sets the low-water mark: a spend that leaves less starts a refill.
    pub fn set_low_water(&self, low_water: u64) {
        self.low_water.store(low_water, Ordering::Relaxed);
    }

    /// Tokens denied on the key while it leased.
    pub fn denied_tokens(&self) -> u64 {
        self.denied_tokens.load(Ordering::Relaxed)
    }

    /// Counts `cost` denied by the store path (a leasing key's demand includes it).
    #[inline]
    pub fn count_denied(&self, cost: u64) {
        self.denied_tokens.fetch_add(cost, Ordering::Relaxed);
    }

    /// Callers of `cost` or more are denied without the store until `until_ns`.
    pub fn deny(&self, until_ns: u64, cost: u64) {
        self.deny_cost
            .store(u32::try_from(cost).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.deny_until_ns.store(until_ns, Ordering::Release);
    }

    /// Forgets the cached denial (a grant came, or the rule changed its rate).
    pub fn clear_denial(&self) {
        self.deny_until_ns.store(0, Ordering::Release);
    }

    /// When the cached denial covers a caller of `cost`: until when the refused cost is
    /// denied, and that cost (`cost` may be more: it waits longer).
    #[inline(always)]
    pub fn denied_until(&self, cost: u64, now_ns: u64) -> Option<(u64, u64)> {
        let until = self.deny_until_ns.load(Ordering::Acquire);
        if now_ns >= until {
            return None;
        }
        let covered = u64::from(self.deny_cost.load(Ordering::Relaxed));
        (cost >= covered).then_some((until, covered))
    }

    /// How long a caller of `cost` is denied by the cached denial, if it covers it.
    pub fn cached_wait(&self, cost: u64, now_ns: u64, rate: Rate) -> Option<u64> {
        let (until, covered) = self.denied_until(cost, now_ns)?;
        Some(until - now_ns + wait_beyond(cost, covered, || rate))
    }

    /// The local decision of `cost` at `now_ns`: lease, cached denial, denial while a
    /// refill comes, seat, else the store. See the module's documentation.
    #[inline(always)]
    pub fn decide(
        &self,
        refill: &Refill,
        cost: u64,
        now_ns: u64,
        around: &mut impl Around,
    ) -> Verdict {
        if let Some(v) = self.spend(cost, now_ns, refill, around) {
            return v;
        }
        if let Some(v) = self.deny_cached(cost, now_ns, around, true) {
            return v;
        }
        self.decide_cold(refill, cost, now_ns, around)
    }

    /// The lease step alone: `cost` spent from a leasing key's lease if it covers it, and
    /// a refill started below the low-water mark.
    #[inline(always)]
    pub fn spend(
        &self,
        cost: u64,
        now_ns: u64,
        refill: &Refill,
        around: &mut impl Around,
    ) -> Option<Verdict> {
        if !self.leases.load(Ordering::Relaxed) {
            return None;
        }
        let Spend::Spent { left } = self.lease.try_spend(cost, now_ns) else {
            return None;
        };
        if left < self.low_water.load(Ordering::Relaxed) && refill.may_prefetch(now_ns) {
            around.refill(now_ns);
        }
        Some(Verdict::Lease { left })
    }

    /// The cached denial covers `cost` (with `seat`, the seat first when the rule has a
    /// local share).
    #[inline(always)]
    fn deny_cached(
        &self,
        cost: u64,
        now_ns: u64,
        around: &mut impl Around,
        seat: bool,
    ) -> Option<Verdict> {
        let (until, covered) = self.denied_until(cost, now_ns)?;
        let seat_wait = if seat && self.local.load(Ordering::Relaxed) {
            match around.seat(cost, now_ns) {
                Ok(left) => return Some(Verdict::Seat { left }),
                Err(wait) => wait,
            }
        } else {
            u64::MAX
        };
        // Only a leasing key's demand is read (lease sizing).
        if self.leases.load(Ordering::Relaxed) {
            self.count_denied(cost);
        }
        let wait = until - now_ns + wait_beyond(cost, covered, || around.rate());
        Some(Verdict::Denied {
            wait_ns: wait.min(seat_wait).max(1),
            why: DenialKind::Cached,
        })
    }

    /// What the lease and the cached denial left: the denial while a refill comes, the
    /// seat, the store.
    #[cold]
    fn decide_cold(
        &self,
        refill: &Refill,
        cost: u64,
        now_ns: u64,
        around: &mut impl Around,
    ) -> Verdict {
        let local = self.local.load(Ordering::Relaxed);
        let mut seat_wait = u64::MAX;
        if local {
            match around.seat(cost, now_ns) {
                Ok(left) => return Verdict::Seat { left },
                Err(wait) => seat_wait = wait,
            }
        }
        if now_ns < refill.denies_until_ns.load(Ordering::Relaxed)
            && around.may_await_refill(now_ns)
        {
            let after = refill.prefetch_after_ns.load(Ordering::Relaxed);
            if now_ns >= after && !around.refill(now_ns) {
                // No refill in flight: one that completed at once may cover the cost;
                // else the caller takes the store path.
                return self
                    .spend(cost, now_ns, refill, around)
                    .unwrap_or(Verdict::Store);
            }
            // Retry-After: no sooner than a refused prefetch may be tried again, nor than
            // the agent's share (at most the rule's rate) brings what the lease lacks.
            let lacking = cost.saturating_sub(self.lease.held()).max(1);
            let rate = around.rate();
            let share = refill.share_milli.load(Ordering::Relaxed);
            let by_share = if share == 0 || share as f64 >= rate.per_sec_f64() * 1000.0 {
                refill_ns(lacking, rate)
            } else {
                (lacking as f64 * 1e12 / share as f64) as u64
            };
            self.count_denied(cost);
            let wait = after.saturating_sub(now_ns).max(by_share).min(seat_wait);
            return Verdict::Denied {
                wait_ns: wait.max(1),
                why: DenialKind::Refilling,
            };
        }
        Verdict::Store
    }

    /// What a caller that waited for the key's store call finds: the lease, or the
    /// cached denial (no seat, no refill denial: the caller is on the store path already).
    pub fn recheck(
        &self,
        refill: &Refill,
        cost: u64,
        now_ns: u64,
        around: &mut impl Around,
    ) -> Option<Verdict> {
        self.spend(cost, now_ns, refill, around)
            .or_else(|| self.deny_cached(cost, now_ns, around, false))
    }
}

impl Refill {
    /// Nothing known yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a prefetch may be started at `now_ns` (a refused one waits).
    #[inline]
    pub fn may_prefetch(&self, now_ns: u64) -> bool {
        now_ns >= self.prefetch_after_ns.load(Ordering::Relaxed)
    }

    /// This agent's share of the key, thousandths of a token per second.
    pub fn share_milli(&self) -> u64 {
        self.share_milli.load(Ordering::Relaxed)
    }

    /// Sets the share (an exact decision promoted the key: the policy's share).
    pub fn set_share_milli(&self, share: u64) {
        self.share_milli.store(share, Ordering::Relaxed);
    }

    /// Writes what a rate lease's grant decided: a caller the cell does not cover is
    /// refused until `deny_until_ns` (the grant's deadline), with the time `share_milli`
    /// (thousandths of a token per second) takes to bring what it lacks.
    pub fn rate_granted(&self, deny_until_ns: u64, share_milli: u64) {
        self.share_milli.store(share_milli, Ordering::Relaxed);
        self.denies_until_ns.store(deny_until_ns, Ordering::Relaxed);
        self.prefetch_after_ns.store(0, Ordering::Relaxed);
    }

    /// Writes what an acquire's reply decided: the policy's refill denial and share, and
    /// a refused prefetch's wait.
    pub(crate) fn granted(&self, policy: &KeyPolicy, prefetch_after_ns: Option<u64>) {
        self.share_milli
            .store(policy.share_milli(), Ordering::Relaxed);
        self.denies_until_ns
            .store(policy.deny_while_refilling_until(), Ordering::Relaxed);
        if let Some(until) = prefetch_after_ns {
            self.prefetch_after_ns.store(until, Ordering::Relaxed);
        }
    }
}

/// How much longer than a cached denial of `covered` tokens a caller of `cost` waits:
/// the time the rule's rate takes to bring the difference (ns).
#[inline(always)]
fn wait_beyond(cost: u64, covered: u64, rate: impl FnOnce() -> Rate) -> u64 {
    if cost > covered {
        refill_ns(cost - covered, rate())
    } else {
        0
    }
}

/// Nanoseconds `rate` takes to bring `tokens` to an empty bucket.
pub fn refill_ns(tokens: u64, rate: Rate) -> u64 {
    Level::default().time_until(tokens, rate) * 1000
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// An agent around the cell: a seat of `seat` tokens, refills that start (and are
    /// counted) unless `no_refill`, and a store that is reachable.
    struct Agent {
        rate: Rate,
        seat: Option<u64>,
        refills: u32,
        no_refill: bool,
    }

    impl Around for Agent {
        fn rate(&self) -> Rate {
            self.rate
        }
        fn seat(&mut self, cost: u64, _: u64) -> Result<u64, u64> {
            match &mut self.seat {
                Some(s) if *s >= cost => {
                    *s -= cost;
                    Ok(*s)
                }
                Some(_) => Err(7_000),
                None => Err(u64::MAX),
            }
        }
        fn refill(&mut self, _: u64) -> bool {
            self.refills += 1;
            !self.no_refill
        }
        fn may_await_refill(&mut self, _: u64) -> bool {
            true
        }
    }

    #[allow(clippy::expect_used, reason = "a test helper")]
    fn agent() -> Agent {
        Agent {
            rate: "1000/s".parse().expect("a rate"),
            seat: None,
            refills: 0,
            no_refill: false,
        }
    }

    #[test]
    fn a_leasing_cell_spends_its_lease_and_refills_below_the_low_water_mark() {
        let (cell, refill, mut a) = (Cell::new(), Refill::new(), agent());
        cell.reset(100, true, false, false);
        cell.lease.grant(10, 1_000);
        cell.low_water.store(5, Ordering::Relaxed);
        assert_eq!(
            cell.decide(&refill, 4, 0, &mut a),
            Verdict::Lease { left: 6 }
        );
        assert_eq!(a.refills, 0);
        assert_eq!(
            cell.decide(&refill, 4, 0, &mut a),
            Verdict::Lease { left: 2 }
        );
        assert_eq!(a.refills, 1, "under the low-water mark");
        assert_eq!(cell.decide(&refill, 4, 0, &mut a), Verdict::Store);
        assert_eq!(
            cell.decide(&refill, 1, 1_000, &mut a),
            Verdict::Store,
            "expired"
        );
    }

    #[test]
    fn a_cached_denial_covers_its_cost_and_more_and_waits_longer_for_more() {
        let (cell, refill, mut a) = (Cell::new(), Refill::new(), agent());
        cell.reset(100, false, false, false);
        cell.deny(5_000_000, 3);
        assert_eq!(
            cell.decide(&refill, 2, 0, &mut a),
            Verdict::Store,
            "less may fit"
        );
        let d = |cost| cell.decide(&refill, cost, 1_000_000, &mut agent());
        assert_eq!(
            d(3),
            Verdict::Denied {
                wait_ns: 4_000_000,
                why: DenialKind::Cached
            }
        );
        // Two more tokens at 1 000/s: 2 ms more.
        assert_eq!(
            d(5),
            Verdict::Denied {
                wait_ns: 6_000_000,
                why: DenialKind::Cached
            }
        );
        assert_eq!(cell.decide(&refill, 3, 5_000_000, &mut a), Verdict::Store);
        assert_eq!(
            cell.denied_tokens(),
            0,
            "a cold key's denials are not demand"
        );
    }

    #[test]
    fn the_seat_admits_before_a_cached_denial_and_shortens_it() {
        let (cell, refill) = (Cell::new(), Refill::new());
        cell.reset(100, false, false, true);
        cell.deny(50_000_000, 1);
        let mut a = Agent {
            seat: Some(2),
            ..agent()
        };
        assert_eq!(
            cell.decide(&refill, 2, 0, &mut a),
            Verdict::Seat { left: 0 }
        );
        assert_eq!(
            cell.decide(&refill, 2, 0, &mut a),
            Verdict::Denied {
                wait_ns: 7_000,
                why: DenialKind::Cached
            },
            "the seat's wait is sooner than the store's"
        );
        // No cached denial: the seat, then the store.
        cell.clear_denial();
        a.seat = Some(1);
        assert_eq!(
            cell.decide(&refill, 1, 0, &mut a),
            Verdict::Seat { left: 0 }
        );
        assert_eq!(cell.decide(&refill, 1, 0, &mut a), Verdict::Store);
    }

    #[test]
    fn a_dry_contended_key_denies_while_its_refill_comes_at_its_share() {
        let (cell, refill) = (Cell::new(), Refill::new());
        cell.reset(100, true, false, false);
        refill
            .denies_until_ns
            .store(1_000_000_000, Ordering::Relaxed);
        // A share of 100 tokens/s: 3 lacking tokens take 30 ms.
        refill.share_milli.store(100_000, Ordering::Relaxed);
        let mut a = agent();
        assert_eq!(
            cell.decide(&refill, 3, 0, &mut a),
            Verdict::Denied {
                wait_ns: 30_000_000,
                why: DenialKind::Refilling
            }
        );
        assert_eq!((a.refills, cell.denied_tokens()), (1, 3));
        // A refused prefetch waits: denied until then, no refill started.
        refill
            .prefetch_after_ns
            .store(90_000_000, Ordering::Relaxed);
        let mut a = agent();
        assert_eq!(
            cell.decide(&refill, 3, 0, &mut a),
            Verdict::Denied {
                wait_ns: 90_000_000,
                why: DenialKind::Refilling
            }
        );
        assert_eq!(a.refills, 0);
        // No refill could start: the store decides.
        refill.prefetch_after_ns.store(0, Ordering::Relaxed);
        let mut a = Agent {
            no_refill: true,
            ..agent()
        };
        assert_eq!(cell.decide(&refill, 3, 0, &mut a), Verdict::Store);
        // Past the refill denial: the store.
        assert_eq!(
            cell.decide(&refill, 3, 1_000_000_000, &mut agent()),
            Verdict::Store
        );
    }

    #[test]
    fn a_recheck_looks_at_the_lease_and_the_cached_denial_only() {
        let (cell, refill) = (Cell::new(), Refill::new());
        cell.reset(100, true, false, true);
        let mut a = Agent {
            seat: Some(5),
            ..agent()
        };
        assert_eq!(cell.recheck(&refill, 1, 0, &mut a), None);
        cell.lease.grant(1, 1_000);
        assert_eq!(
            cell.recheck(&refill, 1, 0, &mut a),
            Some(Verdict::Lease { left: 0 })
        );
        assert_eq!(a.refills, 1, "under the low-water mark");
        cell.deny(2_000, 1);
        assert_eq!(
            cell.recheck(&refill, 1, 0, &mut a),
            Some(Verdict::Denied {
                wait_ns: 2_000,
                why: DenialKind::Cached
            })
        );
        assert_eq!(
            cell.denied_tokens(),
            1,
            "a leasing key's denials are demand"
        );
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// A caller that sees a cached denial sees the cost it was made for, never the
    /// previous one: the time is published after the cost.
    #[test]
    fn loom_a_cached_denial_is_seen_with_its_cost() {
        loom::model(|| {
            let cell = Arc::new(Cell::new());
            cell.deny(0, 9);
            let writer = {
                let cell = cell.clone();
                thread::spawn(move || cell.deny(100, 2))
            };
            if let Some((until, covered)) = cell.denied_until(5, 10) {
                assert_eq!((until, covered), (100, 2));
            }
            writer.join().expect("the writer");
        });
    }
}
