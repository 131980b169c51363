//! The memory store's map: hash tables in shards, each under its own lock. One hash of the
//! key's bytes picks the shard and the bucket, and keys held inline are compared by word
//! loads, not a call to `memcmp`: on a check, the lookup is most of the work.

use std::hash::{BuildHasher, Hasher};

use dashmap::{RwLock, RwLockWriteGuard};
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::key::{INLINE_KEY, InlineKey};

/// Shards of a [`Table`]: enough that two threads rarely meet on one lock.
const SHARDS: usize = 64;

/// A concurrent map from keys (as bytes) to `V`.
pub(super) struct Table<V> {
    shards: Box<[Shard<V>; SHARDS]>,
    hasher: ahash::RandomState,
}

/// One shard, on cache lines of its own so that two threads on two shards do not contend.
/// Under dashmap's own lock (feature `raw-api`), which a panic does not poison: a check takes
/// and releases it with one atomic each, where `std`'s mutex also reads the panic count
/// twice.
#[repr(align(128))]
struct Shard<V>(RwLock<HashTable<(InlineKey, V)>>);

impl<V> Table<V> {
    /// An empty map.
    pub(super) fn new() -> Self {
        Self {
            shards: Box::new(std::array::from_fn(|_| {
                Shard(RwLock::new(HashTable::new()))
            })),
            hasher: ahash::RandomState::new(),
        }
    }

    #[inline(always)]
    fn hash(&self, key: &[u8]) -> u64 {
        let mut hasher = self.hasher.build_hasher();
        hasher.write(key);
        hasher.finish()
    }

    #[inline(always)]
    fn lock(&self, hash: u64) -> RwLockWriteGuard<'_, HashTable<(InlineKey, V)>> {
        // The bits below hashbrown's top seven (its tags), masked into range.
        let index = usize::try_from(hash >> 51).unwrap_or(0) % SHARDS;
        self.shards[index].0.write()
    }

    fn lock_all(&self) -> impl Iterator<Item = RwLockWriteGuard<'_, HashTable<(InlineKey, V)>>> {
        self.shards.iter().map(|s| s.0.write())
    }

    /// Runs `f` on `key`'s value under its shard's lock, if the key is present.
    #[inline(always)]
    pub(super) fn with_mut<R>(&self, key: &[u8], f: impl FnOnce(&mut V) -> R) -> Option<R> {
        let hash = self.hash(key);
        let mut shard = self.lock(hash);
        shard
            .find_mut(hash, |(k, _)| same(k, key))
            .map(|(_, v)| f(v))
    }

    /// Runs `present` on `key`'s value if it is there; otherwise `absent`, and inserts the value
    /// it returns, if any; all under the shard's lock. Says whether it inserted.
    pub(super) fn upsert<R>(
        &self,
        key: &str,
        present: impl FnOnce(&mut V) -> R,
        absent: impl FnOnce() -> (R, Option<V>),
    ) -> (R, bool) {
        let bytes = key.as_bytes();
        let hash = self.hash(bytes);
        let mut shard = self.lock(hash);
        let entry = shard.entry(
            hash,
            |(k, _)| same(k, bytes),
            |(k, _)| self.hash(k.as_bytes()),
        );
        match entry {
            Entry::Occupied(mut e) => (present(&mut e.get_mut().1), false),
            Entry::Vacant(e) => {
                let (result, value) = absent();
                let inserted = value.is_some();
                if let Some(value) = value {
                    e.insert((InlineKey::new(key), value));
                }
                (result, inserted)
            }
        }
    }

    /// Removes `key`; says whether it was there.
    pub(super) fn remove(&self, key: &[u8]) -> bool {
        let hash = self.hash(key);
        let mut shard = self.lock(hash);
        shard
            .find_entry(hash, |(k, _)| same(k, key))
            .map(|e| drop(e.remove()))
            .is_ok()
    }

    /// Keeps the values for which `keep` says so, one shard at a time; returns how many went.
    pub(super) fn retain(&self, mut keep: impl FnMut(&mut V) -> bool) -> usize {
        let mut removed = 0;
        for mut shard in self.lock_all() {
            let before = shard.len();
            shard.retain(|(_, v)| keep(v));
            removed += before - shard.len();
        }
        removed
    }

    /// Visits every value, one shard at a time.
    pub(super) fn for_each(&self, mut f: impl FnMut(&V)) {
        for shard in self.lock_all() {
            shard.iter().for_each(|(_, v)| f(v));
        }
    }

    /// The number of keys.
    pub(super) fn len(&self) -> usize {
        self.lock_all().map(|s| s.len()).sum()
    }

    /// The number of keys the shards hold without growing.
    pub(super) fn capacity(&self) -> usize {
        self.lock_all().map(|s| s.capacity()).sum()
    }

    /// Gives back the memory the shards hold beyond their keys.
    pub(super) fn shrink_to_fit(&self) {
        for mut shard in self.lock_all() {
            shard.shrink_to_fit(|(k, _)| self.hash(k.as_bytes()));
        }
    }
}

impl<V> std::fmt::Debug for Table<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

/// Whether `stored` is `key`.
#[inline]
fn same(stored: &InlineKey, key: &[u8]) -> bool {
    match stored {
        InlineKey::Inline { len, bytes } => usize::from(*len) == key.len() && short_eq(bytes, key),
        InlineKey::Heap(bytes) => **bytes == *key,
    }
}

/// `stored[..key.len()] == key` for a key of at most [`INLINE_KEY`] bytes: by two or three
/// overlapping word loads on each side, not a call to `memcmp` (which cost a check about 25
/// instructions more, for the call and its dispatch on the length).
#[inline]
fn short_eq(stored: &[u8; INLINE_KEY], key: &[u8]) -> bool {
    let n = key.len();
    let Some(stored) = stored.get(..n) else {
        return false;
    };
    if n >= 8 {
        let word =
            |b: &[u8], at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().unwrap_or_default());
        let last = n - 8;
        word(stored, 0) == word(key, 0)
            && word(stored, last) == word(key, last)
            && (n <= 16 || word(stored, 8) == word(key, 8))
    } else if n >= 4 {
        let word =
            |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().unwrap_or_default());
        word(stored, 0) == word(key, 0) && word(stored, n - 4) == word(key, n - 4)
    } else {
        stored == key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_keys_are_equal_exactly_when_their_bytes_are() {
        let text = b"0123456789abcdefghijklmnopqrstuvwxyz";
        for n in 0..=INLINE_KEY {
            let key = &text[..n];
            let stored = InlineKey::from(key.to_vec());
            assert!(same(&stored, key), "{n} bytes");
            // One byte different anywhere, or one byte more or less: another key.
            for at in 0..n {
                let mut other = key.to_vec();
                other[at] ^= 1;
                assert!(!same(&stored, &other), "{n} bytes, byte {at}");
            }
            assert!(!same(&stored, &text[..n + 1]), "{n} + 1 bytes");
            if n > 0 {
                assert!(!same(&stored, &text[..n - 1]), "{n} - 1 bytes");
            }
        }
        let long = InlineKey::from(text.to_vec());
        assert!(same(&long, text));
        assert!(!same(&long, &text[..INLINE_KEY]));
    }

    #[test]
    fn values_are_found_updated_removed_and_kept() {
        let table: Table<u32> = Table::new();
        let keys: Vec<String> = (0..1_000).map(|i| format!("key:{i}")).collect();
        for (i, key) in keys.iter().enumerate() {
            let (was, inserted) = table.upsert(key, |_| true, || (false, Some(i as u32)));
            assert!(!was && inserted);
        }
        assert_eq!(table.len(), 1_000);
        assert_eq!(table.with_mut(b"key:7", |v| *v), Some(7));
        assert_eq!(table.with_mut(b"key:", |v| *v), None);
        let (was, inserted) = table.upsert("key:7", |v| *v += 1, || ((), None));
        assert_eq!((was, inserted), ((), false));
        assert_eq!(table.with_mut(b"key:7", |v| *v), Some(8));
        assert!(table.remove(b"key:7") && !table.remove(b"key:7"));
        // The odd values but key:7's (8, then removed) go.
        assert_eq!(table.retain(|v| *v % 2 == 0), 499);
        assert_eq!(table.len(), 500);
        let mut sum = 0;
        table.for_each(|v| sum += u64::from(*v));
        assert_eq!(sum, (0..1_000).filter(|i| i % 2 == 0).sum::<u64>());
        table.shrink_to_fit();
        assert!(table.capacity() >= table.len());
    }
}
