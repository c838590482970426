//! Global accounting: tokens admitted per bucket per second, summed over every agent's
//! report, and the overshoot against the single-bucket bound `B + r*W`, so an operator
//! sees the bound hold in production and not only in tests.
//!
//! Agents report running totals on the whole seconds of their wall clocks (see
//! `leasehold_store::report`), those of the seconds between two reports included when a
//! large fleet reports less often. The difference between two totals of one agent is
//! what it admitted in between, credited to the seconds the interval covers (spread
//! evenly when a report was missed). A second is settled once every report that covers
//! it should have arrived (later at a slower cadence, [`Ledger::cadence`]); windows of 1
//! to 10 settled seconds are checked. Reports are taken a few
//! ms apart on clocks that agree to within NTP's error, so the bound is given a slack of
//! [`SLACK_SECS`] of refill.
//!
//! Work per report is one entry per (agent, key) it carries; memory is [`SLOTS_KEPT`]
//! seconds per key, and keys nobody reported for [`FORGET_AFTER_MS`] are dropped.

use std::collections::{BTreeMap, HashMap};

use leasehold_store::report::Report;
use serde::Serialize;

/// Seconds of history kept per key.
pub const SLOTS_KEPT: u64 = 16;

/// The longest window checked, seconds.
pub const MAX_WINDOW: u64 = 10;

/// Refill added to the bound for the misalignment of agents' reports, seconds.
pub const SLACK_SECS: f64 = 0.1;

/// A key (or an agent's entry for it) unreported for this long is forgotten (ms).
pub const FORGET_AFTER_MS: u64 = 60_000;

/// A second is settled this long after it ends (ms) when agents report every second:
/// reports are written on the whole second and read half a second later. Each second
/// more between an agent's reports adds a second.
pub const SETTLE_MS: u64 = 1_500;

#[derive(Clone, Copy, Debug)]
struct Last {
    at_ms: u64,
    admitted: u64,
    calls: u64,
}

#[derive(Clone, Debug, Default)]
struct KeyLedger {
    admitted: BTreeMap<u64, u64>,
    calls: BTreeMap<u64, u64>,
    demand_milli: HashMap<String, u64>,
    held: HashMap<String, u64>,
    total: u64,
    last_ms: u64,
    worst: f64,
}

/// What the accounting knows of one key.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct KeyStats {
    /// The Redis key.
    pub key: String,
    /// Agents that reported it recently.
    pub agents: usize,
    /// Tokens admitted since the coordinator started watching.
    pub admitted_total: u64,
    /// Tokens admitted in the last settled second.
    pub admitted_last_sec: u64,
    /// Store calls per second for the key (its parts included), over the last three
    /// settled seconds.
    pub calls_per_sec: f64,
    /// Offered demand, tokens per second, summed over agents.
    pub demand_per_sec: f64,
    /// Tokens agents hold now.
    pub held: u64,
    /// Largest `(admitted in W - (B + r*W)) / (B + r*W)` over windows of 1..=10 settled
    /// seconds in the history, floored at 0.
    pub overshoot: f64,
    /// The largest overshoot seen since the coordinator started.
    pub worst_overshoot: f64,
    /// The last settled second: tokens admitted, the bound `B + r` they are held to,
    /// and the overshoot against it (0 within).
    pub window_1s: Window,
    /// The last ten settled seconds, as `window_1s` (`B + 10 r`).
    pub window_10s: Window,
}

/// Admissions over a window of whole seconds against the bound of one bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Window {
    /// Seconds covered (fewer than asked while the key is new to the coordinator).
    pub secs: u64,
    /// Tokens admitted in it.
    pub admitted: u64,
    /// `B + r*W`.
    pub bound: f64,
    /// `(admitted - bound - slack) / bound`, floored at 0 (see [`SLACK_SECS`]).
    pub overshoot: f64,
}

/// Capacity and rate of a key, for its bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    /// Capacity B.
    pub capacity: u64,
    /// Rate r, tokens per second.
    pub rate_per_sec: f64,
}

/// Totals per (agent, key), and per key the admitted tokens and calls per second.
#[derive(Debug, Default)]
pub struct Ledger {
    last: HashMap<(String, String), Last>,
    keys: HashMap<String, KeyLedger>,
    /// The slowest cadence of the agents' reports, seconds (0 read as 1).
    every: u64,
}

fn credit(slots: &mut BTreeMap<u64, u64>, from_ms: u64, to_ms: u64, n: u64) {
    if n == 0 {
        return;
    }
    // The seconds the interval covers, by the whole seconds the reports were meant for.
    let first = (from_ms + 500) / 1000;
    let end = ((to_ms + 500) / 1000).max(first + 1);
    let secs = end - first;
    let each = n / secs;
    for s in first..end {
        let extra = if s + 1 == end { n % secs } else { 0 };
        *slots.entry(s).or_default() += each + extra;
    }
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one agent's report: the seconds it samples since its previous report, then
    /// its totals now. The first totals of an (agent, key) only set its baseline; totals
    /// not newer than the last ones change nothing.
    pub fn record(&mut self, agent: &str, report: &Report) {
        for (key, samples) in &report.past {
            for s in samples {
                self.take(agent, key, s.at_ms, s.admitted, s.calls);
            }
        }
        for (key, totals) in &report.keys {
            self.take(agent, key, report.at_ms, totals.admitted, totals.calls);
            let k = self.keys.entry(key.clone()).or_default();
            k.demand_milli.insert(agent.to_owned(), totals.demand_milli);
            k.held.insert(agent.to_owned(), totals.held);
        }
    }

    fn take(&mut self, agent: &str, key: &str, at_ms: u64, admitted: u64, calls: u64) {
        let k = self.keys.entry(key.to_owned()).or_default();
        k.last_ms = k.last_ms.max(at_ms);
        let now = Last {
            at_ms,
            admitted,
            calls,
        };
        match self.last.get_mut(&(agent.to_owned(), key.to_owned())) {
            None => {
                self.last.insert((agent.to_owned(), key.to_owned()), now);
            }
            Some(last) if at_ms > last.at_ms => {
                let admitted = admitted.saturating_sub(last.admitted);
                let calls = calls.saturating_sub(last.calls);
                credit(&mut k.admitted, last.at_ms, at_ms, admitted);
                credit(&mut k.calls, last.at_ms, at_ms, calls);
                k.total += admitted;
                *last = now;
            }
            Some(_) => {}
        }
    }

    /// The slowest cadence among the live agents' reports, seconds: a second is settled
    /// once the last of them covering it is due.
    pub fn cadence(&mut self, every: u64) {
        self.every = every;
    }

    fn settle_ms(&self) -> u64 {
        SETTLE_MS + self.every.saturating_sub(1) * 1000
    }

    /// Drops history older than [`SLOTS_KEPT`] seconds and keys (and agents' entries)
    /// unreported for [`FORGET_AFTER_MS`].
    pub fn forget(&mut self, now_ms: u64) {
        let oldest = (now_ms / 1000).saturating_sub(SLOTS_KEPT);
        self.keys.retain(|_, k| {
            k.admitted = k.admitted.split_off(&oldest);
            k.calls = k.calls.split_off(&oldest);
            now_ms.saturating_sub(k.last_ms) < FORGET_AFTER_MS
        });
        self.last
            .retain(|_, l| now_ms.saturating_sub(l.at_ms) < FORGET_AFTER_MS);
        let live: std::collections::HashSet<&str> =
            self.last.keys().map(|(a, _)| a.as_str()).collect();
        for k in self.keys.values_mut() {
            k.demand_milli.retain(|a, _| live.contains(a.as_str()));
            k.held.retain(|a, _| live.contains(a.as_str()));
        }
    }

    /// The keys known.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// The statistics of `key` at wall-clock `now_ms`, checked against `bound`; the
    /// worst overshoot seen is updated.
    pub fn stats(&mut self, key: &str, bound: Bound, now_ms: u64) -> Option<KeyStats> {
        let settle_ms = self.settle_ms();
        let k = self.keys.get_mut(key)?;
        // The last settled second.
        let settled = (now_ms.saturating_sub(settle_ms) / 1000).checked_sub(1)?;
        let at = |m: &BTreeMap<u64, u64>, s: u64| m.get(&s).copied().unwrap_or(0);
        let first = k.admitted.keys().next().copied().unwrap_or(settled);
        let mut overshoot: f64 = 0.0;
        for end in first..=settled {
            let mut sum = 0;
            for w in 1..=MAX_WINDOW.min(end - first + 1) {
                sum += at(&k.admitted, end + 1 - w);
                let limit = bound.capacity as f64 + bound.rate_per_sec * w as f64;
                let slack = bound.rate_per_sec * SLACK_SECS;
                overshoot = overshoot.max((sum as f64 - limit - slack) / limit);
            }
        }
        k.worst = k.worst.max(overshoot);
        let slack = bound.rate_per_sec * SLACK_SECS;
        let window = |w: u64| {
            // The settled seconds since the key's first admissions (none yet: 0).
            let secs = w.min((settled + 1).saturating_sub(first));
            let admitted: u64 = (0..secs).map(|i| at(&k.admitted, settled - i)).sum();
            let limit = bound.capacity as f64 + bound.rate_per_sec * secs as f64;
            Window {
                secs,
                admitted,
                bound: limit,
                overshoot: ((admitted as f64 - limit - slack) / limit).max(0.0),
            }
        };
        let calls: u64 = (0..3)
            .map(|i| at(&k.calls, settled.saturating_sub(i)))
            .sum();
        Some(KeyStats {
            key: key.to_owned(),
            agents: k.demand_milli.len(),
            admitted_total: k.total,
            admitted_last_sec: at(&k.admitted, settled),
            calls_per_sec: calls as f64 / 3.0,
            demand_per_sec: k.demand_milli.values().sum::<u64>() as f64 / 1000.0,
            held: k.held.values().sum(),
            overshoot,
            worst_overshoot: k.worst,
            window_1s: window(1),
            window_10s: window(MAX_WINDOW),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_store::report::KeyReport;

    fn report(at_ms: u64, admitted: u64, calls: u64) -> Report {
        let mut r = Report {
            at_ms,
            ..Report::default()
        };
        r.keys.insert(
            "k".into(),
            KeyReport {
                admitted,
                calls,
                demand_milli: 5000,
                held: 3,
            },
        );
        r
    }

    const T: u64 = 1_700_000_000_000;
    const BOUND: Bound = Bound {
        capacity: 100,
        rate_per_sec: 50.0,
    };

    #[test]
    fn sums_agents_per_second_and_sees_an_overshoot() {
        let mut l = Ledger::new();
        // Two agents, reports on the whole seconds (a few ms late), 60 tokens each per
        // second: 120/s against r = 50/s with B = 100.
        for s in 0..6 {
            l.record("a", &report(T + s * 1000 + 3, 60 * s, 2 * s));
            l.record("b", &report(T + s * 1000 + 9, 60 * s, 2 * s));
        }
        let st = l.stats("k", BOUND, T + 6 * 1000 + 600).unwrap();
        assert_eq!(st.admitted_total, 600);
        assert_eq!(st.admitted_last_sec, 120);
        assert_eq!(st.agents, 2);
        assert!((st.calls_per_sec - 4.0).abs() < 1e-9);
        assert!((st.demand_per_sec - 10.0).abs() < 1e-9);
        // Worst window: 5 s, 600 admitted against 100 + 250 (+5 slack): 0.70.
        assert!(
            (st.overshoot - (600.0 - 355.0) / 350.0).abs() < 1e-9,
            "{st:?}"
        );
        // The current windows: the last second (120 against 150) and the five seconds
        // there are (600 against 350).
        assert_eq!(
            (
                st.window_1s.secs,
                st.window_1s.admitted,
                st.window_1s.overshoot
            ),
            (1, 120, 0.0)
        );
        assert_eq!((st.window_10s.secs, st.window_10s.admitted), (5, 600));
        assert_eq!(st.window_10s.bound, 350.0);
        assert!((st.window_10s.overshoot - st.overshoot).abs() < 1e-9);
    }

    #[test]
    fn within_the_bound_is_zero_and_a_missed_report_is_spread() {
        let mut l = Ledger::new();
        l.record("a", &report(T, 0, 0));
        l.record("a", &report(T + 1000, 100, 1));
        // The report of T+2 s was lost: 100 tokens over two seconds.
        l.record("a", &report(T + 3000, 200, 3));
        l.record("a", &report(T + 4000, 250, 4));
        let st = l.stats("k", BOUND, T + 5600).unwrap();
        assert_eq!(st.overshoot, 0.0, "{st:?}");
        assert_eq!(st.admitted_total, 250);
        // A stale report changes nothing.
        l.record("a", &report(T + 4000, 999, 9));
        assert_eq!(l.stats("k", BOUND, T + 5600).unwrap().admitted_total, 250);
        l.forget(T + 5600 + FORGET_AFTER_MS);
        assert!(l.stats("k", BOUND, T + 70_000).is_none());
    }

    #[test]
    fn a_report_every_five_seconds_places_each_seconds_admissions() {
        use leasehold_store::report::Sample;
        let mut l = Ledger::new();
        l.cadence(5);
        l.record("a", &report(T, 0, 0));
        // One report at T+5 s carrying the four seconds before it: 300 tokens in the
        // second from T+2 s, 10 in the others. Spread evenly it would read 68 a second.
        let mut r = report(T + 5000, 340, 5);
        let admitted = [10, 20, 320, 330];
        r.past.insert(
            "k".into(),
            (1..=4)
                .map(|s| Sample {
                    at_ms: T + s * 1000,
                    admitted: admitted[s as usize - 1],
                    calls: s,
                })
                .collect(),
        );
        l.record("a", &r);
        // Not settled until the report covering it is due: five seconds more than at a
        // report a second.
        assert!(l.stats("k", BOUND, T + 5600).unwrap().window_1s.secs == 0);
        let st = l.stats("k", BOUND, T + 5000 + SETTLE_MS + 4000).unwrap();
        assert_eq!(st.admitted_last_sec, 10);
        assert_eq!(st.window_10s.admitted, 340);
        // 300 in one second against B + r = 150: an overshoot spreading would hide.
        assert!(
            (st.overshoot - (300.0 - 155.0) / 150.0).abs() < 1e-9,
            "{st:?}"
        );
        assert_eq!(st.admitted_total, 340);
    }
}
