//! Fixed-point token bucket arithmetic.
//!
//! A bucket level is a whole number of tokens plus a `carry`: the fraction of the next
//! token, counted in units of `1 / period_us` of a token. Refilling `dt` microseconds at
//! `tokens / period_us` adds `tokens * dt` such units, exactly; whole tokens move out of
//! the carry by integer division. Splitting a refill into pieces therefore gives the same
//! result as doing it at once, which is what makes lazy evaluation (refill only when the
//! bucket is touched) equal to a bucket that refills continuously.
//!
//! Every product here stays below [`crate::MAX_EXACT`] when the rule was validated
//! (`capacity * period_us + tokens <= MAX_EXACT`), so the Lua twin of this code, which
//! runs on doubles inside Redis, computes the same integers.

use crate::rate::Rate;

/// Tokens in a bucket: `tokens + carry / rate.period_us()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Level {
    /// Whole tokens.
    pub tokens: u64,
    /// Fraction of the next token, in `1 / period_us` units; always `< period_us`.
    pub carry: u64,
}

impl Level {
    /// A full bucket.
    pub fn full(capacity: u64) -> Self {
        Self {
            tokens: capacity,
            carry: 0,
        }
    }

    /// The level after `dt_us` of refill, never above `cap`. A level already at or above
    /// `cap` is set to exactly `cap` with no carry: a full bucket accrues nothing.
    #[must_use]
    pub fn refill(self, cap: u64, rate: Rate, dt_us: u64) -> Self {
        if self.tokens >= cap {
            return Self::full(cap);
        }
        let (n, p) = (rate.tokens(), rate.period_us());
        let need = (cap - self.tokens) * p - self.carry;
        if dt_us >= need.div_ceil(n) {
            return Self::full(cap);
        }
        // n * dt < need + n <= capacity * p + n: exact, see the module doc.
        let units = self.carry + n * dt_us;
        Self {
            tokens: self.tokens + units / p,
            carry: units % p,
        }
    }

    /// Microseconds until the bucket holds `k` tokens if nothing else happens and nothing
    /// caps the refill; 0 when it already does. Never 0 when `k > tokens`.
    pub fn time_until(self, k: u64, rate: Rate) -> u64 {
        if self.tokens >= k {
            return 0;
        }
        let need = (k - self.tokens) * rate.period_us() - self.carry;
        need.div_ceil(rate.tokens())
    }

    /// The level after `dt_us` of refill at `n` `1/scale`-ths of a token per `period_us`
    /// (a bucket whose rate is partly leased out: [`crate::model`]'s rate leases), never
    /// above `cap`; the carry stays in `1 / period_us` units, rounded down (less than one
    /// unit per refill: never more than the rate brings). Exact while
    /// `(cap * period_us + n) * scale` stays within [`crate::MAX_EXACT`], which the scale
    /// of a rate-leased bucket is chosen to keep.
    #[must_use]
    pub fn refill_scaled(self, cap: u64, n: u64, period_us: u64, scale: u64, dt_us: u64) -> Self {
        if self.tokens >= cap {
            return Self::full(cap);
        }
        if n == 0 {
            return self;
        }
        let need = ((cap - self.tokens) * period_us - self.carry) * scale;
        if dt_us >= need.div_ceil(n) {
            return Self::full(cap);
        }
        let unit = period_us * scale;
        let units = self.carry * scale + n * dt_us;
        Self {
            tokens: self.tokens + units / unit,
            carry: units % unit / scale,
        }
    }

    /// [`Level::time_until`] at `n` `1/scale`-ths of a token per `period_us`; `None` at
    /// no refill.
    pub fn time_until_scaled(self, k: u64, n: u64, period_us: u64, scale: u64) -> Option<u64> {
        if self.tokens >= k {
            return Some(0);
        }
        if n == 0 {
            return None;
        }
        let need = ((k - self.tokens) * period_us - self.carry) * scale;
        Some(need.div_ceil(n))
    }

    /// Removes `k <= tokens` whole tokens.
    #[must_use]
    pub fn take(self, k: u64) -> Self {
        debug_assert!(k <= self.tokens);
        Self {
            tokens: self.tokens - k,
            carry: self.carry,
        }
    }
}

/// Whole seconds, rounded up, for `tokens` to refill at `rate` into an empty bucket: the
/// `w` of a `RateLimit-Policy` item (with the capacity) and the `t` of a `RateLimit`
/// item (with what is missing); 0 for no tokens.
pub fn refill_secs(tokens: u64, rate: Rate) -> u64 {
    retry_after_secs(Level::default().time_until(tokens, rate))
}

/// Whole seconds for an HTTP `Retry-After` header: rounded up, and at least 1 for any
/// positive wait, so a denial never says "retry after 0".
pub fn retry_after_secs(wait_us: u64) -> u64 {
    if wait_us == 0 {
        0
    } else {
        wait_us.div_ceil(1_000_000).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::num::NonZeroU64;
    use std::time::Duration;

    fn rate(n: u64, per_us: u64) -> Rate {
        Rate::new(NonZeroU64::new(n).unwrap(), Duration::from_micros(per_us)).unwrap()
    }

    #[test]
    fn refills_exactly_and_stops_at_cap() {
        let r = rate(10, 1_000_000); // one token per 100ms
        let l = Level::default().refill(100, r, 250_000);
        assert_eq!(
            l,
            Level {
                tokens: 2,
                carry: 50_000
            }
        );
        let l = l.refill(100, r, 50_000);
        assert_eq!(
            l,
            Level {
                tokens: 3,
                carry: 0
            }
        );
        assert_eq!(l.refill(5, r, 10_000_000), Level::full(5));
        assert_eq!(Level::full(7).refill(5, r, 0), Level::full(5));
    }

    #[test]
    fn time_until_is_exact_and_positive() {
        let r = rate(3, 1_000_000);
        let l = Level {
            tokens: 0,
            carry: 0,
        };
        // 1 token takes 1/3 s = 333_333.3 µs -> rounded up.
        assert_eq!(l.time_until(1, r), 333_334);
        assert_eq!(l.refill(10, r, 333_334).tokens, 1);
        assert_eq!(l.refill(10, r, 333_333).tokens, 0);
        assert_eq!(
            Level {
                tokens: 4,
                carry: 0
            }
            .time_until(4, r),
            0
        );
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1_000_001), 2);
    }

    /// A billion single-microsecond refills equal one refill of a billion microseconds:
    /// the carry loses nothing (the no-drift requirement, sampled every 7th step to
    /// keep the test fast; the property below covers arbitrary splits).
    #[test]
    fn no_drift_over_a_billion_microseconds() {
        let r = rate(7, 3_000_000);
        let cap = 10_000_000;
        let mut pieces = Level::default();
        let steps = 1_000_000_000u64 / 7;
        for _ in 0..steps {
            pieces = pieces.refill(cap, r, 7);
        }
        let whole = Level::default().refill(cap, r, steps * 7);
        assert_eq!(pieces, whole);
        assert_eq!(whole.tokens, steps * 7 * 7 / 3_000_000);
    }

    proptest! {
        #[test]
        fn split_refill_equals_whole(
            n in 1u64..1000, p in 1u64..10_000_000, cap in 1u64..10_000,
            start in 0u64..10_000, splits in proptest::collection::vec(0u64..5_000_000, 1..20)
        ) {
            let r = rate(n, p);
            let start = Level { tokens: start.min(cap), carry: 0 };
            let mut pieces = start;
            for dt in &splits {
                pieces = pieces.refill(cap, r, *dt);
            }
            let whole = start.refill(cap, r, splits.iter().sum());
            prop_assert_eq!(pieces, whole);
            prop_assert!(whole.tokens <= cap && whole.carry < r.period_us());
        }

        #[test]
        fn time_until_is_the_first_moment(n in 1u64..1000, p in 1u64..10_000_000, k in 1u64..1000) {
            let r = rate(n, p);
            let l = Level::default();
            let t = l.time_until(k, r);
            prop_assert!(l.refill(k, r, t).tokens >= k);
            prop_assert!(l.refill(k, r, t - 1).tokens < k);
        }
    }
}
