//! The local lease: tokens an agent holds for one bucket and spends without a network
//! round trip.
//!
//! Spending is one compare-and-swap loop on one atomic counter, so the count never goes
//! below zero and no token is spent twice, whatever the thread interleaving (I3). A lease
//! carries a deadline on the holder's monotonic clock; after it nothing is spent (I4).
//! The holder sets the deadline from the moment it *sent* the acquire, minus a margin, so
//! it always falls before the store forgets the lease.

use crate::sync::{AtomicU64, Ordering};

/// Tokens held for one bucket, with their deadline (holder clock, nanoseconds).
#[derive(Debug)]
pub struct LocalLease {
    tokens: AtomicU64,
    deadline_ns: AtomicU64,
    epoch: AtomicU64,
}

/// The outcome of [`LocalLease::try_spend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spend {
    /// `cost` tokens were taken; `left` remain.
    Spent {
        /// Tokens still held.
        left: u64,
    },
    /// Fewer than `cost` tokens are held; nothing was taken.
    Insufficient {
        /// Tokens held.
        held: u64,
    },
    /// The lease is past its deadline; nothing was taken.
    Expired,
}

impl Default for LocalLease {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalLease {
    /// An empty, expired lease.
    pub fn new() -> Self {
        Self {
            tokens: AtomicU64::new(0),
            deadline_ns: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
        }
    }

    /// Takes `cost` tokens if the lease is live at `now_ns` and holds that many.
    #[inline]
    pub fn try_spend(&self, cost: u64, now_ns: u64) -> Spend {
        if now_ns >= self.deadline_ns.load(Ordering::Acquire) {
            return Spend::Expired;
        }
        let mut held = self.tokens.load(Ordering::Relaxed);
        loop {
            if held < cost {
                return Spend::Insufficient { held };
            }
            match self.tokens.compare_exchange_weak(
                held,
                held - cost,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Spend::Spent { left: held - cost },
                Err(actual) => held = actual,
            }
        }
    }

    /// Tokens held now, live or not.
    pub fn held(&self) -> u64 {
        self.tokens.load(Ordering::Acquire)
    }

    /// The deadline, holder clock nanoseconds.
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns.load(Ordering::Acquire)
    }

    /// What to declare as held when sending an acquire at `now_ns`: the count if the lease
    /// is live, else 0 after forfeiting the expired tokens (they may no longer be spent,
    /// and the store may already have forgotten them).
    pub fn declare(&self, now_ns: u64) -> u64 {
        self.declare_counting(now_ns).0
    }

    /// [`LocalLease::declare`], also saying how many expired tokens were forfeited.
    pub fn declare_counting(&self, now_ns: u64) -> (u64, u64) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        if now_ns >= self.deadline_ns() {
            (0, self.tokens.swap(0, Ordering::AcqRel))
        } else {
            (self.held(), 0)
        }
    }

    /// Applies a grant: `granted` more tokens, and the whole lease now lives until
    /// `deadline_ns` (the store renewed every held token with this acquire).
    pub fn grant(&self, granted: u64, deadline_ns: u64) {
        // Deadline first: a spender that sees the new tokens also sees the new deadline,
        // and a spender that sees the new deadline with the old tokens spends tokens the
        // store renewed too.
        self.deadline_ns.store(deadline_ns, Ordering::Release);
        self.tokens.fetch_add(granted, Ordering::AcqRel);
    }

    /// Empties the lease and returns what it held, for a release: each token is either
    /// spent before this or returned by it, never both.
    pub fn take_all(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.tokens.swap(0, Ordering::AcqRel)
    }

    /// Empties the lease for a new holder: no tokens, no deadline; the epoch moves on, so
    /// no refund counted against the old holder applies.
    pub fn reset(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.tokens.store(0, Ordering::Release);
        self.deadline_ns.store(0, Ordering::Release);
    }

    /// Counts the reports of this lease to the store ([`LocalLease::declare`] and
    /// [`LocalLease::take_all`]); read it before a spend to refund that spend later.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Gives back `n` tokens of a spend that turned out not to be needed, if no report to
    /// the store happened since `epoch` (read before the spend): the store's view of this
    /// lease then still covers them. Otherwise the tokens are dropped, which only
    /// under-admits. The caller must hold whatever serializes reports (the agent's
    /// per-key I/O lock), so no report can slip between the check and the add.
    pub fn refund(&self, n: u64, epoch: u64) -> bool {
        if self.epoch() != epoch {
            return false;
        }
        self.tokens.fetch_add(n, Ordering::AcqRel);
        true
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn spends_until_empty_then_refuses() {
        let l = LocalLease::new();
        assert_eq!(l.try_spend(1, 0), Spend::Expired);
        l.grant(3, 100);
        assert_eq!(l.try_spend(2, 10), Spend::Spent { left: 1 });
        assert_eq!(l.try_spend(2, 10), Spend::Insufficient { held: 1 });
        assert_eq!(l.try_spend(1, 100), Spend::Expired);
        assert_eq!(l.declare(100), 0);
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn refund_only_when_no_report_happened_since() {
        let l = LocalLease::new();
        l.grant(5, 100);
        let e = l.epoch();
        assert_eq!(l.try_spend(2, 1), Spend::Spent { left: 3 });
        assert!(l.refund(2, e));
        assert_eq!(l.held(), 5);
        let e = l.epoch();
        assert_eq!(l.try_spend(2, 1), Spend::Spent { left: 3 });
        assert_eq!(l.declare(1), 3);
        assert!(
            !l.refund(2, e),
            "a declare reported 3; refunding would hide 2 tokens"
        );
        assert_eq!(l.held(), 3);
    }

    /// I3: many threads spending and one returning never take more than was granted.
    #[test]
    fn i3_threads_never_overspend() {
        for _ in 0..20 {
            let l = Arc::new(LocalLease::new());
            l.grant(10_000, u64::MAX);
            let spent: u64 = std::thread::scope(|s| {
                let hs: Vec<_> = (0..4)
                    .map(|_| {
                        let l = l.clone();
                        s.spawn(move || {
                            let mut n = 0;
                            while let Spend::Spent { .. } = l.try_spend(3, 1) {
                                n += 3;
                            }
                            n
                        })
                    })
                    .collect();
                let returned = l.take_all();
                hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>() + returned + l.held()
            });
            assert_eq!(spent, 10_000);
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// I3 under every interleaving loom explores: two spenders race a return; every token
    /// is spent or returned exactly once and the count never wraps.
    #[test]
    fn loom_spend_and_return_account_every_token() {
        loom::model(|| {
            let l = Arc::new(LocalLease::new());
            l.grant(3, 10);
            let spenders: Vec<_> = (0..2)
                .map(|_| {
                    let l = l.clone();
                    thread::spawn(move || match l.try_spend(2, 1) {
                        Spend::Spent { .. } => 2,
                        _ => 0,
                    })
                })
                .collect();
            let returned = l.take_all();
            let spent: u64 = spenders.into_iter().map(|h| h.join().unwrap()).sum();
            assert_eq!(spent + returned + l.held(), 3);
            assert!(spent <= 2);
        });
    }

    /// A grant racing a spend: the spender sees either nothing or a live lease with tokens.
    #[test]
    fn loom_grant_races_spend() {
        loom::model(|| {
            let l = Arc::new(LocalLease::new());
            let g = {
                let l = l.clone();
                thread::spawn(move || l.grant(1, 10))
            };
            let r = l.try_spend(1, 5);
            g.join().unwrap();
            let after = l.held();
            match r {
                Spend::Spent { .. } => assert_eq!(after, 0),
                _ => assert_eq!(after, 1),
            }
        });
    }
}
