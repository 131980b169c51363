//! Completed results: the store trait and the in-memory store.
//!
//! A store only keeps finished results for their TTL; who holds a key in
//! flight is the ledger's business (see `claim.rs`). The memory store keeps
//! the typed value, so a replay is a map get and a clone. A store shared by
//! several processes (Redis) asks for the encoded form instead.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
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
use crate::error::{BoxError, Error};
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

/// How a store wants values handed to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// The value itself; replaying it is a clone (in-process stores).
    Typed,
    /// bincode bytes, readable by another process (shared stores).
    Encoded,
}

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
    /// Wraps `value` in the form the store takes.
    pub(crate) fn new<T>(
        form: Form,
        fingerprint: Option<Fingerprint>,
        value: T,
    ) -> Result<Self, WireError>
    where
        T: Serialize + Send + Sync + 'static,
    {
        Ok(Self(match form {
            Form::Typed => Arc::new(Stored {
                fingerprint,
                weight: weight(encoded_len(&value)),
                value,
            }),
            Form::Encoded => {
                let bytes = wire::seal(&value)?.into_boxed_slice();
                let tag: Box<str> = std::any::type_name::<T>().into();
                Arc::new(Stored {
                    fingerprint,
                    weight: weight(bytes.len() + tag.len()),
                    value: Encoded { bytes, tag },
                })
            }
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
            Form::Encoded
        } else {
            Form::Typed
        };
        f.debug_struct("Record")
            .field("fingerprint", &self.fingerprint().is_some())
            .field("form", &form)
            .finish()
    }
}

/// A store's answer: ready at once (memory, no allocation) or after a round
/// trip (a remote store).
pub(crate) enum Pending<'a, T> {
    Ready(T),
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "for the Redis store; unit tests use it now")
    )]
    Later(Pin<Box<dyn Future<Output = T> + Send + 'a>>),
}

impl<T> Pending<'_, T> {
    pub(crate) async fn resolve(self) -> T {
        match self {
            Self::Ready(value) => value,
            Self::Later(future) => future.await,
        }
    }
}

/// What a store holds, for [`ResultStore::counts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StoreCounts {
    /// Results held, expired ones not yet swept included.
    pub(crate) stored: usize,
    /// What they weigh in bytes (see [`ResultTable`]).
    pub(crate) bytes: u64,
    /// Results evicted by a cap or the byte budget before their TTL.
    pub(crate) evictions: u64,
}

/// Where completed results live for their TTL.
///
/// Keys arrive already scoped. A store never hands out an expired record,
/// whether or not it has been swept.
pub(crate) trait ResultStore: Send + Sync + 'static {
    /// The form [`Record::new`] must produce for this store.
    fn form(&self) -> Form;

    /// Runs `read` on the live record for `key` now (on the store's own clock) without a
    /// round trip, if this store can: `Some(found)`, or `None` when only
    /// [`ResultStore::get`] can answer. The replay fast path.
    fn read_now(&self, key: &[u8], read: &mut dyn FnMut(&Record)) -> Option<bool> {
        let _ = (key, read);
        None
    }

    /// Whether [`ResultStore::read_now`] always answers: then the replay fast path that every
    /// run takes first has read the key, and a claim need not read it again before joining
    /// (only after, to catch a result stored in between).
    fn answers_at_once(&self) -> bool {
        false
    }

    /// The live record for `key` as of `now`.
    fn get(&self, key: &str, now: Instant) -> Pending<'_, Result<Option<Record>, BoxError>>;

    /// [`ResultStore::get`] for a key in its stored form (a table reads it without
    /// checking its text again).
    fn get_stored(
        &self,
        key: &InlineKey,
        now: Instant,
    ) -> Pending<'_, Result<Option<Record>, BoxError>> {
        self.get(key.as_str(), now)
    }

    /// Stores `record` for `ttl`, replacing any record for `key` (handed over in its stored
    /// form, so a table keeps a clone instead of building the key again).
    fn put(
        &self,
        key: &InlineKey,
        record: Record,
        ttl: Duration,
    ) -> Pending<'_, Result<(), BoxError>>;

    /// Results held and evicted, for stats; zero where the store cannot
    /// tell cheaply.
    fn counts(&self) -> StoreCounts {
        StoreCounts::default()
    }

    /// The runtime shut down: drop what this instance alone holds (a shared
    /// store keeps its records for the other instances).
    fn close(&self);
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

impl ResultStore for ResultTable {
    fn form(&self) -> Form {
        Form::Typed
    }

    #[inline]
    fn read_now(&self, key: &[u8], read: &mut dyn FnMut(&Record)) -> Option<bool> {
        Some(self.table.read(key, |record| read(record)).is_some())
    }

    fn answers_at_once(&self) -> bool {
        true
    }

    fn get(&self, key: &str, now: Instant) -> Pending<'_, Result<Option<Record>, BoxError>> {
        Pending::Ready(Ok(self.table.get_at(key.as_bytes(), now)))
    }

    fn get_stored(
        &self,
        key: &InlineKey,
        now: Instant,
    ) -> Pending<'_, Result<Option<Record>, BoxError>> {
        Pending::Ready(Ok(self.table.get_at(key.as_bytes(), now)))
    }

    fn put(
        &self,
        key: &InlineKey,
        record: Record,
        ttl: Duration,
    ) -> Pending<'_, Result<(), BoxError>> {
        let evicted = self.table.insert(key.clone(), record, ttl);
        if evicted > 0 {
            self.evicted(evicted);
        }
        Pending::Ready(Ok(()))
    }

    fn counts(&self) -> StoreCounts {
        StoreCounts {
            stored: self.table.len(),
            bytes: self.table.weight(),
            evictions: self.table.evictions(),
        }
    }

    fn close(&self) {
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
        let record = Record::new(Form::Typed, Some([7; 32]), charge.clone()).unwrap();
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
        let record = Record::new(Form::Encoded, None, charge.clone()).unwrap();
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
