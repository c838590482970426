//! What agents report to the coordinator, and where.
//!
//! On the whole seconds of its wall clock, an agent replaces its report with one
//! `SET lh:agent:{ID} ... PX` (atomic, one key): a first line with the report's
//! wall-clock time in ms, then a line per leased bucket it used recently (the parent key
//! of a split bucket; cold keys' exact decisions cannot overshoot), `KEY admitted,calls,demand,held`, running totals. Bucket keys are
//! escaped, so they hold no whitespace. Lines `=health LINE` and `=name NAME` (the
//! agent's health as its probes say it, and its host and process) may follow the
//! first; a coordinator of an earlier version skips them as lines it does not
//! understand. The report expires unless renewed, and the
//! agent's id is scored with its time in the sorted set `lh:agents`, so the coordinator
//! finds live agents without a keyspace scan: its work per tick is one read per live
//! agent and one entry per (agent, key).
//!
//! **Cadence.** Each report is a network event for Redis, and a thousand agents writing
//! once a second cost a Redis as much as a tenth of a naive per-request script's whole
//! load (a network event costs this Redis about as much as a rate lease's Lua). So an
//! agent writes every [`every_secs`] seconds, one to ten as the fleet grows
//! (the size of `lh:agents`, read in the same round trip), on the seconds
//! [`writes_at`] spreads across the fleet; it still samples its totals every whole
//! second, and a report carries the samples since the last one as `=past KEY
//! AT:ADMITTED:CALLS ...` lines, so the coordinator places every admission in its second
//! whatever the cadence. `=every N` says the cadence: the coordinator settles a second
//! only once every agent's report covering it is due. (A coordinator of an earlier
//! version skips both lines and spreads admissions over the interval.)

use std::collections::{BTreeMap, HashMap};

use leasehold_core::model::AgentId;

/// The sorted set of agents, scored by their last report (wall-clock ms).
pub const AGENTS_KEY: &str = "lh:agents";

/// In a region's store: the regions' bucket keys agents started using, scored by when
/// (wall-clock ms), so the region's broker feeds a new key at once instead of after the
/// next report. The broker trims it.
pub const WANTED_KEY: &str = "lh:wanted";

/// The coordinators' leader lock: the holder's id, with an expiry (see `lh_lead`).
pub const LEAD_KEY: &str = "lh:coordinator";

/// A report lives this long unless renewed (ms): two reports at the slowest cadence.
pub const REPORT_TTL_MS: u64 = 2 * MAX_EVERY_SECS * 1000;

/// The most buckets one report carries (the most recently used first).
pub const MAX_KEYS_PER_REPORT: usize = 4096;

/// The longest interval between an agent's reports, seconds: two reports in a
/// report's life ([`REPORT_TTL_MS`]).
pub const MAX_EVERY_SECS: u64 = 10;

/// Agents the fleet's reports are sized for per second: a fleet up to this size
/// reports every second, a larger one at most about this many reports a second (a
/// thousand agents every 10 s; their reports then cost Redis about as much as the
/// renewals of their rate leases).
pub const REPORTS_PER_SEC: u64 = 100;

/// Seconds between an agent's reports in a fleet of `agents` (see the module's note).
pub fn every_secs(agents: u64) -> u64 {
    agents.div_ceil(REPORTS_PER_SEC).clamp(1, MAX_EVERY_SECS)
}

/// Whether `agent` writes its report on the whole second of `at_ms` (taken within half
/// a second of it) at a cadence of `every` seconds: the fleet's writes spread evenly
/// over the seconds.
pub fn writes_at(at_ms: u64, agent: AgentId, every: u64) -> bool {
    let second = (at_ms + 500) / 1000;
    every <= 1 || (second + agent.0 % every).is_multiple_of(every)
}

/// The report key of `agent`.
pub fn report_key(agent: AgentId) -> String {
    format!("lh:agent:{{{agent}}}")
}

/// One bucket in a report: running totals since the agent started, and its demand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyReport {
    /// Tokens admitted against the bucket (spent from leases, or by exact calls).
    pub admitted: u64,
    /// Store calls made for the bucket (acquire and exact, to it or its parts).
    pub calls: u64,
    /// Offered demand, thousandths of a token per second (averaged over about a second).
    pub demand_milli: u64,
    /// Tokens leased and unspent now.
    pub held: u64,
}

impl KeyReport {
    /// `admitted,calls,demand,held`.
    pub fn encode(&self) -> String {
        format!(
            "{},{},{},{}",
            self.admitted, self.calls, self.demand_milli, self.held
        )
    }

    /// The inverse of [`KeyReport::encode`]; `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        let [admitted, calls, demand_milli, held] = numbers(text, ',')?;
        Some(Self {
            admitted,
            calls,
            demand_milli,
            held,
        })
    }
}

/// Exactly `N` decimal numbers separated by `sep`; `None` for anything else.
fn numbers<const N: usize>(text: &str, sep: char) -> Option<[u64; N]> {
    let mut it = text.split(sep);
    let mut out = [0; N];
    for n in &mut out {
        *n = it.next()?.parse().ok()?;
    }
    it.next().is_none().then_some(out)
}

/// A bucket's running totals at a whole second between two written reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// When the agent took it (wall-clock ms).
    pub at_ms: u64,
    /// [`KeyReport::admitted`] then.
    pub admitted: u64,
    /// [`KeyReport::calls`] then.
    pub calls: u64,
}

/// An agent's samples since its last written report, per bucket, oldest first.
pub type Past = BTreeMap<String, Vec<Sample>>;

/// The most samples a bucket keeps while writes fail.
const MAX_SAMPLES: usize = 2 * MAX_EVERY_SECS as usize;

/// What an agent keeps between the reports it writes.
#[derive(Debug, Default)]
pub struct Log {
    past: Past,
}

impl Log {
    /// Keeps the totals of the whole second of `at_ms`, for the next report.
    pub fn keep<'a>(&mut self, at_ms: u64, keys: impl IntoIterator<Item = (&'a str, KeyReport)>) {
        for (key, r) in keys {
            let sample = Sample {
                at_ms,
                admitted: r.admitted,
                calls: r.calls,
            };
            let v = self.past.entry(key.to_owned()).or_default();
            v.push(sample);
            if v.len() > MAX_SAMPLES {
                v.remove(0);
            }
        }
    }

    /// The samples kept, for the report being written.
    pub fn take(&mut self) -> Past {
        std::mem::take(&mut self.past)
    }

    /// A report that could not be written: its samples go into the next one.
    pub fn restore(&mut self, past: Past) {
        for (key, mut older) in past {
            let v = self.past.entry(key).or_default();
            older.append(v);
            let cut = older.len().saturating_sub(MAX_SAMPLES);
            older.drain(..cut);
            *v = older;
        }
    }
}

/// A report as read back: its time (wall-clock ms) and its buckets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// When the agent wrote it.
    pub at_ms: u64,
    /// Bucket key to totals.
    pub keys: HashMap<String, KeyReport>,
    /// The whole seconds since the previous report, per bucket (see the module's note).
    pub past: Past,
    /// Seconds until the agent's next report (1 when it did not say).
    pub every: u64,
    /// The agent's health line (`ready`, `degraded: REASON`), when it said.
    pub health: Option<String>,
    /// The agent's host and process, when it said.
    pub name: Option<String>,
}

/// What an agent says of itself in its report.
#[derive(Clone, Copy, Debug, Default)]
pub struct AgentLines<'a> {
    /// Its health line.
    pub health: Option<&'a str>,
    /// Its host and process.
    pub name: Option<&'a str>,
    /// Its cadence, seconds (0 or 1: every second, not said).
    pub every: u64,
    /// Its samples since the last report.
    pub past: Option<&'a Past>,
}

/// One line of free text: no line breaks, at most 200 bytes (cut on a character).
fn one_line(text: &str) -> String {
    let mut s: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if s.len() > 200 {
        let mut end = 200;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

impl Report {
    /// The stored text.
    pub fn encode<'a>(at_ms: u64, keys: impl IntoIterator<Item = (&'a str, KeyReport)>) -> String {
        Self::encode_with(at_ms, AgentLines::default(), keys)
    }

    /// The stored text, with what the agent says of itself.
    pub fn encode_with<'a>(
        at_ms: u64,
        agent: AgentLines<'_>,
        keys: impl IntoIterator<Item = (&'a str, KeyReport)>,
    ) -> String {
        let mut text = at_ms.to_string();
        for (tag, value) in [("=health ", agent.health), ("=name ", agent.name)] {
            if let Some(v) = value {
                text.push('\n');
                text.push_str(tag);
                text.push_str(&one_line(v));
            }
        }
        if agent.every > 1 {
            text.push_str(&format!("\n=every {}", agent.every));
        }
        for (key, r) in keys {
            text.push('\n');
            text.push_str(key);
            text.push(' ');
            text.push_str(&r.encode());
        }
        for (key, samples) in agent.past.into_iter().flatten() {
            text.push_str("\n=past ");
            text.push_str(key);
            for s in samples.iter().filter(|s| s.at_ms < at_ms) {
                text.push_str(&format!(" {}:{}:{}", s.at_ms, s.admitted, s.calls));
            }
        }
        text
    }

    /// Parses a stored report, skipping lines it does not understand.
    pub fn parse(text: &str) -> Self {
        let mut lines = text.lines();
        let at_ms = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
        let mut report = Self {
            at_ms,
            every: 1,
            ..Self::default()
        };
        for line in lines {
            let Some((key, rest)) = line.split_once(' ') else {
                continue;
            };
            match key {
                "=health" => report.health = Some(rest.to_owned()),
                "=name" => report.name = Some(rest.to_owned()),
                "=every" => {
                    if let Ok(n) = rest.parse::<u64>() {
                        report.every = n.clamp(1, MAX_EVERY_SECS);
                    }
                }
                "=past" => {
                    let mut it = rest.split(' ');
                    let Some(key) = it.next() else { continue };
                    let samples: Option<Vec<Sample>> = it
                        .map(|t| {
                            let [at_ms, admitted, calls] = numbers(t, ':')?;
                            Some(Sample {
                                at_ms,
                                admitted,
                                calls,
                            })
                        })
                        .collect();
                    if let Some(mut samples) = samples {
                        samples.retain(|s| s.at_ms < at_ms);
                        samples.sort_by_key(|s| s.at_ms);
                        report.past.insert(key.to_owned(), samples);
                    }
                }
                _ => {
                    if let Some(totals) = KeyReport::parse(rest) {
                        report.keys.insert(key.to_owned(), totals);
                    }
                }
            }
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_refuse_garbage() {
        let r = KeyReport {
            admitted: 10,
            calls: 2,
            demand_milli: 3000,
            held: 4,
        };
        assert_eq!(KeyReport::parse(&r.encode()), Some(r));
        assert_eq!(KeyReport::parse("1,2,3"), None);
        assert_eq!(KeyReport::parse("1,2,3,4,5"), None);
        assert_eq!(KeyReport::parse("1,x,3,4"), None);
        assert_eq!(report_key(AgentId(255)), "lh:agent:{00000000000000ff}");
        let text = Report::encode(7, [("lh:{a|b}", r), ("lh:{a|c}", r)]);
        let back = Report::parse(&format!("{text}\ngarbage"));
        assert_eq!(back.at_ms, 7);
        assert_eq!(back.keys.len(), 2);
        assert_eq!(back.keys["lh:{a|c}"], r);
        assert_eq!((back.health, back.name), (None, None));
        let lines = AgentLines {
            health: Some("degraded: store unreachable\n(breaker open: a)"),
            name: Some("gw-1/42"),
            ..Default::default()
        };
        let text = Report::encode_with(7, lines, [("lh:{a|b}", r)]);
        let back = Report::parse(&text);
        assert_eq!(back.keys.len(), 1);
        assert_eq!(
            back.health.as_deref(),
            Some("degraded: store unreachable (breaker open: a)")
        );
        assert_eq!(back.name.as_deref(), Some("gw-1/42"));
        // What a coordinator of the previous version read: the agent lines skipped.
        let old: HashMap<_, _> = text
            .lines()
            .skip(1)
            .filter_map(|l| {
                let (k, t) = l.split_once(' ')?;
                Some((k, KeyReport::parse(t)?))
            })
            .collect();
        assert_eq!(old.len(), 1);
    }

    #[test]
    fn a_slower_cadence_carries_every_second_and_an_older_reader_skips_it() {
        assert_eq!(
            [1, 100, 101, 500, 1000, 5000].map(every_secs),
            [1, 1, 2, 5, 10, 10],
            "every second up to 100 agents, then about 100 reports a second, at most 10 s"
        );
        // Every agent writes once every `every` seconds, the fleet's writes spread evenly.
        for every in 1..=MAX_EVERY_SECS {
            for agent in 0..20u64 {
                let writes = (0..4 * every)
                    .filter(|s| writes_at(s * 1000 + 3, AgentId(agent), every))
                    .count();
                assert_eq!(writes, 4);
            }
            let on_second_0 = (0..60u64)
                .filter(|&a| writes_at(2, AgentId(a), every))
                .count();
            assert_eq!(on_second_0, 60usize.div_ceil(every as usize));
        }
        let r = |admitted, calls| KeyReport {
            admitted,
            calls,
            demand_milli: 1,
            held: 0,
        };
        let mut log = Log::default();
        log.keep(1_000, [("lh:{a|b}", r(10, 1))]);
        log.keep(2_000, [("lh:{a|b}", r(25, 2)), ("lh:{a|c}", r(4, 1))]);
        let past = log.take();
        assert!(log.take().is_empty());
        let lines = AgentLines {
            every: 3,
            past: Some(&past),
            ..Default::default()
        };
        let text = Report::encode_with(3_000, lines, [("lh:{a|b}", r(40, 3))]);
        let back = Report::parse(&text);
        assert_eq!(back.every, 3);
        assert_eq!(back.keys["lh:{a|b}"], r(40, 3));
        let sample = |at_ms, admitted, calls| Sample {
            at_ms,
            admitted,
            calls,
        };
        assert_eq!(
            back.past["lh:{a|b}"],
            [sample(1_000, 10, 1), sample(2_000, 25, 2)]
        );
        assert_eq!(back.past["lh:{a|c}"], [sample(2_000, 4, 1)]);
        // An older coordinator reads the totals now and nothing else.
        let old: Vec<_> = text
            .lines()
            .skip(1)
            .filter_map(|l| KeyReport::parse(l.split_once(' ')?.1))
            .collect();
        assert_eq!(old, [r(40, 3)]);
        // A failed write: its samples go into the next, oldest first, at most ten.
        log.keep(4_000, [("lh:{a|b}", r(50, 4))]);
        log.restore(past);
        let v = &log.take()["lh:{a|b}"];
        assert_eq!(
            v.iter().map(|s| s.at_ms).collect::<Vec<_>>(),
            [1_000, 2_000, 4_000]
        );
        for at in 0..30 {
            log.keep(at * 1000, [("k", r(at, at))]);
        }
        assert_eq!(log.take()["k"].len(), 2 * MAX_EVERY_SECS as usize);
        // Garbage in a sample drops the line, not the report.
        let back = Report::parse("5000\n=past k 1000:1 2000:2:2\nk 1,1,1,1\n=every x");
        assert!(back.past.is_empty() && back.keys.len() == 1 && back.every == 1);
    }
}
