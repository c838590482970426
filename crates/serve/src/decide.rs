//! One `ShouldRateLimit` call, independent of gRPC: match every descriptor to its limit,
//! drop replaced limits, and check the rest together, all or nothing.

use std::time::Duration;

use leasehold_agent::{CheckError, Decision, Limiter};

use crate::config::{Action, Domains, Limit, Unit};

/// The answer for one descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// Over the limit (not in shadow mode).
    pub over_limit: bool,
    /// The limit applied, if any: requests per unit, unit, name.
    pub limit: Option<(u32, Unit, Option<String>)>,
    /// What is left: `u32::MAX` for an unlimited descriptor; 0 where no limit applies
    /// (none matched, replaced), where a shadow limit is over, and for limits not checked
    /// because another refused the request, as envoyproxy/ratelimit reports them.
    pub remaining: u32,
    /// When the tokens asked for exist again (over the limit), or when the bucket is
    /// full again (OK).
    pub reset: Option<Duration>,
}

/// The answer for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Some descriptor is over its limit.
    pub over_limit: bool,
    /// Some descriptor could not be decided: the store is unreachable and its rule
    /// fails closed (it counts as over the limit).
    pub unavailable: bool,
    /// Per descriptor, in the request's order.
    pub statuses: Vec<Status>,
    /// Headers for Envoy to add to the response: `retry-after` when over the limit,
    /// `ratelimit-policy` and `ratelimit` for the tightest limit.
    pub headers: Vec<(&'static str, String)>,
}

/// Why a request could not be decided.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecideError {
    /// No such domain in the configuration.
    #[error("unknown domain {0:?}")]
    UnknownDomain(String),
    /// The request has no descriptor, or an empty one.
    #[error("{0}")]
    Invalid(String),
    /// The limiter refused a check (a cost above a capacity, say).
    #[error(transparent)]
    Check(#[from] CheckError),
}

/// One descriptor of a request: its entries and what it costs.
#[derive(Clone, Debug)]
pub struct Descriptor<'a> {
    /// `(key, value)` entries, in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// Tokens (the descriptor's `hits_addend`, else the request's, else 1).
    pub hits: u64,
}

/// Decides a request of `domain` with `descriptors`.
pub async fn decide(
    limiter: &Limiter,
    domains: &Domains,
    domain: &str,
    descriptors: &[Descriptor<'_>],
) -> Result<Verdict, DecideError> {
    if domain.is_empty() {
        return Err(DecideError::Invalid("domain must not be empty".into()));
    }
    if descriptors.is_empty() {
        return Err(DecideError::Invalid(
            "descriptor list must not be empty".into(),
        ));
    }
    if !domains.has_domain(domain) {
        return Err(DecideError::UnknownDomain(
            domain.chars().take(80).collect(),
        ));
    }
    let matched: Vec<_> = descriptors
        .iter()
        .map(|d| domains.find(domain, &d.entries))
        .collect();
    let replaced: Vec<&str> = matched
        .iter()
        .flatten()
        .flat_map(|m| m.limit.replaces.iter().map(String::as_str))
        .collect();
    let applies = |l: &Limit| l.name.as_deref().is_none_or(|n| !replaced.contains(&n));
    let mut statuses: Vec<Status> = matched
        .iter()
        .map(|m| Status {
            over_limit: false,
            limit: m
                .as_ref()
                .filter(|m| applies(m.limit) && m.limit.action != Action::Unlimited)
                .and_then(|m| {
                    Some((
                        m.limit.requests_per_unit,
                        m.limit.unit?,
                        m.limit.name.clone(),
                    ))
                }),
            // As ratelimit: u32::MAX for an unlimited descriptor, else 0 until checked.
            remaining: match m {
                Some(m) if applies(m.limit) && m.limit.action == Action::Unlimited => u32::MAX,
                _ => 0,
            },
            reset: None,
        })
        .collect();
    // The descriptors to check in the store, with their index.
    let mut checks: Vec<(usize, &str, &[u8], u64)> = Vec::new();
    for (i, m) in matched.iter().enumerate() {
        let Some(m) = m else { continue };
        if !applies(m.limit) {
            continue;
        }
        metrics::counter!("leasehold_serve_hits_total", "domain" => domain.to_owned(), "key" => metric_key(domain, &m.metric_key))
            .increment(1);
        // Over the limit without asking the store (with the reset to report, if any).
        let refused = match &m.limit.action {
            Action::Unlimited => None,
            Action::DenyAll => Some(None),
            Action::Rule(rule) => {
                let hits = descriptors[i].hits;
                match limiter.bucket_params_for(rule, m.subject.as_bytes()) {
                    // More hits than the bucket can ever hold: over the limit, as in
                    // ratelimit (an error would let Envoy, failing open by default, pass
                    // the request). Retry-After: a whole refill, the longest any wait is.
                    Ok(p) if hits > p.capacity => Some(Some(refill_time(p.capacity, p.rate))),
                    _ => {
                        checks.push((i, rule.as_str(), m.subject.as_bytes(), hits));
                        None
                    }
                }
            }
        };
        if let Some(reset) = refused {
            if m.limit.shadow {
                metrics::counter!("leasehold_serve_shadow_total", "domain" => domain.to_owned())
                    .increment(1);
            } else {
                statuses[i].over_limit = true;
                statuses[i].remaining = 0;
                statuses[i].reset = reset;
            }
        }
    }
    let denied_already = statuses.iter().any(|s| s.over_limit);
    let mut unavailable = false;
    if !checks.is_empty() && !denied_already {
        let list: Vec<(&[u8], &str, u64)> = checks.iter().map(|c| (c.2, c.1, c.3)).collect();
        let mut each = Default::default();
        limiter.check_all_each(&list, &mut each).await?;
        for (k, d) in each.iter().enumerate() {
            let (i, rule, subject, _) = checks[k];
            let s = &mut statuses[i];
            match *d {
                Decision::Allowed { remaining, .. } => {
                    s.remaining = remaining.min(u64::from(u32::MAX)) as u32;
                    s.reset = limiter
                        .bucket_params_for(rule, subject)
                        .ok()
                        .map(|p| refill_time(p.capacity.saturating_sub(remaining), p.rate));
                }
                Decision::Denied { retry_after } | Decision::Unavailable { retry_after } => {
                    unavailable |= matches!(d, Decision::Unavailable { .. });
                    s.over_limit = true;
                    s.remaining = 0;
                    s.reset = Some(retry_after);
                }
            }
        }
    }
    let over_limit = statuses.iter().any(|s| s.over_limit);
    let mut headers = Vec::new();
    // The tightest limit: the refused one, else the one with the least left.
    let tightest = statuses
        .iter()
        .filter(|s| s.limit.is_some())
        .min_by_key(|s| (!s.over_limit, s.remaining));
    if let Some(s) = tightest
        && let Some((rpu, unit, name)) = &s.limit
    {
        let label = name.as_deref().unwrap_or(domain);
        let reset = s.reset.map_or(0, |d| {
            leasehold_core::retry_after_secs(d.as_micros().min(u128::from(u64::MAX)) as u64)
        });
        headers.push((
            "ratelimit-policy",
            format!("\"{label}\";q={rpu};w={}", unit.seconds()),
        ));
        headers.push((
            "ratelimit",
            format!("\"{label}\";r={};t={reset}", s.remaining),
        ));
        if s.over_limit {
            headers.push(("retry-after", reset.max(1).to_string()));
        }
    }
    Ok(Verdict {
        over_limit,
        unavailable,
        statuses,
        headers,
    })
}

/// Distinct `key` labels `leasehold_serve_hits_total` takes; past them, hits count under
/// `key="_overflow"`. A descriptor with `detailed_metric` or `value_to_metric` names its
/// runtime value in the key, and every series a Prometheus recorder has seen stays in
/// memory and in every scrape: without a bound, a flood of distinct values grew the
/// process by about 2 KB per value.
pub const MAX_METRIC_KEYS: usize = 10_000;

/// The label for `key` of `domain`: itself while fewer than [`MAX_METRIC_KEYS`] were
/// seen, else `_overflow` (logged once).
fn metric_key(domain: &str, key: &str) -> String {
    use std::collections::HashSet;
    use std::sync::{LazyLock, Mutex};
    static SEEN: LazyLock<Mutex<HashSet<(String, String)>>> = LazyLock::new(Mutex::default);
    let mut seen = SEEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let pair = (domain.to_owned(), key.to_owned());
    if seen.contains(&pair) {
        return pair.1;
    }
    if seen.len() < MAX_METRIC_KEYS {
        seen.insert(pair.clone());
        return pair.1;
    }
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            max = MAX_METRIC_KEYS,
            "leasehold_serve_hits_total has as many key labels as it keeps: hits of new \
             keys count under key=\"_overflow\" (detailed_metric or value_to_metric on a \
             descriptor whose values are unbounded?)"
        );
    });
    "_overflow".to_owned()
}

/// Time for `missing` tokens to refill at `rate`.
fn refill_time(missing: u64, rate: leasehold_core::Rate) -> Duration {
    Duration::from_micros(leasehold_core::Level::default().time_until(missing, rate))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per-value metric keys are bounded: past the cap, new keys count as `_overflow`,
    /// and keys seen before keep their own series.
    #[test]
    fn metric_keys_past_the_cap_count_as_overflow() {
        let first = metric_key("cap-test", "value-0");
        assert_eq!(first, "value-0");
        let mut overflowed = 0;
        for i in 1..=MAX_METRIC_KEYS + 100 {
            if metric_key("cap-test", &format!("value-{i}")) == "_overflow" {
                overflowed += 1;
            }
        }
        assert!(overflowed >= 100, "{overflowed}");
        assert_eq!(metric_key("cap-test", "value-0"), "value-0");
        assert_eq!(metric_key("cap-test", "never-seen"), "_overflow");
    }
}
