//! The Lua functions against the reference model, on a real Redis.
//!
//! Random operation sequences (acquire, release, exact, exact batches over one or two
//! keys, replayed and stale sequence numbers, pauses long enough for leases, records and keys to expire, rule parameters
//! changing under a live bucket) run against Redis and against the model fed the server
//! time each reply reports. The replies must be identical, and after every call the hash
//! Redis holds and its expiry time must equal the model's, field for field.
//! Seed: `LEASEHOLD_SEED` (printed on every run); steps per rule: `LEASEHOLD_DIFF_STEPS`.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::Duration;

use leasehold_agent::StoreError;
use leasehold_core::key::BucketKey;
use leasehold_core::model::{
    AgentId, BatchLog, ExactOutcome, GlobalBucket, Op, ProtocolError, Request, Split,
};
use leasehold_core::rule::{BucketParams, RuleName, RuleSpec};
use leasehold_redis_harness::RedisServer;
use leasehold_store::ExactItem;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::{field, params, runtime, server, store};

fn seed() -> u64 {
    let seed = std::env::var("LEASEHOLD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("LEASEHOLD_SEED={seed}");
    seed
}

fn steps() -> usize {
    std::env::var("LEASEHOLD_DIFF_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(250)
}

/// How far behind `TIME` Redis's expiry clock (the command's start) may be.
const EXPIRY_CLOCK_GAP_MS: u64 = 50;

struct Case {
    name: &'static str,
    /// Parameter sets used at random on the same key (more than one: rules changing).
    params: Vec<BucketParams>,
    /// Longest pause between calls, ms.
    max_pause_ms: u64,
}

type Hash = std::collections::BTreeMap<String, String>;

/// The hash (or a compact bucket's string, as `wire::hash_fields` gives it), its expiry
/// (ms) and the server's time (ms), in one atomic read: a short-lived key may expire
/// between separate reads on a slow machine.
fn read(server: &RedisServer, key: &BucketKey) -> (Hash, i64, u64) {
    let mut c = server.connection().expect("connection");
    let (pairs, at, time): (Vec<Vec<u8>>, i64, Vec<u64>) = redis::Script::new(&format!(
        "local v \
         if redis.call('TYPE', KEYS[1])['ok'] == 'string' then \
           v = {{'{}', redis.call('GET', KEYS[1])}} \
         else v = redis.call('HGETALL', KEYS[1]) end \
         return {{v, redis.call('PEXPIRETIME', KEYS[1]), redis.call('TIME')}}",
        leasehold_store::wire::COMPACT
    ))
    .key(key.as_str())
    .invoke(&mut c)
    .expect("read the bucket");
    let redis: Hash = match pairs.first() {
        Some(name) if name == leasehold_store::wire::COMPACT.as_bytes() => [(
            leasehold_store::wire::COMPACT.to_owned(),
            leasehold_store::wire::compact_text(&pairs[1]).expect("a compact bucket"),
        )]
        .into(),
        _ => {
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = pairs
                .chunks(2)
                .map(|kv| (kv[0].clone(), kv[1].clone()))
                .collect();
            leasehold_store::wire::bucket_fields(&pairs).expect("a bucket's hash")
        }
    };
    (redis, at, time[0] * 1000 + time[1] / 1000)
}

fn check_same(server: &RedisServer, key: &BucketKey, model: &GlobalBucket, ctx: &str) {
    let (redis, at, now_ms) = read(server, key);
    if redis.is_empty()
        && let Some(s) = model.state()
        && s.expire_at_ms < now_ms
    {
        // Expired since the call, when the model says it would: nothing to compare.
        return;
    }
    assert_eq!(
        redis,
        leasehold_store::wire::hash_fields(model.state()),
        "hash differs {ctx}"
    );
    for name in redis
        .keys()
        .filter(|n| *n != leasehold_store::wire::COMPACT)
    {
        assert!(
            leasehold_core::schema::describe(name).is_some(),
            "hash field {name} is missing from leasehold_core::schema {ctx}"
        );
    }
    if let Some(s) = model.state() {
        assert_eq!(at, s.expire_at_ms as i64, "key expiry differs {ctx}");
    }
}

async fn run_case(server: &RedisServer, case: &Case, rng: &mut StdRng) {
    let st = store(&server.url()).await;
    let rule = RuleName::new(case.name).expect("rule name");
    let key = BucketKey::new(&rule, format!("subject-{}", rng.random::<u32>())).expect("key");
    let mut model = GlobalBucket::new();
    // Part 0 of the key, called with the split the parent last reported.
    let part_key = key.part_of(0, 0);
    let mut part_model = GlobalBucket::new();
    let mut split: Option<Split> = None;
    // Three agents make every kind of call; five more only exact batches.
    let agents: Vec<AgentId> = (0..8).map(|_| AgentId(rng.random())).collect();
    let mut seqs = [0u64; 8];
    // A retry re-sends the original command: same request, same rule parameters.
    let mut last: [Option<(Request, BucketParams, bool)>; 3] = [None; 3];
    let mut last_now = 0;
    let (mut replays, mut stales, mut denials, mut splits, mut part_calls) = (0, 0, 0, 0, 0);
    // Exact batches: on the key, sometimes with a second key in the same call.
    let other = BucketKey::new(&rule, format!("other-{}", rng.random::<u32>())).expect("key");
    let mut other_model = GlobalBucket::new();
    let mut last_batch: Vec<Option<Batch>> = vec![None; agents.len()];
    // Every batch each agent sent, to send one again as it was.
    let mut sent: Vec<Vec<Batch>> = vec![Vec::new(); agents.len()];
    // Each batch has its own dedup key (its agent and seq; the first key is always `key`).
    let mut logs: std::collections::HashMap<(usize, u64), BatchLog> =
        std::collections::HashMap::new();
    let mut batches = BatchCounts::default();
    for step in 0..steps() {
        let i = rng.random_range(0..3);
        let roll = rng.random_range(0..100);
        if (12..26).contains(&roll) {
            let i = if rng.random_range(0..3) == 0 {
                rng.random_range(3..agents.len())
            } else {
                i
            };
            let fresh = |rng: &mut StdRng| {
                let p = case.params[rng.random_range(0..case.params.len())];
                let cost = |rng: &mut StdRng| rng.random_range(1..=p.capacity.min(10));
                let costs: Vec<u64> = (0..rng.random_range(1..=4)).map(|_| cost(rng)).collect();
                let other_costs = (rng.random_range(0..2) == 0)
                    .then(|| (0..rng.random_range(1..=3)).map(|_| cost(rng)).collect());
                (p, costs, other_costs)
            };
            // A batch sent again says so (it is not a first): its answer may be kept.
            let (b, first) = match (rng.random_range(0..10), &last_batch[i]) {
                (0..3, Some(b)) => (b.clone(), false),
                // An older batch arriving again, as it was sent: its own dedup key (if
                // still there) answers it, else it is decided like a new one.
                (3, Some(_)) if sent[i].len() > 1 => {
                    batches.older += 1;
                    (
                        sent[i][rng.random_range(0..sent[i].len() - 1)].clone(),
                        false,
                    )
                }
                _ => {
                    let (p, costs, other_costs) = fresh(rng);
                    seqs[i] += 1;
                    let b = Batch {
                        seq: seqs[i],
                        p,
                        costs,
                        other_costs,
                    };
                    sent[i].push(b.clone());
                    (b, true)
                }
            };
            let ctx = format!("in case {} step {step}: exact batch {b:?}", case.name);
            let mut keys = vec![(&key, &mut model, &b.costs)];
            if let Some(oc) = &b.other_costs {
                keys.push((&other, &mut other_model, oc));
            }
            exact_batch(
                server,
                &st,
                agents[i],
                &b,
                first,
                logs.entry((i, b.seq)).or_default(),
                &mut keys,
                &mut last_now,
                &mut batches,
                &ctx,
            )
            .await;
            if last_batch[i].as_ref().is_none_or(|prev| b.seq > prev.seq) {
                last_batch[i] = Some(b);
            }
            continue;
        }
        let (req, p, on_part) = match (roll, last[i]) {
            (0..8, Some(prev)) => prev,
            (8..12, Some((prev, p, on_part))) if prev.seq > 1 => (
                Request {
                    seq: prev.seq - 1,
                    ..prev
                },
                p,
                on_part,
            ),
            _ => {
                let parent = case.params[rng.random_range(0..case.params.len())];
                let part = split
                    .filter(|_| rng.random_range(0..3) == 0)
                    .and_then(|s| s.part_params(&parent, 0));
                let on_part = part.is_some();
                let p = part.unwrap_or(parent);
                seqs[i] += 1;
                let op = agent_op(rng, &p, on_part, (!on_part).then_some(last_now));
                (
                    Request {
                        agent: agents[i],
                        seq: seqs[i],
                        op,
                    },
                    p,
                    on_part,
                )
            }
        };
        let (key, model) = if on_part {
            part_calls += 1;
            (&part_key, &mut part_model)
        } else {
            (&key, &mut model)
        };
        let ctx = format!("in case {} step {step}: {req:?} with {p:?}", case.name);
        match call_same(server, &st, key, model, &p, &req, last_now, &ctx).await {
            Some(reply) => {
                if last[i].is_some_and(|(prev, _, _)| prev.seq >= req.seq) {
                    replays += 1;
                }
                if !on_part {
                    split = reply.split.or(split);
                }
                if matches!(req.op, Op::Split { .. }) {
                    splits += 1;
                } else if reply.granted == 0
                    && !matches!(
                        req.op,
                        Op::Release { .. } | Op::Exact { cost: 0 } | Op::Rate { .. }
                    )
                {
                    denials += 1;
                    assert!(reply.retry_us > 0, "denial without retry time {ctx}");
                }
                last_now = last_now.max(reply.now_us);
            }
            None => {
                stales += 1;
                check_same(server, key, model, &ctx);
            }
        }
        if last[i].is_none_or(|(prev, _, _)| req.seq > prev.seq) {
            last[i] = Some((req, p, on_part));
        }
        if rng.random_range(0..10) == 0 {
            tokio::time::sleep(Duration::from_millis(
                rng.random_range(0..=case.max_pause_ms),
            ))
            .await;
        }
    }
    println!(
        "case {}: {} steps, {replays} replays, {stales} stale, {denials} denials, \
         {splits} splits, {part_calls} part calls, batches {batches:?}, tok={} out={}",
        case.name,
        steps(),
        field(server, key.as_str(), "tok"),
        field(server, key.as_str(), "out")
    );
}

/// One exact batch as sent (a retry sends it again as it was).
#[derive(Clone, Debug)]
struct Batch {
    seq: u64,
    p: BucketParams,
    costs: Vec<u64>,
    other_costs: Option<Vec<u64>>,
}

#[derive(Debug, Default)]
struct BatchCounts {
    calls: u32,
    decided: u32,
    replayed: u32,
    moved: u32,
    older: u32,
    denials: u32,
}

fn decided_in(outs: &[ExactOutcome]) -> bool {
    outs.iter().any(|o| matches!(o, ExactOutcome::Decided(_)))
}

/// Sends `b` on `keys` to Redis and applies it to the models of its dedup key and of each
/// bucket: every key's outcome, hash and expiry, and the dedup key's text, must match.
#[expect(
    clippy::too_many_arguments,
    reason = "a test step with its whole context"
)]
async fn exact_batch(
    server: &RedisServer,
    st: &leasehold_agent::RedisStore,
    agent: AgentId,
    b: &Batch,
    first: bool,
    log: &mut BatchLog,
    keys: &mut [(&BucketKey, &mut GlobalBucket, &Vec<u64>)],
    last_now: &mut u64,
    counts: &mut BatchCounts,
    ctx: &str,
) {
    let items: Vec<ExactItem<'_>> = keys
        .iter()
        .map(|(k, _, costs)| ExactItem {
            key: k,
            params: &b.p,
            costs,
        })
        .collect();
    // The server's time just before the call: with every key moved, no reply tells the
    // call's own time, and the last decided one may be older than the dedup key's expiry.
    let before_us: u64 = {
        let mut c = server.connection().expect("connection");
        let (s, us): (u64, u64) = redis::cmd("TIME").query(&mut c).expect("TIME");
        s * 1_000_000 + us
    };
    let outs = st
        .exact_many(agent, b.seq, &items, first)
        .await
        .unwrap_or_else(|e| panic!("store error {e} {ctx}"));
    counts.calls += 1;
    // One TIME for the whole call: a decided key tells it (as max(TIME, its ts)).
    let now = outs
        .iter()
        .find_map(|o| match o {
            ExactOutcome::Decided(r) => Some(r.now_us),
            _ => None,
        })
        .unwrap_or(before_us.max(*last_now));
    let dedup = leasehold_store::wire::batch_key(keys[0].0, agent, b.seq);
    let kept_until_ms = log.record().map(|r| r.expire_at_ms);
    let mut open = log.open(now, b.seq);
    // Unknown call time (every key moved): a kept answer whose dedup key expires within
    // the clock gap after `now` may have expired before the call reached the server.
    if let (Some(answer), Some(at), false) = (&open, kept_until_ms, decided_in(&outs))
        && outs != *answer
        && at <= now / 1000 + EXPIRY_CLOCK_GAP_MS
    {
        println!("dedup key expired before the call {ctx}");
        open = log.open(at * 1000, b.seq);
    }
    if let Some(answer) = open {
        counts.replayed += 1;
        assert_eq!(outs, answer, "batch answer differs from the one kept {ctx}");
        for (key, model, _) in keys.iter() {
            check_same(server, key, model, ctx);
        }
        return;
    }
    for ((key, model, costs), out) in keys.iter_mut().zip(&outs) {
        let before = model.clone();
        let mut expected = model
            .exact_many(&b.p, now, costs)
            .unwrap_or_else(|e| panic!("model refused what Redis accepted ({e}) {ctx}"));
        // As for single calls: at the expiry boundary, Redis may still have found the key.
        let now_ms = now / 1000;
        if let Some(at) = before.state().map(|s| s.expire_at_ms)
            && at < now_ms
            && now_ms - at <= EXPIRY_CLOCK_GAP_MS
        {
            let mut alive = before.alive_until(now_ms);
            if let Ok(r) = alive.exact_many(&b.p, now, costs)
                && r == *out
            {
                let (redis, _, _) = read(server, key);
                let fits =
                    |m: &GlobalBucket| redis == leasehold_store::wire::hash_fields(m.state());
                // Moved writes nothing: the key may expire right after.
                let unwritten = matches!(out, ExactOutcome::Moved);
                if (*out != expected || !fits(model)) && (fits(&alive) || unwritten) {
                    println!("expiry read at the command's start {ctx}");
                    **model = alive;
                    expected = r;
                }
            }
        }
        assert_eq!(*out, expected, "batch outcome differs for {key:?} {ctx}");
        match out {
            ExactOutcome::Decided(r) => {
                counts.decided += 1;
                counts.denials += r.retry_us.iter().filter(|&&w| w > 0).count() as u32;
                *last_now = (*last_now).max(r.now_us);
            }
            ExactOutcome::Moved => counts.moved += 1,
        }
        check_same(server, key, model, ctx);
    }
    let grace = b.p.grace_us;
    let sizes: Vec<usize> = keys.iter().map(|k| k.2.len()).collect();
    let mut c = server.connection().expect("connection");
    // In one script: read apart, the key may expire between the two reads on a slow
    // machine, and PEXPIRETIME's -2 (no key) would then pass for a far expiry.
    let (raw, at): (Vec<u8>, i64) = redis::Script::new(
        "return {redis.call('GET', KEYS[1]) or '', redis.call('PEXPIRETIME', KEYS[1])}",
    )
    .key(&dedup)
    .invoke(&mut c)
    .expect("read the dedup key");
    let kept: Vec<u64> = match raw {
        v if v.is_empty() => Vec::new(),
        v => {
            assert!(at > 0, "dedup key without an expiry ({at}) {ctx}");
            assert_eq!(v.first(), Some(&leasehold_store::wire::BATCH_TAG), "{ctx}");
            leasehold_store::wire::unpack_numbers(&v[1..]).expect("whole integers")
        }
    };
    // With every key moved, only the dedup key tells the server time of the call.
    let decided = decided_in(&outs);
    let server_now = match kept.get(1) {
        Some(&t) if !decided => t,
        _ => now,
    };
    log.close(server_now, b.seq, grace, &outs, &sizes);
    if !kept.is_empty() {
        log.set_expiry(at as u64);
        let record = log.record().expect("kept");
        assert_eq!(
            kept,
            leasehold_store::wire::batch_numbers(record),
            "dedup key differs {ctx}"
        );
        let least = record.server_now_us / 1000 + grace.div_ceil(1000);
        assert!(
            at as u64 >= least,
            "dedup key expires at {at}, before the grace {least} {ctx}"
        );
    }
}

#[test]
fn differential_lua_matches_model() {
    let mut rng = StdRng::seed_from_u64(seed());
    let server = server();
    let cases = [
        Case {
            name: "fast-small",
            params: vec![params(5, "1000/s", "30ms", "10ms", None)],
            max_pause_ms: 80,
        },
        Case {
            name: "fractional",
            params: vec![params(50, "7/100ms", "200ms", "50ms", None)],
            max_pause_ms: 300,
        },
        Case {
            name: "relaxed",
            params: vec![params(20, "3/s", "100ms", "20ms", Some(8))],
            max_pause_ms: 150,
        },
        Case {
            name: "large-numbers",
            params: vec![params(1_000_000, "1000000/s", "50ms", "10ms", None)],
            max_pause_ms: 60,
        },
        Case {
            // Pauses past DEMAND_TTL: agents' demand goes stale between calls.
            name: "stale-demand",
            params: vec![params(40, "20/s", "2s", "500ms", None)],
            max_pause_ms: 1100,
        },
        Case {
            // Rate leases beside token leases and exact decisions: shares and bursts,
            // their records dropping over pauses past the term.
            name: "rate-leases",
            params: vec![params(60, "200/s", "150ms", "30ms", None)],
            max_pause_ms: 250,
        },
        Case {
            name: "rule-changes",
            params: vec![
                params(30, "10/s", "80ms", "20ms", None),
                params(12, "1/7ms", "40ms", "5ms", None),
                params(30, "10/s", "80ms", "20ms", Some(5)),
            ],
            max_pause_ms: 100,
        },
    ];
    runtime().block_on(async {
        for case in &cases {
            run_case(&server, case, &mut rng).await;
        }
    });
}

/// 120 rate leases on one key (4 ms of term per live share, 0.4 s at least): a renewal whose
/// demand stays within a quarter of the last one gets twice the term, one whose demand
/// moved or whose share was cut gets the plain one; Lua and the model agree on every
/// reply and record.
#[test]
fn steady_rate_renewals_get_twice_the_term_in_lua_as_in_the_model() {
    let server = server();
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let rule = RuleName::new("steady").expect("rule name");
        let key = BucketKey::new(&rule, "tenant").expect("key");
        let p = params(60_000, "12000/s", "10s", "1s", None);
        let mut model = GlobalBucket::new();
        let agents: Vec<AgentId> = (1..=120).map(AgentId).collect();
        let mut last_now = 0;
        let mut terms = Vec::new();
        // First calls, then renewals at the same demand, then at twice it.
        for (round, demand) in [(1, 50_000), (2, 55_000), (3, 110_000)] {
            let mut ttls = Vec::new();
            for a in &agents {
                let req = Request {
                    agent: *a,
                    seq: round,
                    op: Op::Rate {
                        held: if round == 1 { 0 } else { 20 },
                        want: 20,
                        tokens: 0,
                        demand,
                    },
                };
                let ctx = format!("agent {a:?} round {round}");
                let reply = call_same(&server, &st, &key, &mut model, &p, &req, last_now, &ctx)
                    .await
                    .expect("not stale");
                last_now = last_now.max(reply.now_us);
                ttls.push(reply.ttl_us);
            }
            terms.push(ttls);
        }
        // With 120 shares live: 0.48 s plain, 0.96 s steady.
        assert!(terms[0].iter().all(|&t| t <= 480_000), "{:?}", terms[0]);
        assert!(
            terms[1].iter().all(|&t| t == 960_000),
            "steady: {:?}",
            terms[1]
        );
        assert!(
            terms[2].iter().all(|&t| t == 480_000),
            "demand doubled: {:?}",
            terms[2]
        );
    });
}

/// A random operation of an agent on a bucket of parameters `p`; a split (the
/// coordinator's) only when `split_from` gives the time its term is counted from; a rate
/// lease where one may be (strict mode, not on a part).
fn agent_op(rng: &mut StdRng, p: &BucketParams, on_part: bool, split_from: Option<u64>) -> Op {
    let cap = p.capacity;
    let by_rate =
        !on_part && p.region.is_none() && matches!(p.mode, leasehold_core::rule::Mode::Strict);
    match rng.random_range(0..12) {
        10.. if by_rate => {
            let held = rng.random_range(0..=cap / 2);
            Op::Rate {
                held,
                want: rng.random_range(0..=cap),
                tokens: rng.random_range(0..=held),
                // Up to about twice the rate, in thousandths of a token per second.
                demand: rng
                    .random_range(0..=2 * p.rate.tokens() * 1_000_000_000 / p.rate.period_us()),
            }
        }
        0..5 => {
            let want = rng.random_range(1..=cap);
            Op::Acquire {
                held: rng.random_range(0..=cap / 2 + 2),
                want,
                min: rng.random_range(1..=want),
                demand: rng.random_range(0..1_000_000),
            }
        }
        5..7 => Op::Release {
            returned: rng.random_range(0..=cap),
        },
        7 if let Some(from) = split_from
            && rng.random_range(0..4) == 0 =>
        {
            Op::Split {
                parts: rng.random_range(2..=3),
                salt: rng.random_range(0..2),
                until_us: from + rng.random_range(0..400_000),
            }
        }
        _ => Op::Exact {
            cost: rng.random_range(0..=cap.min(10)), // 0: a read
        },
    }
}

/// Sends `req` to Redis and applies it to `model` at the server time the reply reports:
/// the replies must be the same, then the hash and its expiry. `None`: Redis refused it
/// as a stale sequence number, and so does the model (at `last_now`); the state is
/// unchanged. Any other error fails the test.
#[expect(
    clippy::too_many_arguments,
    reason = "a test step with its whole context"
)]
async fn call_same(
    server: &RedisServer,
    st: &leasehold_agent::RedisStore,
    key: &BucketKey,
    model: &mut GlobalBucket,
    p: &BucketParams,
    req: &Request,
    last_now: u64,
    ctx: &str,
) -> Option<leasehold_core::model::Reply> {
    let reply = match st.call(key, p, req).await {
        Ok(reply) => reply,
        Err(StoreError::Refused { code, message }) => {
            assert_eq!(code, "LH_STALE", "{message} {ctx}");
            let model_says = model.apply(p, last_now, req);
            assert!(
                matches!(model_says, Err(ProtocolError::StaleSequence { .. })),
                "Redis said stale, model said {model_says:?} {ctx}"
            );
            return None;
        }
        Err(e) => panic!("store error {e} {ctx}"),
    };
    let before = model.clone();
    let mut expected = model
        .apply(p, reply.now_us, req)
        .unwrap_or_else(|e| panic!("model refused what Redis accepted ({e}) {ctx}"));
    // Redis judges expiry at the command's start, before the function reads TIME: a key
    // that expired in that gap (a few ms on a busy machine) may still have been found.
    // Accept that reading, only at that boundary, when it is the one that gives Redis's
    // reply and hash (the replies of the two readings are often the same: a key expires
    // full).
    let now_ms = reply.now_us / 1000;
    if let Some(at) = before.state().map(|s| s.expire_at_ms)
        && at < now_ms
        && now_ms - at <= EXPIRY_CLOCK_GAP_MS
    {
        let mut alive = before.alive_until(now_ms);
        if let Ok(r) = alive.apply(p, reply.now_us, req)
            && r == reply
        {
            let (redis, _, _) = read(server, key);
            let fits = |m: &GlobalBucket| redis == leasehold_store::wire::hash_fields(m.state());
            if (reply != expected || !fits(model)) && fits(&alive) {
                println!("expiry read at the command's start {ctx}");
                *model = alive;
                expected = r;
            }
        }
    }
    assert_eq!(reply, expected, "reply differs {ctx}");
    check_same(server, key, model, ctx);
    Some(reply)
}

/// A region's bucket (`lh:{RULE|SUBJECT|region}`): agents acquire, release and decide
/// while its broker deposits (new grants, repeats, older ones, terms already over, reads)
/// and pauses let terms end, floors refill and keys expire. Replies, hashes and expiry
/// times must equal the model's.
#[test]
fn differential_region_bucket_matches_model() {
    let mut rng = StdRng::seed_from_u64(seed());
    let server = server();
    let floor = |text: &str| {
        let spec = RuleSpec::new(1, text);
        Some(
            leasehold_core::rule::Rule::from_spec("f", &spec)
                .expect("floor")
                .bucket_params()
                .rate,
        )
    };
    let cases: Vec<(&str, Vec<BucketParams>, u64)> = vec![
        (
            "region-strict",
            vec![params(20, "100/s", "200ms", "20ms", None)],
            150,
        ),
        (
            "region-floor",
            vec![params(30, "50/s", "150ms", "20ms", None)],
            200,
        ),
        (
            "region-rule-changes",
            vec![
                params(30, "10/s", "80ms", "20ms", None),
                params(12, "1/7ms", "40ms", "5ms", Some(6)),
            ],
            120,
        ),
    ];
    runtime().block_on(async {
        let st = store(&server.url()).await;
        for (ci, (name, plist, max_pause)) in cases.into_iter().enumerate() {
            let rule = RuleName::new(name).expect("rule name");
            let key = BucketKey::new(&rule, format!("s-{}", rng.random::<u32>()))
                .expect("key")
                .region_of();
            let floors = [None, floor("40/s"), floor("3/100ms")];
            let mut model = GlobalBucket::new();
            let agents: Vec<AgentId> = (0..3).map(|_| AgentId(rng.random())).collect();
            let broker = AgentId(rng.random());
            let mut seqs = [0u64; 3];
            let mut last: [Option<(Request, BucketParams)>; 3] = [None; 3];
            let mut dseq = 1u64;
            let mut last_now = 0u64;
            let (mut deposits, mut denials, mut replays, mut fed, mut past_term) = (0, 0, 0, 0, 0);
            for step in 0..steps() {
                let mut p = plist[rng.random_range(0..plist.len())];
                // Case 0 never has a floor, case 1 always (one of two, drawn per call),
                // case 2 draws any.
                let fl = match ci {
                    0 => None,
                    1 => floors[rng.random_range(1..floors.len())],
                    _ => floors[rng.random_range(0..floors.len())],
                };
                p.region = Some(leasehold_core::rule::RegionParams::new(fl));
                let cap = p.capacity;
                let i = rng.random_range(0..3);
                let req = if rng.random_range(0..10) < 3 {
                    deposits += 1;
                    let seq = match rng.random_range(0..10) {
                        0 => 0,
                        1 => dseq.saturating_sub(rng.random_range(0..3)),
                        _ => {
                            dseq += rng.random_range(1..1000);
                            dseq
                        }
                    };
                    let until_us = (last_now + rng.random_range(0..400_000))
                        .saturating_sub(rng.random_range(0..60_000));
                    Request {
                        agent: broker,
                        seq,
                        op: Op::Deposit {
                            tokens: rng.random_range(0..=cap),
                            until_us,
                            // The region's rate: unknown, or anything up to the rule's.
                            rate_milli: rng.random_range(0..3) * rng.random_range(0..=100_000),
                        },
                    }
                } else if let (0, Some((prev, prev_p))) = (rng.random_range(0..8), last[i]) {
                    // A retry: the same request with the same parameters.
                    replays += 1;
                    p = prev_p;
                    prev
                } else {
                    seqs[i] += 1;
                    let op = agent_op(&mut rng, &p, false, None);
                    let req = Request { agent: agents[i], seq: seqs[i], op };
                    last[i] = Some((req, p));
                    req
                };
                let ctx = format!("in case {name} step {step}: {req:?} with {p:?}");
                // None: a replayed request whose record changed since, refused by both.
                if let Some(reply) =
                    call_same(&server, &st, &key, &mut model, &p, &req, last_now, &ctx).await
                {
                    last_now = last_now.max(reply.now_us);
                    let state = model.state();
                    if state
                        .is_some_and(|s| s.term_until_us != 0 && s.term_until_us <= reply.now_us)
                    {
                        past_term += 1;
                    }
                    if matches!(req.op, Op::Deposit { .. }) && reply.granted > 0 {
                        fed += 1;
                    }
                    if !matches!(
                        req.op,
                        Op::Deposit { .. } | Op::Release { .. } | Op::Exact { cost: 0 }
                    ) && reply.granted == 0
                    {
                        denials += 1;
                        assert!(reply.retry_us > 0, "denial without retry time {ctx}");
                    }
                }
                if rng.random_range(0..10) == 0 {
                    tokio::time::sleep(Duration::from_millis(rng.random_range(0..=max_pause))).await;
                } else if step % 40 == 39
                    && let Some(s) = model.state()
                {
                    // Past the term's end: what is left is void, the floor refills.
                    let left_ms = s.term_until_us.saturating_sub(last_now) / 1000;
                    // Just past it (within the key's grace), or well past it.
                    let extra = if step % 80 == 39 { rng.random_range(1..=10) } else { max_pause };
                    let ms = left_ms.min(400) + extra;
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
            }
            println!(
                "case {name}: {} steps, {deposits} deposits ({fed} added tokens), {denials} denials, \
                 {replays} replays, {past_term} calls past a term",
                steps()
            );
            // Without a floor a key past its term expires (absent is the same empty
            // bucket); with one it stays and refills there.
            assert!(fed > 0, "case {name} never fed the bucket");
            assert!(ci != 1 || past_term > 0, "case {name} never saw a term end");
        }
    });
}

/// A refusal as `CODE detail`.
fn refusal(err: &redis::RedisError) -> String {
    format!(
        "{} {}",
        err.code().unwrap_or_default(),
        err.detail().unwrap_or_default()
    )
}

/// A server with the function library loaded (by a store connecting to it), for tests
/// that call the functions directly.
fn server_with_library() -> RedisServer {
    let server = server();
    runtime().block_on(async {
        let _store = store(&server.url()).await;
    });
    server
}

/// The Lua refuses bad arguments itself, not only the Rust client: a misconfigured or
/// foreign caller gets an error that names the argument, and nothing is written.
#[test]
fn lua_refuses_bad_arguments_and_writes_nothing() {
    let server = server_with_library();
    let base = ["10", "1", "1000000", "1000000", "100000", "0"];
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "lh_exact",
            &["00ab", "1", "11"],
            "LH_CAPACITY 11 tokens requested",
        ),
        (
            "lh_exact",
            &["00ab", "1", "1.5"],
            "LH_ARG invalid argument cost = 1.5",
        ),
        (
            "lh_exact",
            &["00ab", "-1", "1"],
            "LH_ARG invalid argument seq = -1",
        ),
        (
            "lh_exact",
            &["{x}", "1", "1"],
            "LH_ARG invalid argument agent",
        ),
        (
            "lh_acquire",
            &["00ab", "1", "0", "5", "6", "0"],
            "LH_ARG invalid argument want = 5",
        ),
        (
            "lh_acquire",
            &["00ab", "1", "0", "20", "11", "0"],
            "LH_CAPACITY 11",
        ),
        (
            "lh_acquire",
            &["00ab", "1", "99999999999999", "1", "1", "0"],
            "LH_ARG invalid argument held",
        ),
        (
            "lh_release",
            &["00ab", "1", "x"],
            "LH_ARG invalid argument returned = x",
        ),
        (
            "lh_split",
            &["00ab", "1", "1", "0", "5"],
            "LH_ARG invalid argument parts = 1",
        ),
        (
            "lh_split",
            &["00ab", "1", "65", "0", "5"],
            "LH_ARG invalid argument parts = 65",
        ),
    ];
    let mut conn = server.connection().expect("connection");
    for (f, tail, want) in cases {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(*f).arg(1).arg("lh:{t|bad}");
        // Agent and seq, then the part seed (not a part), then the function's arguments.
        let seed = ["0"; 5];
        for a in base.iter().chain(&tail[..2]).chain(&seed).chain(&tail[2..]) {
            cmd.arg(*a);
        }
        let err = cmd
            .query::<redis::Value>(&mut conn)
            .expect_err("bad arguments must be refused");
        let text = refusal(&err);
        assert!(
            text.starts_with(want),
            "{f} {tail:?}: got {text:?}, want {want:?}"
        );
    }
    let mut cmd = redis::cmd("FCALL");
    cmd.arg("lh_exact").arg(1).arg("lh:{t|bad}");
    for a in [
        "0", "1", "1000000", "1000000", "100000", "0", "00ab", "1", "0", "0", "0", "0", "0", "1",
    ] {
        cmd.arg(a);
    }
    let err = cmd
        .query::<redis::Value>(&mut conn)
        .expect_err("capacity 0");
    let text = err.detail().unwrap_or_default();
    assert!(text.contains("invalid bucket parameters"), "{text}");
    let exists: i64 = server.cmd(&["EXISTS", "lh:{t|bad}"]).expect("EXISTS");
    assert_eq!(exists, 0, "a refused call wrote the key");
}

/// `lh_exact_batch` validates the whole batch before it writes anything: a bad item late
/// in the batch leaves the good keys before it untouched.
#[test]
fn lua_refuses_bad_batches_and_writes_nothing() {
    let server = server_with_library();
    let pack = leasehold_store::wire::pack_numbers;
    // seq 1, one rule: capacity 10, 1 token per s, grace 100 ms, strict.
    let head: &[u64] = &[1, 1, 10, 1, 1_000_000, 100_000, 0];
    let numbers = |items: &[u64]| pack(&[head, items].concat());
    let cases: Vec<(&[&str], Vec<u8>, &str)> = vec![
        (
            &["lh:{t|a}", "lh:{t|a}"],
            numbers(&[1, 1, 1, 1, 1, 1]),
            "LH_ARG a key appears twice",
        ),
        (
            &["lh:{t|a}", "lh:{t|b}"],
            numbers(&[1, 1, 1, 1, 1, 11]),
            "LH_CAPACITY 11",
        ),
        (
            &["lh:{t|a}", "lh:{t|b|1.0}"],
            numbers(&[1, 1, 1, 1, 1, 1]),
            "LH_ARG not a bucket key",
        ),
        (
            &["lh:{t|a}", "app:user:1"],
            numbers(&[1, 1, 1, 1, 1, 1]),
            "LH_ARG not a bucket key",
        ),
        (
            &["lh:{t|a}"],
            numbers(&[1, 1, 1, 7]),
            "LH_ARG 1 numbers left over",
        ),
        (
            &["lh:{t|a}"],
            numbers(&[2, 1, 1]),
            "LH_ARG invalid argument rule = 2",
        ),
        (
            &["lh:{t|a}"],
            numbers(&[1, 0]),
            "LH_ARG invalid batch item 1",
        ),
        (
            &["lh:{t|a}"],
            numbers(&[1, 1, 0]),
            "LH_ARG invalid argument cost = 0",
        ),
        // Numbers cut short, or none: the packed string must hold whole 8-byte integers.
        (
            &["lh:{t|a}"],
            numbers(&[1, 1, 1])[..50].to_vec(),
            "LH_ARG invalid argument numbers: 50 bytes",
        ),
        (
            &["lh:{t|a}"],
            Vec::new(),
            "LH_ARG invalid argument numbers: 0 bytes",
        ),
        // A number past 2^53 - 1 (Lua's exact integers).
        (
            &["lh:{t|a}"],
            numbers(&[1, 1, 1 << 60]),
            "LH_ARG invalid argument cost",
        ),
        // Text where the numbers belong, as an older agent would send them.
        (
            &["lh:{t|a}"],
            b"1".to_vec(),
            "LH_ARG invalid argument numbers",
        ),
    ];
    let mut conn = server.connection().expect("connection");
    for (keys, items, want) in &cases {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("lh_exact_batch")
            .arg(keys.len() + 1)
            .arg(format!("{}:b:00ab:1", keys[0]));
        for k in *keys {
            cmd.arg(*k);
        }
        cmd.arg("00ab").arg(items.as_slice());
        let err = cmd
            .query::<redis::Value>(&mut conn)
            .expect_err("a bad batch must be refused");
        let text = refusal(&err);
        assert!(
            text.starts_with(want),
            "{keys:?} {items:?}: got {text:?}, want {want:?}"
        );
        for k in keys
            .iter()
            .copied()
            .chain([format!("{}:b:00ab:1", keys[0]).as_str()])
        {
            let exists: i64 = server.cmd(&["EXISTS", k]).expect("EXISTS");
            assert_eq!(exists, 0, "a refused batch wrote {k}");
        }
    }
    // Arguments past the packed numbers are refused too.
    let err = redis::cmd("FCALL")
        .arg("lh_exact_batch")
        .arg(2)
        .arg("lh:{t|a}:b:00ab:1")
        .arg("lh:{t|a}")
        .arg("00ab")
        .arg(numbers(&[1, 1, 1]))
        .arg("1")
        .query::<redis::Value>(&mut conn)
        .expect_err("extra arguments must be refused");
    let text = refusal(&err);
    assert!(text.starts_with("LH_ARG 1 arguments left over"), "{text}");
}

/// A bucket key that holds something else (a string that is not a compact bucket, a
/// list) is refused by the batch before anything is written, and by a single call, and
/// the value is left as it was.
#[test]
fn lua_refuses_foreign_values_at_bucket_keys_and_keeps_them() {
    let server = server_with_library();
    let mut conn = server.connection().expect("connection");
    let _: () = server.cmd(&["SET", "lh:{t|s}", "hello"]).expect("SET");
    let _: i64 = server.cmd(&["RPUSH", "lh:{t|l}", "x"]).expect("RPUSH");
    // A hash whose state field is not a bucket's (see wire::STATE).
    let _: i64 = server
        .cmd(&["HSET", "lh:{t|h}", leasehold_store::wire::STATE, "hello"])
        .expect("HSET");
    // An application's hash, and a compact bucket's shape with a clock ten years ahead
    // (read as a bucket, it would never refill).
    let _: i64 = server
        .cmd(&["HSET", "lh:{t|app}", "name", "ada", "plan", "pro"])
        .expect("HSET");
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as u64;
    let mut planted = b"L1".to_vec();
    for n in [5u64, 0, now_us + 10 * 365 * 86_400_000_000, 1_000_000] {
        planted.extend_from_slice(&n.to_le_bytes());
    }
    let _: () = redis::cmd("SET")
        .arg("lh:{t|f}")
        .arg(&planted)
        .query(&mut conn)
        .expect("SET");
    for (foreign, want) in [
        (
            "lh:{t|s}",
            "LH_ARG not a bucket: lh:{t|s} holds another string",
        ),
        ("lh:{t|l}", "LH_ARG not a bucket: lh:{t|l} holds a list"),
        (
            "lh:{t|h}",
            "LH_ARG not a bucket: lh:{t|h} holds a hash of other fields",
        ),
        (
            "lh:{t|app}",
            "LH_ARG not a bucket: lh:{t|app} holds a hash of other fields",
        ),
        ("lh:{t|f}", "LH_ARG not a bucket: lh:{t|f} holds a clock"),
    ] {
        // The foreign key second: the first key must not be written either.
        let err = redis::cmd("FCALL")
            .arg("lh_exact_batch")
            .arg(3)
            .arg("lh:{t|a}:b:00ab:1")
            .arg("lh:{t|a}")
            .arg(foreign)
            .arg("00ab")
            .arg(leasehold_store::wire::pack_numbers(&[
                1, 1, 10, 1, 1_000_000, 100_000, 0, 1, 1, 1, 1, 1, 1,
            ]))
            .query::<redis::Value>(&mut conn)
            .expect_err("a batch over a foreign value must be refused");
        let text = refusal(&err);
        assert!(
            text.starts_with(want),
            "{foreign}: got {text:?}, want {want:?}"
        );
        for k in ["lh:{t|a}", "lh:{t|a}:b:00ab:1"] {
            let exists: i64 = server.cmd(&["EXISTS", k]).expect("EXISTS");
            assert_eq!(exists, 0, "a refused batch wrote {k}");
        }
        // A single call (here lh_exact) is refused too.
        let err = redis::cmd("FCALL")
            .arg("lh_exact")
            .arg(1)
            .arg(foreign)
            .arg(&["10", "1", "1000000", "0", "100000", "0", "00ab", "1"])
            .arg(&["0", "0", "0", "0", "0", "1"])
            .query::<redis::Value>(&mut conn)
            .expect_err("a call on a foreign value must be refused");
        let text = refusal(&err);
        assert!(
            text.starts_with("LH_ARG not a bucket") || text.starts_with("WRONGTYPE"),
            "{foreign}: got {text:?}"
        );
    }
    let s: String = server.cmd(&["GET", "lh:{t|s}"]).expect("GET");
    assert_eq!(s, "hello");
    let l: Vec<String> = server
        .cmd(&["LRANGE", "lh:{t|l}", "0", "-1"])
        .expect("LRANGE");
    assert_eq!(l, ["x"]);
    let h: String = server
        .cmd(&["HGET", "lh:{t|h}", leasehold_store::wire::STATE])
        .expect("HGET");
    assert_eq!(h, "hello");
    let app: std::collections::BTreeMap<String, String> =
        server.cmd(&["HGETALL", "lh:{t|app}"]).expect("HGETALL");
    assert_eq!(format!("{app:?}"), r#"{"name": "ada", "plan": "pro"}"#);
    let kept: Vec<u8> = redis::cmd("GET")
        .arg("lh:{t|f}")
        .query(&mut conn)
        .expect("GET");
    assert_eq!(kept, planted);
    for k in ["lh:{t|app}", "lh:{t|f}"] {
        let ttl: i64 = server.cmd(&["PTTL", k]).expect("PTTL");
        assert_eq!(ttl, -1, "{k} was given an expiry");
    }
}

/// A compact key decided again while its expiry still covers the new one keeps it
/// (`SETRANGE` in place), in Lua as in the model: batches every few ms on one key with a
/// grace of 100 ms (its expiry is set ten graces, 1 s, beyond what it must cover), then a
/// pause past that second, and a key decided by two agents in one call each; the value,
/// the expiry and each answer are compared after every batch. Then a rule with a grace of
/// an hour, whose slack stops at 10 s.
#[test]
fn a_compact_key_keeps_its_expiry_while_it_covers_the_next_one() {
    let server = server();
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let rule = RuleName::new("keep").expect("rule name");
        let key = BucketKey::new(&rule, "tenant").expect("key");
        let p = params(100, "1000/s", "100ms", "100ms", None);
        let mut model = GlobalBucket::new();
        let mut last_now = 0;
        let mut counts = BatchCounts::default();
        let agents = [AgentId(0xa1), AgentId(0xb2)];
        let mut expiries = Vec::new();
        for step in 0..40u64 {
            let costs = vec![1 + step % 3];
            let b = Batch {
                seq: step + 1,
                p,
                costs,
                other_costs: None,
            };
            let ctx = format!("step {step}");
            let mut keys = vec![(&key, &mut model, &b.costs)];
            exact_batch(
                &server,
                &st,
                agents[(step % 2) as usize],
                &b,
                true,
                &mut BatchLog::new(),
                &mut keys,
                &mut last_now,
                &mut counts,
                &ctx,
            )
            .await;
            expiries.push(model.state().expect("a compact bucket").expire_at_ms);
            // A pause past the slack (ten graces: 1 s) once, halfway: the next write sets a
            // new expiry.
            let pause = if step == 20 { 1_500 } else { 5 };
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        let kept = expiries.windows(2).filter(|w| w[0] == w[1]).count();
        let moved = expiries.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(
            kept >= 20,
            "only {kept} of 39 writes kept the key's expiry: {expiries:?}"
        );
        assert!(
            moved >= 1,
            "the pause past the slack set no new expiry: {expiries:?}"
        );
        assert_eq!(counts.decided, 40);
        // A long grace (1 h): the slack stops at 10 s, in Lua as in the model (the
        // expiries are compared after the call).
        let long = BucketKey::new(&rule, "long-grace").expect("key");
        let mut model = GlobalBucket::new();
        let b = Batch {
            seq: 100,
            p: params(100, "1000/s", "100ms", "1h", None),
            costs: vec![1],
            other_costs: None,
        };
        let mut keys = vec![(&long, &mut model, &b.costs)];
        exact_batch(
            &server,
            &st,
            agents[0],
            &b,
            true,
            &mut BatchLog::new(),
            &mut keys,
            &mut last_now,
            &mut counts,
            "a grace of 1 h",
        )
        .await;
        let s = model.state().expect("a compact bucket");
        let now_ms = last_now / 1000;
        assert!(
            s.expire_at_ms <= now_ms + 3_600_000 + 10_000 + 2,
            "an expiry {} ms away: more than a grace and 10 s",
            s.expire_at_ms - now_ms
        );
    });
}

/// A new key decided in a batch is stored compact; a lease on it turns it into the hash,
/// with the tokens the batch left (one token per 1 000 s: no refill between the calls).
#[test]
fn a_compact_bucket_becomes_the_hash_when_leased() {
    let server = server_with_library();
    let mut conn = server.connection().expect("connection");
    let key = "lh:{t|c}";
    let _: redis::Value = redis::cmd("FCALL")
        .arg("lh_exact_batch")
        .arg(2)
        .arg(format!("{key}:b:00ab:1"))
        .arg(key)
        .arg("00ab")
        .arg(leasehold_store::wire::pack_numbers(&[
            1,
            1,
            10,
            1,
            1_000_000_000,
            100_000,
            0,
            1,
            1,
            3,
        ]))
        .query(&mut conn)
        .expect("batch");
    let ty: String = server.cmd(&["TYPE", key]).expect("TYPE");
    assert_eq!(ty, "string");
    let v: Vec<u8> = server.cmd(&["GET", key]).expect("GET");
    let f = leasehold_store::wire::compact_fields(&v).expect("a compact bucket");
    assert_eq!(
        (f["tok"].as_str(), f["p"].as_str()),
        ("7", "1000000000"),
        "{v:?}"
    );
    let reply: Vec<i64> = redis::cmd("FCALL")
        .arg("lh_acquire")
        .arg(1)
        .arg(key)
        .arg(&[
            "10",
            "1",
            "1000000000",
            "1000000",
            "100000",
            "0",
            "00ab",
            "2",
        ])
        .arg(&["0", "0", "0", "0", "0", "0", "5", "1", "0"])
        .query(&mut conn)
        .expect("acquire");
    let granted = reply[0];
    assert!((1..=5).contains(&granted), "granted {granted}");
    let ty: String = server.cmd(&["TYPE", key]).expect("TYPE");
    assert_eq!(ty, "hash");
    let h = support::hash(&server, key);
    assert_eq!(h["tok"], (7 - granted).to_string(), "{h:?}");
    assert_eq!(h["out"], granted.to_string(), "{h:?}");
    assert_eq!(h["00ab:h"], granted.to_string(), "{h:?}");
}

/// `lh_call` (packed numbers) and the decimal functions (tests, `redis-cli`) keep the
/// same records: a retry in either form replays the other's reply, and debits nothing.
#[test]
fn the_decimal_functions_and_lh_call_share_records() {
    let server = server_with_library();
    let mut conn = server.connection().expect("connection");
    let key = "lh:{t|mixed}";
    // B 10, one token per 1 000 s, lease TTL 1 s, grace a minute: records outlive a slow
    // machine, and nothing refills.
    let common = [10u64, 1, 1_000_000_000, 1_000_000, 60_000_000, 0];
    let call = |conn: &mut redis::Connection, op: u64, seq: u64, own: &[u64]| -> Vec<u64> {
        let mut numbers = vec![op];
        numbers.extend(common);
        numbers.extend([seq, 0, 0, 0, 0, 0]);
        numbers.extend(own);
        let v: Vec<u8> = redis::cmd("FCALL")
            .arg("lh_call")
            .arg(1)
            .arg(key)
            .arg("00ab")
            .arg(leasehold_store::wire::pack_numbers(&numbers))
            .query(conn)
            .expect("lh_call");
        leasehold_store::wire::unpack_numbers(&v).expect("a packed reply")
    };
    let decimal = |conn: &mut redis::Connection, f: &str, seq: u64, own: &[u64]| -> Vec<u64> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(f).arg(1).arg(key);
        for n in common {
            cmd.arg(n);
        }
        cmd.arg("00ab").arg(seq).arg(&[0u64; 5][..]).arg(own);
        cmd.query(conn).expect("a decimal call")
    };
    // Acquire 4 through lh_call; its retry through lh_acquire replays it.
    let first = call(&mut conn, 1, 1, &[0, 4, 1, 0]);
    assert_eq!(first.len(), leasehold_store::wire::REPLY_LEN, "{first:?}");
    assert_eq!((first[0], first[2]), (4, 6), "granted 4, 6 left: {first:?}");
    assert_eq!(decimal(&mut conn, "lh_acquire", 1, &[0, 4, 1, 0]), first);
    // An exact decision through lh_exact, retried through lh_call.
    let exact = decimal(&mut conn, "lh_exact", 2, &[3]);
    assert_eq!((exact[0], exact[2]), (3, 3), "{exact:?}");
    assert_eq!(call(&mut conn, 3, 2, &[3]), exact);
    // A release through lh_call, retried through lh_release: credited once.
    let released = call(&mut conn, 2, 3, &[4]);
    assert_eq!(released[0], 4, "{released:?}");
    assert_eq!(decimal(&mut conn, "lh_release", 3, &[4]), released);
    assert_eq!(
        field(&server, key, "tok"),
        7,
        "3 spent of 10, the lease back"
    );
}

/// `lh_call` refuses a malformed call, naming what is wrong, before it touches the key.
#[test]
fn lh_call_refuses_bad_calls_and_writes_nothing() {
    let server = server_with_library();
    let mut conn = server.connection().expect("connection");
    let key = "lh:{t|badcall}";
    let good = [10u64, 1, 1_000_000, 1_000_000, 100_000, 0, 1, 0, 0, 0, 0, 0];
    let with = |op: u64, common: &[u64], own: &[u64]| {
        let mut v = vec![op];
        v.extend(common);
        v.extend(own);
        leasehold_store::wire::pack_numbers(&v)
    };
    let mut over_held = good;
    over_held[10] = 1 << 41; // part_outstanding above its bound
    let mut zero_cap = good;
    zero_cap[0] = 0;
    // An operation and its own numbers on good common ones, then bad common numbers, a bad
    // agent, and numbers that are not whole 8-byte integers; each with its refusal.
    let ops: &[(u64, &[u64], &str)] = &[
        (0, &[1], "operation = 0"),
        (7, &[1], "operation = 7"),
        (3, &[], "numbers: 13 integers, 14"),
        (3, &[1, 1], "numbers: 15 integers, 14"),
        (1, &[1 << 41, 5, 1, 0], "held"),
        (1, &[0, 5, 6, 0], "want = 5"),
    ];
    let mut cases: Vec<(Vec<u8>, &str, String)> = ops
        .iter()
        .map(|(op, own, want)| {
            let text = format!("LH_ARG invalid argument {want}");
            (with(*op, &good, own), "00ab", text)
        })
        .collect();
    let more = [
        (
            with(3, &good, &[11]),
            "00ab",
            "LH_CAPACITY 11 tokens requested",
        ),
        (
            with(3, &over_held, &[1]),
            "00ab",
            "LH_ARG invalid argument part_outstanding",
        ),
        (
            with(3, &zero_cap, &[1]),
            "00ab",
            "LH_ARG invalid bucket parameters: capacity 0",
        ),
        (with(3, &good, &[1]), "{x}", "LH_ARG invalid argument agent"),
        (
            vec![1, 2, 3],
            "00ab",
            "LH_ARG invalid argument numbers: 3 bytes",
        ),
    ];
    cases.extend(more.map(|(n, a, w)| (n, a, w.to_owned())));
    for (numbers, agent, want) in &cases {
        let err = redis::cmd("FCALL")
            .arg("lh_call")
            .arg(1)
            .arg(key)
            .arg(*agent)
            .arg(numbers)
            .query::<redis::Value>(&mut conn)
            .expect_err("a bad call must be refused");
        let text = refusal(&err);
        assert!(text.starts_with(want), "got {text:?}, want {want:?}");
    }
    let err = redis::cmd("FCALL")
        .arg("lh_call")
        .arg(1)
        .arg(key)
        .arg("00ab")
        .arg(with(3, &good, &[1]))
        .arg("extra")
        .query::<redis::Value>(&mut conn)
        .expect_err("an argument left over");
    assert!(
        refusal(&err).starts_with("LH_ARG 1 arguments left over"),
        "{err}"
    );
    let exists: i64 = server.cmd(&["EXISTS", key]).expect("EXISTS");
    assert_eq!(exists, 0, "a refused call wrote the key");
}
