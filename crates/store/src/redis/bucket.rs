//! Bucket calls: one operation on one key (`lh_call`), exact batches per slot
//! (`lh_exact_batch`), seats (`lh_seat`), and reading a bucket back.

use std::sync::atomic::Ordering;

use leasehold_core::key::BucketKey;
use leasehold_core::local::SeatReply;
use leasehold_core::model::{
    AgentId, ExactOutcome, MAX_BATCH_COSTS, Op, ProtocolError, Reply, Request, validate,
    validate_exact,
};
use leasehold_core::rule::{BucketParams, Replication};
use redis::{Cmd, Value};

use crate::wire::{self, ExactItem};

use super::error::{StoreError, classify, is_missing_library};
use super::{Conn, RedisStore};

/// Builds the `FCALL` for `req` (layout in [`crate::wire`]).
pub fn fcall(key: &BucketKey, p: &BucketParams, req: &Request) -> Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(wire::CALL)
        .arg(1)
        .arg(key.as_str())
        .arg(&wire::call_args(p, req)[..]);
    cmd
}

/// Validates an exact batch before it is sent: every key once, every item valid.
pub(crate) fn validate_batch(seq: u64, items: &[ExactItem<'_>]) -> Result<(), StoreError> {
    let mut total = 0;
    let mut keys = std::collections::HashSet::with_capacity(items.len());
    for it in items {
        validate_exact(it.params, seq, it.costs)?;
        total += it.costs.len();
        if !keys.insert(it.key.as_str()) {
            return Err(StoreError::Misconfigured(format!(
                "key {} appears twice in one exact batch",
                it.key.for_logs()
            )));
        }
    }
    if items.is_empty() || total > MAX_BATCH_COSTS {
        return Err(ProtocolError::InvalidArgument {
            what: "count",
            value: total as u64,
        }
        .into());
    }
    Ok(())
}

/// An operation's reply: packed (`lh_call`), or an array (the decimal functions).
pub(super) fn parse_value(v: Value) -> Result<Reply, StoreError> {
    let nums = match &v {
        Value::BulkString(b) => wire::unpack_numbers(b),
        _ => redis::from_redis_value::<Vec<u64>>(v.clone()).ok(),
    }
    .ok_or_else(|| StoreError::Misconfigured(format!("unexpected reply {v:?}")))?;
    match <[u64; wire::REPLY_LEN]>::try_from(nums) {
        Ok(a) => Ok(wire::reply_from_array(a)),
        Err(nums) => Err(StoreError::Misconfigured(format!(
            "unexpected reply {nums:?}; is an older leasehold library loaded?"
        ))),
    }
}

impl RedisStore {
    /// Runs one request on the bucket at `key`, within the call timeout.
    pub async fn call(
        &self,
        key: &BucketKey,
        params: &BucketParams,
        req: &Request,
    ) -> Result<Reply, StoreError> {
        self.call_replicated(key, params, req, None).await
    }

    /// [`RedisStore::call`], and for an acquire or exact call with `replication`, a
    /// `WAIT` pipelined behind it (one round trip): a grant that too few replicas
    /// acknowledged in time is [`StoreError::NotReplicated`].
    #[tracing::instrument(
        level = "debug",
        name = "store_call",
        skip_all,
        fields(key = %key.for_logs(), agent = req.agent.0, seq = req.seq)
    )]
    pub async fn call_replicated(
        &self,
        key: &BucketKey,
        params: &BucketParams,
        req: &Request,
        replication: Option<Replication>,
    ) -> Result<Reply, StoreError> {
        validate(params, req)?;
        self.not_refused()?;
        let cmd = fcall(key, params, req);
        let wait = replication.filter(|_| matches!(req.op, Op::Acquire { .. } | Op::Exact { .. }));
        let limit = self.config.call_timeout;
        tokio::time::timeout(limit, async {
            let seen = self.loader.generation.load(Ordering::Acquire);
            let Some(r) = wait else {
                return parse_value(self.query_loaded(&cmd).await?);
            };
            let mut pipe = redis::pipe();
            pipe.add_command(cmd)
                .cmd("WAIT")
                .arg(r.replicas)
                .arg(r.timeout.as_millis().max(1) as u64);
            let replies = match self.conn()?.query_pipe(&pipe, key.slot()).await {
                Err(e) if is_missing_library(&e) => {
                    self.reload(seen).await?;
                    self.conn()?.query_pipe(&pipe, key.slot()).await
                }
                other => other,
            }
            .map_err(classify)?;
            let mut replies = replies.into_iter();
            let reply =
                parse_value(replies.next().ok_or_else(|| {
                    StoreError::Misconfigured("empty reply to FCALL + WAIT".into())
                })?)?;
            let acked: u64 = replies
                .next()
                .and_then(|v| redis::from_redis_value(v).ok())
                .ok_or_else(|| StoreError::Misconfigured("WAIT gave no count".into()))?;
            if reply.granted > 0 && acked < u64::from(r.replicas) {
                return Err(StoreError::NotReplicated {
                    granted: reply.granted,
                    acked,
                    wanted: r.replicas,
                });
            }
            Ok(reply)
        })
        .await
        .map_err(|_| StoreError::Timeout(limit))?
    }

    /// Runs one exact batch (`lh_exact_batch`) for `agent` with sequence number `seq`,
    /// within the call timeout: one outcome per item. The keys should lie on one node (a
    /// single Redis, or one cluster primary); should the cluster refuse the batch (a slot
    /// moved), it is sent again per slot (each group with its own dedup key). A retry of
    /// the same items with the same `seq` replays (I2); `first` says no call with this
    /// `seq` went out before (the function then does not look for a dedup key: a caller
    /// that says so of a retry could be debited twice).
    pub async fn exact_many(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
        first: bool,
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        validate_batch(seq, items)?;
        self.not_refused()?;
        let limit = self.config.call_timeout;
        tokio::time::timeout(limit, async {
            match self.exact_many_once(agent, seq, items, first).await {
                Err(StoreError::Server { code, .. })
                    if matches!(self.link.conn.get(), Some(Conn::Cluster(_)))
                        && matches!(code.as_str(), "MOVED" | "ASK" | "CROSSSLOT" | "TRYAGAIN") =>
                {
                    // Refused whole, so not applied: each group's first call is a first.
                    self.exact_many_by_slot(agent, seq, items, first).await
                }
                other => other,
            }
        })
        .await
        .map_err(|_| StoreError::Timeout(limit))?
    }

    pub(super) async fn exact_many_once(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
        first: bool,
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("lh_exact_batch")
            .arg(items.len() + 1)
            .arg(wire::batch_key(items[0].key, agent, seq));
        for it in items {
            cmd.arg(it.key.as_str());
        }
        cmd.arg(wire::exact_many_args(agent, seq, items, first));
        let v = self.query_loaded(&cmd).await?;
        let nums = match &v {
            Value::BulkString(b) => wire::unpack_numbers(b),
            _ => None,
        }
        .ok_or_else(|| StoreError::Misconfigured(format!("unexpected reply {v:?}")))?;
        wire::exact_many_reply(&nums, items).ok_or_else(|| {
            StoreError::Misconfigured(format!(
                "unexpected exact batch reply of {} integers for {} keys",
                nums.len(),
                items.len()
            ))
        })
    }

    /// A batch the cluster refused as a whole, sent again as one call per slot.
    pub(super) async fn exact_many_by_slot(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
        first: bool,
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        let mut slots: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let slot = it.key.slot();
            match slots.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, v)) => v.push(i),
                None => slots.push((slot, vec![i])),
            }
        }
        let mut out: Vec<Option<ExactOutcome>> = vec![None; items.len()];
        for (_, idx) in &slots {
            let group: Vec<ExactItem<'_>> = idx.iter().map(|&i| items[i]).collect();
            for (&i, o) in idx
                .iter()
                .zip(self.exact_many_once(agent, seq, &group, first).await?)
            {
                out[i] = Some(o);
            }
        }
        Ok(out
            .into_iter()
            .map(|o| o.unwrap_or(ExactOutcome::Moved))
            .collect())
    }

    /// Claims or renews one of `seats` seats of `rule`'s local share for `agent`, for
    /// `ttl_us` (`lh_seat`; see [`leasehold_core::local`]), or gives it up (`leave`),
    /// within the call timeout.
    pub async fn claim_seat(
        &self,
        rule: &str,
        agent: AgentId,
        seats: u64,
        ttl_us: u64,
        leave: bool,
    ) -> Result<SeatReply, StoreError> {
        self.not_refused()?;
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("lh_seat")
            .arg(1)
            .arg(leasehold_core::local::seats_key(rule))
            .arg(agent.to_string())
            .arg(seats)
            .arg(ttl_us)
            .arg(u64::from(leave));
        let limit = self.config.call_timeout;
        let v = tokio::time::timeout(limit, self.query_loaded(&cmd))
            .await
            .map_err(|_| StoreError::Timeout(limit))??;
        let r: Vec<u64> = redis::from_redis_value(v.clone())
            .map_err(|_| StoreError::Misconfigured(format!("unexpected lh_seat reply {v:?}")))?;
        match r.as_slice() {
            [1, renewed, ttl_us] => Ok(SeatReply::Held {
                ttl_us: *ttl_us,
                renewed: *renewed == 1,
            }),
            [0, _, retry_us] => Ok(SeatReply::Full {
                retry_us: *retry_us,
            }),
            _ => Err(StoreError::Misconfigured(format!(
                "unexpected lh_seat reply {r:?}"
            ))),
        }
    }

    /// The hash of one bucket, as stored (empty when the key does not exist), its
    /// remaining time to live in ms (-2 when absent), and the server time in µs: what an
    /// operator's view of the key is built from. One key, no scan.
    pub async fn bucket(
        &self,
        key: &BucketKey,
    ) -> Result<(std::collections::HashMap<String, String>, i64, u64), StoreError> {
        let mut ty = redis::cmd("TYPE");
        ty.arg(key.as_str());
        let ty: String = redis::from_redis_value(self.conn()?.query(&ty).await.map_err(classify)?)
            .map_err(|e| StoreError::Misconfigured(format!("TYPE {key}: {e}")))?;
        let fields = if ty == "string" {
            // A compact bucket: the hash it stands for.
            let mut get = redis::cmd("GET");
            get.arg(key.as_str());
            let v: Option<Vec<u8>> =
                redis::from_redis_value(self.conn()?.query(&get).await.map_err(classify)?)
                    .map_err(|e| StoreError::Misconfigured(format!("bucket {key}: {e}")))?;
            match v {
                // Expired since TYPE.
                None => Default::default(),
                Some(v) => crate::wire::compact_fields(&v)
                    .map(|f| f.into_iter().collect())
                    .ok_or_else(|| {
                        StoreError::Misconfigured(format!(
                            "{key} holds a string that is not a bucket"
                        ))
                    })?,
            }
        } else {
            let mut hgetall = redis::cmd("HGETALL");
            hgetall.arg(key.as_str());
            let fields = self.conn()?.query(&hgetall).await.map_err(classify)?;
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = redis::from_redis_value(fields)
                .map_err(|e| StoreError::Misconfigured(format!("bucket {key}: {e}")))?;
            crate::wire::bucket_fields(&pairs)
                .map(|f| f.into_iter().collect())
                .ok_or_else(|| {
                    StoreError::Misconfigured(format!("{key} holds a hash that is not a bucket"))
                })?
        };
        let mut pttl = redis::cmd("PTTL");
        pttl.arg(key.as_str());
        let ttl: i64 = redis::from_redis_value(self.conn()?.query(&pttl).await.map_err(classify)?)
            .map_err(|e| StoreError::Misconfigured(format!("PTTL {key}: {e}")))?;
        let now = match self
            .conn()?
            .query(&redis::cmd("TIME"))
            .await
            .map_err(classify)?
        {
            Value::Array(v) if v.len() == 2 => {
                let secs: u64 = redis::from_redis_value(v[0].clone()).unwrap_or(0);
                let micros: u64 = redis::from_redis_value(v[1].clone()).unwrap_or(0);
                secs * 1_000_000 + micros
            }
            other => return Err(StoreError::Misconfigured(format!("TIME replied {other:?}"))),
        };
        Ok((fields, ttl, now))
    }
}
