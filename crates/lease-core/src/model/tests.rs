use super::*;
use crate::rule::Rule;

fn params(capacity: u64, rate: &str) -> BucketParams {
    let mut spec = crate::rule::RuleSpec {
        capacity,
        rate: rate.into(),
        ..Default::default()
    };
    spec.lease_ttl = Some("1s".into());
    spec.grace = Some("100ms".into());
    Rule::from_spec("t", &spec).unwrap().bucket_params()
}

fn acquire(agent: u64, seq: u64, held: u64, want: u64) -> Request {
    Request {
        agent: AgentId(agent),
        seq,
        op: Op::Acquire {
            held,
            want,
            min: 1,
            demand: 0,
        },
    }
}

const T0: u64 = 1_700_000_000_000_000;

#[test]
fn grants_from_a_full_bucket_and_counts_outstanding() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    let r = b.apply(&p, T0, &acquire(1, 1, 0, 4)).unwrap();
    assert_eq!((r.granted, r.remaining, r.ttl_us), (4, 6, 1_000_000));
    let s = b.state().unwrap();
    assert_eq!((s.level.tokens, s.outstanding), (6, 4));
}

#[test]
fn refill_stops_at_capacity_minus_outstanding() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    b.apply(&p, T0, &acquire(1, 1, 0, 4)).unwrap();
    // 0.5 s later the bucket is still at 6 = B - outstanding.
    let r = b.apply(&p, T0 + 500_000, &acquire(2, 1, 0, 1)).unwrap();
    assert_eq!(r.remaining, 5);
    // Agent 1 reports it spent everything: the room opens, refill resumes from here.
    let r = b.apply(&p, T0 + 600_000, &acquire(1, 2, 0, 1)).unwrap();
    assert_eq!((r.granted, r.remaining), (1, 4));
}

#[test]
fn denial_says_when_min_tokens_exist() {
    let p = params(2, "1/s");
    let mut b = GlobalBucket::new();
    b.apply(&p, T0, &acquire(1, 1, 0, 2)).unwrap();
    let mut req = acquire(2, 1, 0, 2);
    req.op = Op::Acquire {
        held: 0,
        want: 2,
        min: 2,
        demand: 0,
    };
    let r = b.apply(&p, T0 + 250_000, &req).unwrap();
    assert_eq!(r.granted, 0);
    // Agent 1's 2 tokens are outstanding; 2 tokens at 1/s need 2 s from empty.
    assert_eq!(r.retry_us, 2_000_000);
}

#[test]
fn replay_returns_the_first_reply_and_changes_nothing() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    let first = b.apply(&p, T0, &acquire(1, 7, 0, 3)).unwrap();
    let before = b.clone();
    let again = b.apply(&p, T0 + 10_000, &acquire(1, 7, 0, 3)).unwrap();
    assert_eq!(first, again);
    assert_eq!(b, before);
    assert_eq!(
        b.apply(&p, T0 + 20_000, &acquire(1, 6, 0, 3)),
        Err(ProtocolError::StaleSequence { seq: 6, last: 7 })
    );
}

#[test]
fn errors_change_nothing_and_name_the_problem() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    let req = Request {
        agent: AgentId(1),
        seq: 1,
        op: Op::Exact { cost: 11 },
    };
    assert_eq!(
        b.apply(&p, T0, &req),
        Err(ProtocolError::CapacityExceeded {
            requested: 11,
            capacity: 10
        })
    );
    assert!(b.state().is_none());
}

#[test]
fn release_credits_no_more_than_was_held() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    b.apply(&p, T0, &acquire(1, 1, 0, 4)).unwrap();
    let rel = |seq, returned| Request {
        agent: AgentId(1),
        seq,
        op: Op::Release { returned },
    };
    let r = b.apply(&p, T0, &rel(2, 100)).unwrap();
    assert_eq!((r.granted, r.remaining), (4, 10));
    assert_eq!(b.state().unwrap().outstanding, 0);
}

#[test]
fn clock_stepping_back_creates_nothing() {
    let p = params(10, "10/s");
    let mut b = GlobalBucket::new();
    b.apply(&p, T0, &acquire(1, 1, 0, 10)).unwrap();
    let r = b
        .apply(&p, T0 - 3_600_000_000, &acquire(2, 1, 0, 1))
        .unwrap();
    assert_eq!((r.granted, r.now_us), (0, T0));
}

#[test]
fn dead_agents_stop_counting_at_their_drop_time() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    b.apply(&p, T0, &acquire(1, 1, 0, 10)).unwrap();
    // Lease 1 s + grace 0.1 s: dropped at T0 + 1.1 s, refill runs from there.
    let v = b.view_at(&p, T0 + 1_100_000);
    assert_eq!((v.level.tokens, v.outstanding, v.agents), (0, 0, 0));
    let v = b.view_at(&p, T0 + 3_100_000);
    assert_eq!(v.level.tokens, 2);
    // The key expires only once full again: 1.1 s + 10 s.
    let s = b.state().unwrap();
    assert_eq!(s.expire_at_ms, (T0 + 11_100_000) / 1000 + 1);
}

/// I1 across a split: the parent's `tokens + outstanding` plus every part's never
/// exceeds B, from the split through the parts' term to the parent's resumption.
#[test]
fn a_split_never_holds_more_than_the_parent_could() {
    let p = params(100, "50/s");
    let mut parent = GlobalBucket::new();
    // Agent 1 holds 30, 70 left in the bucket.
    parent.apply(&p, T0, &acquire(1, 1, 0, 30)).unwrap();
    let req = |seq, until_us| Request {
        agent: AgentId(9),
        seq,
        op: Op::Split {
            parts: 3,
            salt: 0,
            until_us,
        },
    };
    let r = parent.apply(&p, T0 + 10, &req(1, T0 + 5_000_000)).unwrap();
    let split = r.split.unwrap();
    assert_eq!((split.parts, split.tokens, split.outstanding), (3, 70, 30));
    // The parent now grants nothing and says where to go.
    let r = parent.apply(&p, T0 + 20, &acquire(2, 1, 0, 5)).unwrap();
    assert_eq!((r.granted, r.moved), (0, true));
    let part_params: Vec<BucketParams> =
        (0..3).map(|i| split.part_params(&p, i).unwrap()).collect();
    assert_eq!(part_params.iter().map(|q| q.capacity).sum::<u64>(), 100);
    let mut parts: Vec<GlobalBucket> = (0..3).map(|_| GlobalBucket::new()).collect();
    let total = |parent: &GlobalBucket, parts: &[GlobalBucket], t: u64| {
        let v = parent.view_at(&p, t);
        let mut sum = v.level.tokens + v.outstanding;
        for (b, q) in parts.iter().zip(&part_params) {
            if b.state().is_some() {
                let v = b.view_at(q, t);
                // The reservation stands for the parent's outstanding tokens, already
                // counted in the parent.
                let reserved = b.state().unwrap().agents.get(&RESERVATION);
                let reserved = reserved.filter(|r| r.drop_us > t).map_or(0, |r| r.held);
                // A part's tokens are dead once its term is over.
                let usable = if t < split.until_us {
                    v.level.tokens
                } else {
                    0
                };
                sum += usable + v.outstanding - reserved;
            }
        }
        sum
    };
    for step in 0..60u64 {
        let t = T0 + 100 + step * 100_000;
        for (i, (b, q)) in parts.iter_mut().zip(&part_params).enumerate() {
            let r = b
                .apply(q, t, &acquire(10 + i as u64, step + 1, 0, 2))
                .unwrap();
            if t + p.grace_us < T0 + 5_000_000 {
                assert!(!r.moved);
            }
        }
        assert!(total(&parent, &parts, t) <= 100, "over B at step {step}");
    }
    // Past the term: parts refuse, the parent serves again and refills from then.
    let r = parts[0]
        .apply(&part_params[0], T0 + 6_100_000, &acquire(10, 100, 0, 1))
        .unwrap();
    assert_eq!((r.granted, r.moved), (0, true));
    let r = parent
        .apply(&p, T0 + 6_000_000, &acquire(2, 2, 0, 5))
        .unwrap();
    assert_eq!((r.moved, r.split), (false, None));
    assert!(r.granted > 0);
}

#[test]
fn scale_is_the_rate_over_the_sum_of_demands() {
    let p = params(1000, "100/s");
    let mut b = GlobalBucket::new();
    let ask = |agent, demand| Request {
        agent: AgentId(agent),
        seq: 1,
        op: Op::Acquire {
            held: 0,
            want: 1,
            min: 1,
            demand,
        },
    };
    // 50 tokens/s of demand: under the rate, everyone gets all it asks for.
    let r = b.apply(&p, T0, &ask(1, 50_000)).unwrap();
    assert_eq!(r.scale_ppm, 1_000_000);
    // 400/s in all: each agent may have a quarter of its demand.
    let r = b.apply(&p, T0, &ask(2, 350_000)).unwrap();
    assert_eq!(r.scale_ppm, 250_000);
    assert_eq!(b.state().unwrap().demand_sum, 400_000);
}

/// Under contention an agent leases at most its share of the rate: with demand 1:9
/// on a key whose rate is a tenth of the total, the small agent banks a tenth of B,
/// then earns a tenth of the refill, and waits its turn for more.
#[test]
fn contended_agents_lease_their_share_and_wait_their_turn() {
    let p = params(80, "100/s");
    let mut b = GlobalBucket::new();
    let ask = |agent, seq, demand| Request {
        agent: AgentId(agent),
        seq,
        op: Op::Acquire {
            held: 0,
            want: 40,
            min: 1,
            demand,
        },
    };
    // Agent 2 (900/s) alone drains the bucket; agent 1 (100/s) joins.
    b.apply(&p, T0, &ask(2, 1, 900_000)).unwrap();
    b.apply(&p, T0, &ask(2, 2, 900_000)).unwrap();
    let r = b.apply(&p, T0, &ask(1, 1, 100_000)).unwrap();
    assert_eq!((r.granted, r.scale_ppm), (0, 100_000));
    // 90 ms: 9 tokens refilled (under B/8, so not plenty). Agent 1 takes its banked
    // credit, B/10 = 8 tokens, not the 9 there are.
    let r = b.apply(&p, T0 + 90_000, &ask(1, 2, 100_000)).unwrap();
    assert_eq!(r.granted, 8);
    // Out of credit: one token takes 100 ms to earn at 10 tokens/s, but in 90 ms the
    // bucket could hold B/8 = 10 tokens (plenty, when credit no longer binds).
    let r = b.apply(&p, T0 + 90_000, &ask(1, 3, 100_000)).unwrap();
    assert_eq!((r.granted, r.retry_us), (0, 90_000));
    // Agent 2 takes what is left.
    let r = b.apply(&p, T0 + 90_000, &ask(2, 3, 900_000)).unwrap();
    assert_eq!(r.granted, 1);
}

/// A silent agent's demand stops counting a second after its last call, so the
/// others' shares grow back without waiting for its lease to run out.
#[test]
fn demand_of_a_silent_agent_goes_stale() {
    let p = params(100, "10/s");
    let mut b = GlobalBucket::new();
    let ask = |agent, seq, demand| Request {
        agent: AgentId(agent),
        seq,
        op: Op::Acquire {
            held: 0,
            want: 1,
            min: 1,
            demand,
        },
    };
    b.apply(&p, T0, &ask(1, 1, 30_000)).unwrap();
    let r = b.apply(&p, T0 + 500_000, &ask(2, 1, 10_000)).unwrap();
    assert_eq!(r.scale_ppm, 250_000);
    // Agent 1 says nothing more; a second after its call its demand is gone.
    let r = b.apply(&p, T0 + 1_000_000, &ask(2, 2, 10_000)).unwrap();
    assert_eq!(
        (r.scale_ppm, b.state().unwrap().demand_sum),
        (1_000_000, 10_000)
    );
    assert_eq!(b.state().unwrap().agents[&AgentId(1)].demand, 0);
}

fn decided(o: ExactOutcome) -> ExactReply {
    match o {
        ExactOutcome::Decided(r) => r,
        other => panic!("not decided: {other:?}"),
    }
}

#[test]
fn an_exact_batch_decides_costs_in_order_and_its_log_replays_a_retry() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    let mut log = BatchLog::new();
    assert_eq!(log.open(T0, 5), None);
    let r = decided(b.exact_many(&p, T0, &[4, 7, 6, 1]).unwrap());
    // 4 fits (6 left), 7 does not (one token short), 6 does (0 left), 1 does not.
    assert_eq!(
        r.retry_us.iter().map(|&w| w == 0).collect::<Vec<_>>(),
        [true, false, true, false]
    );
    assert_eq!(
        (r.remaining, r.retry_us[1], r.retry_us[3]),
        (0, 1_000_000, 1_000_000)
    );
    let answer = vec![ExactOutcome::Decided(r)];
    log.close(T0, 5, p.grace_us, &answer, &[4]);
    // The same batch again (a lost reply): the same answer, from the log.
    assert_eq!(log.open(T0 + 10, 5), Some(answer.clone()));
    // Past the grace (100 ms) the log is gone.
    assert_eq!(log.open(T0 + 100_000, 5), None);
    // No record in the bucket: it expires once full again, a grace after the call, and
    // ten graces (1 s) beyond.
    let s = b.state().unwrap();
    assert!(s.agents.is_empty());
    assert_eq!(
        s.expire_at_ms,
        (T0 + 100_000 + 10_000_000) / 1000 + 1 + 1000
    );
}

#[test]
fn a_compact_key_keeps_its_expiry_while_it_covers_the_next() {
    let p = params(100, "1000/s");
    let mut b = GlobalBucket::new();
    // A token taken: full again 1 ms later; expiry a grace (100 ms) after that, and ten
    // graces (1 s) beyond.
    decided(b.exact_many(&p, T0, &[1]).unwrap());
    let first = (T0 + 1_000 + 100_000) / 1000 + 1 + 1000;
    assert_eq!(b.state().unwrap().expire_at_ms, first);
    // 10 ms later it needs 10 ms more: within the slack, kept.
    decided(b.exact_many(&p, T0 + 10_000, &[1]).unwrap());
    assert_eq!(b.state().unwrap().expire_at_ms, first);
    // 990 ms later it needs 990 ms more: still within, kept.
    decided(b.exact_many(&p, T0 + 990_000, &[1]).unwrap());
    assert_eq!(b.state().unwrap().expire_at_ms, first);
    // 1.2 s later, past it: a new one, with the slack again.
    decided(b.exact_many(&p, T0 + 1_200_000, &[1]).unwrap());
    assert_eq!(
        b.state().unwrap().expire_at_ms,
        (T0 + 1_200_000 + 1_000 + 100_000) / 1000 + 1 + 1000
    );
}

/// A long grace does not keep an idle tenant's key for ten of them: the slack stops at
/// 10 s.
#[test]
fn a_compact_keys_slack_is_at_most_ten_seconds() {
    let mut spec = crate::rule::RuleSpec {
        capacity: 100,
        rate: "1000/s".into(),
        ..Default::default()
    };
    spec.grace = Some("1h".into());
    let p = Rule::from_spec("t", &spec).unwrap().bucket_params();
    let mut b = GlobalBucket::new();
    decided(b.exact_many(&p, T0, &[1]).unwrap());
    assert_eq!(
        b.state().unwrap().expire_at_ms,
        (T0 + 1_000 + 3_600_000_000) / 1000 + 1 + 10_000
    );
}

#[test]
fn an_exact_batch_leaves_a_split_key_alone() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    let split = Request {
        agent: AgentId(1),
        seq: 1,
        op: Op::Split {
            parts: 2,
            salt: 0,
            until_us: T0 + 1_000_000,
        },
    };
    b.apply(&p, T0, &split).unwrap();
    let before = b.clone();
    assert_eq!(b.exact_many(&p, T0 + 1, &[1]).unwrap(), ExactOutcome::Moved);
    assert_eq!(b, before);
    assert!(matches!(
        b.exact_many(&p, T0, &[11]),
        Err(ProtocolError::CapacityExceeded { requested: 11, .. })
    ));
}

fn region(capacity: u64, rate: &str, floor: Option<&str>) -> BucketParams {
    let floor = floor.map(|f| params(1, f).rate);
    BucketParams {
        region: Some(crate::rule::RegionParams::new(floor)),
        ..params(capacity, rate)
    }
}

fn deposit(seq: u64, tokens: u64, until_us: u64) -> Request {
    Request {
        agent: AgentId(99),
        seq,
        op: Op::Deposit {
            tokens,
            until_us,
            rate_milli: 0,
        },
    }
}

fn exact(agent: u64, seq: u64, cost: u64) -> Request {
    Request {
        agent: AgentId(agent),
        seq,
        op: Op::Exact { cost },
    }
}

#[test]
fn a_region_bucket_starts_empty_and_holds_only_what_is_deposited() {
    let p = region(100, "100/s", None);
    let mut b = GlobalBucket::new();
    let r = b.apply(&p, T0, &exact(1, 1, 1)).unwrap();
    assert_eq!((r.granted, r.retry_us), (0, region::REGION_WAIT_US));
    // No refill at the rule's rate, however long it waits.
    let r = b.apply(&p, T0 + 5_000_000, &exact(1, 2, 1)).unwrap();
    assert_eq!(r.granted, 0);
    let r = b
        .apply(&p, T0 + 5_000_000, &deposit(7, 3, T0 + 6_000_000))
        .unwrap();
    let st = region::RegionState::from_reply(&r);
    assert_eq!((st.deposited, st.held, st.term_left_us), (3, 3, 1_000_000));
    for seq in 3..6 {
        assert_eq!(
            b.apply(&p, T0 + 5_100_000, &exact(1, seq, 1))
                .unwrap()
                .granted,
            1
        );
    }
    assert_eq!(
        b.apply(&p, T0 + 5_100_000, &exact(1, 6, 1))
            .unwrap()
            .granted,
        0
    );
}

#[test]
fn a_deposit_applies_once_and_never_out_of_order() {
    let p = region(100, "100/s", None);
    let mut b = GlobalBucket::new();
    let until = T0 + 1_000_000;
    b.apply(&p, T0, &deposit(10, 5, until)).unwrap();
    // A retry (the same seq) and an older grant arriving late change nothing.
    let r = b.apply(&p, T0 + 10, &deposit(10, 5, until)).unwrap();
    assert_eq!((r.granted, r.remaining), (0, 5));
    let r = b.apply(&p, T0 + 20, &deposit(9, 50, until)).unwrap();
    assert_eq!((r.granted, r.remaining), (0, 5));
    // A read (seq 0) neither.
    let r = b.apply(&p, T0 + 30, &deposit(0, 50, until)).unwrap();
    assert_eq!((r.granted, r.remaining), (0, 5));
    let r = b.apply(&p, T0 + 40, &deposit(11, 2, until)).unwrap();
    assert_eq!((r.granted, r.remaining), (2, 7));
}

#[test]
fn what_is_left_at_the_end_of_the_term_is_void_then_the_floor_refills_from_empty() {
    let p = region(100, "100/s", Some("10/s"));
    let mut b = GlobalBucket::new();
    b.apply(&p, T0, &deposit(1, 50, T0 + 1_000_000)).unwrap();
    // A lease ends with the term: 1 s less the grace (100 ms), from 0.5 s in.
    let r = b.apply(&p, T0 + 500_000, &acquire(1, 1, 0, 10)).unwrap();
    assert_eq!((r.granted, r.ttl_us), (10, 400_000));
    // Past the term: the 40 tokens left are gone; the floor adds 10/s from the term's end.
    let r = b.apply(&p, T0 + 1_300_000, &exact(2, 1, 1)).unwrap();
    assert_eq!((r.granted, r.remaining), (1, 2));
    // Its burst is a second of it.
    let r = b.apply(&p, T0 + 2_000_000, &exact(2, 2, 1)).unwrap();
    assert_eq!((r.granted, r.remaining), (1, 8));
    // A deposit whose term is already over adds nothing; a new one drops what the floor
    // made.
    let r = b
        .apply(&p, T0 + 2_000_000, &deposit(2, 40, T0 + 1_500_000))
        .unwrap();
    assert_eq!((r.granted, r.remaining), (0, 8));
    let r = b
        .apply(&p, T0 + 2_000_000, &deposit(3, 4, T0 + 4_000_000))
        .unwrap();
    assert_eq!((r.granted, r.remaining), (4, 4));
    // A region's bucket with no term yet serves its floor from its first call.
    let mut b2 = GlobalBucket::new();
    b2.apply(&p, T0, &exact(2, 1, 1)).unwrap();
    let r = b2.apply(&p, T0 + 900_000, &exact(2, 2, 1)).unwrap();
    assert_eq!((r.granted, r.remaining), (1, 8));
}

#[test]
fn a_region_bucket_is_never_split_or_batched_and_deposits_need_one() {
    let p = region(100, "100/s", None);
    let mut b = GlobalBucket::new();
    let split = Request {
        agent: AgentId(1),
        seq: 1,
        op: Op::Split {
            parts: 2,
            salt: 0,
            until_us: T0 + 1,
        },
    };
    assert!(b.apply(&p, T0, &split).is_err());
    assert!(b.exact_many(&p, T0, &[1]).is_err());
    assert!(
        b.apply(&params(100, "100/s"), T0, &deposit(1, 1, T0 + 1))
            .is_err()
    );
}

#[test]
fn an_exact_batch_writes_nothing_it_did_not_change_and_compacts_a_hash_left_a_level() {
    let p = params(10, "1/s");
    let mut b = GlobalBucket::new();
    // A new key: compact, 9 left.
    decided(b.exact_many(&p, T0, &[1]).unwrap());
    assert!(b.state().unwrap().compact);
    decided(b.exact_many(&p, T0 + 1, &[9]).unwrap());
    let empty = b.clone();
    // Nothing admitted: the key keeps what it held, its time and expiry too.
    let r = decided(b.exact_many(&p, T0 + 500_000, &[1, 2]).unwrap());
    assert!(r.retry_us.iter().all(|&w| w > 0), "{r:?}");
    assert_eq!(b, empty);
    // A lease makes it a hash; once its record has dropped, a batch makes it compact.
    let acquire = Request {
        agent: AgentId(1),
        seq: 1,
        op: Op::Acquire {
            held: 0,
            want: 1,
            min: 1,
            demand: 0,
        },
    };
    b.apply(&p, T0 + 2_000_000, &acquire).unwrap();
    assert!(!b.state().unwrap().compact);
    // Within the record's life, still a hash.
    decided(b.exact_many(&p, T0 + 2_000_001, &[1]).unwrap());
    assert!(!b.state().unwrap().compact);
    // Long after (the record dropped, a later batch found no record left).
    let later = T0 + 2_000_000 + p.lease_ttl_us + p.grace_us + 1;
    decided(b.exact_many(&p, later, &[1]).unwrap());
    decided(b.exact_many(&p, later + 1, &[1]).unwrap());
    let s = b.state().unwrap();
    assert!(s.compact && s.agents.is_empty(), "{s:?}");
}
