//! The agent's background loop: prefetches, the sweep (reclaim, demotion, renewal,
//! forgetting idle keys), metrics, the report to the coordinator, topology and rules
//! file refreshes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use leasehold_core::rule::Leasing;
use tokio::time::Instant;

use crate::breaker::Breaker;
use crate::counters::Counter;
use crate::store::Store;

use super::keys::KeyState;
use super::seats::SEAT_TTL_US;
use super::seats::{SEAT_MARGIN_NS, SEAT_RENEW_EVERY};
use super::table::RuleTable;
use super::{Inner, TOPOLOGY_EVERY};
use super::{Limiter, keymap};
use crate::redis_store::RedisStore;
use leasehold_core::{Reclaim, SweepAction};
use std::sync::Weak;
use std::time::SystemTime;
use tokio::sync::mpsc;

/// How often the store's eviction policy is read again.
const POLICY_EVERY: Duration = Duration::from_secs(30);

pub(super) async fn background(
    inner: Weak<Inner>,
    mut prefetch: mpsc::Receiver<Arc<KeyState>>,
    watch: Option<Duration>,
) {
    let Some(sweep_every) = inner.upgrade().map(|i| i.config.sweep_every) else {
        return;
    };
    let mut sweep = tokio::time::interval(sweep_every);
    // Metrics and the coordinator's report, on the whole seconds of the wall clock so
    // every agent's report covers the same second.
    let mut publish = tokio::time::interval_at(
        Instant::now() + Duration::from_millis(1000 - wall_ms() % 1000),
        Duration::from_secs(1),
    );
    publish.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: a new agent claims its seats as it starts.
    let mut seats = tokio::time::interval(SEAT_RENEW_EVERY);
    seats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut topology = tokio::time::interval(TOPOLOGY_EVERY);
    topology.tick().await;
    let mut policy = tokio::time::interval(POLICY_EVERY);
    policy.tick().await;
    let mut watch = tokio::time::interval(watch.unwrap_or(Duration::from_secs(3600)));
    let watching = watch.period() < Duration::from_secs(3600);
    // Only the Notify is held: the loop must not keep the limiter alive.
    let Some(stop) = inner.upgrade().map(|i| Arc::clone(&i.stop)) else {
        return;
    };
    loop {
        tokio::select! {
            () = stop.notified() => return,
            ks = prefetch.recv() => {
                let Some(ks) = ks else { return };
                let Some(inner) = inner.upgrade() else { return };
                tokio::spawn(refill(Limiter { inner }, ks));
            }
            _ = sweep.tick() => {
                let Some(inner) = inner.upgrade() else { return };
                Limiter { inner }.sweep();
            }
            _ = publish.tick() => {
                let Some(inner) = inner.upgrade() else { return };
                for e in inner.rules.load().by_name.values() {
                    e.base.counters.publish(&e.base.name);
                }
                metrics::gauge!("leasehold_keys_in_memory").set(inner.keys.len() as f64);
                metrics::gauge!("leasehold_store_may_evict_buckets")
                    .set(if inner.evicting.load(Ordering::Relaxed) { 1.0 } else { 0.0 });
                metrics::counter!("leasehold_keys_decided_without_state_total")
                    .absolute(inner.keys_over_cap.load(Ordering::Relaxed));
                metrics::counter!("leasehold_keys_evicted_total")
                    .absolute(inner.keys_evicted.load(Ordering::Relaxed));
                metrics::counter!("leasehold_keys_first_seen_total")
                    .absolute(inner.keys_first_seen.load(Ordering::Relaxed));
                inner.error_kinds.publish();
                let now = Limiter { inner: Arc::clone(&inner) }.now_ns();
                for (shard, open) in inner.breakers.states(now) {
                    metrics::gauge!("leasehold_breaker_open", "shard" => shard)
                        .set(if open { 1.0 } else { 0.0 });
                }
                metrics::counter!("leasehold_library_loads_total").absolute(inner.store.library_loads());
                if matches!(inner.store, Store::Redis(_)) {
                    probe_open_shards(&Limiter { inner: Arc::clone(&inner) });
                    tokio::spawn(report(Limiter { inner }));
                }
            }
            _ = seats.tick() => {
                let Some(inner) = inner.upgrade() else { return };
                if !inner.rules.load().seats.is_empty() {
                    tokio::spawn(claim_seats(Limiter { inner }));
                }
            }
            _ = policy.tick() => {
                let Some(inner) = inner.upgrade() else { return };
                if let Store::Redis(r) = &inner.store {
                    let r = r.clone();
                    let inner = Arc::downgrade(&inner);
                    tokio::spawn(async move {
                        if !r.is_connected() {
                            return;
                        }
                        let found = super::builder::evicting_policy(&r).await;
                        let Some(inner) = inner.upgrade() else { return };
                        if found.is_none() && r.refused().is_some() {
                            r.refuse(None);
                            tracing::warn!("Redis maxmemory-policy is noeviction now: the store is used from now on");
                        }
                        let was = inner.evicting.swap(found.is_some(), Ordering::Relaxed);
                        if let (Some(policy), false) = (found, was) {
                            tracing::error!(
                                %policy,
                                "Redis maxmemory-policy changed to one that may evict bucket \
                                 keys: an evicted bucket comes back full; set noeviction"
                            );
                        }
                    });
                }
            }
            _ = topology.tick() => {
                let Some(inner) = inner.upgrade() else { return };
                if let Store::Redis(r) = &inner.store {
                    let r = r.clone();
                    let inner = Arc::downgrade(&inner);
                    tokio::spawn(async move {
                        match r.shards().await {
                            Ok(ranges) => {
                                if let Some(inner) = inner.upgrade() {
                                    inner.breakers.set_topology(&ranges);
                                }
                            }
                            Err(e) => tracing::debug!(error = %e, "slot map refresh failed"),
                        }
                    });
                }
            }
            _ = watch.tick(), if watching => {
                let Some(inner) = inner.upgrade() else { return };
                let changed = inner.rules_file.as_ref().is_some_and(|p| {
                    std::fs::metadata(p).and_then(|m| m.modified()).ok() != *inner.rules_mtime.lock()
                });
                if changed && let Err(e) = (Limiter { inner }).reload_rules() {
                    tracing::error!(error = %e, "rules file refused; the rules in force stay");
                }
            }
        }
    }
}

/// Finishes what `build` could not while the store was unreachable (see
/// [`LimiterBuilder::start_degraded`](super::LimiterBuilder::start_degraded)): once the store
/// answers, reads its eviction policy (a store that may evict buckets is refused until
/// its policy is `noeviction`, unless `allow_evicting_store`) and its slot map.
pub(super) async fn when_connected(store: RedisStore, inner: Weak<Inner>) {
    store.connected().await;
    if let Some(policy) = super::builder::evicting_policy(&store).await {
        let Some(inner) = inner.upgrade() else { return };
        inner.evicting.store(true, Ordering::Relaxed);
        if inner.config.allow_evicting_store {
            tracing::error!(
                %policy,
                "Redis maxmemory-policy may evict bucket keys, and an evicted bucket comes \
                 back full (allow_evicting_store is set)"
            );
        } else {
            let why = format!(
                "Redis maxmemory-policy is {policy}: it may evict bucket keys, and an evicted \
                 bucket comes back full; the store is not used until its policy is noeviction"
            );
            tracing::error!("{why}");
            store.refuse(Some(why));
        }
    }
    match store.shards().await {
        Ok(ranges) => {
            if let Some(inner) = inner.upgrade() {
                inner.breakers.set_topology(&ranges);
            }
        }
        Err(e) => tracing::debug!(error = %e, "slot map read failed; the next refresh retries"),
    }
}

/// Claims or renews this agent's seat of every rule with a local share (see
/// [`leasehold_core::local`]), or gives back a seat no decision wanted for
/// `seat_idle_after`. A tenure is good until its claim's send time plus the record's
/// lifetime, less a margin; a refused or failed claim leaves it to run out.
pub(super) async fn claim_seats(limiter: Limiter) {
    let inner = &limiter.inner;
    if inner.shut.load(Ordering::Acquire) {
        return;
    }
    let idle_after = inner.config.seat_idle_after.as_nanos() as u64;
    for (name, seat) in limiter.seats() {
        let sent = limiter.now_ns();
        let agents = u64::from(seat.share.agents);
        // At start nothing was wanted yet, and the agent clock starts at 0: a new agent
        // claims, and gives the seat back if no decision wants it.
        if sent.saturating_sub(seat.wanted_ns.load(Ordering::Relaxed)) > idle_after {
            if seat.tenure.deadline_ns() > 0 {
                limiter.give_seat_back(&name, &seat).await;
            }
            continue;
        }
        match (inner.store)
            .claim_seat(&name, inner.agent, agents, SEAT_TTL_US, false)
            .await
        {
            Ok(reply) if !inner.shut.load(Ordering::Acquire) => {
                seat.tenure
                    .answered(reply, sent, limiter.now_ns(), SEAT_MARGIN_NS);
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(rule = %name, error = %e, "seat claim failed"),
        }
    }
}

/// `HOST/PID`, for the coordinator's page to tell gateways apart.
fn process_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "?".to_owned());
        format!("{host}/{}", std::process::id())
    })
}

pub(super) fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Probes each shard whose breaker is open and due a probe, with a `PING` to it: a
/// breaker closes once its store answers again even when no decision comes to test it
/// (readiness would otherwise stay degraded on an idle gateway until its next request).
/// And checks each closed shard that answered nothing for a second the same way: a store
/// that died while no decision needed it opens the breaker after as many failed checks
/// as failed calls would (readiness said `ready` for as long as the gateway was idle,
/// and its next requests found out one timeout or refusal at a time).
fn probe_open_shards(limiter: &Limiter) {
    let Store::Redis(r) = &limiter.inner.store else {
        return;
    };
    let now = limiter.now_ns();
    for (slot, breaker) in limiter.inner.breakers.probes_due(now) {
        let (r, l) = (r.clone(), limiter.clone());
        tokio::spawn(async move { ping_through(&r, &l, &breaker, slot).await });
    }
    if r.not_reached().is_some() {
        // Not connected yet: readiness says so already, and the dialler retries.
        return;
    }
    for (slot, breaker) in limiter.inner.breakers.idle_due(now) {
        if breaker.idle_check.swap(true, Ordering::AcqRel) {
            continue;
        }
        let (r, l) = (r.clone(), limiter.clone());
        tokio::spawn(async move {
            ping_through(&r, &l, &breaker, slot).await;
            breaker.idle_check.store(false, Ordering::Release);
        });
    }
}

/// A `PING` to the shard serving `slot`, through its breaker: its answer is a success
/// or a failure there, as a call's is.
async fn ping_through<Q>(r: &RedisStore, l: &Limiter, breaker: &Breaker<Q>, slot: u16) {
    let Ok(permit) = breaker.enter(l.now_ns()) else {
        return;
    };
    match r.ping_slot(slot).await {
        Ok(()) => permit.succeeded(l.now_ns()),
        Err(_) => permit.failed(l.now_ns()),
    }
}

/// Writes this agent's report for the coordinator (see [`crate::report`]): running
/// totals of the leased buckets it used recently. On the seconds between two reports
/// (a large fleet's cadence) the totals are kept for the next one.
pub(super) async fn report(limiter: Limiter) {
    use crate::report::{
        KeyReport, MAX_KEYS_PER_REPORT, REPORT_TTL_MS, Report, every_secs, writes_at,
    };
    let Store::Redis(store) = &limiter.inner.store else {
        return;
    };
    let at_ms = wall_ms();
    let now = limiter.now_ns();
    // The sweep's list holds every key reported (KeyState::active): a pass over the
    // whole map would touch every cold key once a second.
    let mut keys: Vec<(u64, Arc<KeyState>)> = {
        limiter
            .inner
            .swept
            .lock()
            .iter()
            .map(|ks| (ks.last_io_ns.load(Ordering::Relaxed), ks.clone()))
            // Leased keys: exact decisions are exact by construction, and cold keys are
            // most keys.
            // A region's bucket of a global key, leased or not: the region's broker feeds
            // the keys reported.
            .filter(|(last, ks)| {
                let recent = now.saturating_sub(*last) < REPORT_TTL_MS * 1_000_000;
                ks.hot().lease.held() > 0
                    || ks.without_store.load(Ordering::Relaxed) > 0
                    || (recent && (ks.hot().leases() || ks.region))
            })
            .collect()
    };
    keys.sort_unstable_by_key(|(last, _)| std::cmp::Reverse(*last));
    keys.truncate(MAX_KEYS_PER_REPORT);
    let mut lines = Vec::with_capacity(keys.len());
    for (_, ks) in keys {
        let mut driver = ks.driver.lock().await;
        // Admissions made without the store count against the bucket like any other.
        driver
            .policy
            .admitted_without_store(ks.without_store.swap(0, Ordering::Relaxed));
        let held = ks.hot().lease.held();
        let mut t = driver.policy.totals(held);
        // A rate lease's cell is spent outside the key's policy.
        if let Some(rk) = ks.rate.lock().as_ref() {
            let (spent, demand) = rk.totals();
            t.admitted += spent;
            t.demand_milli = demand;
        }
        if t.calls == 0 && t.admitted == 0 {
            continue;
        }
        let totals = KeyReport {
            admitted: t.admitted,
            calls: t.calls,
            demand_milli: t.demand_milli,
            held,
        };
        lines.push((ks.bucket.as_str().to_owned(), totals));
    }
    let inner = &limiter.inner;
    let every = inner.report_every.load(Ordering::Relaxed);
    let lines = lines.iter().map(|(k, r)| (k.as_str(), *r));
    if !writes_at(at_ms, inner.agent, every) {
        inner.report_log.lock().keep(at_ms, lines);
        return;
    }
    let past = inner.report_log.lock().take();
    let health = limiter.health().line();
    let agent = crate::report::AgentLines {
        health: Some(&health),
        name: Some(process_name()),
        every,
        past: Some(&past),
    };
    let text = Report::encode_with(at_ms, agent, lines);
    match store.report(inner.agent, at_ms, &text).await {
        Ok(fleet) => inner
            .report_every
            .store(every_secs(fleet), Ordering::Relaxed),
        Err(e) => {
            tracing::debug!(error = %e, "report to the coordinator failed");
            inner.report_log.lock().restore(past);
        }
    }
}

pub(super) async fn refill(limiter: Limiter, ks: Arc<KeyState>) {
    let rules = limiter.inner.rules.load_full();
    if rules.get(&ks.rule).is_ok() {
        let entry = ks.entry.load_full();
        let entry = &entry;
        let mut driver = ks.driver.lock().await;
        // Checked under the key's lock, which shutdown takes after setting `shut`: a
        // refill queued before a shutdown leases nothing after it.
        if entry.rule.leasing() == Leasing::Rate {
            let due = ks
                .rate
                .lock()
                .as_ref()
                .is_none_or(|rk| rk.due(limiter.now_ns()));
            if limiter.is_hot(&ks, entry) && due {
                let _ = limiter.rate_call(&ks, &mut driver, entry).await;
            }
        } else if limiter.is_hot(&ks, entry)
            && ks.hot().leases()
            && ks.hot().lease.held() < ks.hot().low_water()
        {
            let _ = limiter.acquire(&ks, &mut driver, entry, 0).await;
        }
    }
    ks.prefetching.store(false, Ordering::Release);
}

/// How often the sweep passes over the whole key map (forgetting idle cold keys), at
/// most: `forget_after` divided by this, and never more often than it visits the keys
/// that lease. Spread over the ticks between: at 50 000 keys a tenth of the map took a
/// tick 0.66 ms of a runtime thread at the median (long-tail); with the defaults (30 s,
/// 100 ms) a tick now visits 3 of the 64 shards.
const FULL_SWEEPS_PER_FORGET: u32 = 10;

impl Limiter {
    /// Puts `ks` (an active key, [`KeyState::active`]) among the keys the sweep visits
    /// every tick, once. A key already listed costs a load, not a write: a load that sees
    /// it listed comes before the sweep's unlisting, whose second look then sees the key
    /// active.
    pub(super) fn track(&self, ks: &Arc<KeyState>) {
        if !ks.in_sweep.load(Ordering::SeqCst) && !ks.in_sweep.swap(true, Ordering::SeqCst) {
            self.inner.swept.lock().push(ks.clone());
        }
    }

    /// Returns the tokens of idle leases and demotes their keys, renews live leases close
    /// to expiry; and passes over a few shards of the whole map, forgetting cold keys idle
    /// for long (each shard about every `forget_after` / 10).
    pub(super) fn sweep(&self) {
        let inner = &self.inner;
        let now = self.now_ns();
        let rules = inner.rules.load_full();
        // The list stays locked through the pass (no await in it), so the report never
        // reads it half made; `track` waits meanwhile.
        let mut swept = inner.swept.lock();
        let mut keep = Vec::with_capacity(swept.len());
        for ks in std::mem::take(&mut *swept) {
            if !ks.active(now) {
                // Inactive: it leaves the list, unless it turned active meanwhile (then
                // whichever of this and `track` sets the flag second sees the other, and
                // the key stays listed once).
                ks.in_sweep.store(false, Ordering::SeqCst);
                if !ks.active(now) || ks.in_sweep.swap(true, Ordering::SeqCst) {
                    continue;
                }
            }
            if rules.get(&ks.rule).is_err() {
                // The rule is gone: the pass over the map forgets the key.
                ks.in_sweep.store(false, Ordering::SeqCst);
                continue;
            }
            keep.push(ks.clone());
            if !ks.hot().leases() && ks.hot().lease.held() == 0 {
                // Listed for the report only: nothing to reclaim or renew.
                continue;
            }
            let entry = ks.entry.load_full();
            let Ok(mut driver) = ks.driver.clone().try_lock_owned() else {
                continue;
            };
            if entry.rule.leasing() == Leasing::Rate {
                self.rate_sweep(ks, entry, driver);
                continue;
            }
            let held = ks.hot().lease.held();
            let action = driver.policy.sweep(
                &entry.rule,
                &inner.policy,
                now,
                &ks.hot().lease,
                ks.hot().denied_tokens(),
                ks.last_io_ns.load(Ordering::Relaxed),
            );
            let this = self.clone();
            match action {
                SweepAction::Keep => {}
                SweepAction::Idle => {
                    if entry.rule.leasing() == Leasing::Auto {
                        ks.hot().set_leases(false);
                    }
                    if held > 0 {
                        tokio::spawn(async move {
                            let mut driver = driver;
                            let _ = this.release(&ks, &mut driver, &entry, true).await;
                        });
                    }
                }
                SweepAction::Reclaim(reclaim) => {
                    // Reclaim: tokens this agent is not spending, or more than its share
                    // of a contended key, go back where other agents can lease them.
                    tokio::spawn(async move {
                        let mut driver = driver;
                        let idle = reclaim == Reclaim::Idle;
                        if this.release(&ks, &mut driver, &entry, idle).await.is_ok() {
                            entry.counters.incr(Counter::Reclaims);
                        }
                    });
                }
                SweepAction::Renew => {
                    tokio::spawn(async move {
                        let mut driver = driver;
                        if !this.inner.shut.load(Ordering::Acquire) {
                            let _ = this.acquire(&ks, &mut driver, &entry, 0).await;
                        }
                    });
                }
            }
        }
        *swept = keep;
        drop(swept);
        // The pass over the whole map, a few shards a tick: about once every `forget_after`
        // / FULL_SWEEPS_PER_FORGET in all, never a stall of the runtime's thread for the
        // whole map (a pass over 50 000 keys took 4-10 ms). Keys that lease are listed
        // when they start (`track`); the pass lists any it finds unlisted.
        let every =
            (inner.config.forget_after / FULL_SWEEPS_PER_FORGET).max(inner.config.sweep_every);
        let ticks = (every.as_nanos() / inner.config.sweep_every.as_nanos().max(1)).max(1) as usize;
        let shards = keymap::SHARDS.div_ceil(ticks);
        let first = inner.sweep_cursor.fetch_add(shards, Ordering::Relaxed) % keymap::SHARDS;
        self.sweep_shards(now, &rules, first, shards);
    }

    /// Part of the pass over the whole map, `count` shards from `first`: forgets cold keys
    /// idle for `forget_after` and keys whose rule is gone, and lists any key that leases
    /// and is not listed yet. (At `max_keys` a new key takes an idle one's place:
    /// `KeyMap::get_or_insert_with`.)
    fn sweep_shards(&self, now: u64, rules: &RuleTable, first: usize, count: usize) {
        let inner = &self.inner;
        let mut forget = Vec::new();
        let forget_after = inner.config.forget_after.as_nanos() as u64;
        inner.keys.for_each_in(first, count, |slot| {
            let ks = &slot.ks;
            // Most keys are cold and hold nothing: all they need is to be forgotten once
            // idle for long, checked without a lock or a rule lookup.
            if !ks.active(now) {
                if now.saturating_sub(ks.last_io_ns.load(Ordering::Relaxed)) >= forget_after
                    && ks.waiters.load(Ordering::Acquire) == 0
                    && ks.seat.full_at(now)
                {
                    forget.push(slot.id());
                }
                return;
            }
            if rules.get(&ks.rule).is_err() {
                forget.push(slot.id());
                return;
            }
            self.track(ks);
        });
        for id in forget {
            inner.keys.remove(&id);
        }
    }
}
