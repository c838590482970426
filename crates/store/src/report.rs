//! What agents report to the coordinator, and where.
//!
//! Every second, on the whole second of its wall clock, an agent replaces its report
//! with one `SET lh:agent:{ID} ... PX` (atomic, one key): a first line with the report's
//! wall-clock time in ms, then a line per leased bucket it used recently (the parent key
//! of a split bucket; cold keys' exact decisions cannot overshoot), `KEY admitted,calls,demand,held`, running totals. Bucket keys are
//! escaped, so they hold no whitespace. Lines `=health LINE` and `=name NAME` (the
//! agent's health as its probes say it, and its host and process) may follow the
//! first; a coordinator of an earlier version skips them as lines it does not
//! understand. The report expires unless renewed, and the
//! agent's id is scored with its time in the sorted set `lh:agents`, so the coordinator
//! finds live agents without a keyspace scan: its work per tick is one read per live
//! agent and one entry per (agent, key).

use std::collections::HashMap;

use leasehold_core::model::AgentId;

/// The sorted set of agents, scored by their last report (wall-clock ms).
pub const AGENTS_KEY: &str = "lh:agents";

/// In a region's store: the regions' bucket keys agents started using, scored by when
/// (wall-clock ms), so the region's broker feeds a new key at once instead of after the
/// next report. The broker trims it.
pub const WANTED_KEY: &str = "lh:wanted";

/// The coordinators' leader lock: the holder's id, with an expiry (see `lh_lead`).
pub const LEAD_KEY: &str = "lh:coordinator";

/// A report lives this long unless renewed (ms).
pub const REPORT_TTL_MS: u64 = 10_000;

/// The most buckets one report carries (the most recently used first).
pub const MAX_KEYS_PER_REPORT: usize = 4096;

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
        let mut it = text.split(',').map(|v| v.parse::<u64>().ok());
        let r = Self {
            admitted: it.next()??,
            calls: it.next()??,
            demand_milli: it.next()??,
            held: it.next()??,
        };
        it.next().is_none().then_some(r)
    }
}

/// A report as read back: its time (wall-clock ms) and its buckets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// When the agent wrote it.
    pub at_ms: u64,
    /// Bucket key to totals.
    pub keys: HashMap<String, KeyReport>,
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
        for (key, r) in keys {
            text.push('\n');
            text.push_str(key);
            text.push(' ');
            text.push_str(&r.encode());
        }
        text
    }

    /// Parses a stored report, skipping lines it does not understand.
    pub fn parse(text: &str) -> Self {
        let mut lines = text.lines();
        let at_ms = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
        let mut report = Self {
            at_ms,
            ..Self::default()
        };
        for line in lines {
            let Some((key, rest)) = line.split_once(' ') else {
                continue;
            };
            match key {
                "=health" => report.health = Some(rest.to_owned()),
                "=name" => report.name = Some(rest.to_owned()),
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
}
