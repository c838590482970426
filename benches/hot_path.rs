//! The hot path: a decision on a key whose local lease covers it, against governor's keyed
//! limiter (local only, no global budget) in the same group, with 1 and 2 threads over
//! 10 000 keys, then 1 000. Each thread walks the keys round-robin. At 10 000 keys the
//! agent's per-key state is spread over megabytes of heap (each key's creation allocates
//! its driver and the store call's buffers between one key's state and the next), so the
//! two sizes show memory locality apart from the work per decision. Then a key over its
//! limit: a denial the agent cached, against governor's denial of a spent quota.
//!
//! `cargo bench --bench hot_path`; compare the two lines of each group: absolute times
//! on a shared 2-core machine prove little.
#![allow(missing_docs, clippy::expect_used, clippy::unwrap_used)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use leasehold::agent::{Decision, Limiter, LimiterConfig, Rules};

fn keys(n: usize) -> Arc<Vec<String>> {
    Arc::new((0..n).map(|i| format!("tenant-{i}")).collect())
}

/// A limiter on the embedded store with one rule, `bench`, as `rule` (TOML) says.
async fn embedded(rule: &str) -> Limiter {
    let rules = Rules::from_toml(&format!("[rules.bench]\n{rule}")).unwrap();
    let mut config = LimiterConfig::default();
    // A group's keys sit idle while the other system's group runs: an idle lease goes
    // back to its bucket after `return_after` (500 ms by default), and the next group
    // would time the slow path. A key in steady use keeps its lease; so do these.
    config.idle_after = Duration::from_secs(1800);
    config.return_after = Duration::from_secs(1800);
    Limiter::builder()
        .embedded()
        .rules(rules)
        .config(config)
        .build()
        .await
        .unwrap()
}

fn leasehold_limiter(rt: &tokio::runtime::Runtime, keys: &[String]) -> Limiter {
    rt.block_on(async {
        let l = embedded(
            "capacity = 1000000000\nrate = \"1000000000/s\"\nleasing = \"lease\"\n\
             lease_min = 100000000\nlease_max = 100000000\nlease_ttl = \"1h\"\n",
        )
        .await;
        for k in keys {
            assert!(matches!(
                l.check(&"bench".into(), k, 1).await.unwrap(),
                Decision::Allowed { .. }
            ));
        }
        // Every key must hold a lease before timing starts, or the bench measures the
        // fall-through to the slow path instead of the hot path.
        let missing = keys
            .iter()
            .filter(|k| l.try_check(&"bench".into(), k, 1).unwrap().is_none())
            .count();
        assert_eq!(missing, 0, "{missing} of {} keys hold no lease", keys.len());
        l
    })
}

/// Runs `op(thread, i)` `iters` times on each of `threads` threads; returns the wall time
/// divided among the threads' operations as criterion expects (time per `iters`).
fn threaded(threads: usize, iters: u64, op: impl Fn(usize, u64) + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let op = &op;
            s.spawn(move || {
                for i in 0..iters {
                    op(t, i);
                }
            });
        }
    });
    start.elapsed()
}

fn hot_path(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    for n in [10_000usize, 1_000] {
        let keys = keys(n);
        let ours = leasehold_limiter(&rt, &keys);
        let quota = Quota::per_second(NonZeroU32::new(1_000_000_000).unwrap());
        let governor = RateLimiter::keyed(quota);
        for k in keys.iter() {
            let _ = governor.check_key(k);
        }
        let suffix = if n == 10_000 {
            String::new()
        } else {
            format!(", {n} keys")
        };
        compare(
            c,
            ("decision", &suffix),
            &keys,
            ("leasehold check (leased key)", &ours, |d| {
                matches!(d, Some(Decision::Allowed { .. }))
            }),
            ("governor check_key", &governor, true),
        );
    }
}

/// One group per thread count (1 and 2), `NAME/T-thread SUFFIX`: `ours` and `governor`
/// deciding `keys`, each thread walking them from its own offset; each decision must be
/// the one named (ours: the predicate; governor: admitted or not), checked the same way
/// on both sides (inlined, a counter bumped off the measured path when one is not).
fn compare(
    c: &mut Criterion,
    (name, suffix): (&str, &str),
    keys: &[String],
    ours: (&str, &Limiter, impl Fn(&Option<Decision>) -> bool + Sync),
    governor: (&str, &DefaultKeyedRateLimiter<String>, bool),
) {
    let n = keys.len();
    let at = |t: usize, i: u64| &keys[(i as usize * 7 + t * (n / 2 - 1)) % n];
    for threads in [1usize, 2] {
        let group = format!("{name}/{threads}-thread{suffix}");
        let mut g = c.benchmark_group(&group);
        g.throughput(criterion::Throughput::Elements(1));
        g.bench_function(ours.0, |b| {
            b.iter_custom(|iters| {
                checked(threads, iters, &group, |t, i| {
                    (ours.2)(&ours.1.try_check(&"bench".into(), at(t, i), 1).unwrap())
                })
            })
        });
        g.bench_function(governor.0, |b| {
            b.iter_custom(|iters| {
                checked(threads, iters, &group, |t, i| {
                    governor.1.check_key(at(t, i)).is_ok() == governor.2
                })
            })
        });
        g.finish();
    }
}

/// [`threaded`] over `decided(thread, i)`, which says whether its decision was the one
/// the group names. Any other (a lease gone, say) would time another path: counted, off
/// the measured path's way, and refused.
fn checked(
    threads: usize,
    iters: u64,
    group: &str,
    decided: impl Fn(usize, u64) -> bool + Sync,
) -> Duration {
    let wrong = AtomicU64::new(0);
    let took = threaded(threads, iters, |t, i| {
        if !black_box(decided(t, i)) {
            wrong.fetch_add(1, Ordering::Relaxed);
        }
    });
    let wrong = wrong.into_inner();
    assert_eq!(wrong, 0, "{group}: {wrong} decisions not as named");
    took
}

/// A limiter whose keys are all denied from the agent's cache: each had its one token
/// (B = 1, one token an hour, exact), then a denial the store timed an hour out.
fn denying_limiter(rt: &tokio::runtime::Runtime, keys: &[String]) -> Limiter {
    rt.block_on(async {
        let l = embedded("capacity = 1\nrate = \"1/h\"\nleasing = \"exact\"\n").await;
        for k in keys {
            for _ in 0..2 {
                let _ = l.check(&"bench".into(), k, 1).await.unwrap();
            }
            assert!(
                matches!(
                    l.try_check(&"bench".into(), k, 1).unwrap(),
                    Some(Decision::Denied { .. })
                ),
                "{k} is not denied from the cache"
            );
        }
        l
    })
}

/// A key over its limit: the decision is a denial the agent cached (the store named when
/// to try again), against governor's denial of a spent quota; 1 000 keys.
fn denial(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let n = 1_000;
    let keys = keys(n);
    let ours = denying_limiter(&rt, &keys);
    let governor = RateLimiter::keyed(Quota::per_hour(NonZeroU32::new(1).unwrap()));
    for k in keys.iter() {
        let _ = governor.check_key(k);
        assert!(governor.check_key(k).is_err());
    }
    compare(
        c,
        ("denial", &format!(", {n} keys")),
        &keys,
        ("leasehold check (cached denial)", &ours, |d| {
            matches!(d, Some(Decision::Denied { .. }))
        }),
        ("governor check_key (spent quota)", &governor, false),
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = hot_path, denial
}
criterion_main!(benches);
