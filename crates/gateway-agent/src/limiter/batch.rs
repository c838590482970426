//! Cold keys' exact decisions, batched per shard.
//!
//! A decision on a cold key joins its shard's queue and waits for its answer; it holds no
//! lock while it waits. A task sends the queue to the store as one `lh_exact_batch` call,
//! then sends what queued meanwhile, and ends when the queue is empty; a second task
//! joins while the first has a call in flight once [`SECOND_SENDER_AT`] keys wait, so a
//! busy agent's Redis does not idle for a round trip between batches, and agents that
//! share a busy Redis send fewer, fuller calls. So a batch forms from whatever arrived while the previous calls were
//! in flight: an idle shard sends a lone decision at once, and a busy one carries many
//! decisions per round trip. Decisions on the same key in one batch are one item (their costs decided
//! in arrival order, each answered on its own), so a decision never waits on another
//! decision's I/O for longer than that I/O takes.
//!
//! A batch is one sequence number: a retry after an unknown outcome replays it (I2). A
//! key found split is answered `Moved` and takes the per-key path, which routes it.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use leasehold_core::model::{ExactOutcome, MAX_BATCH_COSTS};
use leasehold_store::ExactItem;
use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use super::call::CallTimer;
use super::keys::KeyState;
use super::store_path::store_answered;
use super::table::RuleEntry;
use super::{Decision, Limiter};
use crate::breaker::Refusal;
use crate::counters::Counter;

/// A shard's breaker, with its queue of exact decisions.
type Breaker = crate::breaker::Breaker<ExactBatch>;
use crate::redis_store::ErrorKind;

/// The most keys one call carries.
const MAX_KEYS: usize = 128;

/// The most decisions on one key coalesced into one item; more wait for the next call.
const MAX_ITEM_COSTS: usize = 256;

/// Calls in flight per shard: two, so the next batch is on its way while Redis runs one
/// (with one, Redis would idle for a round trip between batches)...
const SENDERS: usize = 2;

/// ...but the second starts only once this many keys wait: when many agents share a
/// Redis it is busy anyway, and a second small call costs it the function's fixed part
/// again for few decisions. long-tail (8 agents × 16 in flight): 143 calls/1k and
/// 0.74-0.95x naive, against 203 calls/1k and 0.70-0.76x with the second sender at once.
const SECOND_SENDER_AT: usize = 16;

/// How a queued decision was answered.
#[derive(Clone, Copy, Debug)]
pub(super) enum Answer {
    /// The store decided it.
    Decided {
        admitted: bool,
        /// When denied: µs until its cost could exist.
        retry_us: u64,
        /// Tokens left in the bucket right after it.
        remaining: u64,
    },
    /// The key is split: decide it on the per-key path.
    Moved,
    /// No answer from the store (the failure policy decides).
    Failed,
    /// No answer within the decision's timeout (the failure policy decides).
    TimedOut,
}

struct Item {
    ks: Arc<KeyState>,
    entry: Arc<RuleEntry>,
    costs: Vec<u64>,
    waiters: Vec<oneshot::Sender<Answer>>,
    /// The latest moment one of its decisions still waits for the answer.
    deadline: Instant,
}

/// One shard's queue of cold decisions.
#[derive(Default)]
pub(crate) struct ExactBatch {
    pending: parking_lot::Mutex<Pending>,
}

impl std::fmt::Debug for ExactBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.pending.lock();
        f.debug_struct("ExactBatch")
            .field("senders", &p.senders)
            .field("keys", &p.items.len())
            .finish()
    }
}

#[derive(Default)]
struct Pending {
    /// Tasks sending this queue.
    senders: usize,
    items: Vec<Item>,
    /// Where each key state's open item is in `items` (by the state's address).
    open: HashMap<usize, usize, foldhash::fast::RandomState>,
}

impl ExactBatch {
    /// Queues a decision; returns where its answer comes and whether the caller must
    /// start a sending task.
    fn push(
        &self,
        ks: &Arc<KeyState>,
        entry: &Arc<RuleEntry>,
        cost: u64,
        deadline: Instant,
    ) -> (oneshot::Receiver<Answer>, bool) {
        let (tx, rx) = oneshot::channel();
        let mut guard = self.pending.lock();
        let p = &mut *guard;
        // Decisions on one key state under one rule entry share an item. (Key states
        // made per decision at max_keys each get their own: `take` keeps two items of
        // one bucket out of one call.)
        let at = Arc::as_ptr(ks) as usize;
        let same = p
            .open
            .get(&at)
            .and_then(|&i| p.items.get_mut(i))
            .filter(|it| {
                Arc::ptr_eq(&it.ks, ks)
                    && Arc::ptr_eq(&it.entry, entry)
                    && it.costs.len() < MAX_ITEM_COSTS
            });
        match same {
            Some(it) => {
                it.costs.push(cost);
                it.waiters.push(tx);
                it.deadline = it.deadline.max(deadline);
            }
            None => {
                p.open.insert(at, p.items.len());
                p.items.push(Item {
                    ks: ks.clone(),
                    entry: entry.clone(),
                    costs: vec![cost],
                    waiters: vec![tx],
                    deadline,
                });
            }
        }
        let start = p.senders == 0 || (p.senders < SENDERS && p.items.len() >= SECOND_SENDER_AT);
        if start {
            p.senders += 1;
        }
        (rx, start)
    }

    /// The next call's items, oldest first (each bucket once, within the size caps), or
    /// `None` when nothing waits: the sending task then ends. Items whose decisions all
    /// stopped waiting by `now` are dropped unsent: the failure policy answered them, so
    /// they take no tokens, and a call with no time left would count as a failure.
    fn take(&self, now: Instant) -> Option<Vec<Item>> {
        let mut guard = self.pending.lock();
        let p = &mut *guard;
        p.items.retain_mut(|it| {
            let live = it.deadline > now;
            if !live {
                for w in it.waiters.drain(..) {
                    let _ = w.send(Answer::TimedOut);
                }
            }
            live
        });
        if p.items.is_empty() {
            p.open.clear();
            p.senders -= 1;
            return None;
        }
        let mut batch: Vec<Item> = Vec::with_capacity(p.items.len().min(MAX_KEYS));
        let mut rest = Vec::new();
        // Each bucket once per call, checked by name: several key states may name one.
        let mut seen: HashMap<u64, usize, foldhash::fast::RandomState> = HashMap::default();
        let mut costs = 0;
        for it in std::mem::take(&mut p.items) {
            let fits = batch.len() < MAX_KEYS && costs + it.costs.len() <= MAX_BATCH_COSTS;
            let h = seen.hasher().hash_one(it.ks.bucket.as_str());
            let dup = match seen.get(&h) {
                None => false,
                Some(&j) if batch[j].ks.bucket == it.ks.bucket => true,
                Some(_) => batch.iter().any(|b| b.ks.bucket == it.ks.bucket),
            };
            if fits && !dup {
                costs += it.costs.len();
                seen.entry(h).or_insert(batch.len());
                batch.push(it);
            } else {
                rest.push(it);
            }
        }
        p.items = rest;
        p.open.clear();
        for (i, it) in p.items.iter().enumerate() {
            p.open.insert(Arc::as_ptr(&it.ks) as usize, i);
        }
        Some(batch)
    }
}

impl Limiter {
    /// Decides `cost` on cold key `ks` in its shard's next batch; `None` when the key is
    /// split (the per-key path decides).
    pub(super) async fn exact_batched(
        &self,
        ks: &Arc<KeyState>,
        entry: &Arc<RuleEntry>,
        cost: u64,
        deadline: Instant,
    ) -> Option<Decision> {
        let (rx, start) = self.inner.breakers.with_slot(ks.slot, |shard| {
            let (rx, start) = shard.queue.push(ks, entry, cost, deadline);
            (rx, start.then(|| shard.clone()))
        });
        if let Some(shard) = start {
            let limiter = self.clone();
            tokio::spawn(async move { limiter.send_batches(&shard).await });
        }
        ks.last_io_ns.store(self.now_ns(), Ordering::Relaxed);
        let d = match timeout_at(deadline, rx).await {
            Ok(Ok(Answer::Decided {
                admitted,
                retry_us,
                remaining,
            })) => {
                store_answered(ks);
                self.exact_decided(ks, entry, cost, admitted, retry_us, remaining)
            }
            Ok(Ok(Answer::Moved)) => return None,
            Ok(Ok(Answer::Failed) | Err(_)) => self.degraded(ks, entry, cost),
            Ok(Ok(Answer::TimedOut)) => self.waited_out(ks, entry, cost),
            // The batch call itself goes on, bounded by its last decision's deadline, and
            // counts against the shard once if it times out: the many decisions waiting
            // on one call are one failure, not many (a burst of them while this process
            // is too busy to read the reply would otherwise open the breaker at once).
            Err(_) => self.waited_out(ks, entry, cost),
        };
        Some(d)
    }

    /// A sending task of the shard: one call at a time until the queue is empty.
    async fn send_batches(&self, shard: &Breaker) {
        while let Some(items) = shard.queue.take(Instant::now()) {
            let out = self.send_batch(shard, &items).await;
            self.answer(items, out);
            // The callers just answered run before the next batch is taken: a caller that
            // decides again at once joins it instead of waiting a whole call for the one
            // after (callers in a loop otherwise split into two half-size batches that
            // take turns).
            tokio::task::yield_now().await;
        }
    }

    /// One `lh_exact_batch` call through the shard's breaker; a retry of an unknown
    /// outcome reuses the sequence number. The call ends when its last decision stops
    /// waiting, and then counts as one failure on the shard, as a per-key call that timed
    /// out does.
    async fn send_batch(
        &self,
        shard: &Breaker,
        items: &[Item],
    ) -> Result<Vec<ExactOutcome>, Answer> {
        let deadline = items
            .iter()
            .map(|it| it.deadline)
            .max()
            .ok_or(Answer::Failed)?;
        let first = &items[0];
        let permit = match shard.enter(self.now_ns()) {
            Ok(p) => p,
            Err(why) => {
                if why == Refusal::Saturated {
                    first.entry.counters.incr(Counter::StoreErrors);
                }
                return Err(Answer::Failed);
            }
        };
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let calls: Vec<ExactItem<'_>> = items
            .iter()
            .map(|it| ExactItem {
                key: &it.ks.bucket,
                params: &it.entry.params,
                costs: &it.costs,
            })
            .collect();
        let started = Instant::now();
        let _timed = CallTimer {
            shard: self.inner.breakers.shard_name(first.ks.slot),
            op: "exact_many",
            started,
        };
        let grace_us = items.iter().map(|it| it.entry.params.grace_us).min();
        let replay_window = std::time::Duration::from_micros(grace_us.unwrap_or(0)) / 2;
        let mut attempt = 0;
        loop {
            first.entry.counters.incr(Counter::StoreCalls);
            let call = (self.inner.store).exact_many(self.inner.agent, seq, &calls, attempt == 0);
            let Ok(reply) = timeout_at(deadline, call).await else {
                // No answer by the last decision's deadline: one failure for the call (it
                // counts only if nothing on the shard succeeded since it was sent).
                permit.failed(self.now_ns());
                return Err(Answer::TimedOut);
            };
            match reply {
                Ok(out) => {
                    permit.succeeded(self.now_ns());
                    return Ok(out);
                }
                Err(e) if e.is_retryable() && attempt < 2 && started.elapsed() < replay_window => {
                    attempt += 1;
                }
                Err(e) => {
                    first.entry.counters.incr(Counter::StoreErrors);
                    self.inner.error_kinds.incr(e.kind());
                    match e.kind() {
                        ErrorKind::Refused => permit.succeeded(self.now_ns()),
                        ErrorKind::Protocol => drop(permit),
                        _ => permit.failed(self.now_ns()),
                    }
                    if e.is_retryable() {
                        tracing::debug!(error = %e, keys = items.len(), "exact batch failed; the failure policy decides");
                    } else {
                        // Each batch would say it again: once every 10 s.
                        static SAID: AtomicU64 = AtomicU64::new(0);
                        if super::once_per(&SAID, self.now_ns(), 10_000_000_000) {
                            tracing::error!(
                                error = %e,
                                keys = items.len(),
                                "store refused an exact batch (said at most every 10 s)"
                            );
                        }
                    }
                    return Err(Answer::Failed);
                }
            }
        }
    }

    /// Answers every decision of the batch, and counts them in their keys' policies (a
    /// cold key used fast enough, or leased by others, becomes hot).
    fn answer(&self, items: Vec<Item>, out: Result<Vec<ExactOutcome>, Answer>) {
        let outs = match out {
            Ok(outs) => outs,
            Err(why) => {
                for it in items {
                    for w in it.waiters {
                        let _ = w.send(why);
                    }
                }
                return;
            }
        };
        let call_keys = items.len() as u64;
        for (it, o) in items.into_iter().zip(outs) {
            let r = match o {
                ExactOutcome::Decided(r) => r,
                ExactOutcome::Moved => {
                    for w in it.waiters {
                        let _ = w.send(Answer::Moved);
                    }
                    continue;
                }
            };
            if let Ok(mut driver) = it.ks.driver.try_lock() {
                let decisions: Vec<(u64, bool)> = it
                    .costs
                    .iter()
                    .zip(&r.retry_us)
                    .map(|(&cost, &retry)| (cost, retry == 0))
                    .collect();
                self.count_exact(
                    &it.ks,
                    &mut driver,
                    &it.entry,
                    &decisions,
                    call_keys,
                    r.scale_ppm != 0,
                );
            }
            // Tokens left right after each decision: the final count plus what the later
            // admitted ones took.
            let mut remaining = r.remaining;
            let mut after = vec![0; it.costs.len()];
            for i in (0..it.costs.len()).rev() {
                after[i] = remaining;
                if r.retry_us[i] == 0 {
                    remaining += it.costs[i];
                }
            }
            for ((w, &retry_us), remaining) in it.waiters.into_iter().zip(&r.retry_us).zip(after) {
                let _ = w.send(Answer::Decided {
                    admitted: retry_us == 0,
                    retry_us,
                    remaining,
                });
            }
        }
    }
}
