//! The agent's map of keys: shards of hashbrown tables, each under a read-write lock,
//! with the key's bytes and a pointer to its state inline in the table's slots. The locks
//! are crossbeam's `ShardedLock`: a reader locks its own thread's stripe, so readers on
//! two cores do not pass one lock word between them (2 threads at 10 000 keys, 30% less
//! time a decision); a writer locks every stripe, which key creation can afford.
//!
//! A decision on a leased key, or a cached denial, reads one shard lock, one control
//! group, one slot (a cache line: 10 000 keys' slots lie in under 1 MB) and the key's
//! cell (another line); the key's state only when the lease runs low. A map that boxes
//! each entry (papaya) adds a pointer chase into memory scattered by every allocation
//! made between two keys' creations: at 10 000 keys that was most of a decision's time. Writers (a key's creation, forgetting) take one shard's write lock; a
//! creation at `max_keys` evicts from that shard, or from a next one whose lock is free.
//!
//! At `max_keys` a key enters only when seen before, recently ([`Doorkeeper`], TinyLFU's
//! admission): a tenant of a long tail seen once is decided without keeping its state,
//! instead of each one allocating a state and evicting another key for it.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, PoisonError};

use crossbeam_utils::CachePadded;
use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};
use parking_lot::Mutex;

use super::keys::{KeyId, KeyRef, KeyState};
use crate::counters::RuleCounters;

type Hasher = foldhash::fast::RandomState;
type Table = hashbrown::HashTable<Slot>;

/// Bytes of a key (rule name, then subject) kept in its slot; longer keys are boxed.
const KEY_INLINE: usize = 24;

/// A key in the map, one cache line: its bytes, its state, and what the hot path reads
/// without touching the state (its cell, as a chunk and an index, and its rule's
/// counters).
#[repr(align(64))]
pub(super) struct Slot {
    key: smallvec::SmallVec<[u8; KEY_INLINE]>,
    rule_len: u32,
    cell: u32,
    chunk: Arc<Chunk>,
    pub(super) ks: Arc<KeyState>,
    pub(super) counters: Arc<RuleCounters>,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 64);

impl Slot {
    fn is(&self, id: &KeyId) -> bool {
        self.rule_len as usize == id.rule_len && self.key[..] == id.bytes[..]
    }

    /// The key.
    pub(super) fn id(&self) -> KeyId {
        KeyId {
            bytes: self.key[..].into(),
            rule_len: self.rule_len as usize,
        }
    }

    /// The key's subject.
    pub(super) fn subject(&self) -> &[u8] {
        &self.key[self.rule_len as usize..]
    }

    #[inline]
    fn hot(&self) -> &Hot {
        &self.chunk.cells[self.cell as usize]
    }

    /// Reads what an eviction looks at (see [`victim`]), to bring it into the cache.
    #[inline]
    fn warm(&self) -> u64 {
        self.ks.warm() ^ u64::from(self.hot().leases())
    }

    /// The key's cell when `cost` is neither 0 nor more than the rule's capacity (0 once
    /// the rule is removed: then never).
    #[inline]
    pub(super) fn valid_for(&self, cost: u64) -> Option<&Hot> {
        let hot = self.hot();
        hot.valid_for(cost).then_some(hot)
    }

    /// [`Slot::valid_for`], when the key leases too: its lease may cover `cost` (the HTTP
    /// layer's all-or-nothing path).
    #[cfg(feature = "tower")]
    #[inline]
    pub(super) fn leased_for(&self, cost: u64) -> Option<&Hot> {
        self.valid_for(cost).filter(|hot| hot.leases())
    }
}

/// Shards: enough that two threads rarely meet on one lock.
pub(super) const SHARDS: usize = 64;

pub(super) struct KeyMap {
    shards: Box<[CachePadded<ShardedLock<Table>>]>,
    hasher: Hasher,
    len: AtomicUsize,
    /// Made when the map first reaches `max_keys`.
    door: OnceLock<Doorkeeper>,
}

/// Which keys new to a full map were seen recently: one bit per key hash in 2^21 (256
/// KB), all cleared once 2^18 keys were marked, so at most an eighth are set and a key
/// seen once passes for another only one time in eight or fewer. long-tail-store (a
/// million tenants, 50 000 keys a gateway): each gateway marks about 20 000 keys a second,
/// so a key seen again within about 13 s enters. Races between markers and the clearing
/// lose a mark or keep one: a key is let in one sighting later or earlier, no more.
pub(super) struct Doorkeeper {
    bits: Box<[AtomicU64]>,
    marked: AtomicUsize,
}

const DOOR_BITS: usize = 1 << 21;
const DOOR_MARKS: usize = DOOR_BITS / 8;

impl Doorkeeper {
    fn new() -> Self {
        Self {
            bits: (0..DOOR_BITS / 64).map(|_| AtomicU64::new(0)).collect(),
            marked: AtomicUsize::new(0),
        }
    }

    /// Whether the key of `hash` was seen since the last clearing; marks it.
    fn seen(&self, hash: u64) -> bool {
        // Bits of the hash that neither the shard (its top) nor the table's probe (its
        // low bits) spends, so keys of one shard spread over the whole filter.
        let bit = (hash >> 20) as usize % DOOR_BITS;
        let mask = 1u64 << (bit % 64);
        if self.bits[bit / 64].fetch_or(mask, Ordering::Relaxed) & mask != 0 {
            return true;
        }
        if self.marked.fetch_add(1, Ordering::Relaxed) + 1 >= DOOR_MARKS {
            self.marked.store(0, Ordering::Relaxed);
            for w in self.bits.iter() {
                w.store(0, Ordering::Relaxed);
            }
        }
        false
    }
}

impl KeyMap {
    pub(super) fn new() -> Self {
        let hasher = Hasher::default();
        Self {
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(ShardedLock::new(Table::new())))
                .collect(),
            hasher,
            len: AtomicUsize::new(0),
            door: OnceLock::new(),
        }
    }

    /// The shard of a key's hash. The table uses the hash's low bits and its top 7; the
    /// shard takes bits below.
    fn shard_of(hash: u64) -> usize {
        (hash >> 48) as usize % SHARDS
    }

    /// Shard `i`'s table, read-locked. A poisoned lock (a panic while it was held) still
    /// guards a whole table: every write to it is one hashbrown call.
    #[inline(always)]
    fn read(&self, i: usize) -> ShardedLockReadGuard<'_, Table> {
        self.shards[i % SHARDS]
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Shard `i`'s table, write-locked (see [`KeyMap::read`]).
    fn write(&self, i: usize) -> ShardedLockWriteGuard<'_, Table> {
        self.shards[i % SHARDS]
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// `f` of the key's slot, under the shard's read lock (no reference count touched).
    #[inline(always)]
    pub(super) fn with<R>(&self, key: &KeyRef<'_>, f: impl FnOnce(&Slot) -> R) -> Option<R> {
        let hash = self.hasher.hash_one(key);
        let table = self.read(Self::shard_of(hash));
        table
            .find(hash, |slot| key.matches(&slot.key, slot.rule_len as usize))
            .map(f)
    }

    /// The key's state.
    pub(super) fn get(&self, key: &KeyRef<'_>) -> Option<Arc<KeyState>> {
        self.with(key, |slot| slot.ks.clone())
    }

    /// The key's state: found, or made by `make(false)` and inserted. At `max` keys a
    /// key the [`Doorkeeper`] has not seen recently gets a state kept out of the map
    /// (`make(true)`), and one it has takes the place of an idle cold key of its shard
    /// (the longest idle of up to [`EVICTION_SAMPLES`] keys sampled from a random place,
    /// as Redis evicts: no pass over the map); when none of those may go (each leases,
    /// holds tokens or has a waiter), `make(true)` again.
    pub(super) fn get_or_insert_with(
        &self,
        id: KeyId,
        max: usize,
        now: u64,
        make: impl FnOnce(bool) -> Arc<KeyState>,
    ) -> (Arc<KeyState>, Placed) {
        let hash = self.hasher.hash_one(&id);
        let shard = Self::shard_of(hash);
        let mut table = self.write(shard);
        if let Some(slot) = table.find(hash, |slot| slot.is(&id)) {
            return (slot.ks.clone(), Placed::Found);
        }
        let mut placed = Placed::Inserted;
        if self.len.load(Ordering::Relaxed) >= max {
            if !self.door.get_or_init(Doorkeeper::new).seen(hash) {
                return (make(true), Placed::FirstSeen);
            }
            // The key's own shard, else the next few whose lock is free (never waited
            // for while this one is held: no lock order to keep).
            let evicted = self.evict(&mut table, hash, now)
                || (1..=EVICTION_SHARDS).any(|i| {
                    self.shards[(shard + i) % SHARDS]
                        .try_write()
                        .ok()
                        .is_some_and(|mut t| self.evict(&mut t, hash, now))
                });
            if !evicted {
                return (make(true), Placed::Transient);
            }
            placed = Placed::Evicted;
        }
        self.len.fetch_add(1, Ordering::Relaxed);
        let ks = make(false);
        table.insert_unique(
            hash,
            Slot {
                key: id.bytes[..].into(),
                rule_len: id.rule_len as u32,
                cell: ks.cell.at.index,
                chunk: ks.cell.at.chunk.clone(),
                counters: ks.counters.clone(),
                ks: ks.clone(),
            },
            |slot| {
                self.hasher
                    .hash_one(KeyRef::of(&slot.key, slot.rule_len as usize))
            },
        );
        (ks, placed)
    }

    /// Removes the victim of `table` (see [`victim`]), if any.
    fn evict(&self, table: &mut Table, hash: u64, now: u64) -> bool {
        let Some(index) = victim(table, hash, now) else {
            return false;
        };
        let removed = table.get_bucket_entry(index).map(|e| e.remove()).is_ok();
        if removed {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }

    /// Forgets the key.
    pub(super) fn remove(&self, id: &KeyId) {
        let hash = self.hasher.hash_one(id);
        let mut table = self.write(Self::shard_of(hash));
        if let Ok(e) = table.find_entry(hash, |slot| slot.is(id)) {
            e.remove();
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Visits every key, one shard at a time under its read lock (a writer to that shard
    /// waits for the shard's visit, never for the whole map's).
    pub(super) fn for_each(&self, f: impl FnMut(&Slot)) {
        self.for_each_in(0, SHARDS, f);
    }

    /// Visits the keys of `count` shards from shard `first` (wrapping; each shard once).
    pub(super) fn for_each_in(&self, first: usize, count: usize, mut f: impl FnMut(&Slot)) {
        for i in 0..count.min(SHARDS) {
            for slot in self.read(first + i).iter() {
                f(slot);
            }
        }
    }
}

/// How [`KeyMap::get_or_insert_with`] placed a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Placed {
    /// It was in the map.
    Found,
    /// Inserted.
    Inserted,
    /// Inserted in place of an idle cold key, at `max_keys`.
    Evicted,
    /// Not inserted: the map is full and the key was not seen recently.
    FirstSeen,
    /// Not inserted: the map is full and no sampled key could go.
    Transient,
}

/// Keys sampled for an eviction, and the buckets probed to find them.
pub(super) const EVICTION_SAMPLES: usize = 5;
const EVICTION_PROBES: usize = 64;
/// Shards tried after the key's own when it has no victim (a small map spreads thin).
const EVICTION_SHARDS: usize = 3;

/// The bucket of the longest idle evictable key of up to [`EVICTION_SAMPLES`] found from
/// a place `hash` picks (a new key's hash: random to callers). Consecutive buckets, so
/// the probe reads adjacent control bytes and slots.
fn victim(table: &Table, hash: u64, now: u64) -> Option<usize> {
    let n = table.num_buckets();
    if n == 0 {
        return None;
    }
    let start = (hash.rotate_left(29) as usize) % n;
    let mut sampled = [None::<(usize, &Slot)>; EVICTION_SAMPLES];
    let mut count = 0;
    for i in 0..EVICTION_PROBES.min(n) {
        let index = (start + i) % n;
        if let Some(slot) = table.get_bucket(index) {
            sampled[count] = Some((index, slot));
            count += 1;
            if count == EVICTION_SAMPLES {
                break;
            }
        }
    }
    // The sampled keys' states and cells are read all together before any is looked at:
    // independent loads, whose cache misses overlap. Looked at one after the other, each
    // key's misses waited for the last key's (a tenth of long-tail-store's client time).
    std::hint::black_box(sampled.iter().flatten().fold(0, |a, (_, s)| a ^ s.warm()));
    let mut best = None::<(u64, usize)>;
    for &(index, slot) in sampled.iter().flatten() {
        if let Some(idle) = slot.ks.idle_if_evictable(now)
            && best.is_none_or(|(b, _)| idle > b)
        {
            best = Some((idle, index));
        }
    }
    best.map(|(_, index)| index)
}

/// A key's cell ([`leasehold_core::Cell`]): what a decision on a leased key, or a cached
/// denial, reads and writes, one cache line per key, in chunks shared by many keys, so the
/// hot path never touches memory a key's other allocations scattered.
pub(super) type Hot = leasehold_core::Cell;

const CELLS_PER_CHUNK: usize = 256;

pub(super) struct Chunk {
    cells: Box<[Hot]>,
}

/// The arena of [`Hot`] cells: chunks of 256, a cell reused once its key's state is
/// dropped (nothing else refers to it then).
#[derive(Default)]
pub(super) struct Cells {
    free: Mutex<Vec<CellRef>>,
}

/// Where a cell is.
#[derive(Clone)]
struct CellRef {
    chunk: Arc<Chunk>,
    index: u32,
}

impl CellRef {
    #[inline]
    fn get(&self) -> &Hot {
        &self.chunk.cells[self.index as usize]
    }
}

/// A key's cell, given back to the arena when dropped.
pub(super) struct Cell {
    at: CellRef,
    cells: Arc<Cells>,
}

impl Cells {
    /// A cell, empty, set for a key of `capacity` that `hot` leases, of a rule in
    /// `shadow` mode or not, with a `local` share or not.
    pub(super) fn take(
        self: &Arc<Self>,
        capacity: u64,
        hot: bool,
        shadow: bool,
        local: bool,
    ) -> Cell {
        let at = {
            let mut free = self.free.lock();
            match free.pop() {
                Some(cell) => cell,
                None => {
                    let chunk = Arc::new(Chunk {
                        cells: (0..CELLS_PER_CHUNK).map(|_| Hot::new()).collect(),
                    });
                    free.extend((1..CELLS_PER_CHUNK as u32).rev().map(|index| CellRef {
                        chunk: chunk.clone(),
                        index,
                    }));
                    CellRef { chunk, index: 0 }
                }
            }
        };
        let cell = Cell {
            at,
            cells: self.clone(),
        };
        cell.get().reset(capacity, hot, shadow, local);
        cell
    }
}

impl Cell {
    #[inline]
    pub(super) fn get(&self) -> &Hot {
        self.at.get()
    }
}

impl Drop for Cell {
    fn drop(&mut self) {
        self.cells.free.lock().push(self.at.clone());
    }
}

impl std::fmt::Debug for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cell")
            .field("index", &self.at.index)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_doorkeeper_lets_a_key_in_on_its_second_sighting_and_forgets_after_its_marks() {
        let door = Doorkeeper::new();
        let hash = |i: u64| foldhash::fast::FixedState::with_seed(7).hash_one(i);
        assert!(!door.seen(hash(1)), "a first sighting");
        assert!(door.seen(hash(1)), "a second sighting");
        // Fill to one mark short of the clearing: the first key is still remembered.
        let mut marked = 1;
        let mut i = 2;
        while marked < DOOR_MARKS - 1 {
            if !door.seen(hash(i)) {
                marked += 1;
            }
            i += 1;
        }
        assert!(door.seen(hash(1)), "forgotten before the clearing");
        // The next new mark clears every bit.
        while door.seen(hash(i)) {
            i += 1;
        }
        assert!(!door.seen(hash(1)), "remembered past the clearing");
        let set: u32 = door
            .bits
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones())
            .sum();
        assert_eq!(set, 1, "bits set after the clearing and one mark");
    }
}
