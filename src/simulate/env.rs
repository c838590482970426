//! The store under test: embedded, or spawned Redis (single, primary and replica, Sentinel,
//! cluster, behind a fault proxy), its faults, and the memory it uses.

use std::sync::atomic::{AtomicBool, Ordering};

use leasehold::agent::EmbeddedStore;
use leasehold_redis_harness::{Cluster, FaultProxy, RedisServer, ReplicaPair};

use super::cores::RedisCore;

/// Where the global buckets live.
#[derive(Clone, Debug)]
pub(crate) enum StoreChoice {
    /// In this process.
    Embedded,
    /// A private redis-server.
    Spawn,
    /// A private primary and replica behind a virtual address that a failover moves.
    SpawnReplica,
    /// A private 6-node cluster.
    ClusterSpawn,
    /// A Redis already running.
    Redis(String),
    /// A Redis Cluster already running, by seed nodes.
    Cluster(Vec<String>),
}

impl StoreChoice {
    /// How reports name it: never an address (it may hold a password).
    pub(crate) fn shown(&self) -> &'static str {
        match self {
            Self::Embedded => "embedded",
            Self::Spawn => "spawn (a private redis-server)",
            Self::SpawnReplica => "spawn-replica (a private primary and replica)",
            Self::ClusterSpawn => "cluster-spawn (a private 6-node cluster)",
            Self::Redis(_) => "an external Redis",
            Self::Cluster(_) => "an external Redis Cluster",
        }
    }
}

impl std::str::FromStr for StoreChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "embedded" => Ok(Self::Embedded),
            "spawn" => Ok(Self::Spawn),
            "spawn-replica" => Ok(Self::SpawnReplica),
            "cluster-spawn" => Ok(Self::ClusterSpawn),
            // A malformed address (one Redis or a cluster's nodes) is refused before anything
            // starts, in words that show none of it.
            url if ["redis://", "rediss://", "cluster://"]
                .iter()
                .any(|p| url.starts_with(p))
                && let Some(why) = leasehold_store::secret::shape_problem(url) =>
            {
                Err(format!("store address: {why}"))
            }
            url if url.starts_with("redis://") || url.starts_with("rediss://") => {
                Ok(Self::Redis(url.to_owned()))
            }
            // The first node's credentials are every node's, as the library takes them.
            list if list.starts_with("cluster://") => Ok(Self::Cluster(
                leasehold_store::redis::node_urls("redis", &list["cluster://".len()..])
                    .map_err(|e| e.to_string())?,
            )),
            // Sentinel (and TLS cluster) addresses are the library's, serve's, the
            // coordinator's and the gateway's; named by their scheme only.
            other
                if ["redis+sentinel://", "rediss+sentinel://", "clusters://"]
                    .iter()
                    .any(|p| other.starts_with(p)) =>
            {
                let scheme = other.split("://").next().unwrap_or_default();
                Err(format!(
                    "{scheme}:// addresses are for serve, the coordinator and the gateway; \
                     simulate runs on embedded, spawn, spawn-replica (a primary and replica it \
                     fails over itself), cluster-spawn, redis://, rediss:// or cluster://"
                ))
            }
            // Not shown: a mistyped address (`redis//:PW@host`) or a bare password may be
            // all it is.
            other => Err(format!(
                "unknown store (not shown, {} characters: it may hold a password): embedded, \
                 spawn (a private redis-server), spawn-replica, cluster-spawn, \
                 redis://HOST:PORT, rediss://HOST:PORT or cluster://HOST:PORT,HOST:PORT",
                other.chars().count()
            )),
        }
    }
}

/// What a system's agents connect to.
#[derive(Clone)]
pub(super) enum Target {
    Embedded(EmbeddedStore),
    Redis(String),
    Cluster(Vec<String>),
}

impl Target {
    /// The memory Redis uses (`used_memory`, MB), for a single Redis.
    pub(super) async fn memory_mb(&self) -> Option<f64> {
        let Self::Redis(url) = self else {
            return None;
        };
        let info = info(url, &["memory"]).await?;
        Some(info_number(&info, "used_memory")? / 1e6)
    }

    /// What the store's Redis processes have spent since they started, summed over every
    /// node of a cluster (replicas too: replication is part of what a decision costs):
    /// `(cpu, scripts)`, µs. `cpu` is `used_cpu_user` plus `used_cpu_sys` of INFO cpu, the
    /// processes' whole CPU (reading and writing replies is a large part of what a
    /// per-request script costs a shard, and the agents' reports count too); `scripts` is
    /// the time INFO commandstats gives the script calls themselves (FCALL, FCALL_RO,
    /// EVALSHA, EVAL; the commands they run are inside that time). None for the embedded
    /// store or when a node does not answer.
    pub(super) async fn usage_us(&self) -> Option<(u64, u64)> {
        let urls = match self {
            Self::Embedded(_) => return None,
            Self::Redis(url) => vec![url.clone()],
            Self::Cluster(seeds) => cluster_nodes(seeds).await?,
        };
        let (mut cpu, mut scripts) = (0u64, 0u64);
        for url in urls {
            let info = info(&url, &["cpu", "commandstats"]).await?;
            let secs = info_number(&info, "used_cpu_user")? + info_number(&info, "used_cpu_sys")?;
            cpu += (secs * 1e6) as u64;
            // cmdstat_fcall:calls=N,usec=U,...
            for l in info.lines() {
                let Some((name, stats)) =
                    l.strip_prefix("cmdstat_").and_then(|l| l.split_once(':'))
                else {
                    continue;
                };
                if !matches!(name, "fcall" | "fcall_ro" | "evalsha" | "eval") {
                    continue;
                }
                scripts += (stats.split(','))
                    .find_map(|f| f.strip_prefix("usec="))
                    .and_then(|u| u.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
        Some((cpu, scripts))
    }
}

/// The INFO sections of the Redis at `url`, one after another (a Redis before 7 takes one
/// section a call).
async fn info(url: &str, sections: &[&str]) -> Option<String> {
    let client = redis::Client::open(url).ok()?;
    let mut c = client.get_multiplexed_async_connection().await.ok()?;
    let mut info = String::new();
    for section in sections {
        let text: String = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut c)
            .await
            .ok()?;
        info.push_str(&text);
    }
    Some(info)
}

/// The number INFO gives `field` (`field:NUMBER`).
fn info_number(info: &str, field: &str) -> Option<f64> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .parse()
        .ok()
}

/// Every node of the cluster the seeds belong to, as URLs (CLUSTER NODES of the first seed
/// that answers).
async fn cluster_nodes(seeds: &[String]) -> Option<Vec<String>> {
    for seed in seeds {
        let Ok(client) = redis::Client::open(seed.as_str()) else {
            continue;
        };
        let Ok(mut c) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let Ok(text) = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async::<String>(&mut c)
            .await
        else {
            continue;
        };
        // The seed's scheme and credentials, for every node.
        let (scheme, rest) = seed.split_once("://").unwrap_or(("redis", seed));
        let user = rest
            .split_once('@')
            .map(|(u, _)| format!("{u}@"))
            .unwrap_or_default();
        return Some(
            text.lines()
                .filter(|l| !l.contains("fail") && !l.contains("noaddr"))
                .filter_map(|l| l.split_whitespace().nth(1)?.split('@').next())
                .map(|addr| format!("{scheme}://{user}{addr}"))
                .collect(),
        );
    }
    None
}

/// This process's resident memory, MB.
pub(super) fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1000.0)
}

/// Removes `ids` from the agents the store knows (best effort: the run is over, and the
/// coordinator prunes what stays).
pub(super) async fn forget_agents(target: &Target, ids: &[leasehold::core::model::AgentId]) {
    use leasehold::agent::{RedisStore, StoreConfig};
    let store = match target {
        Target::Embedded(_) => return,
        Target::Redis(url) => RedisStore::connect(url, StoreConfig::default()).await,
        Target::Cluster(nodes) => RedisStore::connect_cluster(nodes, StoreConfig::default()).await,
    };
    if let Ok(store) = store {
        for &id in ids {
            let _ = store.forget_agent(id).await;
        }
    }
}

/// The store of one system's run, started fresh for it so that faults in one run never
/// leak into the next.
pub(super) enum Env {
    Embedded(EmbeddedStore),
    External(Target),
    Single(RedisServer),
    Pair { pair: ReplicaPair, vip: FaultProxy },
    Cluster(Cluster),
}

impl Env {
    pub(super) fn start(choice: &StoreChoice) -> Result<Self, String> {
        let e = |e: leasehold_redis_harness::HarnessError| e.to_string();
        Ok(match choice {
            StoreChoice::Embedded => Self::Embedded(EmbeddedStore::new()),
            // `hz 100`, as docs/operating.md advises for a long tail of cold keys: Redis's
            // active expiry then pauses at most about 2.5 ms a cycle, not 25 ms.
            StoreChoice::Spawn => {
                Self::Single(RedisServer::start_with(&["--hz", "100"]).map_err(e)?)
            }
            StoreChoice::SpawnReplica => {
                let pair = ReplicaPair::start().map_err(e)?;
                let vip = FaultProxy::start(pair.primary.addr()).map_err(e)?;
                Self::Pair { pair, vip }
            }
            StoreChoice::ClusterSpawn => Self::Cluster(Cluster::start().map_err(e)?),
            StoreChoice::Redis(url) => Self::External(Target::Redis(url.clone())),
            StoreChoice::Cluster(nodes) => Self::External(Target::Cluster(nodes.clone())),
        })
    }

    /// Runs its redis-server processes on `core` (see [`RedisCore`]); again after a
    /// fault restarts one.
    pub(super) fn pin(&self, core: Option<&RedisCore>) -> Result<(), String> {
        let Some(core) = core else {
            return Ok(());
        };
        let servers = match self {
            Self::Single(server) => vec![server],
            Self::Pair { pair, .. } => vec![&pair.primary, &pair.replica],
            Self::Embedded(_) | Self::External(_) | Self::Cluster(_) => Vec::new(),
        };
        for pid in servers.iter().filter_map(|s| s.pid()) {
            core.pin(pid)?;
        }
        Ok(())
    }

    pub(super) fn target(&self) -> Target {
        match self {
            Self::Embedded(s) => Target::Embedded(s.clone()),
            Self::External(t) => t.clone(),
            Self::Single(server) => Target::Redis(server.url()),
            Self::Pair { vip, .. } => Target::Redis(vip.url()),
            Self::Cluster(c) => Target::Cluster(c.urls()),
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Self::Embedded(_) => "embedded".into(),
            // Shown in the output and written in the JSON report: no password.
            Self::External(Target::Redis(u)) => leasehold::store::secret::redact(u),
            Self::External(Target::Cluster(n)) => format!(
                "cluster {}",
                (n.iter().map(|u| leasehold::store::secret::redact(u)))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Self::External(Target::Embedded(_)) => "embedded".into(),
            Self::Single(_) => "spawn".into(),
            Self::Pair { .. } => "spawn-replica".into(),
            Self::Cluster(_) => "cluster-spawn (3 primaries, 3 replicas)".into(),
        }
    }

    /// Checks that the scenario's faults can happen to this store.
    pub(super) fn supports(choice: &StoreChoice, action: &str) -> bool {
        match action {
            "crash-agent" | "leave-agent" | "join-agent" => true,
            "kill-store" | "restore-store" => {
                matches!(choice, StoreChoice::Embedded | StoreChoice::Spawn)
            }
            "promote-replica" | "stall-replication" => {
                matches!(choice, StoreChoice::SpawnReplica)
            }
            "stop-coordinator" | "start-coordinator" => !matches!(choice, StoreChoice::Embedded),
            _ => false,
        }
    }

    /// Makes a store fault happen; `naive_offline` is the embedded naive bucket's switch.
    pub(super) fn fault(&mut self, action: &str, naive_offline: &AtomicBool) -> Result<(), String> {
        match (action, self) {
            ("kill-store", Self::Embedded(s)) => {
                s.set_offline(true);
                naive_offline.store(true, Ordering::Release);
            }
            ("restore-store", Self::Embedded(s)) => {
                s.set_offline(false);
                naive_offline.store(false, Ordering::Release);
            }
            ("kill-store", Self::Single(server)) => server.kill(),
            ("restore-store", Self::Single(server)) => {
                server.restart().map_err(|e| e.to_string())?
            }
            ("stall-replication", Self::Pair { pair, .. }) => {
                pair.link.set(leasehold_redis_harness::Fault::Blackhole);
            }
            ("promote-replica", Self::Pair { pair, vip }) => {
                pair.fail_over().map_err(|e| e.to_string())?;
                vip.set_upstream(pair.replica.addr());
                vip.cut();
                pair.rejoin().map_err(|e| e.to_string())?;
            }
            (action, _) => return Err(format!("fault {action} does not apply to this store")),
        }
        Ok(())
    }
}
