//! The hash that holds one bucket in Redis: every field, in one table that the
//! coordinator's view of a key and docs/protocol.md share. `lua/leasehold.lua` stores the same
//! fields packed: the bucket's in one field, each agent's record in one field named by
//! its id, as 64-bit integers
//! (`leasehold_store::wire::bucket_fields` reads them as these; the differential test
//! compares that with the model's after every step).
//!
//! Numbers are shown as decimal integers; times are server microseconds.

/// Tokens in the bucket (whole tokens).
pub const TOKENS: &str = "tok";
/// The fractional token carried between refills, in units of 1/period.
pub const CARRY: &str = "car";
/// The refill period the level was computed with (µs): a rule change rescales it.
pub const PERIOD: &str = "p";
/// When the level was last brought up to date.
pub const UPDATED: &str = "ts";
/// Tokens leased out and not yet returned or expired (strict mode holds them back).
pub const OUTSTANDING: &str = "out";
/// The earliest moment a lease record may drop (its expiry plus grace).
pub const NEXT_DROP: &str = "nexp";
/// The latest such moment: the key may expire only after it (I6).
pub const LAST_DROP: &str = "mx";
/// The sum of the live agents' reported demand (thousandths of a token per second).
pub const DEMAND_SUM: &str = "ds";
/// The earliest moment an agent's demand goes stale.
pub const NEXT_STALE: &str = "dx";
/// When this bucket was last split (its generation), 0 if never.
pub const SPLIT_GEN: &str = "sg";
/// The split in force: `parts,salt,until,tokens,outstanding,drop` (absent when none).
pub const SPLIT: &str = "sp";
/// On a part of a split bucket: `generation,until` of the split it serves.
pub const PART: &str = "pt";
/// On a region's bucket: when the term its deposits serve ends (absent: never fed).
pub const TERM_UNTIL: &str = "ru";
/// On a region's bucket: the last deposit applied, by its grant's global time.
pub const DEPOSIT_SEQ: &str = "rq";
/// On a region's bucket: the rate the region gets (milli-tokens/s), by its last deposit.
pub const REGION_RATE: &str = "rr";

/// The rate leases' shares, `1/scale`-ths of a token per rate period (absent when none):
/// the bucket refills at the rest of its rate.
pub const SHARED: &str = "sh";
/// How many records hold a share (absent when none).
pub const SHARE_RECORDS: &str = "sn";
/// The unit the shares are counted in, `period_us × scale` (absent when none).
pub const SHARE_UNIT: &str = "su";

/// Per agent (`ID` = 16 hex digits), what it holds from this bucket.
pub const AGENT_HELD: &str = ":h";
/// Per agent: when its record drops (lease expiry plus grace).
pub const AGENT_DROP: &str = ":x";
/// Per agent: the sequence number of its last applied request (replays answer from
/// [`AGENT_REPLY`]).
pub const AGENT_SEQ: &str = ":s";
/// Per agent: the reply to that request, as its wire encoding.
pub const AGENT_REPLY: &str = ":r";
/// Per agent: its reported demand (thousandths of a token per second).
pub const AGENT_DEMAND: &str = ":d";
/// Per agent: the lease credit it has earned at its share (thousandths of a token).
pub const AGENT_CREDIT: &str = ":c";

/// Per agent: its rate lease's share (`1/scale`-ths of a token per rate period; absent when
/// it has none); its held is then its burst.
pub const AGENT_SHARE: &str = ":q";

/// Every field, with its meaning: `(name, meaning)`; per-agent fields are written
/// `ID:h` and so on.
pub const FIELDS: &[(&str, &str)] = &[
    (TOKENS, "tokens in the bucket"),
    (
        CARRY,
        "fractional token carried between refills (1/period units)",
    ),
    (PERIOD, "refill period the level was computed with (µs)"),
    (UPDATED, "when the level was last brought up to date"),
    (
        OUTSTANDING,
        "tokens leased out, not yet returned or expired",
    ),
    (NEXT_DROP, "earliest moment a lease record may drop"),
    (
        LAST_DROP,
        "latest such moment: the key expires only after it",
    ),
    (DEMAND_SUM, "sum of live agents' demand (milli-tokens/s)"),
    (NEXT_STALE, "earliest moment an agent's demand goes stale"),
    (SPLIT_GEN, "when the bucket was last split"),
    (
        SPLIT,
        "split in force: parts,salt,until,tokens,outstanding,drop",
    ),
    (PART, "on a part: generation,until of its split"),
    (TERM_UNTIL, "on a region's bucket: when its term ends"),
    (
        DEPOSIT_SEQ,
        "on a region's bucket: the last deposit applied",
    ),
    (
        REGION_RATE,
        "on a region's bucket: the rate it gets (milli-tokens/s)",
    ),
    (
        SHARED,
        "rate leases' shares (1/scale tokens per rate period)",
    ),
    (SHARE_RECORDS, "records holding a share"),
    (SHARE_UNIT, "the shares' unit: rate period (µs) times scale"),
    (
        AGENT_HELD,
        "per agent: tokens it holds (a rate lease: its burst)",
    ),
    (AGENT_DROP, "per agent: when its record drops"),
    (AGENT_SEQ, "per agent: sequence number of its last request"),
    (AGENT_REPLY, "per agent: the reply to it (for replays)"),
    (AGENT_DEMAND, "per agent: its demand (milli-tokens/s)"),
    (
        AGENT_CREDIT,
        "per agent: lease credit earned at its share (milli-tokens)",
    ),
    (
        AGENT_SHARE,
        "per agent: its rate lease's share (1/scale tokens per rate period)",
    ),
];

/// The table entry describing hash field `name` (`tok`, or `0123456789abcdef:h`).
pub fn describe(name: &str) -> Option<&'static str> {
    let key = match name.rfind(':') {
        Some(i) => &name[i..],
        None => name,
    };
    FIELDS.iter().find(|(n, _)| *n == key).map(|(_, m)| *m)
}
