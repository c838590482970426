//! Refill rates as exact rationals: `tokens` every `period` microseconds.
//!
//! A rate is never a float. `10/s` is stored as 10 tokens per 1 000 000 µs and `1/1m` as
//! 1 token per 60 000 000 µs, reduced by their greatest common divisor, so the bucket
//! arithmetic in [`crate::bucket`] can refill by integer steps and carry the remainder
//! exactly: there is no drift however many operations run.

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;
use std::time::Duration;

/// The largest integer every component of Leasehold handles exactly: Redis runs its Lua
/// with double-precision numbers, which are exact up to 2^53 - 1.
pub const MAX_EXACT: u64 = (1 << 53) - 1;

/// The longest refill period accepted (about 407 days: a limit per year, as
/// envoyproxy/ratelimit's `unit: year`, fits); longer ones are a typo. Exactness does
/// not rest on it: a rule's `capacity * period_us` is bounded on its own.
pub const MAX_PERIOD_US: u64 = 1 << 45;

/// The fastest refill accepted, in tokens per second; faster ones are a typo.
pub const MAX_TOKENS_PER_SEC: u64 = 1_000_000_000;

/// A refill rate: `tokens` added every `period_us` microseconds, in lowest terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    tokens: u64,
    period_us: u64,
}

/// Why a rate was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RateError {
    /// The text is not of the form `N/PERIOD` (for example `100/s`, `5/1m`, `1/250ms`).
    #[error("rate {text:?} is not of the form N/PERIOD, e.g. \"100/s\", \"5/1m\", \"1/250ms\"")]
    Syntax {
        /// The text given.
        text: String,
    },
    /// The token count is zero; a bucket that never refills is not a rate limit.
    #[error("rate must add at least one token per period (got {text:?})")]
    Zero {
        /// The text given.
        text: String,
    },
    /// The period is shorter than one microsecond or longer than [`MAX_PERIOD_US`].
    #[error("rate period must be between 1µs and {max_days} days (got {})", humantime::format_duration(*period), max_days = MAX_PERIOD_US / 86_400_000_000)]
    Period {
        /// The period given.
        period: Duration,
    },
    /// More than [`MAX_TOKENS_PER_SEC`] tokens per second.
    #[error("rate of {tokens} tokens per {period_us}µs exceeds {MAX_TOKENS_PER_SEC} tokens/s")]
    Absurd {
        /// Tokens per period.
        tokens: u64,
        /// The period in microseconds.
        period_us: u64,
    },
}

impl Rate {
    /// `tokens` every `period`. Fails on periods outside 1µs..=[`MAX_PERIOD_US`] and on
    /// rates above [`MAX_TOKENS_PER_SEC`].
    pub fn new(tokens: NonZeroU64, period: Duration) -> Result<Self, RateError> {
        let period_us = period.as_micros();
        if period_us == 0 || period_us > u128::from(MAX_PERIOD_US) {
            return Err(RateError::Period { period });
        }
        let period_us = period_us as u64;
        let tokens = tokens.get();
        // tokens / period_us > MAX/1e6  <=>  tokens * 1e6 > MAX * period_us
        if u128::from(tokens) * 1_000_000 > u128::from(MAX_TOKENS_PER_SEC) * u128::from(period_us) {
            return Err(RateError::Absurd { tokens, period_us });
        }
        let g = gcd(tokens, period_us);
        Ok(Self {
            tokens: tokens / g,
            period_us: period_us / g,
        })
    }

    /// `tokens` per second.
    pub fn per_second(tokens: NonZeroU64) -> Result<Self, RateError> {
        Self::new(tokens, Duration::from_secs(1))
    }

    /// Tokens added per period (numerator, in lowest terms).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The period in microseconds (denominator, in lowest terms).
    pub fn period_us(&self) -> u64 {
        self.period_us
    }

    /// This rate for a bucket of `capacity` whose arithmetic must stay within `max_units`
    /// (`capacity * period_us + tokens <= max_units`): itself when it fits, else the
    /// nearest rate below it over a period short enough, `floor(tokens * d / period_us)`
    /// every `d` µs (short by less than one of those tokens: 86 401/day at B = 86 401 runs
    /// as 52 123 every 52 123 185 854 µs, 0.0015% short); `None` when not even one token
    /// fits.
    pub fn within_units(self, capacity: u64, max_units: u64) -> Option<Self> {
        if self.fits_units(capacity, max_units) {
            return Some(self);
        }
        // d * (capacity + ceil(tokens / period)) <= max_units keeps the new rate within.
        let per_us_ceil = self.tokens.div_ceil(self.period_us);
        let d = max_units / capacity.checked_add(per_us_ceil)?.checked_add(1)?;
        let tokens = u128::from(self.tokens) * u128::from(d) / u128::from(self.period_us);
        let tokens = NonZeroU64::new(u64::try_from(tokens).ok()?)?;
        let r = Self::new(tokens, Duration::from_micros(d)).ok()?;
        r.fits_units(capacity, max_units).then_some(r)
    }

    /// Whether a bucket of `capacity` at this rate keeps its arithmetic within
    /// `max_units`: `capacity * period_us + tokens <= max_units`.
    pub fn fits_units(&self, capacity: u64, max_units: u64) -> bool {
        u128::from(capacity) * u128::from(self.period_us) + u128::from(self.tokens)
            <= u128::from(max_units)
    }

    /// Thousandths of a token per second, rounded down (at most `u64::MAX`).
    pub fn milli_per_sec(&self) -> u64 {
        let milli = u128::from(self.tokens) * 1_000_000_000 / u128::from(self.period_us);
        u64::try_from(milli).unwrap_or(u64::MAX)
    }

    /// Tokens per second, for display and metrics only; never used in bucket math.
    pub fn per_sec_f64(&self) -> f64 {
        self.tokens as f64 * 1e6 / self.period_us as f64
    }
}

impl fmt::Display for Rate {
    /// Per second when that is a whole number (`50/s`, kept in lowest terms as 1/20ms),
    /// else per its own period (`1/1m`, `7/3s`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.period_us <= 1_000_000
            && 1_000_000 % self.period_us == 0
            && let Some(n) = self.tokens.checked_mul(1_000_000 / self.period_us)
        {
            return write!(f, "{n}/s");
        }
        let d = Duration::from_micros(self.period_us);
        write!(f, "{}/{}", self.tokens, humantime::format_duration(d))
    }
}

impl FromStr for Rate {
    type Err = RateError;

    /// Parses `N/PERIOD`: `100/s`, `5/1m`, `1/250ms`, `30/2h`. A bare unit means one of it.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let syntax = || RateError::Syntax {
            text: text.to_owned(),
        };
        let (n, per) = text.split_once('/').ok_or_else(syntax)?;
        let n: u64 = n.trim().parse().map_err(|_| syntax())?;
        let n = NonZeroU64::new(n).ok_or_else(|| RateError::Zero {
            text: text.to_owned(),
        })?;
        let per = per.trim();
        let period = if per.starts_with(|c: char| c.is_ascii_digit()) {
            parse_duration(per).map_err(|_| syntax())?
        } else {
            parse_duration(&format!("1{per}")).map_err(|_| syntax())?
        };
        Self::new(n, period)
    }
}

/// Parses a duration such as `250ms`, `5s` or `1m 30s`.
pub fn parse_duration(text: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(text.trim())
}

pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_too_fine_for_its_capacity_is_approximated_from_below() {
        let units = 1u64 << 52;
        let day: Rate = "86401/day".parse().unwrap();
        let r = day.within_units(86_401, units).unwrap();
        assert!(
            u128::from(86_401u64) * u128::from(r.period_us()) + u128::from(r.tokens())
                <= u128::from(units)
        );
        // At most the rate asked, and within 0.01% of it.
        assert!(
            u128::from(r.tokens()) * u128::from(day.period_us())
                <= u128::from(day.tokens()) * u128::from(r.period_us())
        );
        let (asked, got) = (day.per_sec_f64(), r.per_sec_f64());
        assert!(got <= asked && got > asked * 0.9999, "{asked} {got}");
        // A rate that fits is itself; one that cannot hold a token is refused.
        let s: Rate = "1000/s".parse().unwrap();
        assert_eq!(s.within_units(1000, units), Some(s));
        assert_eq!(s.within_units(units, units), None);
        let year: Rate = "4294967295/365d".parse().unwrap();
        let r = year.within_units(4_294_967_295, units).unwrap();
        assert!(
            r.per_sec_f64() <= year.per_sec_f64() && r.per_sec_f64() > year.per_sec_f64() * 0.99
        );
    }

    #[test]
    fn parses_and_reduces() {
        let r: Rate = "100/s".parse().unwrap();
        assert_eq!((r.tokens(), r.period_us()), (1, 10_000));
        let r: Rate = "5/1m".parse().unwrap();
        assert_eq!((r.tokens(), r.period_us()), (1, 12_000_000));
        let r: Rate = "3/250ms".parse().unwrap();
        assert_eq!((r.tokens(), r.period_us()), (3, 250_000));
        assert!((r.per_sec_f64() - 12.0).abs() < 1e-9);
    }

    #[test]
    fn refuses_nonsense_with_a_named_reason() {
        assert!(matches!("0/s".parse::<Rate>(), Err(RateError::Zero { .. })));
        assert!(matches!(
            "ten/s".parse::<Rate>(),
            Err(RateError::Syntax { .. })
        ));
        assert!(matches!(
            "10".parse::<Rate>(),
            Err(RateError::Syntax { .. })
        ));
        assert!(matches!(
            "1/0s".parse::<Rate>(),
            Err(RateError::Period { .. })
        ));
        // The period as given, not rounded to µs.
        let e = "1/1ns".parse::<Rate>().unwrap_err().to_string();
        assert!(e.contains("got 1ns"), "{e}");
        let e = "5/0.5us".parse::<Rate>().unwrap_err().to_string();
        assert!(e.contains("got 500ns"), "{e}");
        assert!(matches!(
            "1/1000d".parse::<Rate>(),
            Err(RateError::Period { .. })
        ));
        assert!(matches!(
            "2000000000/s".parse::<Rate>(),
            Err(RateError::Absurd { .. })
        ));
        let msg = "0/s".parse::<Rate>().unwrap_err().to_string();
        assert!(msg.contains("at least one token"), "{msg}");
    }

    #[test]
    fn rates_read_back_per_second_when_whole() {
        for (text, shown) in [
            ("50/s", "50/s"),
            ("7/100ms", "70/s"),
            ("1/s", "1/s"),
            ("1/1m", "1/1m"),
            ("7/3s", "7/3s"),
            ("3/2500ms", "3/2s 500ms"),
        ] {
            let r: Rate = text.parse().unwrap();
            assert_eq!(r.to_string(), shown, "{text}");
            assert_eq!(
                r.to_string().parse::<Rate>().unwrap(),
                r,
                "{text} reads back"
            );
        }
    }
}
