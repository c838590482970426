//! What the agents and the coordinator keep beside the buckets: reports, announced
//! region keys, the leader lock, the live agents, and reads of the store's shape (shards,
//! eviction policy, time, a bucket's split).

use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, Split};
use redis::Value;

use crate::report::{AGENTS_KEY, LEAD_KEY, REPORT_TTL_MS, WANTED_KEY, report_key};
use crate::wire;

use super::error::{StoreError, classify};
use super::{Conn, RedisStore};

impl RedisStore {
    /// Tells the region's broker that agents use `key`, a region's bucket of a global key
    /// (see [`crate::report::WANTED_KEY`]).
    pub async fn announce_region_key(&self, key: &BucketKey) -> Result<(), StoreError> {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut add = redis::cmd("ZADD");
        add.arg(WANTED_KEY).arg(at_ms).arg(key.as_str());
        self.query::<i64>(&add).await.map(|_| ())
    }

    /// Replaces `agent`'s report (see [`crate::report`]) and scores it live at `at_ms`;
    /// returns the size of the fleet, the agents in `lh:agents`.
    pub async fn report(
        &self,
        agent: leasehold_core::model::AgentId,
        at_ms: u64,
        text: &str,
    ) -> Result<u64, StoreError> {
        let mut set = redis::cmd("SET");
        set.arg(report_key(agent))
            .arg(text)
            .arg("PX")
            .arg(REPORT_TTL_MS);
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(AGENTS_KEY).arg(at_ms).arg(agent.to_string());
        // The fleet's set lives as long as someone reports: once every agent has stopped
        // it is gone a report's life later, not kept for ever.
        let mut life = redis::cmd("PEXPIRE");
        life.arg(AGENTS_KEY).arg(REPORT_TTL_MS);
        let mut card = redis::cmd("ZCARD");
        card.arg(AGENTS_KEY);
        // All in flight at once: the multiplexed connection writes them together, and
        // Redis reads them in one go (one network event costs Redis more than the four
        // commands).
        let (set, zadd, life, card) = tokio::join!(
            self.query::<()>(&set),
            self.query::<i64>(&zadd),
            self.query::<i64>(&life),
            self.query::<u64>(&card)
        );
        set?;
        zadd?;
        life?;
        card
    }

    /// The slot ranges of the store's primaries, named `host:port`: one range covering
    /// every slot for a single Redis, `CLUSTER SLOTS` for a cluster.
    pub async fn shards(&self) -> Result<Vec<crate::ShardRange>, StoreError> {
        if let Some(Conn::Single(_) | Conn::Sentinel(_)) = self.link.conn.get() {
            return Ok(vec![(
                0,
                leasehold_core::key::SLOTS - 1,
                "single".to_owned(),
            )]);
        }
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let v = self.conn()?.query(&cmd).await.map_err(classify)?;
        let bad = || StoreError::Misconfigured(format!("unexpected CLUSTER SLOTS reply {v:?}"));
        let Value::Array(entries) = &v else {
            return Err(bad());
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Array(items) = entry else {
                return Err(bad());
            };
            let (Some(start), Some(end), Some(Value::Array(primary))) =
                (items.first(), items.get(1), items.get(2))
            else {
                return Err(bad());
            };
            let start: u16 = redis::from_redis_value(start.clone()).map_err(|_| bad())?;
            let end: u16 = redis::from_redis_value(end.clone()).map_err(|_| bad())?;
            let (Some(host), Some(port)) = (primary.first(), primary.get(1)) else {
                return Err(bad());
            };
            let host: String = redis::from_redis_value(host.clone()).map_err(|_| bad())?;
            let port: u16 = redis::from_redis_value(port.clone()).map_err(|_| bad())?;
            ranges.push((start, end, format!("{host}:{port}")));
        }
        Ok(ranges)
    }

    /// Reads `maxmemory-policy`; bucket keys must not be evicted (a lost bucket resets
    /// its budget), so anything but `noeviction` or a `volatile-*` policy is a warning.
    pub async fn maxmemory_policy(&self) -> Result<String, StoreError> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory-policy");
        let v = self.conn()?.query(&cmd).await.map_err(classify)?;
        let found = match v {
            Value::Array(items) => items.get(1).cloned(),
            Value::Map(pairs) => pairs.into_iter().next().map(|(_, v)| v),
            _ => None,
        };
        match found {
            Some(v) => redis::from_redis_value::<String>(v)
                .map_err(|e| StoreError::Misconfigured(format!("maxmemory-policy: {e}"))),
            None => Err(StoreError::Misconfigured(
                "CONFIG GET maxmemory-policy returned nothing".into(),
            )),
        }
    }

    /// The agents that reported since `since_ms` (wall clock), by id, each with the
    /// time of its last report (its score in `lh:agents`, wall-clock ms).
    pub async fn live_agents(&self, since_ms: u64) -> Result<Vec<(AgentId, u64)>, StoreError> {
        let mut live = redis::cmd("ZRANGEBYSCORE");
        live.arg(AGENTS_KEY)
            .arg(since_ms)
            .arg("+inf")
            .arg("WITHSCORES");
        let scored: Vec<(String, f64)> = self.query(&live).await?;
        Ok(scored
            .iter()
            .filter_map(|(id, at)| {
                let id = u64::from_str_radix(id, 16).ok()?;
                Some((AgentId(id), *at as u64))
            })
            .collect())
    }

    /// Forgets agents whose last report is older than `before_ms`.
    pub async fn forget_agents(&self, before_ms: u64) -> Result<(), StoreError> {
        let mut prune = redis::cmd("ZREMRANGEBYSCORE");
        prune.arg(AGENTS_KEY).arg("-inf").arg(before_ms);
        self.query::<i64>(&prune).await.map(drop)
    }

    /// Forgets `agent` at once: its entry in the live set and its report (a run that
    /// leaves the store to others, such as `simulate` on an operator's Redis, where no
    /// coordinator may prune them).
    pub async fn forget_agent(
        &self,
        agent: leasehold_core::model::AgentId,
    ) -> Result<(), StoreError> {
        let mut rem = redis::cmd("ZREM");
        rem.arg(AGENTS_KEY).arg(agent.to_string());
        self.query::<i64>(&rem).await?;
        self.query::<i64>(redis::cmd("DEL").arg(report_key(agent)))
            .await
            .map(drop)
    }

    /// `agent`'s last report (see [`crate::report`]), if it has not expired.
    pub async fn agent_report(&self, agent: AgentId) -> Result<Option<String>, StoreError> {
        self.query(redis::cmd("GET").arg(report_key(agent))).await
    }

    /// The last reports of `agents`, in order: up to 128 reads in flight at once, which
    /// the multiplexed connection writes together and Redis reads together (one read
    /// after another costs Redis a round of system calls per agent, every second).
    pub async fn agent_reports(
        &self,
        agents: &[AgentId],
    ) -> Result<Vec<Option<String>>, StoreError> {
        let mut out = Vec::with_capacity(agents.len());
        for chunk in agents.chunks(128) {
            let reads = chunk.iter().map(|&a| self.agent_report(a));
            for r in futures_util::future::join_all(reads).await {
                out.push(r?);
            }
        }
        Ok(out)
    }

    /// The region keys announced since `since_ms` (see [`WANTED_KEY`]), with when.
    pub async fn announced_keys(&self, since_ms: u64) -> Result<Vec<(String, u64)>, StoreError> {
        let mut read = redis::cmd("ZRANGEBYSCORE");
        read.arg(WANTED_KEY)
            .arg(since_ms)
            .arg("+inf")
            .arg("WITHSCORES");
        self.query(&read).await
    }

    /// Forgets region keys announced before `before_ms`.
    pub async fn forget_announced(&self, before_ms: u64) -> Result<(), StoreError> {
        let mut trim = redis::cmd("ZREMRANGEBYSCORE");
        trim.arg(WANTED_KEY).arg("-inf").arg(before_ms);
        self.query::<i64>(&trim).await.map(drop)
    }

    /// Takes or extends the coordinators' leader lock ([`LEAD_KEY`]) for `id` for `ttl_ms`
    /// (`lh_lead`): true when `id` holds it after.
    pub async fn take_lead(&self, id: &str, ttl_ms: u64) -> Result<bool, StoreError> {
        self.lead(id, ttl_ms, false).await
    }

    /// Releases the leader lock if `id` holds it.
    pub async fn give_up_lead(&self, id: &str) -> Result<(), StoreError> {
        self.lead(id, 1, true).await.map(drop)
    }

    async fn lead(&self, id: &str, ttl_ms: u64, give_up: bool) -> Result<bool, StoreError> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("lh_lead")
            .arg(1)
            .arg(LEAD_KEY)
            .arg(id)
            .arg(ttl_ms)
            .arg(u8::from(give_up));
        let held: i64 = redis::from_redis_value(self.query_loaded(&cmd).await?)
            .map_err(|e| StoreError::Misconfigured(format!("lh_lead: {e}")))?;
        Ok(held == 1)
    }

    /// The store's clock (`TIME`), µs since the epoch.
    pub async fn server_now_us(&self) -> Result<u64, StoreError> {
        let (secs, micros): (u64, u64) = self.query(&redis::cmd("TIME")).await?;
        Ok(secs * 1_000_000 + micros)
    }

    /// The split in force on the bucket at `key` at `now_us` (server clock), read from its
    /// state (`lh_state`; a compact bucket or none has no split).
    pub async fn split_of(
        &self,
        key: &BucketKey,
        now_us: u64,
    ) -> Result<Option<Split>, StoreError> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("lh_state").arg(1).arg(key.as_str());
        let v = self.query_loaded(&cmd).await?;
        let state: Option<Vec<u8>> = redis::from_redis_value(v)
            .map_err(|e| StoreError::Misconfigured(format!("lh_state: {e}")))?;
        let Some(state) = state else {
            return Ok(None);
        };
        let fields =
            wire::bucket_fields(&[(wire::STATE.as_bytes().to_vec(), state)]).ok_or_else(|| {
                StoreError::Misconfigured(format!("{key} holds a hash that is not a bucket"))
            })?;
        let num = |name: &str| {
            fields
                .get(name)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let split = wire::decode_split(
            fields
                .get(leasehold_core::schema::SPLIT)
                .map(String::as_str),
            num(leasehold_core::schema::SPLIT_GEN),
        );
        Ok(split.filter(|s| s.until_us > now_us))
    }

    /// Whether the store answers (`PING`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.query::<String>(&redis::cmd("PING")).await.map(drop)
    }

    /// Whether the primary serving `slot` answers (`PING`; on one node or behind
    /// Sentinel, the primary): a shard's probe with no decision to send.
    pub async fn ping_slot(&self, slot: u16) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("PING");
        let limit = self.config.call_timeout;
        tokio::time::timeout(limit, self.conn()?.query_pipe(&pipe, slot))
            .await
            .map_err(|_| StoreError::Timeout(limit))?
            .map(drop)
            .map_err(classify)
    }
}
