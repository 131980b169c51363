//! Completed results: records and the runtime's result table.
//!
//! The table only keeps finished results for their TTL; who holds a key in
//! flight is the ledger's business (see `claim.rs`). It keeps the typed
//! value, so a replay is a map get and a clone. A record read from a store
//! shared by several processes holds the encoded bytes instead.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::{Counters, Sweeper, TtlTable};
use tokio::time::Instant;

use super::options::Fingerprint;
use super::seam::StoredResult;
use crate::clock::{RuntimeClock, WindowClock};
use crate::error::Error;
use crate::key::{InlineKey, shown};
use crate::wire::{self, WireError};

/// `value` as a shared store keeps it: in the versioned envelope
/// ([`crate::wire`]), with its type tag.
pub(crate) fn stored_result<T: Serialize>(
    fingerprint: Option<Fingerprint>,
    value: &T,
) -> Result<StoredResult, WireError> {
    Ok(StoredResult::new(
        fingerprint,
        std::any::type_name::<T>(),
        wire::seal(value)?,
    ))
}

/// bincode settings a typed value is measured with: those of the envelope's
/// payload, so a value weighs the same in memory as in a shared store.
const CODEC: bincode::config::Configuration = bincode::config::standard();

/// A value in its versioned envelope, readable by another process, with its
/// type tag (the Rust type name), so a value of another type is refused
/// rather than misread.
struct Encoded {
    bytes: Box<[u8]>,
    tag: Box<str>,
}

/// A record's contents: the fingerprint digest beside the value, in one
/// allocation.
struct Stored<V: ?Sized> {
    fingerprint: Option<Fingerprint>,
    /// The value's size in bytes, encoded (saturated at 4 GiB): what it
    /// counts against a byte budget.
    weight: u32,
    /// The typed value, or [`Encoded`] bytes.
    value: V,
}

/// `value`'s size bincode-encoded: the measure of a typed value's bytes (its
/// heap layout is not visible to generic code); its in-memory size if it
/// cannot be encoded.
fn encoded_len<T: Serialize>(value: &T) -> usize {
    let mut size = bincode::enc::write::SizeWriter::default();
    match bincode::serde::encode_into_writer(value, &mut size, CODEC) {
        Ok(()) => size.bytes_written,
        Err(_) => std::mem::size_of::<T>(),
    }
}

fn weight(bytes: usize) -> u32 {
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// A completed result with the digest of the fingerprint of the request
/// that produced it: one pointer, so a table entry stays within a cache
/// line, and cloning it is one reference count.
#[derive(Clone)]
pub(crate) struct Record(Arc<Stored<dyn Any + Send + Sync>>);

impl Record {
    /// A record of the typed `value`: replaying it is a clone.
    pub(crate) fn new<T>(fingerprint: Option<Fingerprint>, value: T) -> Self
    where
        T: Serialize + Send + Sync + 'static,
    {
        Self(Arc::new(Stored {
            fingerprint,
            weight: weight(encoded_len(&value)),
            value,
        }))
    }

    /// A record of a result read from a shared store.
    pub(crate) fn from_stored(result: StoredResult) -> Self {
        Self(Arc::new(Stored {
            fingerprint: result.fingerprint,
            weight: weight(result.value.len() + result.type_tag.len()),
            value: Encoded {
                bytes: result.value.into_boxed_slice(),
                tag: result.type_tag.into_boxed_str(),
            },
        }))
    }

    pub(crate) fn fingerprint(&self) -> Option<&Fingerprint> {
        self.0.fingerprint.as_ref()
    }

    /// The value's size in bytes, encoded (see [`Stored::weight`]).
    pub(crate) fn weight(&self) -> u32 {
        self.0.weight
    }

    /// Bytes this record holds in its own allocation: the fingerprint
    /// digest and the value (not what the value points to).
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> usize {
        std::mem::size_of_val(&*self.0)
    }

    /// The value as a `T`, for `key`'s caller.
    ///
    /// Fails with [`Error::TypeMismatch`] if it was stored as another type
    /// (another type tag, or bytes that do not decode exactly as a `T`:
    /// bincode is not self-describing, so a type of the same shape reads back
    /// silently), and with [`Error::StoreUnavailable`] whose source is the
    /// [`WireError`] if its envelope is unreadable here (another format
    /// version, no envelope, too large): fail closed, neither misread nor run
    /// again.
    pub(crate) fn value<T>(&self, key: &str) -> Result<T, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        let mismatch = || Error::TypeMismatch { key: shown(key) };
        let value: &(dyn Any + Send + Sync) = &self.0.value;
        if let Some(Encoded { bytes, tag }) = value.downcast_ref::<Encoded>() {
            if **tag != *std::any::type_name::<T>() {
                return Err(mismatch());
            }
            return match wire::open::<T>(bytes) {
                Ok(value) => Ok(value),
                Err(WireError::Codec { .. }) => Err(mismatch()),
                Err(unreadable) => {
                    tracing::warn!(
                        key = %shown(key),
                        error = %unreadable,
                        "idempotency result in the shared store is unreadable by this build; \
                         failing closed"
                    );
                    Err(Error::StoreUnavailable {
                        key: shown(key),
                        source: Arc::new(unreadable),
                    })
                }
            };
        }
        value.downcast_ref::<T>().cloned().ok_or_else(mismatch)
    }

    fn is_encoded(&self) -> bool {
        self.0.value.is::<Encoded>()
    }
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let form = if self.is_encoded() {
            "encoded"
        } else {
            "typed"
        };
        f.debug_struct("Record")
            .field("fingerprint", &self.fingerprint().is_some())
            .field("form", &form)
            .finish()
    }
}

/// What the table holds, for stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StoreCounts {
    /// Results held, expired ones not yet swept included.
    pub(crate) stored: usize,
    /// What they weigh in bytes (see [`ResultTable`]).
    pub(crate) bytes: u64,
    /// Results evicted by a cap or the byte budget before their TTL.
    pub(crate) evictions: u64,
}

/// Results in a [`TtlTable`] swept by the runtime's sweeper, capped at
/// `max_results` entries and `max_bytes` bytes (the oldest evicted first).
///
/// A result weighs its key, its value encoded (the measure of a typed
/// value's size) and [`ENTRY_OVERHEAD`] for the entry around them.
pub(crate) struct ResultTable {
    // Records inline in the table: a replay touches the entry and the value. Expiries on
    // the windows' clock: a replay reads the time as a throttled call does, from the TSC.
    table: Arc<TtlTable<InlineKey, Record, WindowClock>>,
    /// When the last eviction warning was logged, in ms on the table's clock
    /// (`u64::MAX`: never).
    warned_at: AtomicU64,
}

/// Evictions are logged at warn at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// What a stored result costs beside its key and value: the table entry,
/// the record's allocation, its slot in the insertion order.
pub(crate) const ENTRY_OVERHEAD: u64 = 200;

/// A stored result's weight against the byte budget.
fn weigh(key: &InlineKey, record: &Record) -> u64 {
    key.as_bytes().len() as u64 + u64::from(record.weight()) + ENTRY_OVERHEAD
}

impl ResultTable {
    pub(crate) fn new(
        counters: Arc<Counters>,
        sweeper: &Sweeper,
        clock: RuntimeClock,
        max_results: usize,
        max_bytes: u64,
    ) -> Self {
        Self {
            table: TtlTable::with_clock(counters, WindowClock::new(clock))
                .with_max_len(max_results)
                .with_max_weight(max_bytes, weigh)
                .swept_by(sweeper),
            warned_at: AtomicU64::new(u64::MAX),
        }
    }

    /// Logs evictions at warn, at most once per [`WARN_EVERY`].
    fn evicted(&self, n: usize) {
        // The table's clock: every eviction reads it, and it is cheaper than tokio's.
        let now = self.table.now_ns() / 1_000_000;
        let last = self.warned_at.load(Ordering::Relaxed);
        let due = last == u64::MAX || now.saturating_sub(last) >= WARN_EVERY.as_millis() as u64;
        if due
            && self
                .warned_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                evicted = n,
                evictions = self.table.evictions(),
                stored = self.table.len(),
                stored_bytes = self.table.weight(),
                max_results = self.table.max_len().unwrap_or(usize::MAX),
                max_bytes = self.table.max_weight().unwrap_or(u64::MAX),
                "idempotency results evicted before their ttl: the store is at its cap of \
                 results or bytes; raise them with RuntimeBuilder::with_max_idempotency_results \
                 and RuntimeBuilder::with_max_idempotency_bytes"
            );
        }
    }
}

impl ResultTable {
    /// Runs `f` on the live record for `key` now, on the table's clock, if there is one. The
    /// replay fast path.
    #[inline]
    pub(crate) fn read<R>(&self, key: &[u8], f: impl FnOnce(&Record) -> R) -> Option<R> {
        self.table.read(key, f)
    }

    /// The live record for `key` as of `now`.
    pub(crate) fn get(&self, key: &InlineKey, now: Instant) -> Option<Record> {
        self.table.get_at(key.as_bytes(), now)
    }

    /// Stores `record` for `ttl`, replacing any record for `key`; evictions past the caps
    /// are logged.
    pub(crate) fn put(&self, key: &InlineKey, record: Record, ttl: Duration) {
        let evicted = self.table.insert(key.clone(), record, ttl);
        if evicted > 0 {
            self.evicted(evicted);
        }
    }

    /// Results held and evicted, for stats.
    pub(crate) fn counts(&self) -> StoreCounts {
        StoreCounts {
            stored: self.table.len(),
            bytes: self.table.weight(),
            evictions: self.table.evictions(),
        }
    }

    /// The runtime shut down: drop every result.
    pub(crate) fn close(&self) {
        self.table.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Charge {
        id: u64,
        note: String,
    }

    #[test]
    fn typed_record_replays_the_same_type_only() {
        let charge = Charge {
            id: 7,
            note: "ok".into(),
        };
        let record = Record::new(Some([7; 32]), charge.clone());
        assert_eq!(record.fingerprint(), Some(&[7; 32]));
        assert_eq!(record.value::<Charge>("k").unwrap(), charge);
        assert!(matches!(
            record.value::<u64>("k"),
            Err(Error::TypeMismatch { .. })
        ));
    }

    #[test]
    fn encoded_record_round_trips_through_bincode() {
        let charge = Charge {
            id: 9,
            note: "paid".into(),
        };
        let record = Record::from_stored(stored_result(None, &charge).unwrap());
        assert!(record.is_encoded());
        assert_eq!(record.value::<Charge>("k").unwrap(), charge);
        assert!(matches!(
            record.value::<u8>("k"),
            Err(Error::TypeMismatch { .. })
        ));
    }

    #[test]
    fn a_stored_result_in_another_format_version_fails_closed_not_misread() {
        let mut stored = stored_result(None, &7_u64).unwrap();
        assert_eq!(&stored.value[..3], b"tb\x01", "enveloped, version 1");
        assert_eq!(
            Record::from_stored(stored.clone())
                .value::<u64>("k")
                .unwrap(),
            7
        );
        stored.value[2] = 9;
        match Record::from_stored(stored.clone()).value::<u64>("k") {
            Err(Error::StoreUnavailable { key, source }) => {
                assert_eq!(key, "k");
                assert!(
                    matches!(
                        source.downcast_ref::<WireError>(),
                        Some(WireError::UnknownVersion {
                            found: 9,
                            supported: 1
                        })
                    ),
                    "{source:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        // Without an envelope (written before envelopes, or by something else).
        let plain = StoredResult::new(None, stored.type_tag.clone(), vec![7]);
        assert!(matches!(
            Record::from_stored(plain).value::<u64>("k"),
            Err(Error::StoreUnavailable { .. })
        ));
        // Enveloped but truncated: it does not decode as the type.
        let mut cut = stored_result(None, &String::from("paid")).unwrap();
        cut.value.truncate(cut.value.len() - 1);
        assert!(matches!(
            Record::from_stored(cut).value::<String>("k"),
            Err(Error::TypeMismatch { .. })
        ));
    }
}
