//! One rate limit request, independent of gRPC and HTTP: match every descriptor to its
//! limit, drop replaced limits, and decide the rest together, all or nothing.
//!
//! As envoyproxy/ratelimit: a descriptor's `limit` (RateLimitOverride) takes the place of
//! whatever the YAML says for it; `hits_addend: 0` on a descriptor is a check that takes
//! nothing; a descriptor in quota mode over its limit is reported `OVER_LIMIT` while the
//! request stays OK, unless every quota descriptor is over. Unlike ratelimit, a refused
//! request takes nothing from any bucket (see `Limiter::check_all_each`).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use leasehold_agent::headers::{self, Policy};
use leasehold_agent::{Admission, Check, CheckError, Decision, Limiter, RuleRef};
use leasehold_core::rule::{Rule, RuleSpec};
use leasehold_store::{Rules, RulesError};

use crate::config::{Action, Domains, Limit, MAX_PER_SECOND, Unit};

/// How answers are shaped, as envoyproxy/ratelimit's settings of the same names.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Every descriptor is in quota mode (`QUOTA_MODE`).
    pub quota_mode: bool,
    /// Answers carry dynamic metadata (`RESPONSE_DYNAMIC_METADATA`).
    pub dynamic_metadata: bool,
    /// Header names for the tightest limit: `None` for the IETF draft's `RateLimit-Policy`
    /// and `RateLimit`; else ratelimit's three (`LIMIT_RESPONSE_HEADERS_ENABLED`, with
    /// `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`).
    pub limit_headers: Option<[String; 3]>,
    /// An RLQS bucket whose reports show no request for this long is abandoned (the
    /// client forgets it until its next request); `None`: a minute.
    pub rlqs_idle: Option<Duration>,
}

/// The answer for one descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// Over the limit (not in shadow mode). In quota mode the request may still be OK.
    pub over_limit: bool,
    /// Refused because its store could not be reached and its rule fails closed (then
    /// `over_limit` too: over gRPC the only refusal is OVER_LIMIT).
    pub unavailable: bool,
    /// The limit applied, if any: requests per unit, unit, name.
    pub limit: Option<(u32, Unit, Option<String>)>,
    /// What is left: `u32::MAX` for an unlimited descriptor; 0 where no limit applies
    /// (none matched, replaced), where a shadow limit is over, and for limits not checked
    /// because another refused the request, as envoyproxy/ratelimit reports them.
    pub remaining: u32,
    /// When the tokens asked for exist again (over the limit; `None` when they never
    /// will: more hits than the bucket holds), or when the bucket is full again (OK).
    pub reset: Option<Duration>,
    /// The rule that decided it, as clients see it (`None` for no rule: unlimited, deny
    /// all, no match).
    pub policy: Option<Policy>,
    /// `remaining` is the store's count (not an admission by fail open, the emergency
    /// limit or shadow mode, nor a refusal because the store is unreachable).
    pub metered: bool,
}

/// The answer for a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// The request is refused: a descriptor not in quota mode is over its limit, or every
    /// quota descriptor is.
    pub over_limit: bool,
    /// Some descriptor could not be decided: the store is unreachable and its rule
    /// fails closed (it counts as over the limit).
    pub unavailable: bool,
    /// Refused only because the store is unreachable, on limits that leave that to
    /// Envoy ([`crate::config::Limit::failure_to_envoy`]): the gRPC service answers with
    /// an error, as envoyproxy/ratelimit does, and Envoy's `failure_mode_deny` decides.
    pub failed: bool,
    /// Per descriptor, in the request's order.
    pub statuses: Vec<Status>,
    /// Headers for the client: `retry-after` when over the limit (unless no wait would
    /// do), and the tightest limit's (see [`Options::limit_headers`]).
    pub headers: Vec<(String, String)>,
    /// With [`Options::dynamic_metadata`]: the domain, the descriptors (entries as
    /// `key=value`, their `limit` and `hitsAddend`), the request's `hitsAddend`, and the
    /// `metadata` of the descriptors that passed, merged (the first value of a key wins;
    /// objects merge).
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// Why a request could not be decided.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecideError {
    /// The request has no domain or no descriptor.
    #[error("{0}")]
    Invalid(String),
    /// The limiter refused a check.
    #[error(transparent)]
    Check(#[from] CheckError),
}

/// One descriptor of a request.
#[derive(Clone, Debug)]
pub struct Descriptor<'a> {
    /// `(key, value)` entries, in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// Tokens (the descriptor's `hits_addend`, else the request's, else 1); 0: a check
    /// that takes nothing.
    pub hits: u64,
    /// The request's own limit for it (RateLimitOverride): requests per unit and unit.
    pub limit: Option<(u32, Unit)>,
}

/// A descriptor's tokens, as ratelimit counts them: its own `hits_addend` (0: a check
/// that takes nothing), else the request's, whose 0 counts 1.
pub fn hits(own: Option<u64>, request: u32) -> u64 {
    own.unwrap_or(u64::from(request.max(1)))
}

/// Distinct limits requests may name in descriptors' `limit`: each is a Leasehold rule.
pub const MAX_OVERRIDE_LIMITS: usize = 1024;

/// What every request is decided with: the limiter, the limits in force (swapped on
/// reload) and the rules made for limits requests named.
#[derive(Debug)]
pub struct Decider {
    limiter: Limiter,
    domains: ArcSwap<Domains>,
    /// Rules for descriptors' own limits, by (requests per unit, unit).
    overrides: Mutex<BTreeMap<(u32, Unit), Rule>>,
    options: Options,
    /// Store calls made by this process's RLQS tiers.
    tier_calls: std::sync::atomic::AtomicU64,
}

impl Decider {
    /// Decides with `limiter` under `domains` (whose rules the limiter holds).
    pub fn new(limiter: Limiter, domains: Domains, options: Options) -> Arc<Self> {
        Arc::new(Self {
            limiter,
            domains: ArcSwap::from_pointee(domains),
            overrides: Mutex::default(),
            options,
            tier_calls: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The limiter.
    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// The limits in force.
    pub fn domains(&self) -> Arc<Domains> {
        self.domains.load_full()
    }

    /// The answers' options.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Store calls this process's RLQS tiers made (see [`crate::rlqs`]).
    pub fn tier_calls(&self) -> u64 {
        self.tier_calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn count_tier_call(&self) {
        self.tier_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Puts `domains` and `rules` (a reloaded file's) in force; limits requests named
    /// stay. Rules the limiter refuses leave the config in force as it was.
    pub fn reload(&self, domains: Domains, rules: &Rules) -> Result<(), RulesError> {
        let overrides = self
            .overrides
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.limiter
            .set_rules(&with_overrides(rules, overrides.values()))?;
        self.domains.store(Arc::new(domains));
        Ok(())
    }

    /// The rule of a descriptor's own limit, made (and given to the limiter) the first
    /// time it is named; why not, past [`MAX_OVERRIDE_LIMITS`] or when the rule is
    /// refused.
    fn override_rule(&self, rpu: u32, unit: Unit) -> Result<String, String> {
        let name = format!("_limit.{rpu}-per-{}", unit.name());
        let mut overrides = self
            .overrides
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if overrides.contains_key(&(rpu, unit)) {
            return Ok(name);
        }
        if overrides.len() >= MAX_OVERRIDE_LIMITS {
            return Err(format!(
                "{MAX_OVERRIDE_LIMITS} distinct descriptor limits are kept already"
            ));
        }
        let spec = RuleSpec::new(u64::from(rpu), format!("{rpu}/{}s", unit.seconds()));
        let rule = Rule::from_spec(&name, &spec).map_err(|e| e.to_string())?;
        overrides.insert((rpu, unit), rule);
        let domains = self.domains.load();
        if let Err(e) =
            (self.limiter).set_rules(&with_overrides(&domains.rules(), overrides.values()))
        {
            overrides.remove(&(rpu, unit));
            return Err(e.to_string());
        }
        Ok(name)
    }

    /// Decides a request of `domain` with `descriptors` (a domain not configured: every
    /// descriptor OK, as in ratelimit).
    pub async fn decide(
        &self,
        domain: &str,
        descriptors: &[Descriptor<'_>],
        request_hits: u32,
    ) -> Result<Verdict, DecideError> {
        if domain.is_empty() {
            return Err(DecideError::Invalid("domain must not be empty".into()));
        }
        if descriptors.is_empty() {
            return Err(DecideError::Invalid(
                "descriptor list must not be empty".into(),
            ));
        }
        let domains = self.domains.load();
        if !domains.has_domain(domain) {
            // As ratelimit: no limit is configured for the domain, so OK.
            tracing::debug!(domain = %domain.chars().take(80).collect::<String>(), "unknown domain");
            metrics::counter!("leasehold_serve_unknown_domain_total").increment(1);
            let ok = Status {
                over_limit: false,
                unavailable: false,
                limit: None,
                remaining: 0,
                reset: None,
                policy: None,
                metered: true,
            };
            return Ok(Verdict {
                over_limit: false,
                unavailable: false,
                failed: false,
                statuses: vec![ok; descriptors.len()],
                headers: Vec::new(),
                metadata: None,
            });
        }
        let limiter = &self.limiter;
        let matched: Vec<Option<Found<'_>>> = descriptors
            .iter()
            .map(|d| self.find(&domains, domain, d))
            .collect();
        let replaced: Vec<&str> = matched
            .iter()
            .flatten()
            .flat_map(|m| m.limit.replaces.iter().map(String::as_str))
            .collect();
        let applies = |l: &Limit| l.name.as_deref().is_none_or(|n| !replaced.contains(&n));
        // A limit applies and counts (not replaced, not unlimited).
        let counted = |i: usize| {
            matched[i]
                .as_ref()
                .is_some_and(|m| applies(&m.limit) && m.limit.action != Action::Unlimited)
        };
        let quota = |i: usize| {
            self.options.quota_mode || matched[i].as_ref().is_some_and(|m| m.limit.quota_mode)
        };
        let mut statuses: Vec<Status> = matched
            .iter()
            .enumerate()
            .map(|(i, m)| Status {
                over_limit: false,
                unavailable: false,
                limit: m.as_ref().filter(|_| counted(i)).and_then(|m| {
                    Some((
                        m.limit.requests_per_unit,
                        m.limit.unit?,
                        m.limit.name.clone(),
                    ))
                }),
                // As ratelimit: u32::MAX for an unlimited descriptor, else 0 until checked.
                remaining: match m {
                    Some(m) if applies(&m.limit) && m.limit.action == Action::Unlimited => u32::MAX,
                    _ => 0,
                },
                reset: None,
                policy: None,
                metered: true,
            })
            .collect();
        // A descriptor in shadow mode over its limit: counted, let through.
        let shadow_over = || {
            metrics::counter!("leasehold_serve_shadow_total", "domain" => domain.to_owned())
                .increment(1);
        };
        // Over the limit without taking: in shadow mode only counted.
        let over = |s: &mut Status, shadow: bool, reset: Option<Duration>| {
            if shadow {
                shadow_over();
                // Let through: what it reports is not the store's count.
                s.metered = false;
            } else {
                s.over_limit = true;
                s.remaining = 0;
                s.reset = reset;
            }
        };
        // The descriptors to take from the store.
        let mut takes: Vec<Take<'_>> = Vec::new();
        let mut unavailable = false;
        for (i, m) in matched.iter().enumerate() {
            let Some(m) = m else { continue };
            if !applies(&m.limit) {
                continue;
            }
            metrics::counter!("leasehold_serve_hits_total", "domain" => domain.to_owned(), "key" => metric_key(domain, &m.metric_key))
                .increment(1);
            let hits = descriptors[i].hits;
            let shadow = m.limit.shadow;
            let rule = match &m.limit.action {
                Action::Unlimited => continue,
                Action::DenyAll => {
                    over(&mut statuses[i], shadow, None);
                    continue;
                }
                Action::Rule(rule) => rule,
            };
            let subject = m.subject.as_bytes();
            statuses[i].policy = limiter.policy(rule, subject).ok();
            let Ok(p) = limiter.bucket_params_for(rule, subject) else {
                // The rule went with a reload meanwhile: the limiter says so.
                takes.push(Take {
                    i,
                    rule,
                    subject,
                    hits,
                    capacity: u64::MAX,
                    shadow,
                });
                continue;
            };
            if hits > 0 {
                takes.push(Take {
                    i,
                    rule,
                    subject,
                    hits,
                    capacity: p.capacity,
                    shadow,
                });
                continue;
            }
            // A check that takes nothing: is there a token now?
            let s = &mut statuses[i];
            match limiter.peek(rule, subject, 1).await? {
                Decision::Allowed { remaining, via } => {
                    if via == Admission::Shadow {
                        shadow_over();
                    }
                    s.metered = via.is_metered();
                    s.remaining = clip(remaining);
                    s.reset = Some(refill_time(p.capacity.saturating_sub(remaining), p.rate));
                }
                Decision::Denied { retry_after } => over(s, shadow, Some(retry_after)),
                Decision::Unavailable { retry_after } => {
                    unavailable = true;
                    s.unavailable = true;
                    s.metered = false;
                    over(s, shadow, Some(retry_after));
                }
            }
        }
        // More hits on a bucket than it can ever hold, one descriptor's or several naming
        // it together: over the limit, as in ratelimit (an error would let Envoy, failing
        // open by default, pass the request), with no time that would help.
        let mut k = 0;
        while k < takes.len() {
            let (rule, subject, capacity) = (takes[k].rule, takes[k].subject, takes[k].capacity);
            let same = |t: &Take<'_>| t.rule == rule && t.subject == subject;
            let sum = takes
                .iter()
                .filter(|t| same(t))
                .fold(0u64, |a, t| a.saturating_add(t.hits));
            if sum <= capacity {
                k += 1;
                continue;
            }
            for t in takes.iter().filter(|t| same(t)) {
                over(&mut statuses[t.i], t.shadow, None);
            }
            takes.retain(|t| !same(t));
        }
        // Refused: a descriptor not in quota mode is over, or every quota one is.
        let refused = |statuses: &[Status]| {
            let mut quotas = (0..statuses.len()).filter(|&i| counted(i) && quota(i));
            (0..statuses.len()).any(|i| statuses[i].over_limit && !quota(i))
                || (quotas.clone().next().is_some() && quotas.all(|i| statuses[i].over_limit))
        };
        // All or nothing; a quota descriptor found over is left out and the rest tried
        // again (the refusal took nothing).
        while !takes.is_empty() && !refused(&statuses) {
            let list: Vec<Check> = (takes.iter())
                .map(|t| Check::new(t.rule, t.subject, t.hits))
                .collect();
            let mut each = Vec::new();
            let (d, at) = limiter.check_all_each(&list, &mut each).await?;
            if let Decision::Allowed { .. } = d {
                for (t, d) in takes.iter().zip(&each) {
                    if let Some(Decision::Allowed { remaining, via }) = *d {
                        if via == Admission::Shadow {
                            // A shadow rule's refusal, let through by the agent.
                            shadow_over();
                        }
                        let s = &mut statuses[t.i];
                        s.metered = via.is_metered();
                        s.remaining = clip(remaining);
                        // No count, no time: a fail-open admission's 0 left is not an
                        // empty bucket (it said a full refill's wait, a second here).
                        s.reset = (limiter.bucket_params_for(t.rule, t.subject).ok())
                            .filter(|_| s.metered)
                            .map(|p| refill_time(p.capacity.saturating_sub(remaining), p.rate));
                    }
                }
                break;
            }
            let i = takes[at].i;
            let s = &mut statuses[i];
            s.over_limit = true;
            s.remaining = 0;
            if let Decision::Denied { retry_after } | Decision::Unavailable { retry_after } = d {
                s.reset = Some(retry_after);
            }
            s.unavailable = matches!(d, Decision::Unavailable { .. });
            unavailable |= s.unavailable;
            s.metered = !s.unavailable;
            if !quota(i) {
                break;
            }
            takes.remove(at);
        }
        let over_limit = refused(&statuses);
        if !over_limit {
            // Nothing refused the request, so nothing was made unavailable by it.
            unavailable = false;
        }
        let headers = self.headers(domain, &statuses, over_limit, &quota);
        let metadata = self.options.dynamic_metadata.then(|| {
            let passed = matched.iter().enumerate().filter_map(|(i, m)| {
                let m = m.as_ref()?;
                let unlimited = applies(&m.limit) && m.limit.action == Action::Unlimited;
                (!statuses[i].over_limit && !unlimited)
                    .then_some(m.limit.metadata.as_ref())
                    .flatten()
            });
            metadata(domain, descriptors, request_hits, passed)
        });
        // Every refusing descriptor refused for want of the store, and every limit the
        // request names leaves that to Envoy (one with its own `on_failure` decides).
        let failed = over_limit
            && (statuses.iter().zip(&matched))
                .filter(|(s, _)| s.over_limit)
                .all(|(s, _)| s.unavailable)
            && matched
                .iter()
                .flatten()
                .all(|m| m.limit.failure_to_envoy || !matches!(m.limit.action, Action::Rule(_)));
        Ok(Verdict {
            over_limit,
            unavailable,
            failed,
            statuses,
            headers,
            metadata,
        })
    }

    /// The limit of one descriptor: its own (`limit`), else the YAML's.
    fn find<'a>(
        &self,
        domains: &'a Domains,
        domain: &str,
        d: &Descriptor<'_>,
    ) -> Option<Found<'a>> {
        let Some((rpu, unit)) = d.limit else {
            let m = domains.find(domain, &d.entries)?;
            return Some(Found {
                limit: Cow::Borrowed(m.limit),
                subject: m.subject,
                metric_key: m.metric_key,
            });
        };
        // As ratelimit: the bucket is the domain and every entry, the metric key too.
        let mut full_key = String::from(domain);
        for (k, v) in &d.entries {
            full_key.push('.');
            full_key.push_str(k);
            full_key.push('_');
            full_key.push_str(v);
        }
        let action = if rpu == 0 {
            Action::DenyAll
        } else if u64::from(rpu) > MAX_PER_SECOND * unit.seconds() {
            static SAID: AtomicU64 = AtomicU64::new(0);
            if said_now(&SAID) {
                tracing::warn!(
                    limit = %format!("{rpu}/{}", unit.name()),
                    "a descriptor's own limit above {MAX_PER_SECOND} a second is taken as no \
                     limit: its requests are all OK (said at most every 10 s)"
                );
            }
            Action::Unlimited
        } else {
            match self.override_rule(rpu, unit) {
                Ok(rule) => Action::Rule(rule.into()),
                Err(why) => {
                    static SAID: AtomicU64 = AtomicU64::new(0);
                    if said_now(&SAID) {
                        tracing::warn!(
                            limit = %format!("{rpu}/{}", unit.name()),
                            why = %why,
                            "a descriptor's own limit is not applied (the YAML's applies; said \
                             at most every 10 s)"
                        );
                    }
                    let m = domains.find(domain, &d.entries)?;
                    return Some(Found {
                        limit: Cow::Borrowed(m.limit),
                        subject: m.subject,
                        metric_key: m.metric_key,
                    });
                }
            }
        };
        let mut pairs: Vec<[&str; 2]> = vec![["", domain]];
        pairs.extend(d.entries.iter().map(|(k, v)| [*k, *v]));
        Some(Found {
            limit: Cow::Owned(Limit {
                action,
                requests_per_unit: rpu,
                unit: Some(unit),
                name: None,
                replaces: Vec::new(),
                shadow: false,
                quota_mode: false,
                detailed_metric: false,
                metadata: None,
                full_key: full_key.clone(),
                subject_keys: None,
                entries: d
                    .entries
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), Some((*v).to_owned())))
                    .collect(),
                failure_to_envoy: true,
            }),
            subject: serde_json::to_string(&pairs).unwrap_or_default(),
            metric_key: full_key,
        })
    }

    /// `retry-after` when refused (unless no wait helps), and the limits: by default the
    /// IETF draft's `RateLimit-Policy` and `RateLimit`, one item per descriptor that has a
    /// limit, as the tower layer and the HTTP API describe a rule ([`headers`]); with
    /// `limit_headers`, ratelimit's three headers for the tightest limit (the refusing
    /// one, not in quota mode, else the one with the least left).
    fn headers(
        &self,
        domain: &str,
        statuses: &[Status],
        over_limit: bool,
        quota: &dyn Fn(usize) -> bool,
    ) -> Vec<(String, String)> {
        let mut out = Vec::new();
        match &self.options.limit_headers {
            Some([limit, remaining, reset_name]) => {
                // Only counted limits: one let through without its store (fail open, the
                // local emergency limit) or refused for want of it has no count to say,
                // and a remaining of 0 on an admitted request reads as exhausted.
                let tightest = statuses
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.limit.is_some() && s.metered && !s.unavailable)
                    .min_by_key(|(i, s)| (!s.over_limit || quota(*i), s.remaining))
                    .map(|(_, s)| s);
                if let Some(
                    s @ Status {
                        limit: Some((rpu, _, _)),
                        ..
                    },
                ) = tightest
                {
                    out.push((limit.clone(), rpu.to_string()));
                    out.push((remaining.clone(), s.remaining.to_string()));
                    out.push((reset_name.clone(), s.reset.map_or(0, secs).to_string()));
                }
            }
            None => {
                let (mut policies, mut left) = (Vec::new(), Vec::new());
                for s in statuses {
                    let Some((rpu, unit, name)) = &s.limit else {
                        continue;
                    };
                    let Some(p) = &s.policy else {
                        // No bucket (requests_per_unit 0: every request is over).
                        let label = name.as_deref().unwrap_or(domain);
                        policies.push(headers::policy_item(label, u64::from(*rpu), unit.seconds()));
                        left.push(headers::limit_item(label, 0, 0));
                        continue;
                    };
                    policies.push(p.item());
                    let d = match (s.over_limit, s.reset) {
                        (_, _) if !s.metered => continue,
                        // More hits than the bucket holds: no wait helps, no time to say.
                        (true, None) => continue,
                        (true, Some(retry_after)) => Decision::Denied { retry_after },
                        (false, _) => Decision::Allowed {
                            remaining: u64::from(s.remaining),
                            via: leasehold_agent::Admission::Exact,
                        },
                    };
                    left.extend(p.limit_item(d));
                }
                if !policies.is_empty() {
                    out.push(("ratelimit-policy".into(), policies.join(", ")));
                }
                if !left.is_empty() {
                    out.push(("ratelimit".into(), left.join(", ")));
                }
            }
        }
        if over_limit
            && let Some(wait) = statuses
                .iter()
                .filter(|s| s.over_limit)
                .find_map(|s| s.reset)
        {
            out.push(("retry-after".into(), headers::retry_secs(wait).to_string()));
        }
        out
    }
}

/// A descriptor to take from the store.
struct Take<'a> {
    /// Its index in the request.
    i: usize,
    rule: &'a RuleRef,
    subject: &'a [u8],
    hits: u64,
    /// Its bucket's capacity.
    capacity: u64,
    /// Its limit is in shadow mode.
    shadow: bool,
}

/// A descriptor's limit: the YAML's, or one the request named.
struct Found<'a> {
    limit: Cow<'a, Limit>,
    subject: String,
    metric_key: String,
}

/// `rules` with the rules of descriptors' own limits.
fn with_overrides<'a>(rules: &Rules, overrides: impl Iterator<Item = &'a Rule>) -> Rules {
    rules.clone().and(overrides.cloned())
}

/// As ratelimit's dynamic metadata: domain, descriptors, hitsAddend, and `passed`'s
/// metadata merged.
fn metadata<'a>(
    domain: &str,
    descriptors: &[Descriptor<'_>],
    request_hits: u32,
    passed: impl Iterator<Item = &'a serde_json::Value>,
) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::{Map, Value, json};
    let mut fields = Map::new();
    fields.insert("domain".into(), json!(domain));
    let list: Vec<Value> = descriptors
        .iter()
        .map(|d| {
            let mut f = Map::new();
            let entries: Vec<String> = d.entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
            f.insert("entries".into(), json!(entries));
            if let Some((rpu, unit)) = d.limit {
                f.insert(
                    "limit".into(),
                    json!(format!(
                        "requests_per_unit:{rpu} unit:{}",
                        unit.name().to_ascii_uppercase()
                    )),
                );
            }
            f.insert("hitsAddend".into(), json!(d.hits));
            Value::Object(f)
        })
        .collect();
    fields.insert("descriptors".into(), Value::Array(list));
    if request_hits != 0 {
        fields.insert("hitsAddend".into(), json!(request_hits));
    }
    let mut merged = Map::new();
    for m in passed {
        if let Value::Object(src) = m {
            merge(&mut merged, src);
        }
    }
    if !merged.is_empty() {
        fields.insert("metadata".into(), Value::Object(merged));
    }
    fields
}

/// Adds `src`'s keys to `dest`: a key already there keeps its value, objects merge.
fn merge(
    dest: &mut serde_json::Map<String, serde_json::Value>,
    src: &serde_json::Map<String, serde_json::Value>,
) {
    for (k, v) in src {
        match (dest.get_mut(k), v) {
            (Some(serde_json::Value::Object(d)), serde_json::Value::Object(s)) => merge(d, s),
            (Some(_), _) => {}
            (None, v) => {
                dest.insert(k.clone(), v.clone());
            }
        }
    }
}

fn clip(n: u64) -> u32 {
    n.min(u64::from(u32::MAX)) as u32
}

/// Whole seconds, rounded up.
fn secs(d: Duration) -> u64 {
    leasehold_core::retry_after_secs(d.as_micros().min(u128::from(u64::MAX)) as u64)
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
    use std::sync::LazyLock;
    static SEEN: LazyLock<Mutex<HashSet<(String, String)>>> = LazyLock::new(Mutex::default);
    let mut seen = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
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

/// Whether a warning that every request could repeat is due: at most once every 10 s
/// for each `slot`.
fn said_now(slot: &AtomicU64) -> bool {
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    leasehold_agent::telemetry::once_per(slot, now_ns, 10_000_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_warning_is_said_once_in_ten_seconds() {
        let slot = AtomicU64::new(0);
        assert!(said_now(&slot));
        assert!(!said_now(&slot));
        slot.fetch_sub(10_000_000_000, std::sync::atomic::Ordering::Relaxed);
        assert!(said_now(&slot));
    }

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

    /// Merged metadata: the first value of a key wins, objects merge.
    #[test]
    fn metadata_merges_as_ratelimit() {
        let a = serde_json::json!({"backend": "a", "team": {"name": "x"}});
        let b = serde_json::json!({"backend": "b", "team": {"on_call": "y"}, "tier": 2});
        let m = metadata("d", &[], 0, [&a, &b].into_iter());
        assert_eq!(
            serde_json::Value::Object(m["metadata"].as_object().unwrap().clone()),
            serde_json::json!({"backend": "a", "team": {"name": "x", "on_call": "y"}, "tier": 2})
        );
    }
}
