//! Keys, clocks and the function library on a real Redis: I4, I5, I6, I7, and the
//! single-flight reload of a lost library.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use leasehold_agent::{LIBRARY, RedisStore, StoreError};
use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, Op, Reply, Request};
use leasehold_core::rule::{BucketParams, RuleName};
use leasehold_core::{LocalLease, Spend};
use leasehold_redis_harness::RedisServer;
use support::{field, params, runtime, server, store};

fn rule() -> RuleName {
    RuleName::new("keys").expect("name")
}

fn exact(agent: u64, seq: u64, cost: u64) -> Request {
    Request {
        agent: AgentId(agent),
        seq,
        op: Op::Exact { cost },
    }
}

fn server_time_us(server: &RedisServer) -> u64 {
    let t: Vec<String> = server.cmd(&["TIME"]).expect("TIME");
    t[0].parse::<u64>().expect("secs") * 1_000_000 + t[1].parse::<u64>().expect("usecs")
}

/// I5: a bucket written by a node whose clock ran an hour ahead (then failed over to a
/// node with a correct clock) creates no tokens until the server clock catches up.
#[test]
fn i5_stored_time_ahead_of_the_server_creates_no_tokens() {
    let server = server();
    let p = params(10, "100/s", "1s", "1s", None);
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let k = BucketKey::new(&rule(), "clock").expect("key");
        st.call(&k, &p, &exact(1, 1, 10)).await.expect("drain");
        let ahead = server_time_us(&server) + 3_600_000_000;
        // The state field's fourth integer is ts (wire::STATE).
        let mut c = server.connection().expect("connection");
        let state: Vec<u8> = redis::cmd("HGET")
            .arg(k.as_str())
            .arg(leasehold_store::wire::STATE)
            .query(&mut c)
            .expect("HGET");
        let mut numbers = leasehold_store::wire::unpack_numbers(&state).expect("a state");
        numbers[3] = ahead;
        let _: i64 = redis::cmd("HSET")
            .arg(k.as_str())
            .arg(leasehold_store::wire::STATE)
            .arg(leasehold_store::wire::pack_numbers(&numbers))
            .query(&mut c)
            .expect("HSET");
        tokio::time::sleep(Duration::from_millis(300)).await; // 30 tokens' worth of refill
        let r = st.call(&k, &p, &exact(1, 2, 1)).await.expect("call");
        assert_eq!(r.granted, 0, "tokens were created by a clock stepping back");
        assert_eq!(
            r.now_us, ahead,
            "time must not move back: now = max(now, last)"
        );
        assert_eq!(field(&server, k.as_str(), "tok"), 0);
        println!(
            "stored time 1h ahead: after 300ms of wall time, granted {} and now_us == stored ts",
            r.granted
        );
    });
}

/// I6: the key outlives every lease in it and lives until the bucket would be full again,
/// then Redis removes it.
#[test]
fn i6_key_expires_only_when_full_and_leaseless() {
    let server = server();
    // Lease 200ms + grace 100ms, then 10 tokens at 50/s = 200ms to refill: 500ms.
    let p = params(10, "50/s", "200ms", "100ms", None);
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let k = BucketKey::new(&rule(), "expiry").expect("key");
        let req = Request {
            agent: AgentId(3),
            seq: 1,
            op: Op::Acquire {
                held: 0,
                want: 10,
                min: 1,
                demand: 0,
            },
        };
        let r = st.call(&k, &p, &req).await.expect("acquire");
        assert_eq!(r.granted, 10);
        let at_ms: u64 = server
            .cmd(&["PEXPIRETIME", k.as_str()])
            .expect("PEXPIRETIME");
        assert!(
            at_ms * 1000 >= r.now_us + 500_000,
            "key would expire before it is full again"
        );
        assert!(
            at_ms * 1000 <= r.now_us + 502_000,
            "key lives longer than needed"
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        let exists: i64 = server.cmd(&["EXISTS", k.as_str()]).expect("EXISTS");
        assert_eq!(exists, 1, "deleted while its lease or refill was pending");
        let wait_ms = (at_ms * 1000).saturating_sub(server_time_us(&server)) / 1000 + 20;
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        let exists: i64 = server.cmd(&["EXISTS", k.as_str()]).expect("EXISTS");
        assert_eq!(exists, 0, "a full, leaseless bucket should have expired");
        // And an absent key is a full bucket.
        let r = st.call(&k, &p, &exact(4, 1, 10)).await.expect("exact");
        assert_eq!(r.granted, 10);
    });
}

/// I4: an agent's local lease ends (on its own clock, from the moment it sent the
/// acquire, minus a margin) while the store still counts the agent's tokens.
#[test]
fn i4_local_lease_ends_before_the_store_forgets_it() {
    let server = server();
    let p = params(10, "1/s", "300ms", "50ms", None);
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let k = BucketKey::new(&rule(), "deadline").expect("key");
        let start = std::time::Instant::now();
        let clock = || start.elapsed().as_nanos() as u64;
        let lease = LocalLease::new();
        let sent = clock();
        let req = Request {
            agent: AgentId(0xD),
            seq: 1,
            op: Op::Acquire {
                held: lease.declare(sent),
                want: 5,
                min: 1,
                demand: 0,
            },
        };
        let r: Reply = st.call(&k, &p, &req).await.expect("acquire");
        lease.grant(r.granted, sent + r.ttl_us * 1000 - 10_000_000);
        assert!(matches!(lease.try_spend(1, clock()), Spend::Spent { .. }));
        while clock() < lease.deadline_ns() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(lease.try_spend(1, clock()), Spend::Expired);
        let drop_us = field(&server, k.as_str(), &format!("{}:x", AgentId(0xD)));
        let now_us = server_time_us(&server);
        assert!(
            drop_us > now_us,
            "the store forgot the lease before the agent stopped spending"
        );
        println!(
            "local lease ended {}µs before the store drops the record",
            drop_us - now_us
        );
    });
}

/// I7: every call touches exactly its own key, whatever the subject: after calls for N
/// hostile subjects the database holds exactly N keys. And the library itself only ever
/// names KEYS[1].
#[test]
fn i7_each_call_touches_exactly_its_own_key() {
    let server = server();
    let p = params(5, "1/s", "1s", "1s", None);
    let long = "y".repeat(1 << 20);
    let subjects: Vec<Vec<u8>> = vec![
        b"plain".to_vec(),
        b"{".to_vec(),
        b"}".to_vec(),
        b"{x}".to_vec(),
        b"}{plain".to_vec(),
        b"\0\0\0".to_vec(),
        b"\xff\xfe\x00{".to_vec(),
        "tenant ✓ ünïcode".as_bytes().to_vec(),
        long.into_bytes(),
        vec![b'%'; 10_000],
    ];
    runtime().block_on(async {
        let st = store(&server.url()).await;
        for (i, s) in subjects.iter().enumerate() {
            let k = BucketKey::new(&rule(), s).expect("key");
            let req = Request {
                agent: AgentId(i as u64 + 1),
                seq: 1,
                op: Op::Acquire {
                    held: 0,
                    want: 2,
                    min: 1,
                    demand: 0,
                },
            };
            let r = st.call(&k, &p, &req).await.expect("call");
            assert_eq!(r.granted, 2, "each subject has its own full bucket");
        }
    });
    let n: i64 = server.cmd(&["DBSIZE"]).expect("DBSIZE");
    assert_eq!(n as usize, subjects.len());
    // `rcall` is `redis.call` bound to a local by the first call (and only there).
    assert_eq!(
        LIBRARY.matches("rcall = ").count() + LIBRARY.matches("rcall, ").count(),
        2,
        "rcall is declared and bound once each"
    );
    assert!(LIBRARY.contains(
        "sfind, rcall, spack, sunpack = string.find, redis.call, struct.pack, struct.unpack\n"
    ));
    let calls = LIBRARY.lines().filter(|l| {
        l.contains("redis.call(") || l.contains("redis.pcall(") || l.contains("rcall(")
    });
    assert!(calls.clone().any(|l| l.contains("rcall(")));
    for line in calls {
        let args = line
            .split("redis.call(")
            .nth(1)
            .or_else(|| line.split("redis.pcall(").nth(1))
            .or_else(|| line.split("rcall(").nth(1))
            .unwrap_or_default();
        let target = args
            .split(',')
            .nth(1)
            .map(|a| a.trim().trim_end_matches(')'));
        // A batch reads all its bucket keys at once (keys[2..], each checked as a bucket
        // key before) and counts those of them MGET found no string at.
        let ok = args.starts_with("'TIME')")
            || target == Some("key")
            || target == Some("dkey")
            || args.starts_with("'MGET', unpack(keys, 2, nkeys))")
            || args.starts_with("'EXISTS', unpack(absent))");
        assert!(
            ok,
            "a redis.call that does not target the call's one key: {line}"
        );
    }
    // ... and `key` is only ever bound to KEYS[1], directly or through `the_key`, which
    // checks it and returns it, or (a batch) to each bucket key of a batch, which is
    // checked as a bucket key before anything is read; `dkey`, the batch's dedup key, must
    // be its first bucket key's name plus `:b:AGENT:SEQ` (same slot, never a foreign key).
    for line in LIBRARY.lines().filter(|l| l.contains(" key =")) {
        assert!(
            [
                "local key = keys[1]",
                "local key = the_key(keys, p)",
                "local key = keys[k]",
                "local key = keys[k + 1]"
            ]
            .contains(&line.trim()),
            "key bound to something else: {line}"
        );
    }
    let batch = LIBRARY
        .split("local function exact_batch(keys, id, args, first)")
        .nth(1)
        .and_then(|body| body.split("\nend\n").next())
        .expect("exact_batch");
    assert!(batch.contains("if not bucket_key(key) then fail("));
    assert!(
        batch.find("if not bucket_key(key) then fail(")
            < batch.find("rcall('MGET', unpack(keys, 2, nkeys))"),
        "the batch's keys are checked before they are read"
    );
    assert!(batch.contains("      absent[#absent + 1] = key\n"));
    assert!(
        LIBRARY
            .contains("  return #key <= 512 and sfind(key, '^lh:{[%w%._%-]+|[^{}|]+}$') ~= nil\n")
    );
    let check = "if dkey ~= keys[2] .. ':b:' .. id .. ':' .. fmt(seq) then";
    assert!(batch.contains(check));
    assert!(
        batch.find("local kept = redis.call('GET', dkey)") > batch.find(check),
        "the dedup key is checked before it is read"
    );
    let the_key = LIBRARY
        .split("local function the_key(keys, p)")
        .nth(1)
        .and_then(|body| body.split("\nend\n").next())
        .expect("the_key");
    assert!(the_key.contains("local key = keys[1]") && the_key.trim_end().ends_with("return key"));
}

/// A fleet starting together does not have Redis compile the library once per agent: an
/// agent that finds this text of it loaded does not load it again; one that finds another
/// text (an older build's) replaces it.
#[test]
fn the_library_is_loaded_once_for_many_agents() {
    let server = server();
    let p = params(1_000, "1000/s", "1s", "1s", None);
    runtime().block_on(async {
        let first = store(&server.url()).await;
        assert_eq!(first.library_loads(), 1);
        for _ in 0..3 {
            let next = store(&server.url()).await;
            assert_eq!(next.library_loads(), 0, "loaded again though it was there");
            let k = BucketKey::new(&rule(), "many").expect("key");
            next.call(&k, &p, &exact(7, 1, 1)).await.expect("call");
        }
        let older = LIBRARY.replace("LEASEHOLD_FINGERPRINT", "an older build");
        let _: String = server
            .cmd(&["FUNCTION", "LOAD", "REPLACE", &older])
            .expect("FUNCTION LOAD");
        let upgraded = store(&server.url()).await;
        assert_eq!(upgraded.library_loads(), 1, "another text must be replaced");
        let print: String = server
            .cmd(&["FCALL_RO", "lh_fingerprint", "0"])
            .expect("lh_fingerprint");
        assert!(print.starts_with("leasehold-"), "{print}");
    });
}

/// A library lost under load (FUNCTION FLUSH) is loaded again exactly once, and every
/// caller's decision goes through.
#[test]
fn function_flush_under_load_reloads_once() {
    let server = server();
    let p = params(1_000_000, "1000000/s", "1s", "1s", None);
    runtime().block_on(async {
        let st = store(&server.url()).await;
        assert_eq!(st.library_loads(), 1);
        let k = BucketKey::new(&rule(), "flush").expect("key");
        st.call(&k, &p, &exact(1, 1, 1)).await.expect("warm");
        let _: String = server.cmd(&["FUNCTION", "FLUSH"]).expect("FUNCTION FLUSH");
        let tasks: Vec<_> = (0..32u64)
            .map(|i| {
                let (st, k) = (st.clone(), k.clone());
                tokio::spawn(async move {
                    for seq in 1..=20 {
                        st.call(&k, &p, &exact(100 + i, seq, 1))
                            .await
                            .expect("call after flush");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(
            st.library_loads(),
            2,
            "the library must be reloaded once, not by every caller"
        );
        println!(
            "32 concurrent callers after FUNCTION FLUSH: 640 calls ok, library loads {}",
            st.library_loads()
        );
    });
}

/// A restarted Redis (no persistence: no data, no functions) is reconnected to and the
/// library reloaded, without a new store.
#[test]
fn restarted_redis_gets_the_library_again() {
    let mut server = server();
    let p = params(10, "1/s", "1s", "1s", None);
    runtime().block_on(async {
        let st: Arc<RedisStore> = Arc::new(store(&server.url()).await);
        let k = BucketKey::new(&rule(), "restart").expect("key");
        st.call(&k, &p, &exact(1, 1, 1)).await.expect("before");
        server.restart().expect("restart");
        let mut outcome = None;
        for seq in 2..100 {
            match st.call(&k, &p, &exact(1, seq, 1)).await {
                Ok(r) => {
                    outcome = Some(r);
                    break;
                }
                Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => panic!("after restart: {e}"),
            }
        }
        let r = outcome.expect("no success within 5s of the restart");
        assert_eq!(r.granted, 1);
        assert_eq!(st.library_loads(), 2);
    });
}

/// Bad connection targets fail with an error that says what is wrong, quickly.
#[test]
fn unreachable_or_malformed_redis_is_reported() {
    runtime().block_on(async {
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = free.local_addr().expect("addr").port();
        drop(free);
        let started = std::time::Instant::now();
        let e = RedisStore::connect(&format!("redis://127.0.0.1:{port}"), support::config())
            .await
            .expect_err("nothing listens there");
        assert!(
            matches!(e, StoreError::Unavailable(_) | StoreError::Timeout(_)),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(6));
        let e = RedisStore::connect("http://nope", support::config())
            .await
            .expect_err("bad url");
        assert!(e.to_string().contains("redis url"), "{e}");
    });
    // A store whose eviction policy may drop bucket keys is detectable.
    let server = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"])
        .unwrap_or_else(|e| panic!("{e}"));
    runtime().block_on(async {
        let st = store(&server.url()).await;
        assert_eq!(st.maxmemory_policy().await.expect("policy"), "allkeys-lru");
    });
}

/// Parameters that could never grant are refused before anything is sent.
#[test]
fn cost_above_capacity_is_refused_locally() {
    let server = server();
    let p: BucketParams = params(10, "1/s", "1s", "1s", None);
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let k = BucketKey::new(&rule(), "big").expect("key");
        let e = st
            .call(&k, &p, &exact(1, 1, 11))
            .await
            .expect_err("11 > 10");
        assert!(e.to_string().contains("at most 10"), "{e}");
        let exists: i64 = server.cmd(&["EXISTS", k.as_str()]).expect("EXISTS");
        assert_eq!(exists, 0);
    });
}
