//! The rule table: each rule's entry as this agent's region uses it, its overrides,
//! and replacing the rules (code or the rules file) under running keys.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use leasehold_core::key::{BucketKey, SubjectError};
use leasehold_core::local::{LocalShare, Tenure};
use leasehold_core::rule::{BucketParams, Rule};

use crate::counters::{Counter, RuleCounters};
use crate::rules::{Overrides, Rules, RulesError, UnknownRule};

use super::seats::Seat;
use super::{Admission, Decision, FastMap, Limiter, RuleRef};
use crate::headers::Policy;

pub(crate) struct RuleEntry {
    /// The rule as the store keeps it (its global part when it has a local share).
    pub(super) rule: Rule,
    /// This agent's seat of the rule's local share, and the rule's tenure.
    pub(super) local: Option<(LocalShare, Arc<Seat>)>,
    pub(crate) params: BucketParams,
    pub(crate) name: Arc<str>,
    /// This rule's `RateLimit-Policy` item, made once so a response needs no formatting.
    #[cfg_attr(
        not(feature = "tower"),
        expect(dead_code, reason = "read by the tower layer")
    )]
    pub(crate) policy_item: bytes::Bytes,
    /// The rule as clients see it (the whole rule, its local share included).
    pub(crate) policy: Policy,
    pub(super) counters: Arc<RuleCounters>,
    /// Shadow mode: refusals are counted as such and let through.
    pub(super) shadow: bool,
    /// What a denial (429) counts as: `Denied`, or `ShadowDenied` in shadow mode.
    pub(super) denied: Counter,
    /// What a refusal for an unreachable store (503) counts as.
    pub(super) unavailable: Counter,
}

impl RuleEntry {
    /// The entry of `rule` as this agent's region uses it (see [`Rule::in_region`]).
    pub(super) fn new(
        rule: &Rule,
        counters: &Arc<RuleCounters>,
        shadow_all: bool,
        region: Option<&str>,
        seat: Option<&Arc<Seat>>,
    ) -> Result<Arc<Self>, String> {
        let whole = rule.in_region(region)?;
        let shadow = shadow_all || whole.shadow();
        // The policy a client sees is the whole rule's; the store keeps its global part.
        let policy = Policy::new(whole.name().as_str(), whole.capacity().get(), whole.rate());
        let local = whole.local().zip(seat.cloned());
        let rule = &whole.global_part();
        Ok(Arc::new(Self {
            local,
            policy_item: policy.item().into(),
            policy,
            params: rule.bucket_params(),
            rule: rule.clone(),
            name: rule.name().as_str().into(),
            counters: counters.clone(),
            shadow,
            denied: if shadow {
                Counter::ShadowDenied
            } else {
                Counter::Denied
            },
            unavailable: if shadow {
                Counter::ShadowUnavailable
            } else {
                Counter::Unavailable
            },
        }))
    }

    /// The store key of `subject` under this rule: the region's bucket of a global key
    /// when the rule is region-fed.
    pub(super) fn key(&self, subject: &[u8]) -> Result<BucketKey, SubjectError> {
        let key = BucketKey::new(self.rule.name(), subject)?;
        Ok(if self.rule.region_fed().is_some() {
            key.region_of()
        } else {
            key
        })
    }

    /// The decision the caller gets: in shadow mode a refusal is let through (it was
    /// counted as a shadow refusal where it was made).
    #[inline]
    pub(super) fn enforce(&self, d: Decision) -> Decision {
        match d {
            Decision::Denied { .. } | Decision::Unavailable { .. } if self.shadow => {
                Decision::Allowed {
                    remaining: 0,
                    via: Admission::Shadow,
                }
            }
            d => d,
        }
    }
}

/// A rule's overrides, and the entry of each by its name.
pub(super) type OverrideEntries = (Overrides, FastMap<Box<str>, Arc<RuleEntry>>);

/// A rule and its per-subject overrides (which share its counters).
pub(super) struct RuleSet {
    pub(super) base: Arc<RuleEntry>,
    pub(super) overrides: Option<OverrideEntries>,
}

impl RuleSet {
    /// The entry that applies to `subject`; hashes the subject only when the rule has
    /// `sha256:` overrides. Called on the cold path only: a key keeps its entry.
    pub(super) fn resolve(&self, subject: &[u8]) -> &Arc<RuleEntry> {
        self.entry_by(|o| o.resolve(subject))
    }

    /// [`Self::resolve`] for a subject as the key map keeps it (a long one by its
    /// SHA-256: see [`super::keys::SUBJECT_INLINE`]).
    pub(super) fn resolve_kept(&self, kept: &[u8]) -> &Arc<RuleEntry> {
        match super::keys::hashed_subject(kept) {
            Some(digest) => self.entry_by(|o| o.resolve_digest(&digest)),
            None => self.resolve(kept),
        }
    }

    /// The entry of the override `find` names, else the rule's.
    fn entry_by<'a>(
        &'a self,
        find: impl FnOnce(&'a Overrides) -> Option<(&'a str, &'a Rule)>,
    ) -> &'a Arc<RuleEntry> {
        self.overrides
            .as_ref()
            .and_then(|(o, entries)| entries.get(find(o)?.0))
            .unwrap_or(&self.base)
    }
}

pub(super) struct RuleTable {
    pub(super) by_name: FastMap<Box<str>, RuleSet>,
    /// The seats of the rules with a local share, claimed by the background loop.
    pub(super) seats: FastMap<Box<str>, Arc<Seat>>,
    /// The rules as given (for listings).
    pub(super) source: Rules,
}

impl RuleTable {
    /// The table of `rules` as `region` uses them; an error names a rule that does not fit
    /// the region.
    pub(super) fn new(
        rules: &Rules,
        old: Option<&RuleTable>,
        shadow_all: bool,
        region: Option<&str>,
    ) -> Result<Self, String> {
        let mut by_name = FastMap::default();
        let mut seats = FastMap::default();
        for rule in rules.iter() {
            let name = rule.name().as_str();
            let counters = old
                .and_then(|t| t.by_name.get(name))
                .map_or_else(Default::default, |e| e.base.counters.clone());
            // A seat of the same share goes on; a changed one is claimed anew (its first
            // answer starts it empty).
            let seat = rule.local().map(|share| {
                old.and_then(|t| t.seats.get(name))
                    .filter(|s| s.share == share)
                    .cloned()
                    .unwrap_or_else(|| {
                        Arc::new(Seat {
                            share,
                            tenure: Tenure::new(),
                            wanted_ns: AtomicU64::new(0),
                        })
                    })
            });
            let overrides = match rules.overrides(name) {
                Some(o) => {
                    let mut entries = FastMap::default();
                    for (n, r) in o.iter() {
                        let e = RuleEntry::new(r, &counters, shadow_all, region, seat.as_ref())?;
                        entries.insert(n.into(), e);
                    }
                    Some((o.clone(), entries))
                }
                None => None,
            };
            let base = RuleEntry::new(rule, &counters, shadow_all, region, seat.as_ref())?;
            by_name.insert(name.into(), RuleSet { base, overrides });
            if let Some(seat) = seat {
                seats.insert(name.into(), seat);
            }
        }
        // Seats no longer in force stop at once (their records expire in the store).
        if let Some(old) = old {
            for (name, seat) in &old.seats {
                if !seats.get(name).is_some_and(|s| Arc::ptr_eq(s, seat)) {
                    seat.tenure.lost();
                }
            }
        }
        Ok(Self {
            by_name,
            seats,
            source: rules.clone(),
        })
    }

    pub(super) fn get(&self, name: &str) -> Result<&RuleSet, UnknownRule> {
        self.by_name.get(name).ok_or_else(|| UnknownRule {
            name: name.chars().take(80).collect(),
            known: {
                let mut names: Vec<&str> = self.by_name.keys().map(AsRef::as_ref).collect();
                names.sort_unstable();
                names.join(", ")
            },
        })
    }
}

impl Limiter {
    /// Reads the rules file again. A file that fails validation is refused and the rules
    /// in force stay; keys of removed rules answer `UnknownRule` from then on.
    #[tracing::instrument(level = "info", name = "rules_reload", skip_all)]
    pub fn reload_rules(&self) -> Result<usize, RulesError> {
        let Some(path) = &self.inner.rules_file else {
            return Ok(self.inner.rules.load().by_name.len());
        };
        self.inner.note_rules_mtime();
        let rules = Rules::from_file(path)?;
        if let Some(rule) = self
            .inner
            .required
            .lock()
            .iter()
            .find(|r| rules.get(r).is_err())
        {
            return Err(RulesError::Required {
                path: path.display().to_string(),
                rule: rule.clone(),
            });
        }
        let n = rules.len();
        self.set_rules(&rules)?;
        tracing::info!(rules = n, path = %path.display(), "rules reloaded");
        Ok(n)
    }

    /// Names rules this process checks requests against (a gateway's configured rules):
    /// each must exist now, and a reload of the rules file that lacks one is refused, with
    /// the rules in force kept, as a file lacking it is refused at start.
    pub fn require_rules<S: AsRef<str>>(
        &self,
        names: impl IntoIterator<Item = S>,
    ) -> Result<(), UnknownRule> {
        let names: Vec<String> = names.into_iter().map(|n| n.as_ref().to_owned()).collect();
        let table = self.inner.rules.load();
        for n in &names {
            table.get(n)?;
        }
        self.inner.required.lock().extend(names);
        Ok(())
    }

    /// Replaces the rules with ones built in code. Rules that do not fit this agent's
    /// region (a region-scoped rule without a weight for it, say) are refused, and the
    /// rules in force stay.
    pub fn set_rules(&self, rules: &Rules) -> Result<(), RulesError> {
        let table = RuleTable::new(
            rules,
            Some(&self.inner.rules.load()),
            self.inner.config.shadow,
            self.inner.config.region.as_deref(),
        )
        .map(Arc::new)
        .map_err(|why| RulesError::NotForAgent { why })?;
        self.inner.rules.store(table.clone());
        self.inner.keys.for_each(|slot| {
            let ks = &slot.ks;
            let capacity = match table.get(&ks.rule) {
                Ok(set) => {
                    let entry = set.resolve_kept(slot.subject());
                    if entry.params != ks.entry.load().params {
                        // A cached denial was timed at the old rate.
                        ks.hot().clear_denial();
                    }
                    ks.hot()
                        .set_rule_flags(entry.shadow, entry.local.is_some() && !ks.transient);
                    ks.entry.store(entry.clone());
                    entry.params.capacity
                }
                Err(_) => 0,
            };
            ks.hot().set_capacity(capacity);
        });
        Ok(())
    }
}

impl Limiter {
    /// How `rule` is described to clients for `subject` (its override's when it has one):
    /// see [`crate::headers`].
    pub fn policy(&self, rule: &RuleRef, subject: impl AsRef<[u8]>) -> Result<Policy, UnknownRule> {
        let table = self.inner.rules.load();
        Ok(table
            .get(rule.as_str())?
            .resolve(subject.as_ref())
            .policy
            .clone())
    }
}
