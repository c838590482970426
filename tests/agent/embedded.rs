//! The Limiter's behaviour on the embedded store: hot path without the store, negative
//! cache, promotion and demotion, multi-rule refunds, waiting, errors and reloads.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::Duration;

use leasehold_agent::{
    Admission, Check, CheckError, Decision, Limiter, LimiterConfig, ManualClock, Rules,
};

fn rules(text: &str) -> Rules {
    Rules::from_toml(text).expect("rules")
}

async fn limiter(text: &str) -> Limiter {
    limiter_with(Limiter::builder().embedded(), text).await
}

/// [`limiter`] on `clock`: time moves only when the test moves it.
async fn limiter_on(clock: &ManualClock, text: &str) -> Limiter {
    limiter_with(Limiter::builder().clock(clock), text).await
}

async fn limiter_with(builder: leasehold_agent::LimiterBuilder, text: &str) -> Limiter {
    builder
        .rules(rules(text))
        .config({
            let mut c = LimiterConfig::default();
            c.hot_above_per_sec = 5;
            c.idle_after = Duration::from_millis(300);
            c.forget_after = Duration::from_millis(600);
            c.sweep_every = Duration::from_millis(20);
            c
        })
        .build()
        .await
        .expect("limiter")
}

const LEASED: &str = r#"
[rules.api]
capacity = 1000
rate = "100/s"
leasing = "lease"
lease_max = 100
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_key_decides_without_the_store_in_steady_state() {
    let l = limiter(LEASED).await;
    // A steady 5000 decisions/s. Warm up: the agent measures the demand and sizes its
    // lease; then prefetches keep the lease ahead of the demand.
    for i in 0..200 {
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(matches!(
            l.check(&"api".into(), "t", 1).await.unwrap(),
            Decision::Allowed { .. }
        ));
    }
    let calls = l.stats("api").unwrap().store_calls;
    // A steady 5000 decisions/s: prefetches keep the lease ahead of the demand.
    let mut fast = 0;
    for i in 0..200 {
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if let Some(Decision::Allowed {
            via: Admission::Lease,
            ..
        }) = l.try_check(&"api".into(), "t", 1).unwrap()
        {
            fast += 1;
        }
    }
    assert_eq!(fast, 200, "a live lease answers without waiting");
    let s = l.stats("api").unwrap();
    assert!(
        s.store_calls - calls <= 8,
        "a few prefetches for 200 decisions: {s:?}"
    );
}

#[tokio::test]
async fn empty_bucket_is_remembered_until_the_refill_time() {
    let l = limiter("[rules.api]\ncapacity = 3\nrate = \"1/10s\"\nleasing = \"exact\"\n").await;
    for _ in 0..3 {
        assert!(matches!(
            l.check(&"api".into(), "t", 1).await.unwrap(),
            Decision::Allowed {
                via: Admission::Exact,
                ..
            }
        ));
    }
    let Decision::Denied { retry_after } = l.check(&"api".into(), "t", 1).await.unwrap() else {
        panic!("the bucket is empty")
    };
    assert!(
        retry_after > Duration::from_secs(9) && retry_after <= Duration::from_secs(10),
        "{retry_after:?}"
    );
    let calls = l.stats("api").unwrap().store_calls;
    for _ in 0..100 {
        let d = l
            .try_check(&"api".into(), "t", 1)
            .unwrap()
            .expect("negative cache answers at once");
        assert!(matches!(d, Decision::Denied { retry_after } if retry_after > Duration::ZERO));
    }
    assert_eq!(
        l.stats("api").unwrap().store_calls,
        calls,
        "denials cost no store call"
    );
}

/// A cached denial covers the costs it was made for: after a cost of 5 is refused with
/// 2 tokens left, a cost of 1 is still admitted (the store decides it), and one of 5 or
/// more is denied from the cache, a larger one told to wait for its own tokens.
#[tokio::test]
async fn a_cached_denial_does_not_refuse_a_smaller_cost_the_bucket_holds() {
    let l = limiter("[rules.api]\ncapacity = 10\nrate = \"1/10s\"\nleasing = \"exact\"\n").await;
    for _ in 0..8 {
        assert!(matches!(
            l.check(&"api".into(), "t", 1).await.unwrap(),
            Decision::Allowed { .. }
        ));
    }
    assert!(matches!(
        l.check(&"api".into(), "t", 5).await.unwrap(),
        Decision::Denied { .. }
    ));
    let calls = l.stats("api").unwrap().store_calls;
    // Cost 5 lacks 3 tokens (30 s at 1/10s); cost 6 lacks 4 (40 s).
    let Decision::Denied { retry_after } = l.check(&"api".into(), "t", 6).await.unwrap() else {
        panic!("cost 6 with 2 left")
    };
    assert!(
        retry_after > Duration::from_secs(35) && retry_after <= Duration::from_secs(40),
        "{retry_after:?}"
    );
    assert_eq!(
        l.stats("api").unwrap().store_calls,
        calls,
        "cost 6: from the cache"
    );
    for left in [1, 0] {
        assert!(
            matches!(
                l.check(&"api".into(), "t", 1).await.unwrap(),
                Decision::Allowed { remaining, .. } if remaining == left
            ),
            "cost 1 with {} left",
            left + 1
        );
    }
    assert!(matches!(
        l.check(&"api".into(), "t", 1).await.unwrap(),
        Decision::Denied { .. }
    ));
}

/// A leased key whose one agent's callers want far more than the rate (cost 10 every
/// 10 ms on 10 tokens/s): the denials while the lease refills name a time at which the
/// rate can have brought what the lease lacks (at least one token, 100 ms), not the
/// pacing of the agent's own prefetches (once 11-53 ms for most of them: the share it
/// reported, 20-40 times the rate, was taken as its rate), and at most the cost's whole
/// refill. (A denial the store named may be shorter: the bucket had most of the cost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_of_a_refilling_lease_is_what_the_rate_brings() {
    let clock = ManualClock::new();
    let l = limiter_on(
        &clock,
        "[rules.api]\ncapacity = 100\nrate = \"10/s\"\nleasing = \"lease\"\n",
    )
    .await;
    let mut waits = Vec::new();
    for _ in 0..80 {
        if let Decision::Denied { retry_after } = l.check(&"api".into(), "t", 10).await.unwrap() {
            waits.push(retry_after);
        }
        // 10 ms pass for the agent and the store; the refills it asked for land meanwhile.
        clock.advance(Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        waits.len() > 40,
        "the bucket ran dry: {} denials of 80",
        waits.len()
    );
    let short = waits
        .iter()
        .filter(|w| **w < Duration::from_millis(100))
        .count();
    assert!(
        short * 10 <= waits.len(),
        "{short} of {} under 100 ms: {waits:?}",
        waits.len()
    );
    assert!(
        waits.iter().all(|w| *w <= Duration::from_secs(1)),
        "cost 10 at 10 tokens/s: {waits:?}"
    );
}

#[tokio::test]
async fn errors_name_what_is_wrong() {
    let l = limiter("[rules.api]\ncapacity = 10\nrate = \"1/s\"\n").await;
    assert!(matches!(
        l.check(&"api".into(), "t", 11).await,
        Err(CheckError::CostExceedsCapacity {
            cost: 11,
            capacity: 10,
            ..
        })
    ));
    let e = l
        .check(&"nope".into(), "t", 1)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"nope\"") && e.contains("api"), "{e}");
    assert!(matches!(
        l.check(&"api".into(), "", 1).await,
        Err(CheckError::Subject(_))
    ));
    assert!(matches!(
        l.check(&"api".into(), "t", 0).await,
        Err(CheckError::ZeroCost)
    ));
    // Hostile subjects are just subjects.
    let big = vec![b'{'; 1 << 20];
    assert!(matches!(
        l.check(&"api".into(), &big, 1).await.unwrap(),
        Decision::Allowed { .. }
    ));
    assert!(matches!(
        l.check(&"api".into(), b"\0}{x", 1).await.unwrap(),
        Decision::Allowed { .. }
    ));
}

#[tokio::test]
async fn cold_keys_are_promoted_then_demoted_and_forgotten() {
    let l = limiter("[rules.api]\ncapacity = 1000\nrate = \"1000/s\"\nlease_ttl = \"2s\"\n").await;
    for _ in 0..10 {
        l.check(&"api".into(), "warm", 1).await.unwrap();
    }
    let s = l.stats("api").unwrap();
    assert!(s.admitted_exact >= 5, "cold at first: {s:?}");
    for _ in 0..200 {
        l.check(&"api".into(), "warm", 1).await.unwrap();
    }
    let s = l.stats("api").unwrap();
    assert!(s.admitted_lease > 150, "promoted to leasing: {s:?}");
    assert!(s.lease_grants >= 1);
    // Idle: the lease goes back, the key goes cold, then it is forgotten.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s = l.stats("api").unwrap();
    assert!(s.lease_returns >= 1, "idle lease returned: {s:?}");
    assert_eq!(l.keys_in_memory(), 0, "idle cold key forgotten");
}

#[tokio::test]
async fn multi_rule_denial_refunds_the_other_leases() {
    // The tenant bucket is exactly one lease of 50 and barely refills.
    let l = limiter(
        "[rules.tenant]\ncapacity = 50\nrate = \"1/100s\"\nleasing = \"lease\"\nlease_min = 50\nlease_max = 50\n\
         [rules.endpoint]\ncapacity = 1\nrate = \"1/100s\"\nleasing = \"exact\"\n",
    )
    .await;
    assert!(matches!(
        l.check(&"tenant".into(), "t", 10).await.unwrap(),
        Decision::Allowed { .. }
    ));
    let checks = [
        Check::new(&"tenant".into(), "t", 10),
        Check::new(&"endpoint".into(), "e", 1),
    ];
    assert!(matches!(
        l.check_all(&checks).await.unwrap(),
        Decision::Allowed { .. }
    ));
    // The endpoint bucket is now empty: the tenant's 10 tokens must come back.
    assert!(matches!(
        l.check_all(&checks).await.unwrap(),
        Decision::Denied { .. }
    ));
    let mut spent = 0;
    while let Some(Decision::Allowed {
        via: Admission::Lease,
        ..
    }) = l.try_check(&"tenant".into(), "t", 1).unwrap()
    {
        spent += 1;
    }
    assert_eq!(l.stats("tenant").unwrap().lease_tokens_granted, 50);
    assert_eq!(
        spent, 30,
        "50 leased - 10 - 10 admitted; the denied request's 10 came back"
    );
}

#[tokio::test]
async fn check_wait_queues_until_tokens_arrive() {
    let l = limiter("[rules.api]\ncapacity = 2\nrate = \"10/s\"\nleasing = \"exact\"\n").await;
    let start = tokio::time::Instant::now();
    let mut admitted = 0;
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let l = l.clone();
            tokio::spawn(async move {
                l.check_wait(&"api".into(), "t", 1, Duration::from_secs(2))
                    .await
            })
        })
        .collect();
    for t in tasks {
        if let Decision::Allowed { .. } = t.await.unwrap().unwrap() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 6, "everyone waited for a token");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(350),
        "4 refills at 10/s take 400ms, took {took:?}"
    );
    // A wait longer than allowed is a plain denial.
    let d = l
        .check_wait(&"api".into(), "t", 2, Duration::from_millis(1))
        .await
        .unwrap();
    assert!(matches!(d, Decision::Denied { .. }));
}

#[tokio::test]
async fn a_bad_rules_file_is_refused_and_the_old_rules_stay() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, "[rules.api]\ncapacity = 5\nrate = \"1/s\"\n").unwrap();
    let l = Limiter::builder()
        .embedded()
        .rules_file(&path)
        .build()
        .await
        .unwrap();
    assert_eq!(l.bucket_params("api").unwrap().capacity, 5);
    std::fs::write(&path, "[rules.api]\ncapacity = 0\nrate = \"1/s\"\n").unwrap();
    let e = l.reload_rules().unwrap_err().to_string();
    assert!(e.contains("capacity"), "{e}");
    assert_eq!(
        l.bucket_params("api").unwrap().capacity,
        5,
        "old rules stay in force"
    );
    std::fs::write(
        &path,
        "[rules.api]\ncapacity = 7\nrate = \"1/s\"\n[rules.new]\ncapacity = 1\nrate = \"1/s\"\n",
    )
    .unwrap();
    assert_eq!(l.reload_rules().unwrap(), 2);
    assert_eq!(l.bucket_params("api").unwrap().capacity, 7);
    assert!(matches!(
        l.check(&"new".into(), "t", 1).await.unwrap(),
        Decision::Allowed { .. }
    ));
}

#[tokio::test]
async fn watched_rules_file_reloads_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, "[rules.api]\ncapacity = 5\nrate = \"1/s\"\n").unwrap();
    let l = Limiter::builder()
        .embedded()
        .rules_file(&path)
        .watch_rules(Duration::from_millis(20))
        .build()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    std::fs::write(&path, "[rules.api]\ncapacity = 9\nrate = \"1/s\"\n").unwrap();
    let f = std::fs::File::options().append(true).open(&path).unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(1))
        .unwrap();
    for _ in 0..100 {
        if l.bucket_params("api").unwrap().capacity == 9 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the watched rules file was not reloaded");
}

/// `shutdown` returns what the leases hold, stops the background loop, and leaves the
/// limiter deciding by exact calls: nothing is leased again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_leases_and_leases_nothing_after() {
    let l = limiter(LEASED).await;
    for _ in 0..50 {
        l.check(&"api".into(), "t", 1).await.expect("check");
    }
    let before = l.stats("api").expect("stats");
    assert!(before.lease_grants > 0, "{before:?}");
    l.shutdown().await;
    let after = l.stats("api").expect("stats");
    assert!(
        after.lease_tokens_returned > before.lease_tokens_returned,
        "the unspent lease went back: {after:?}"
    );
    for _ in 0..20 {
        let d = l.check(&"api".into(), "t", 1).await.expect("check");
        assert!(
            matches!(
                d,
                Decision::Allowed {
                    via: Admission::Exact,
                    ..
                }
            ),
            "{d:?}"
        );
    }
    // No refill or sweep runs any more: the lease counters stay where they were.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let end = l.stats("api").expect("stats");
    assert_eq!(end.lease_grants, after.lease_grants, "{end:?}");
    assert_eq!(end.admitted_exact, after.admitted_exact + 20, "{end:?}");
}

/// At `max_keys` a key seen for the first time is decided without keeping its state, and
/// one seen again takes the place of an idle cold key (none is decided without keeping
/// state while idle keys can go); the map stays at the cap, a key that leases is never
/// dropped (its lease goes on deciding), and a key kept out or dropped loses nothing: its
/// bucket is the store's, so a subject admitted once is denied again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_keys_a_new_key_takes_an_idle_keys_place_and_leases_stay() {
    let l = Limiter::builder()
        .embedded()
        .rules(rules(
            "[rules.leased]\ncapacity = 1000\nrate = \"100/s\"\nleasing = \"lease\"\n\
             lease_max = 100\n\n[rules.once]\ncapacity = 1\nrate = \"1/1h\"\nleasing = \"exact\"\n",
        ))
        .config({
            let mut c = LimiterConfig::default();
            c.max_keys = 300;
            c
        })
        .build()
        .await
        .unwrap();
    let leased: Vec<String> = (0..20).map(|i| format!("lease-{i}")).collect();
    for s in &leased {
        let mut via_lease = false;
        for _ in 0..200 {
            if let Decision::Allowed {
                via: Admission::Lease,
                ..
            } = l.check(&"leased".into(), s, 1).await.unwrap()
            {
                via_lease = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(via_lease, "{s} never decided from its lease");
    }
    let flood = 3000;
    for i in 0..flood {
        let first = l
            .check(&"once".into(), &format!("once-{i}"), 1)
            .await
            .unwrap();
        assert!(
            matches!(first, Decision::Allowed { .. }),
            "once-{i}: {first:?}"
        );
        let again = l
            .check(&"once".into(), &format!("once-{i}"), 1)
            .await
            .unwrap();
        assert!(
            matches!(again, Decision::Denied { .. }),
            "once-{i} again: {again:?}"
        );
        assert!(l.keys_in_memory() <= 300, "{} keys", l.keys_in_memory());
    }
    let (evicted, without_state) = l.keys_evicted();
    assert_eq!(
        without_state, 0,
        "decided without state while idle keys could go"
    );
    // Each new key past the cap: kept out the first time, let in the second.
    let first_seen = l.keys_first_seen();
    assert!(
        first_seen >= flood - 300 && first_seen <= flood,
        "{first_seen} first sightings kept out for {flood} new keys"
    );
    assert!(
        evicted >= flood - 300,
        "{evicted} evicted for {flood} new keys seen twice"
    );
    for s in &leased {
        let d = l.check(&"leased".into(), s, 1).await.unwrap();
        assert!(
            matches!(
                d,
                Decision::Allowed {
                    via: Admission::Lease,
                    ..
                }
            ),
            "{s} lost its lease: {d:?}"
        );
    }
    for i in 0..100 {
        let d = l
            .check(&"once".into(), &format!("once-{i}"), 1)
            .await
            .unwrap();
        assert!(
            matches!(d, Decision::Denied { .. }),
            "once-{i} again: {d:?}"
        );
    }
}

/// The in-process store (what `leasehold serve` uses without `--redis`) drops the buckets
/// Redis would have expired, whatever the traffic: a flood of distinct keys that are full
/// again within milliseconds leaves about a sweep's worth of them, not the whole flood.
/// (Not in agent_memory.rs, whose test measures this process's RSS.)
#[test]
fn the_embedded_store_sweeps_buckets_redis_would_have_expired() {
    use leasehold_core::key::BucketKey;
    use leasehold_core::model::{AgentId, Op, Request};
    use leasehold_core::rule::RuleName;
    // The store's clock moves 10 µs a call, whatever this machine's speed: about 1 100
    // keys are live at any time, so the bound below holds on a fast box and a slow one.
    let clock = std::sync::atomic::AtomicU64::new(1_700_000_000_000_000);
    let store = leasehold_agent::EmbeddedStore::with_time(move || {
        clock.fetch_add(10, std::sync::atomic::Ordering::Relaxed)
    });
    // A token a millisecond: each key is full again 1 ms after its one debit, and
    // expires a grace (10 ms) later.
    let p = support::params(1, "1000/s", "100ms", "10ms", None);
    let rule = RuleName::new("flood").expect("name");
    let flood = 200_000u64;
    for i in 0..flood {
        let key = BucketKey::new(&rule, format!("value-{i}")).expect("key");
        let req = Request {
            agent: AgentId(1),
            seq: i + 1,
            op: Op::Exact { cost: 1 },
        };
        let reply = store.call(&key, &p, &req).expect("call");
        assert_eq!(reply.granted, 1, "each new key's one token");
    }
    let held = store.buckets() as u64;
    println!("{flood} distinct keys: {held} buckets held");
    // A sweep whenever a shard served as many calls as it holds: at most about twice
    // what is live (here a few per shard) plus 64 a shard.
    assert!(held < 64 * 2 * 64, "{held} of {flood} buckets still held");

    // Exact batches' dedup logs go the same way (one batch of one key each).
    let items_of = |i: u64| BucketKey::new(&rule, format!("batch-{i}")).expect("key");
    for i in 0..flood / 4 {
        let key = items_of(i);
        let item = leasehold_store::wire::ExactItem {
            key: &key,
            params: &p,
            costs: &[1],
        };
        store.exact_many(AgentId(2), i + 1, &[item]).expect("batch");
    }
    let logs = store.batch_logs() as u64;
    println!("{} batches: {logs} dedup logs held", flood / 4);
    assert!(logs < 64 * 2 * 64, "{logs} dedup logs still held");
}

/// On a clock the test moves: a denial lasts exactly until the time it names, not a
/// microsecond less, whatever the machine's load.
#[tokio::test]
async fn a_denial_lasts_exactly_until_its_retry_after() {
    let clock = ManualClock::new();
    let l = limiter_on(
        &clock,
        "[rules.api]\ncapacity = 2\nrate = \"1/s\"\nleasing = \"exact\"\n",
    )
    .await;
    let api = l.rule("api").unwrap();
    for _ in 0..2 {
        assert!(matches!(
            l.check(&api, "t", 1).await.unwrap(),
            Decision::Allowed { .. }
        ));
    }
    let Decision::Denied { retry_after } = l.check(&api, "t", 1).await.unwrap() else {
        panic!("the bucket is empty");
    };
    assert_eq!(retry_after, Duration::from_secs(1), "one token at 1/s");
    clock.advance(retry_after - Duration::from_micros(1));
    assert!(matches!(
        l.check(&api, "t", 1).await.unwrap(),
        Decision::Denied { .. }
    ));
    clock.advance(Duration::from_micros(1));
    assert!(matches!(
        l.check(&api, "t", 1).await.unwrap(),
        Decision::Allowed { .. }
    ));
}
