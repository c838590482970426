//! What one system did in a run, computed as DESIGN.md section 6 defines it.
//!
//! Every decision is recorded per key per millisecond slot (tokens arriving, tokens
//! admitted). Overshoot is the worst, over keys and over sliding windows of W slots, of
//! `(admitted_in_W - (B + r*W')) / (B + r*W')` floored at 0, where `W' = W + 1 ms`
//! because W slots of one millisecond span at most W + 1 ms. Utilisation is admitted
//! tokens over the admissions of one ideal token bucket (same B, r, starting full)
//! replaying the merged arrival trace of each key. Denials below the limit are what that
//! ideal bucket admitted in a slot beyond what the system admitted in it, summed over
//! slots and keys (tokens), in the seconds in which the key was offered no more than its
//! rate: 0 means no request was refused, while the key was within its limit, that one
//! bucket would have let through. (Over the limit the same difference counts which
//! requests were admitted, a millisecond earlier or later, rather than how many: an
//! overloaded key would show hundreds of thousands of such "denials" while admitting
//! exactly what the ideal bucket does. Utilisation measures that case.)

use std::collections::HashMap;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Slots a thread records before it first sums them (16 bytes each).
const COMPACT_AT: usize = 1 << 18;

/// One thread's record of a run.
#[derive(Clone)]
pub(crate) struct Recording {
    /// (`key << 32 | ms`, tokens arriving, tokens admitted), in the order recorded; a
    /// slot may appear more than once until [`Recording::compact`] sums them. A push per
    /// decision costs the workload far less than a hash map of a million keys would.
    slots: Vec<(u64, u32, u32)>,
    /// Length at which `add` compacts `slots` next.
    compact_at: usize,
    pub(crate) latency: Histogram<u64>,
    pub(crate) decisions: u64,
    pub(crate) admitted: u64,
    pub(crate) denied: u64,
    pub(crate) unavailable: u64,
}

impl Recording {
    pub(crate) fn new() -> Self {
        Self {
            slots: Vec::new(),
            compact_at: COMPACT_AT,
            // 1 ns .. 60 s, 3 significant digits.
            latency: Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap_or_else(|_| {
                // The bounds above are valid constants; new_with_bounds only fails on bad ones.
                Histogram::new(3).unwrap_or_else(|_| unreachable!("3 significant digits is valid"))
            }),
            decisions: 0,
            admitted: 0,
            denied: 0,
            unavailable: 0,
        }
    }

    #[inline]
    pub(crate) fn add(&mut self, key: u32, ms: u64, cost: u64, admitted: bool) {
        let slot = (u64::from(key) << 32) | ms.min(u64::from(u32::MAX));
        let taken = if admitted { cost as u32 } else { 0 };
        match self.slots.last_mut() {
            Some(last) if last.0 == slot => {
                last.1 += cost as u32;
                last.2 += taken;
            }
            _ => {
                self.slots.push((slot, cost as u32, taken));
                if self.slots.len() >= self.compact_at {
                    self.compact();
                    self.compact_at = (self.slots.len() * 2).max(COMPACT_AT);
                }
            }
        }
    }

    /// Sorts the slots and sums the entries of each.
    fn compact(&mut self) {
        self.slots.sort_unstable_by_key(|s| s.0);
        self.slots.dedup_by(|next, kept| {
            let same = next.0 == kept.0;
            if same {
                kept.1 += next.1;
                kept.2 += next.2;
            }
            same
        });
    }

    pub(crate) fn merge(&mut self, other: Recording) {
        self.slots.extend(other.slots);
        let _ = self.latency.add(&other.latency);
        self.decisions += other.decisions;
        self.admitted += other.admitted;
        self.denied += other.denied;
        self.unavailable += other.unavailable;
    }
}

/// Latency percentiles, ns.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Latency {
    pub(crate) p50: u64,
    pub(crate) p95: u64,
    pub(crate) p99: u64,
    pub(crate) p999: u64,
    pub(crate) max: u64,
}

/// One system's figures.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct SystemReport {
    pub(crate) decisions: u64,
    pub(crate) decisions_per_sec: f64,
    pub(crate) admitted: u64,
    pub(crate) denied: u64,
    pub(crate) unavailable: u64,
    pub(crate) redis_calls: u64,
    pub(crate) redis_calls_per_1k_decisions: f64,
    pub(crate) overshoot_1s: f64,
    pub(crate) overshoot_10s: f64,
    pub(crate) utilization: f64,
    /// Tokens the ideal bucket admitted that this system denied, in the seconds in which
    /// their key was offered at most its rate.
    pub(crate) denied_below_limit: u64,
    /// Seconds (of each key, summed) in which the key was offered at most its rate: none,
    /// and `denied_below_limit` says nothing (the table shows "-").
    pub(crate) seconds_within_limit: u64,
    pub(crate) latency_ns: Latency,
    /// This process's resident memory at the end of the system's run, MB (the systems run
    /// one after another in one process), and how much it grew during the run.
    pub(crate) rss_mb: f64,
    pub(crate) rss_growth_mb: f64,
    /// The memory the store's Redis used at the end of the run (single Redis only).
    pub(crate) store_mb: Option<f64>,
    /// The CPU the store's Redis processes spent over the measured window (after the
    /// warm-up), µs per decision (none for a system that made no store calls), and in all,
    /// s (Target::usage_us; none for the embedded store).
    pub(crate) store_cpu_us_per_decision: Option<f64>,
    pub(crate) store_cpu_s: Option<f64>,
    /// Of the store's time over the measured window, what its script calls took (INFO
    /// commandstats), s: the decisions' own cost, without the connections' and reports'.
    pub(crate) store_scripts_s: Option<f64>,
    /// Tokens admitted per second for key 0, per 100 ms (the plot's line; in the JSON report
    /// as `series`).
    pub(crate) series: Vec<f64>,
}

/// Computes the figures of a merged recording.
/// `rec` covers `from_ms` (the warm-up) and then `duration_ms`: the figures are of the
/// latter, the ideal bucket's level and the overshoot of both.
pub(crate) fn analyze(
    rec: Recording,
    capacity: f64,
    rate_per_sec: f64,
    from_ms: u64,
    duration_ms: u64,
    redis_calls: u64,
) -> SystemReport {
    let mut by_key: HashMap<u32, Vec<(u32, u32, u32)>, foldhash::fast::RandomState> =
        HashMap::default();
    let mut rec = rec;
    rec.compact();
    for &(k, arrived, admitted) in &rec.slots {
        by_key.entry((k >> 32) as u32).or_default().push((
            (k & 0xffff_ffff) as u32,
            arrived,
            admitted,
        ));
    }
    let (mut over_1s, mut over_10s, mut ideal, mut admitted_tokens) = (0f64, 0f64, 0f64, 0f64);
    let (mut below, mut within) = (0f64, 0u64);
    // Whole 100 ms buckets only: a partial last one would read as a drop.
    let mut series = vec![0f64; ((from_ms + duration_ms) / 100) as usize];
    for (key, slots) in &mut by_key {
        slots.sort_unstable();
        over_1s = over_1s.max(overshoot(slots, capacity, rate_per_sec, 1000));
        over_10s = over_10s.max(overshoot(slots, capacity, rate_per_sec, 10_000));
        let (i, b, w) = ideal_admissions(
            slots,
            capacity,
            rate_per_sec,
            from_ms,
            from_ms + duration_ms,
        );
        ideal += i;
        below += b;
        within += w;
        admitted_tokens += (slots.iter())
            .filter(|s| u64::from(s.0) >= from_ms)
            .map(|s| f64::from(s.2))
            .sum::<f64>();
        if *key == 0 {
            for &(ms, _, adm) in slots.iter() {
                if let Some(b) = series.get_mut(ms as usize / 100) {
                    *b += f64::from(adm) * 10.0;
                }
            }
        }
    }
    let secs = duration_ms as f64 / 1000.0;
    let h = &rec.latency;
    SystemReport {
        decisions: rec.decisions,
        decisions_per_sec: rec.decisions as f64 / secs,
        admitted: rec.admitted,
        denied: rec.denied,
        unavailable: rec.unavailable,
        redis_calls,
        redis_calls_per_1k_decisions: if rec.decisions == 0 {
            0.0
        } else {
            redis_calls as f64 * 1000.0 / rec.decisions as f64
        },
        overshoot_1s: over_1s,
        overshoot_10s: over_10s,
        utilization: if ideal == 0.0 {
            1.0
        } else {
            admitted_tokens / ideal
        },
        denied_below_limit: below as u64,
        seconds_within_limit: within,
        rss_mb: 0.0,
        rss_growth_mb: 0.0,
        store_mb: None,
        store_cpu_us_per_decision: None,
        store_cpu_s: None,
        store_scripts_s: None,
        latency_ns: Latency {
            p50: h.value_at_quantile(0.5),
            p95: h.value_at_quantile(0.95),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        },
        series,
    }
}

/// The worst `(admitted - bound) / bound` over windows of `w` slots, floored at 0.
/// `slots` is sorted by ms: (ms, arrived, admitted).
fn overshoot(slots: &[(u32, u32, u32)], capacity: f64, rate: f64, w: u32) -> f64 {
    let bound = capacity + rate * f64::from(w + 1) / 1000.0;
    let (mut lo, mut sum, mut worst) = (0usize, 0f64, 0f64);
    for hi in 0..slots.len() {
        sum += f64::from(slots[hi].2);
        while slots[lo].0 + w <= slots[hi].0 {
            sum -= f64::from(slots[lo].2);
            lo += 1;
        }
        worst = worst.max((sum - bound) / bound);
    }
    worst
}

/// Tokens one ideal bucket (full at the start) admits for this arrival trace, and the
/// tokens it admitted in a slot beyond what the system admitted there.
fn ideal_admissions(
    slots: &[(u32, u32, u32)],
    capacity: f64,
    rate: f64,
    from_ms: u64,
    to_ms: u64,
) -> (f64, f64, u64) {
    // Tokens offered per second of the run.
    let mut offered: HashMap<u32, f64, foldhash::fast::RandomState> = HashMap::default();
    for &(ms, arrived, _) in slots {
        *offered.entry(ms / 1000).or_default() += f64::from(arrived);
    }
    // Whole seconds of the measured window only: a second cut short (the run's last, a
    // warm-up ending mid-second) would read as offered under the rate.
    let whole = |sec: u32| u64::from(sec) * 1000 >= from_ms && u64::from(sec + 1) * 1000 <= to_ms;
    let within =
        |ms: u32| whole(ms / 1000) && offered.get(&(ms / 1000)).is_some_and(|&o| o <= rate);
    let (mut tokens, mut last, mut admitted, mut below) = (capacity, 0u32, 0f64, 0f64);
    for &(ms, arrived, ours) in slots {
        tokens = (tokens + rate * f64::from(ms - last) / 1000.0).min(capacity);
        last = ms;
        let take = f64::from(arrived).min(tokens.floor());
        tokens -= take;
        if u64::from(ms) >= from_ms {
            admitted += take;
            if within(ms) {
                below += (take - f64::from(ours)).max(0.0);
            }
        }
    }
    let seconds = (offered.iter())
        .filter(|&(&sec, &o)| whole(sec) && o <= rate)
        .count() as u64;
    (admitted, below, seconds)
}

/// An SVG line chart of admitted tokens per second for key 0, one line per system,
/// with the rule's rate.
pub(crate) fn svg(title: &str, rate: f64, systems: &[(String, Vec<f64>)]) -> String {
    let (w, h, pad) = (900.0, 360.0, 50.0);
    // The opening burst (up to B in the first 100 ms) would flatten everything else:
    // the axis stops at twice the rate and higher points are drawn at the top.
    let ymax = rate * 2.0;
    let n = systems
        .iter()
        .map(|(_, s)| s.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let x = |i: usize| pad + (w - 2.0 * pad) * i as f64 / (n - 1) as f64;
    let y = |v: f64| h - pad - (h - 2.0 * pad) * v.min(ymax) / ymax;
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"20\" font-size=\"14\">{title}</text>\n\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{pad}\" y=\"{t}\">0 s</text><text x=\"{r2}\" y=\"{t}\">{secs:.1} s</text>\n\
         <text x=\"5\" y=\"{pad}\">{ymax:.0}/s (clipped)</text>\n\
         <line x1=\"{pad}\" y1=\"{ly}\" x2=\"{r}\" y2=\"{ly}\" stroke=\"gray\" stroke-dasharray=\"6 4\"/>\n\
         <text x=\"{r3}\" y=\"{ly2}\" fill=\"gray\">limit r = {rate:.0}/s</text>\n",
        b = h - pad,
        r = w - pad,
        r2 = w - pad - 30.0,
        r3 = w - pad - 140.0,
        t = h - pad + 18.0,
        secs = (n - 1) as f64 / 10.0,
        ly = y(rate),
        ly2 = y(rate) - 5.0,
        title = super::html::escape(title),
    );
    for (i, (name, series)) in systems.iter().enumerate() {
        let c = colors[i % colors.len()];
        let points: Vec<String> = series
            .iter()
            .enumerate()
            .map(|(j, v)| format!("{:.1},{:.1}", x(j), y(*v)))
            .collect();
        out.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>\n",
            points.join(" "),
            pad + 10.0 + 140.0 * i as f64,
            pad - 10.0,
            super::html::escape(name)
        ));
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overshoot_is_zero_within_the_bound_and_measured_beyond_it() {
        // B = 10, r = 1000/s: a 1000-slot window may hold 10 + 1001 = 1011.
        let within: Vec<_> = (0..1000)
            .map(|ms| (ms, 1, 1))
            .chain([(1000, 11, 11)])
            .collect();
        assert_eq!(overshoot(&within, 10.0, 1000.0, 1000), 0.0);
        let beyond: Vec<_> = (0..1000).map(|ms| (ms, 2, 2)).collect();
        let o = overshoot(&beyond, 10.0, 1000.0, 1000);
        assert!((o - (2000.0 - 1011.0) / 1011.0).abs() < 1e-9, "{o}");
    }

    #[test]
    fn the_ideal_bucket_admits_its_burst_then_its_rate() {
        // 100 tokens arrive every ms for 1 s against B = 50, r = 1000/s.
        let slots: Vec<_> = (0..1000).map(|ms| (ms, 100, 0)).collect();
        let (ideal, below, within) = ideal_admissions(&slots, 50.0, 1000.0, 0, 1000);
        assert!((ideal - (50.0 + 999.0)).abs() < 1.0, "{ideal}");
        // Offered 100x its rate: nothing is counted below the limit, and no second was
        // within it.
        assert_eq!((below, within), (0.0, 0));
        // Offered its rate and admitted nothing: everything the ideal admitted was denied
        // below the limit.
        let refused: Vec<_> = (0..1000).map(|ms| (ms, 1, 0)).collect();
        assert_eq!(
            ideal_admissions(&refused, 50.0, 1000.0, 0, 1000),
            (1000.0, 1000.0, 1)
        );
        // A second cut short by the end of the run is not one within the limit.
        let cut: Vec<_> = (0..1003).map(|ms| (ms, 100, 0)).collect();
        assert_eq!(ideal_admissions(&cut, 50.0, 1000.0, 0, 1003).2, 0);
        // A system that admits what arrives, under the limit, denies nothing below it.
        let under: Vec<_> = (0..1000).map(|ms| (ms, 1, 1)).collect();
        assert_eq!(
            ideal_admissions(&under, 50.0, 1000.0, 0, 1000),
            (1000.0, 0.0, 1)
        );
    }
}
