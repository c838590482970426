//! The edge vocabulary: a rule as callers name it ([`RuleRef`]) and one limit a request
//! must pass ([`Check`]). Every decision names the rule first, as a `&RuleRef`, then the
//! subject, then the cost: a subject passed where the rule goes does not compile.

use std::borrow::Cow;
use std::sync::Arc;

use smallvec::SmallVec;

use super::Limiter;
use crate::rules::UnknownRule;

/// A rule, as every decision names it. [`Limiter::rule`] gives one for a rule that exists
/// now (a gateway's configured rules, checked at start); `RuleRef::from` any name (a rule
/// chosen per request) is checked at each decision. A `&'static str` or an `Arc<str>` is
/// shared, never copied, per request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleRef(Repr);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Repr {
    Static(&'static str),
    Shared(Arc<str>),
}

impl RuleRef {
    /// The name.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Static(s) => s,
            Repr::Shared(s) => s,
        }
    }
}

impl From<&'static str> for RuleRef {
    fn from(s: &'static str) -> Self {
        Self(Repr::Static(s))
    }
}

impl From<Arc<str>> for RuleRef {
    fn from(s: Arc<str>) -> Self {
        Self(Repr::Shared(s))
    }
}

impl From<&Arc<str>> for RuleRef {
    fn from(s: &Arc<str>) -> Self {
        Self(Repr::Shared(s.clone()))
    }
}

impl From<String> for RuleRef {
    fn from(s: String) -> Self {
        Self(Repr::Shared(s.into()))
    }
}

impl From<Cow<'static, str>> for RuleRef {
    fn from(s: Cow<'static, str>) -> Self {
        match s {
            Cow::Borrowed(s) => s.into(),
            Cow::Owned(s) => s.into(),
        }
    }
}

/// One limit a request must pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    rule: RuleRef,
    subject: SmallVec<[u8; 48]>,
    cost: u64,
}

impl Check {
    /// `cost` tokens of `rule` for `subject`. A subject up to 48 bytes is kept inline.
    pub fn new(rule: &RuleRef, subject: impl AsRef<[u8]>, cost: u64) -> Self {
        Self {
            rule: rule.clone(),
            subject: SmallVec::from_slice(subject.as_ref()),
            cost,
        }
    }

    /// The rule.
    pub fn rule(&self) -> &str {
        self.rule.as_str()
    }

    /// Who is limited.
    pub fn subject(&self) -> &[u8] {
        &self.subject
    }

    /// Tokens the request costs.
    pub fn cost(&self) -> u64 {
        self.cost
    }
}

impl From<&RuleRef> for RuleRef {
    fn from(r: &RuleRef) -> Self {
        r.clone()
    }
}

impl std::fmt::Display for RuleRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Limiter {
    /// The rule named `name`, if it exists now (a later reload may remove it: decisions
    /// then answer [`UnknownRule`]).
    pub fn rule(&self, name: &str) -> Result<RuleRef, UnknownRule> {
        let table = self.inner.rules.load();
        table.get(name)?;
        Ok(RuleRef::from(name.to_owned()))
    }
}
