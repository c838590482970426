//! The wire encoding of the `leasehold` function library: the arguments of a call, the
//! reply array, and the text a bucket's hash stores. The one place these layouts are
//! spelled out on the Rust side; `leasehold.lua` is the other end.
//!
//! - Call: `FCALL lh_call 1 KEY AGENT NUMBERS` ([`call_args`]): the operation's number,
//!   then the arguments below but the agent, packed; the reply packed too. The decimal
//!   form, kept for the agents of the versions before: `FCALL lh_<op> 1 KEY` then 13
//!   common arguments (capacity, rate tokens, rate
//!   period µs, lease TTL µs, grace µs, max outstanding or 0 in strict mode, agent id,
//!   seq, and the part seed: generation, until, tokens, outstanding, drop; all zero for a
//!   bucket that is not a part; a region's bucket has its floor there: tokens, period µs,
//!   burst, 0, 0), then the operation's own. `lh_deposit`'s reply carries a region's
//!   state ([`leasehold_core::model::region::RegionState`]).
//! - Reply: [`REPLY_LEN`] integers: granted, ttl, remaining, retry, now, scale, moved
//!   (0/1), then the split in force (parts, salt, generation, until, tokens, outstanding,
//!   drop; zeros when none), then a rate lease's burst (0 without a share).
//! - Exact batches: `FCALL lh_exact_batch N DEDUP KEY...` ([`batch_key`]) then
//!   [`exact_many_args`]; the reply, one string of packed integers ([`unpack_numbers`]),
//!   is read by [`exact_many_reply`]; the dedup key holds [`BATCH_TAG`], then
//!   [`batch_numbers`] packed.
//! - Hash: see [`leasehold_core::schema`]; [`hash_fields`] renders a model state as those
//!   fields, and [`bucket_fields`] reads Redis's hash (its state packed in [`STATE`], each
//!   agent's record packed in a field named by the agent) as the same. A compact bucket
//!   (a 42-byte string, [`compact_value`], see [`BucketState::compact`]) renders as one
//!   entry named [`COMPACT`] whose value is `tok,car,ts,p,expiry` ([`compact_text`] reads
//!   Redis's string so); [`compact_fields`] reads such a string as the hash it stands
//!   for.

use std::collections::BTreeMap;

use leasehold_core::key::BucketKey;
use leasehold_core::model::{
    AgentId, BatchRecord, BucketState, ExactOutcome, ExactReply, Op, Reply, Request, Split,
};
use leasehold_core::rule::{BucketParams, Mode, PartSeed};
use leasehold_core::schema as h;

/// Integers in a reply.
pub const REPLY_LEN: usize = 15;

/// The function agents call for every single-key operation: [`call_args`].
pub const CALL: &str = "lh_call";

/// The number of `op` in `lh_call`.
pub fn op_number(op: &Op) -> u64 {
    match op {
        Op::Acquire { .. } => 1,
        Op::Release { .. } => 2,
        Op::Exact { .. } => 3,
        Op::Split { .. } => 4,
        Op::Deposit { .. } => 5,
        Op::Rate { .. } => 6,
    }
}

/// The arguments of `FCALL lh_call 1 KEY`: the agent, then one string of packed integers
/// ([`pack_numbers`]): the operation's number ([`op_number`]), the arguments of
/// [`args`] but the agent, in the same order. The reply is [`REPLY_LEN`] integers packed
/// the same way.
pub fn call_args(p: &BucketParams, req: &Request) -> [Vec<u8>; 2] {
    let (common, rest) = args(p, req);
    let mut numbers = Vec::with_capacity(1 + common.len() + rest.len());
    numbers.push(op_number(&req.op));
    numbers.extend(common);
    numbers.extend(rest);
    [agent(req).into_bytes(), pack_numbers(&numbers)]
}

/// The agent id as the hash and the arguments spell it.
pub fn agent(req: &Request) -> String {
    req.agent.to_string()
}

/// The integer arguments of a call after the agent id: seq, the part seed, then the
/// operation's own; `common` (capacity .. max outstanding) come before the agent id.
pub fn args(p: &BucketParams, req: &Request) -> ([u64; 6], Vec<u64>) {
    let max_outstanding = match p.mode {
        Mode::Strict => 0,
        Mode::Relaxed { max_outstanding } => max_outstanding.get(),
    };
    let common = [
        p.capacity,
        p.rate.tokens(),
        p.rate.period_us(),
        p.lease_ttl_us,
        p.grace_us,
        max_outstanding,
    ];
    let mut seed = p.part.unwrap_or(PartSeed {
        gen_us: 0,
        until_us: 0,
        tokens: 0,
        outstanding: 0,
        drop_us: 0,
    });
    if let Some(r) = &p.region
        && let Some(f) = r.floor
    {
        (seed.gen_us, seed.until_us, seed.tokens) = (f.tokens(), f.period_us(), r.floor_burst);
    }
    let mut rest = vec![
        req.seq,
        seed.gen_us,
        seed.until_us,
        seed.tokens,
        seed.outstanding,
        seed.drop_us,
    ];
    match req.op {
        Op::Acquire {
            held,
            want,
            min,
            demand,
        } => rest.extend([held, want, min, demand]),
        Op::Release { returned } => rest.push(returned),
        Op::Exact { cost } => rest.push(cost),
        Op::Split {
            parts,
            salt,
            until_us,
        } => rest.extend([parts, salt, until_us]),
        Op::Deposit {
            tokens,
            until_us,
            rate_milli,
        } => rest.extend([tokens, until_us, rate_milli]),
        Op::Rate {
            held,
            want,
            tokens,
            demand,
        } => rest.extend([held, want, tokens, demand]),
    }
    (common, rest)
}

/// A reply as the functions return it.
pub fn reply_to_array(r: &Reply) -> [u64; REPLY_LEN] {
    let s = split_numbers(r.split.as_ref());
    [
        r.granted,
        r.ttl_us,
        r.remaining,
        r.retry_us,
        r.now_us,
        r.scale_ppm,
        u64::from(r.moved),
        s[0],
        s[1],
        s[2],
        s[3],
        s[4],
        s[5],
        s[6],
        r.burst,
    ]
}

/// The inverse of [`reply_to_array`].
pub fn reply_from_array(a: [u64; REPLY_LEN]) -> Reply {
    Reply {
        granted: a[0],
        ttl_us: a[1],
        remaining: a[2],
        retry_us: a[3],
        now_us: a[4],
        scale_ppm: a[5],
        moved: a[6] != 0,
        split: (a[7] != 0).then_some(Split {
            parts: a[7],
            salt: a[8],
            gen_us: a[9],
            until_us: a[10],
            tokens: a[11],
            outstanding: a[12],
            drop_us: a[13],
        }),
        burst: a[14],
    }
}

fn split_numbers(s: Option<&Split>) -> [u64; 7] {
    s.map_or([0; 7], |s| {
        [
            s.parts,
            s.salt,
            s.gen_us,
            s.until_us,
            s.tokens,
            s.outstanding,
            s.drop_us,
        ]
    })
}

fn join(v: &[u64]) -> String {
    let text: Vec<String> = v.iter().map(u64::to_string).collect();
    text.join(",")
}

/// The stored form of a reply (`ID:r`, replayed to a retry): the array, comma separated;
/// the split's 7 numbers only when a split is in force; not the burst (a replay reads it
/// from the record: [`leasehold_core::model::AgentRecord::burst`]).
pub fn encode_reply(r: &Reply) -> String {
    let a = reply_to_array(r);
    let n = if r.split.is_none() { 7 } else { 14 };
    join(&a[..n])
}

/// The split stored in a bucket's `sp` field (parts, salt, until, tokens, outstanding,
/// drop) with its start from `sg`; `None` when absent or unreadable.
pub fn decode_split(sp: Option<&str>, gen_us: u64) -> Option<Split> {
    let v: Vec<u64> = sp?
        .split(',')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    match v[..] {
        [parts, salt, until_us, tokens, outstanding, drop_us] if parts != 0 => Some(Split {
            parts,
            salt,
            gen_us,
            until_us,
            tokens,
            outstanding,
            drop_us,
        }),
        _ => None,
    }
}

/// The name under which [`hash_fields`] gives a compact bucket's string.
pub const COMPACT: &str = "(compact)";

/// The hash fields Redis holds for `state`, sorted by name (empty for an absent key); for
/// a compact bucket, its string as the one entry [`COMPACT`].
pub fn hash_fields(state: Option<&BucketState>) -> BTreeMap<String, String> {
    let mut f = BTreeMap::new();
    let Some(s) = state else {
        return f;
    };
    if s.compact {
        let v = [
            s.level.tokens,
            s.level.carry,
            s.updated_us,
            s.period_us,
            s.expire_at_ms,
        ];
        f.insert(COMPACT.to_owned(), join(&v));
        return f;
    }
    for (k, v) in [
        (h::TOKENS, s.level.tokens),
        (h::CARRY, s.level.carry),
        (h::PERIOD, s.period_us),
        (h::UPDATED, s.updated_us),
        (h::OUTSTANDING, s.outstanding),
        (h::NEXT_DROP, s.next_drop_us),
        (h::LAST_DROP, s.last_drop_us),
        (h::DEMAND_SUM, s.demand_sum),
        (h::NEXT_STALE, s.next_stale_us),
    ] {
        f.insert(k.to_owned(), v.to_string());
    }
    if s.last_split_us != 0 {
        f.insert(h::SPLIT_GEN.to_owned(), s.last_split_us.to_string());
    }
    if let Some(sp) = &s.split {
        let v = [
            sp.parts,
            sp.salt,
            sp.until_us,
            sp.tokens,
            sp.outstanding,
            sp.drop_us,
        ];
        f.insert(h::SPLIT.to_owned(), join(&v));
    }
    if let Some(t) = &s.part {
        f.insert(h::PART.to_owned(), join(&[t.gen_us, t.until_us]));
    }
    if s.term_until_us != 0 {
        f.insert(h::TERM_UNTIL.to_owned(), s.term_until_us.to_string());
    }
    if s.deposit_seq != 0 {
        f.insert(h::DEPOSIT_SEQ.to_owned(), s.deposit_seq.to_string());
    }
    if s.region_rate_milli != 0 {
        f.insert(h::REGION_RATE.to_owned(), s.region_rate_milli.to_string());
    }
    if s.share_records != 0 {
        f.insert(h::SHARED.to_owned(), s.shared.to_string());
        f.insert(h::SHARE_RECORDS.to_owned(), s.share_records.to_string());
        f.insert(h::SHARE_UNIT.to_owned(), s.share_unit.to_string());
    }
    for (id, r) in &s.agents {
        f.insert(format!("{id}{}", h::AGENT_HELD), r.held.to_string());
        f.insert(format!("{id}{}", h::AGENT_DROP), r.drop_us.to_string());
        f.insert(format!("{id}{}", h::AGENT_SEQ), r.seq.to_string());
        f.insert(format!("{id}{}", h::AGENT_REPLY), encode_reply(&r.reply));
        f.insert(format!("{id}{}", h::AGENT_DEMAND), r.demand.to_string());
        f.insert(
            format!("{id}{}", h::AGENT_CREDIT),
            r.credit_milli.to_string(),
        );
        if r.share != 0 {
            f.insert(format!("{id}{}", h::AGENT_SHARE), r.share.to_string());
        }
    }
    f
}

/// The field of a bucket's hash that holds its state, packed: tok, car, p, ts, out, nexp,
/// mx, ds, dx, sg, ru, rq, rr, the split in force (parts, salt, until, tokens,
/// outstanding, drop; parts 0 when none) and the part's (generation, until), as 21
/// little-endian unsigned 64-bit integers, and three more while rate leases hold shares:
/// their sum, how many records have one, and the unit they are counted in. Each agent's record is the field named by its id: held, x, seq, demand,
/// credit, its rate lease's share if it has one, then its last reply (7 integers, 14 with
/// a split).
/// `leasehold.lua` reads and writes two fields a call so, instead of one decimal field
/// per number; [`bucket_fields`] reads them as the fields [`hash_fields`] renders.
pub const STATE: &str = "st";

/// The fields of [`leasehold_core::schema`] a bucket's hash stands for, given as Redis
/// holds it (`HGETALL`'s pairs): [`STATE`] and each agent's record expand to the fields
/// [`hash_fields`] renders. `None` if a field is neither.
pub fn bucket_fields(pairs: &[(Vec<u8>, Vec<u8>)]) -> Option<BTreeMap<String, String>> {
    let mut f = BTreeMap::new();
    for (name, value) in pairs {
        let name = std::str::from_utf8(name).ok()?;
        if name == STATE {
            let v = unpack_numbers(value)?;
            if v.len() != 21 && v.len() != 24 {
                return None;
            }
            for (k, n) in [
                (h::TOKENS, v[0]),
                (h::CARRY, v[1]),
                (h::PERIOD, v[2]),
                (h::UPDATED, v[3]),
                (h::OUTSTANDING, v[4]),
                (h::NEXT_DROP, v[5]),
                (h::LAST_DROP, v[6]),
                (h::DEMAND_SUM, v[7]),
                (h::NEXT_STALE, v[8]),
            ] {
                f.insert(k.to_owned(), n.to_string());
            }
            for (k, n) in [
                (h::SPLIT_GEN, v[9]),
                (h::TERM_UNTIL, v[10]),
                (h::DEPOSIT_SEQ, v[11]),
                (h::REGION_RATE, v[12]),
            ] {
                if n != 0 {
                    f.insert(k.to_owned(), n.to_string());
                }
            }
            if v[13] != 0 {
                f.insert(h::SPLIT.to_owned(), join(&v[13..19]));
            }
            if v[19] != 0 {
                f.insert(h::PART.to_owned(), join(&v[19..21]));
            }
            if v.len() == 24 {
                for (k, n) in [
                    (h::SHARED, v[21]),
                    (h::SHARE_RECORDS, v[22]),
                    (h::SHARE_UNIT, v[23]),
                ] {
                    f.insert(k.to_owned(), n.to_string());
                }
            }
        } else if !name.is_empty()
            && name.len() <= 32
            && name.bytes().all(|b| b.is_ascii_hexdigit())
        {
            let mut v = unpack_numbers(value)?;
            if ![12, 13, 19, 20].contains(&v.len()) {
                return None;
            }
            if v.len() == 13 || v.len() == 20 {
                // A rate lease's record: its share before the reply.
                let share = v.remove(5);
                f.insert(format!("{name}{}", h::AGENT_SHARE), share.to_string());
            }
            for (suffix, n) in [
                (h::AGENT_HELD, v[0]),
                (h::AGENT_DROP, v[1]),
                (h::AGENT_SEQ, v[2]),
                (h::AGENT_DEMAND, v[3]),
                (h::AGENT_CREDIT, v[4]),
            ] {
                f.insert(format!("{name}{suffix}"), n.to_string());
            }
            f.insert(format!("{name}{}", h::AGENT_REPLY), join(&v[5..]));
        } else {
            return None;
        }
    }
    Some(f)
}

/// The tag that begins a compact bucket's string.
pub const COMPACT_TAG: &[u8; 2] = b"L1";

/// A compact bucket's string as a batch writes it: [`COMPACT_TAG`], then tokens,
/// carry, updated (µs), period (µs) and the key's expiry as last set (ms: a write whose
/// expiry that covers keeps it: `SETRANGE` in place) as little-endian unsigned 64-bit
/// integers (Lua's `struct` reads and writes it far faster than decimal text).
pub fn compact_value(
    tokens: u64,
    carry: u64,
    updated_us: u64,
    period_us: u64,
    expire_at_ms: u64,
) -> Vec<u8> {
    let mut v = Vec::with_capacity(42);
    v.extend_from_slice(COMPACT_TAG);
    for n in [tokens, carry, updated_us, period_us, expire_at_ms] {
        v.extend_from_slice(&n.to_le_bytes());
    }
    v
}

/// A compact bucket's five numbers (tokens, carry, updated, period, expiry), or `None`
/// if `v` is not one. The four-number string of a library before the expiry was kept
/// reads with expiry 0 (it covers nothing: the next write sets one).
pub fn compact_numbers(v: &[u8]) -> Option<[u64; 5]> {
    let (tag, rest) = v.split_at_checked(2)?;
    if tag != COMPACT_TAG {
        return None;
    }
    let n = unpack_numbers(rest)?;
    match n[..] {
        [tok, car, ts, p, exp] => Some([tok, car, ts, p, exp]),
        [tok, car, ts, p] => Some([tok, car, ts, p, 0]),
        _ => None,
    }
}

/// A compact bucket's string as [`hash_fields`] renders it (`tok,car,ts,p,expiry`), or
/// `None`.
pub fn compact_text(v: &[u8]) -> Option<String> {
    compact_numbers(v).map(|n| join(&n))
}

/// The hash a compact bucket's string stands for (its four fields; every other field is
/// 0), or `None` if `v` is not one.
pub fn compact_fields(v: &[u8]) -> Option<BTreeMap<String, String>> {
    let [tok, car, ts, p, _] = compact_numbers(v)?;
    Some(
        [
            (h::TOKENS, tok),
            (h::CARRY, car),
            (h::UPDATED, ts),
            (h::PERIOD, p),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_string()))
        .collect(),
    )
}

/// One key of an exact batch: its bucket, the rule's parameters and the costs of the
/// decisions on it, in arrival order.
#[derive(Clone, Copy, Debug)]
pub struct ExactItem<'a> {
    /// The bucket (never a split's part).
    pub key: &'a BucketKey,
    /// Its parameters.
    pub params: &'a BucketParams,
    /// The decisions' costs.
    pub costs: &'a [u64],
}

/// The arguments of `FCALL lh_exact_batch` after the keys: the agent, then one string of
/// little-endian unsigned 64-bit integers ([`pack_numbers`]): seq, the distinct rule
/// parameters (capacity, rate tokens, rate period µs, grace µs, max outstanding), then
/// per key its rule's index (from 1), its number of costs and the costs. Every key once.
/// Then, on a `first` attempt (no call with this `seq` was sent before), `first`: the
/// function has no dedup key to look for.
pub fn exact_many_args(
    agent: AgentId,
    seq: u64,
    items: &[ExactItem<'_>],
    first: bool,
) -> Vec<Vec<u8>> {
    let mut rules: Vec<&BucketParams> = Vec::new();
    let mut index = Vec::with_capacity(items.len());
    for it in items {
        let i = match rules
            .iter()
            .position(|r| std::ptr::eq(*r, it.params) || **r == *it.params)
        {
            Some(i) => i,
            None => {
                rules.push(it.params);
                rules.len() - 1
            }
        };
        index.push(i + 1);
    }
    let n = 3 + rules.len() * 5 + items.iter().map(|it| 2 + it.costs.len()).sum::<usize>();
    let mut numbers = Vec::with_capacity(n - 1);
    let mut num = |v: u64| numbers.push(v);
    num(seq);
    num(rules.len() as u64);
    for p in &rules {
        let max_outstanding = match p.mode {
            Mode::Strict => 0,
            Mode::Relaxed { max_outstanding } => max_outstanding.get(),
        };
        for v in [
            p.capacity,
            p.rate.tokens(),
            p.rate.period_us(),
            p.grace_us,
            max_outstanding,
        ] {
            num(v);
        }
    }
    for (it, i) in items.iter().zip(index) {
        num(i as u64);
        num(it.costs.len() as u64);
        for &c in it.costs {
            num(c);
        }
    }
    let mut args = vec![agent.to_string().into_bytes(), pack_numbers(&numbers)];
    if first {
        args.push(b"first".to_vec());
    }
    args
}

/// Integers as `lh_exact_batch` reads its numbers: little-endian, 8 bytes each.
pub fn pack_numbers(numbers: &[u64]) -> Vec<u8> {
    numbers.iter().flat_map(|n| n.to_le_bytes()).collect()
}

/// The integers [`pack_numbers`] packed (an `lh_exact_batch` reply); `None` unless the
/// bytes are a whole number of them.
pub fn unpack_numbers(bytes: &[u8]) -> Option<Vec<u64>> {
    let words = bytes.chunks_exact(8);
    if !words.remainder().is_empty() {
        return None;
    }
    words
        .map(|w| w.try_into().ok().map(u64::from_le_bytes))
        .collect()
}

/// A batch dedup record's first byte.
pub const BATCH_TAG: u8 = 0xc1;

/// The dedup key of `agent`'s batch `seq` whose first key is `first`: beside it, in its
/// slot.
pub fn batch_key(first: &BucketKey, agent: AgentId, seq: u64) -> String {
    format!("{}:b:{agent}:{seq}", first.as_str())
}

/// The reply of `lh_exact_batch`, unpacked (server time, then per key: status, time past
/// the server time, remaining, scale, each cost's wait), one outcome per item; `None` if
/// its shape does not match the items.
pub fn exact_many_reply(v: &[u64], items: &[ExactItem<'_>]) -> Option<Vec<ExactOutcome>> {
    let (&server_now, mut rest) = v.split_first()?;
    let mut out = Vec::with_capacity(items.len());
    for it in items {
        let n = it.costs.len();
        let a = rest.get(..4 + n)?;
        rest = &rest[4 + n..];
        out.push(match a[0] {
            0 => ExactOutcome::Decided(ExactReply {
                now_us: server_now + a[1],
                remaining: a[2],
                scale_ppm: a[3],
                retry_us: a[4..].to_vec(),
            }),
            1 => ExactOutcome::Moved,
            _ => return None,
        });
    }
    rest.is_empty().then_some(out)
}

/// What a batch's dedup key holds after [`BATCH_TAG`], as numbers: its seq, then its
/// reply as `lh_exact_batch` gives it (packed as [`pack_numbers`] does).
pub fn batch_numbers(r: &BatchRecord) -> Vec<u64> {
    let mut v = vec![r.seq, r.server_now_us];
    for (o, &n) in r.outcomes.iter().zip(&r.counts) {
        match o {
            ExactOutcome::Decided(x) => {
                v.extend([0, x.now_us - r.server_now_us, x.remaining, x.scale_ppm]);
                v.extend(&x.retry_us);
            }
            // A moved key's costs are answered 0.
            ExactOutcome::Moved => {
                v.extend([1, 0, 0, 0]);
                v.extend(std::iter::repeat_n(0, n));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_numbers_round_trip_and_refuse_a_partial_integer() {
        let v = [0, 1, u64::from(u32::MAX) + 7, (1 << 53) - 1];
        let b = pack_numbers(&v);
        assert_eq!(b.len(), 32);
        assert_eq!(unpack_numbers(&b), Some(v.to_vec()));
        assert_eq!(unpack_numbers(&[]), Some(Vec::new()));
        assert_eq!(unpack_numbers(&b[..31]), None);
    }

    #[test]
    fn compact_values_round_trip_and_refuse_other_strings() {
        let v = compact_value(7, 12_345, 1_796_154_857_347_044, 1_000_000, 1_796_154_859);
        assert_eq!(v.len(), 42);
        assert_eq!(
            compact_numbers(&v),
            Some([7, 12_345, 1_796_154_857_347_044, 1_000_000, 1_796_154_859])
        );
        assert_eq!(
            compact_text(&v).as_deref(),
            Some("7,12345,1796154857347044,1000000,1796154859")
        );
        // The four-number form of a library before the expiry was kept: expiry 0.
        assert_eq!(
            compact_numbers(&v[..34]),
            Some([7, 12_345, 1_796_154_857_347_044, 1_000_000, 0])
        );
        assert_eq!(
            compact_fields(&v).map(|f| f["ts"].clone()).as_deref(),
            Some("1796154857347044")
        );
        let mut other = v.clone();
        other[0] = b'X';
        for bad in [
            &other[..],
            &v[..33],
            &v[..26],
            b"7,0,1,1000000",
            b"",
            b"hello",
        ] {
            assert_eq!(compact_numbers(bad), None, "{bad:?}");
        }
        for bad in [&b"7,0,1,1000000"[..], b"7,0,1,x", b"hello", &other[..]] {
            assert_eq!(compact_fields(bad), None, "{bad:?}");
        }
        assert_eq!(
            pack_numbers(&[1, 258]),
            [1, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn replies_round_trip_with_and_without_a_split() {
        let mut r = Reply {
            granted: 3,
            ttl_us: 1_000_000,
            remaining: 7,
            retry_us: 0,
            now_us: 42,
            scale_ppm: 500_000,
            moved: true,
            split: None,
            burst: 12,
        };
        assert_eq!(reply_from_array(reply_to_array(&r)), r);
        assert_eq!(encode_reply(&r), "3,1000000,7,0,42,500000,1");
        r.split = Some(Split {
            parts: 3,
            salt: 9,
            gen_us: 10,
            until_us: 20,
            tokens: 70,
            outstanding: 30,
            drop_us: 15,
        });
        assert_eq!(reply_from_array(reply_to_array(&r)), r);
        assert_eq!(encode_reply(&r).split(',').count(), 14);
    }

    #[test]
    fn a_stored_split_reads_back_or_not_at_all() {
        let s = decode_split(Some("3,9,20,70,30,15"), 10).unwrap();
        assert_eq!((s.parts, s.salt, s.gen_us, s.until_us), (3, 9, 10, 20));
        assert_eq!(decode_split(None, 10), None);
        assert_eq!(decode_split(Some("3,9,x,70,30,15"), 10), None);
        assert_eq!(decode_split(Some("0,0,0,0,0,0"), 0), None);
        assert_eq!(decode_split(Some("3,9"), 10), None);
    }
}
