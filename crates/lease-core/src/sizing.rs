//! Lease sizing: how many tokens an agent asks for, from its measured demand.
//!
//! An agent asks for enough to cover `horizon` of its own demand (about 200 ms), within the
//! rule's lease bounds, so it calls the store a few times a second however hot the key is,
//! and an idle agent holds little.

use std::time::Duration;

use crate::rule::Rule;

/// What to ask the store for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseRequest {
    /// Tokens wanted.
    pub want: u64,
    /// The least grant worth having; less is refused and the store says when `min` exist.
    pub min: u64,
}

/// The default demand horizon a lease should cover. Shorter means fewer tokens in flight
/// (less budget stranded in the leases of agents whose demand just stopped), longer means
/// fewer store calls; 100 ms kept utilisation above 0.99 in every `simulate` scenario.
pub const DEFAULT_HORIZON: Duration = Duration::from_millis(100);

/// Sizes a lease for `demand_milli` (thousandths of a token per second, measured locally)
/// over `horizon`, for a request that needs at least `needed` tokens now (0 when
/// prefetching). A request waiting for tokens takes any grant that covers it (`min =
/// needed`); a prefetch waits for a quarter of its lease (`min = want / 4`), so agents of
/// a saturated key collect tokens in batches instead of calling the store for each one.
/// The result satisfies `1 <= min <= want <= max(lease_max, needed)`, all capped at B.
pub fn lease_request(
    rule: &Rule,
    demand_milli: u64,
    horizon: Duration,
    needed: u64,
) -> LeaseRequest {
    let cap = rule.capacity().get();
    let max = rule.lease_max().get();
    let horizon_us = horizon.as_micros().min(u128::from(u64::MAX)) as u64;
    let covered = (u128::from(demand_milli) * u128::from(horizon_us)).div_ceil(1_000_000_000);
    let want = u64::try_from(covered)
        .unwrap_or(u64::MAX)
        .clamp(rule.lease_min().get(), max);
    if needed == 0 {
        return LeaseRequest {
            want,
            min: (want / 4).max(1),
        };
    }
    let min = needed.clamp(1, cap);
    LeaseRequest {
        want: want.max(min),
        min,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_the_horizon_within_bounds() {
        let rule = Rule::new("r", 1000, "100/s").unwrap(); // lease_max = 125
        let h = Duration::from_millis(200);
        assert_eq!(
            lease_request(&rule, 0, h, 0),
            LeaseRequest { want: 1, min: 1 }
        );
        // 200 tokens/s for 200 ms -> 40.
        assert_eq!(
            lease_request(&rule, 200_000, h, 1),
            LeaseRequest { want: 40, min: 1 }
        );
        assert_eq!(lease_request(&rule, u64::MAX, h, 1).want, 125);
        assert_eq!(
            lease_request(&rule, 0, h, 500),
            LeaseRequest {
                want: 500,
                min: 500
            }
        );
        assert_eq!(
            lease_request(&rule, 0, h, 5000),
            LeaseRequest {
                want: 1000,
                min: 1000
            }
        );
    }
}
