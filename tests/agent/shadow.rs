//! Shadow mode: decisions are made and counted, never enforced. The same load on a rule
//! in shadow mode and on its enforcing twin: every shadow response is an admission, and
//! exactly the twin's denials are counted as `shadow_denied`; with the store gone, the
//! would-be 503s are `shadow_unavailable`.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use leasehold_agent::{
    Admission, Check, Decision, EmbeddedStore, Limiter, LimiterConfig, Rules, Store,
};

const RULES: &str = r#"
[rules.enforced]
capacity = 10
rate = "1/m"
leasing = "exact"

[rules.watched]
capacity = 10
rate = "1/m"
leasing = "exact"
shadow = true

[rules.enforced.overrides."tenant-s"]
shadow = true
"#;

async fn limiter(store: Store, shadow_all: bool) -> Limiter {
    Limiter::builder()
        .store(store)
        .rules(Rules::from_toml(RULES).unwrap())
        .config({
            let mut c = LimiterConfig::default();
            c.shadow = shadow_all;
            c
        })
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_counts_exactly_the_would_be_refusals_and_enforces_none() {
    let embedded = EmbeddedStore::new();
    let l = limiter(Store::Embedded(embedded.clone()), false).await;
    let mut enforced = Vec::new();
    let mut watched = Vec::new();
    for _ in 0..25 {
        enforced.push(l.check(&"enforced".into(), "t", 1).await.unwrap());
        watched.push(l.check(&"watched".into(), "t", 1).await.unwrap());
    }
    let denied = enforced
        .iter()
        .filter(|d| matches!(d, Decision::Denied { .. }))
        .count() as u64;
    assert_eq!(denied, 15);
    for (e, w) in enforced.iter().zip(&watched) {
        match e {
            Decision::Denied { .. } => assert_eq!(
                *w,
                Decision::Allowed {
                    remaining: 0,
                    via: Admission::Shadow
                }
            ),
            _ => assert_eq!(e, w, "an admission is the same in shadow mode"),
        }
    }
    let s = l.stats("watched").unwrap();
    assert_eq!((s.shadow_denied, s.denied), (denied, 0));
    assert_eq!(s.admitted(), 25);
    assert_eq!(l.stats("enforced").unwrap().denied, denied);

    // An override in shadow mode: that subject is watched, the rest enforced.
    for _ in 0..12 {
        let d = l.check(&"enforced".into(), "tenant-s", 1).await.unwrap();
        assert!(matches!(d, Decision::Allowed { .. }), "{d:?}");
    }
    assert_eq!(l.stats("enforced").unwrap().shadow_denied, 2);

    // Store unreachable, rules failing closed: 503s become shadow admissions.
    embedded.set_offline(true);
    let d = l.check(&"watched".into(), "t2", 1).await.unwrap();
    assert_eq!(
        d,
        Decision::Allowed {
            remaining: 0,
            via: Admission::Shadow
        }
    );
    assert_eq!(l.stats("watched").unwrap().shadow_unavailable, 1);
    let d = l.check(&"enforced".into(), "t2", 1).await.unwrap();
    assert!(matches!(d, Decision::Unavailable { .. }), "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_switch_puts_every_rule_in_shadow_mode() {
    let l = limiter(Store::Embedded(EmbeddedStore::new()), true).await;
    for _ in 0..20 {
        let d = l.check(&"enforced".into(), "t", 1).await.unwrap();
        assert!(matches!(d, Decision::Allowed { .. }), "{d:?}");
    }
    let s = l.stats("enforced").unwrap();
    assert_eq!((s.shadow_denied, s.denied, s.admitted_exact), (10, 0, 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_all_reports_the_tightest_check() {
    let rules = "[rules.a]\ncapacity = 100\nrate = \"1/m\"\nleasing = \"exact\"\n\
                 [rules.b]\ncapacity = 5\nrate = \"1/m\"\nleasing = \"exact\"\n";
    let l = Limiter::builder()
        .embedded()
        .rules(Rules::from_toml(rules).unwrap())
        .build()
        .await
        .unwrap();
    let d = l
        .check_all(&[
            Check::new(&"a".into(), "t", 1),
            Check::new(&"b".into(), "t", 1),
        ])
        .await
        .unwrap();
    assert_eq!(
        d,
        Decision::Allowed {
            remaining: 4,
            via: Admission::Exact
        }
    );
}
