//! Completed results: records and the runtime's result table.
//!
//! The table only keeps finished results for their TTL; who holds a key in
//! flight is the ledger's business (see `claim.rs`). It keeps the typed
//! value, so a replay is a map get and a clone. A record read from a store
//! shared by several processes holds the encoded bytes instead.

use std::any::{Any, TypeId};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use arc_swap::ArcSwap;
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
///
/// Unchecked: a value whose encoding its type cannot read back is stored
/// all the same, and then never replays. Completions call
/// [`checked_stored_result`]; tests build records with this.
#[cfg(test)]
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

/// `value` as a shared store keeps it (in the versioned envelope
/// ([`crate::wire`]), with its type tag), checked: the envelope is decoded back as a `T` before
/// it is handed out, so a value a shared store could keep but never hand
/// back fails with [`WireError::RoundTrip`] (naming the type and why)
/// before anything is stored, never as a result that replays as "another
/// type" for its whole TTL.
///
/// Every value is checked, not only the first of its type: whether a value
/// reads back can depend on the value (a `skip_serializing_if =
/// "Vec::is_empty"` field without a default fails only when empty). The
/// check is one decode of the bytes just encoded, beside a store round trip.
///
/// # Errors
///
/// [`WireError::RoundTrip`] when the encoding does not decode as a `T`;
/// [`WireError::TooLarge`] or [`WireError::Codec`] when it cannot be encoded.
pub(crate) fn checked_stored_result<T>(
    fingerprint: Option<Fingerprint>,
    value: &T,
) -> Result<StoredResult, WireError>
where
    T: Serialize + DeserializeOwned + 'static,
{
    Ok(StoredResult::new(
        fingerprint,
        std::any::type_name::<T>(),
        wire::seal_checked(value)?,
    ))
}

/// Result types whose first value [`check_round_trip`] read back.
static ROUND_TRIPPED: LazyLock<ArcSwap<HashSet<TypeId, ahash::RandomState>>> =
    LazyLock::new(ArcSwap::default);

/// The check of [`checked_stored_result`] for the in-memory path, which
/// stores the typed value and never decodes it: whether `value` would come
/// back from a shared store, so that a type that cannot is found where it
/// is developed, not in production.
///
/// Checked once per type in the process: after a type's first value passes,
/// the check is one lock-free set lookup (a later value that would fail, as
/// [`checked_stored_result`] describes, is not caught here; in memory it
/// still replays).
///
/// # Errors
///
/// As [`checked_stored_result`].
pub(crate) fn check_round_trip<T>(value: &T) -> Result<(), WireError>
where
    T: Serialize + DeserializeOwned + 'static,
{
    let id = TypeId::of::<T>();
    if ROUND_TRIPPED.load().contains(&id) {
        return Ok(());
    }
    wire::seal_checked(value)?;
    ROUND_TRIPPED.rcu(|passed| {
        let mut passed = HashSet::clone(passed);
        passed.insert(id);
        passed
    });
    Ok(())
}

/// The record of a key whose function ran but whose result could not be
/// stored, `cause` saying why (with its sources, cut to 4 KiB): a
/// [`StoredResult`] a store keeps as it keeps any other, tagged with `T`'s
/// name, whose envelope holds no value but the cause (the reserved format
/// version 255). Every later call of the key replays it as
/// [`Error::Unstorable`] naming the key and the cause, instead of running
/// the function again; a build that predates it reads an unknown format
/// version and fails closed.
pub(crate) fn unstorable_result<T: ?Sized>(
    fingerprint: Option<Fingerprint>,
    cause: &(dyn std::error::Error + 'static),
) -> StoredResult {
    StoredResult::new(
        fingerprint,
        std::any::type_name::<T>(),
        wire::seal_unstorable(&crate::error::with_causes(cause)),
    )
}

/// A value in its versioned envelope, readable by another process, with its
/// type tag (the Rust type name of the type that wrote it).
struct Encoded {
    bytes: Box<[u8]>,
    tag: Box<str>,
}

impl Encoded {
    /// The value as a `T`, for `key`'s caller (see [`Record::value`]).
    fn decode<T: DeserializeOwned>(&self, key: &str) -> Result<T, Error> {
        let payload = match wire::unseal(&self.bytes) {
            Ok(payload) => payload,
            Err(cause @ WireError::Unstorable { .. }) => {
                return Err(Error::Unstorable {
                    key: shown(key),
                    source: Arc::new(cause),
                });
            }
            Err(unreadable) => {
                tracing::warn!(
                    key = %shown(key),
                    error = %unreadable,
                    "idempotency result in the shared store is unreadable by this build; \
                     failing closed"
                );
                return Err(Error::StoreUnavailable {
                    key: shown(key),
                    source: Arc::new(unreadable),
                });
            }
        };
        // Version 1 names no fields, so a value of another type of the same shape would
        // read back: the tag decides. Version 2 names them: the tag says which type wrote
        // it, and a type that moved or was renamed since still reads it.
        if *self.tag != *std::any::type_name::<T>() && !payload.format.is_self_describing() {
            return Err(Error::TypeMismatch { key: shown(key) });
        }
        payload.decode::<T>().map_err(|e| {
            tracing::debug!(
                key = %shown(key),
                stored_as = %self.tag,
                asked_for = std::any::type_name::<T>(),
                error = %crate::error::with_causes(&e),
                "idempotency result does not decode as the type asked for"
            );
            Error::TypeMismatch { key: shown(key) }
        })
    }
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

/// `value`'s size encoded as a shared store would keep it: the measure of a
/// typed value's bytes (its heap layout is not visible to generic code), so
/// a value weighs the same in memory as in a shared store; its in-memory
/// size if it cannot be encoded.
fn encoded_len<T: Serialize>(value: &T) -> usize {
    wire::encoded_len(value).unwrap_or(std::mem::size_of::<T>())
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

    /// The record of a key whose function ran but whose result could not be
    /// stored: [`unstorable_result`] as a record, for the key's local
    /// waiters and the in-memory table.
    pub(crate) fn unstorable<T: ?Sized>(
        fingerprint: Option<Fingerprint>,
        cause: &(dyn std::error::Error + 'static),
    ) -> Self {
        Self::from_stored(unstorable_result::<T>(fingerprint, cause))
    }

    /// The value as a `T`, for `key`'s caller.
    ///
    /// Fails with [`Error::TypeMismatch`] if it was stored as another type:
    /// its bytes do not decode as a `T` (version 2, which names fields and
    /// variants, whatever the type tag: a type renamed or moved to another
    /// module since still reads its results), or its type tag is not `T`'s
    /// name (version 1, bincode, which is not self-describing: a type of the
    /// same shape would read back silently). Fails with
    /// [`Error::Unstorable`] for the record of a result that could not be
    /// stored ([`Record::unstorable`]), and with [`Error::StoreUnavailable`]
    /// whose source is the [`WireError`] if its envelope is unreadable here
    /// (another format version, no envelope, too large): fail closed,
    /// neither misread nor run again.
    pub(crate) fn value<T>(&self, key: &str) -> Result<T, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        let value: &(dyn Any + Send + Sync) = &self.0.value;
        if let Some(encoded) = value.downcast_ref::<Encoded>() {
            return encoded.decode(key);
        }
        value
            .downcast_ref::<T>()
            .cloned()
            .ok_or_else(|| Error::TypeMismatch { key: shown(key) })
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
    fn encoded_record_round_trips_in_version_2() {
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
        assert_eq!(&stored.value[..3], b"tb\x02", "enveloped, version 2");
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
                            supported: 2
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

    /// A result as an earlier release stored it: version 1, bincode.
    fn stored_v1<T: Serialize>(value: &T) -> StoredResult {
        let mut bytes = b"tb\x01".to_vec();
        bytes.extend(bincode::serde::encode_to_vec(value, bincode::config::standard()).unwrap());
        StoredResult::new(None, std::any::type_name::<T>(), bytes)
    }

    #[test]
    fn a_result_an_earlier_release_stored_still_replays() {
        let charge = Charge {
            id: 3,
            note: "old".into(),
        };
        let record = Record::from_stored(stored_v1(&charge));
        assert_eq!(record.value::<Charge>("k").unwrap(), charge);
        // Version 1 names no fields: another tag is refused, not decoded
        // (these bytes would read back as a `(u64, String)`).
        assert!(matches!(
            record.value::<(u64, String)>("k"),
            Err(Error::TypeMismatch { .. })
        ));
    }

    #[test]
    fn a_version_2_result_replays_under_another_type_name_if_it_decodes() {
        #[derive(Debug, Clone, PartialEq, serde::Deserialize)]
        struct Moved {
            note: String,
            id: u64,
        }
        let charge = Charge {
            id: 9,
            note: "paid".into(),
        };
        let record = Record::from_stored(stored_result(None, &charge).unwrap());
        assert_eq!(
            record.value::<Moved>("k").unwrap(),
            Moved {
                note: "paid".into(),
                id: 9
            }
        );
        let e = record.value::<Vec<u64>>("k").unwrap_err();
        assert!(matches!(e, Error::TypeMismatch { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "key \"k\" holds a result of another type than the one asked for"
        );
    }

    #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
    struct Secret {
        id: u8,
        #[serde(skip_serializing)]
        #[allow(dead_code, reason = "skipped when serialized: what the test is about")]
        secret: String,
    }

    #[test]
    fn a_result_that_cannot_come_back_is_refused_before_it_is_stored() {
        let secret = Secret {
            id: 1,
            secret: "s".into(),
        };
        // Unchecked, it is stored and never replays.
        let stored = stored_result(Some([1; 32]), &secret).unwrap();
        assert!(matches!(
            Record::from_stored(stored).value::<Secret>("k"),
            Err(Error::TypeMismatch { .. })
        ));
        // Checked, it fails first, naming the type and the cause.
        let e = checked_stored_result(Some([1; 32]), &secret).unwrap_err();
        let WireError::RoundTrip { type_name, source } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*type_name, std::any::type_name::<Secret>());
        assert_eq!(source.to_string(), "missing field `secret`");
        let e = check_round_trip(&secret).unwrap_err();
        assert!(matches!(e, WireError::RoundTrip { .. }), "{e:?}");
        // A type that passes is stored and checked once per process.
        let charge = Charge {
            id: 1,
            note: "ok".into(),
        };
        let stored = checked_stored_result(None, &charge).unwrap();
        assert_eq!(
            Record::from_stored(stored).value::<Charge>("k").unwrap(),
            charge
        );
        check_round_trip(&charge).unwrap();
        assert!(ROUND_TRIPPED.load().contains(&TypeId::of::<Charge>()));
        assert!(!ROUND_TRIPPED.load().contains(&TypeId::of::<Secret>()));
    }

    #[tokio::test]
    async fn an_unstorable_record_round_trips_through_a_store_as_its_error() {
        use crate::idempotency::{
            ClaimReply, ClaimRequest, ClaimToken, IdempotencyStore, MemoryIdempotencyStore,
        };
        let secret = Secret {
            id: 1,
            secret: "s".into(),
        };
        let cause = checked_stored_result(Some([4; 32]), &secret).unwrap_err();
        let stored = unstorable_result::<Secret>(Some([4; 32]), &cause);
        assert_eq!(stored.type_tag, std::any::type_name::<Secret>());
        assert_eq!(&stored.value[..3], b"tb\xff");
        // Kept by a store as any result is.
        let store = MemoryIdempotencyStore::new();
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        let owner = ClaimToken::new();
        let request = ClaimRequest::new(owner, Some(&[4; 32]), lease, ttl);
        assert!(matches!(
            store.claim("k", request).await.unwrap(),
            ClaimReply::Won { .. }
        ));
        assert!(store.complete("k", owner, &stored, ttl).await.unwrap());
        let request = ClaimRequest::new(ClaimToken::new(), Some(&[4; 32]), lease, ttl);
        let ClaimReply::Completed(back) = store.claim("k", request).await.unwrap() else {
            panic!("completed");
        };
        assert_eq!(back, stored);
        let expected = format!(
            "a value of type {} does not decode from its own encoding: missing field `secret`",
            std::any::type_name::<Secret>()
        );
        for record in [
            Record::from_stored(back),
            Record::unstorable::<Secret>(Some([4; 32]), &cause),
        ] {
            assert_eq!(record.fingerprint(), Some(&[4; 32]));
            // Whatever type a retry asks for: the key ran.
            for e in [
                record.value::<Secret>("k").unwrap_err(),
                record.value::<u64>("k").unwrap_err(),
            ] {
                let Error::Unstorable { key, source } = &e else {
                    panic!("{e:?}");
                };
                assert_eq!(key, "k");
                assert_eq!(
                    e.to_string(),
                    "idempotency key \"k\" ran, but its result could not be stored"
                );
                assert!(
                    matches!(source.downcast_ref::<WireError>(), Some(WireError::Unstorable { cause }) if *cause == expected),
                    "{source:?}"
                );
                assert_eq!(source.to_string(), expected);
                assert_eq!(e.key(), Some("k"));
            }
        }
    }

    #[test]
    fn a_typed_record_weighs_its_version_2_encoding() {
        let charge = Charge {
            id: 7,
            note: "ok".into(),
        };
        let sealed = wire::seal(&charge).unwrap();
        let record = Record::new(None, charge);
        assert_eq!(record.weight() as usize, sealed.len() - 3);
        // A flattened struct has no length up front: bincode could not measure it.
        #[derive(serde::Serialize)]
        struct Flat {
            #[serde(flatten)]
            rest: std::collections::BTreeMap<String, u8>,
        }
        let flat = Flat {
            rest: [("a".to_owned(), 1)].into(),
        };
        assert_eq!(Record::new(None, flat).weight(), 4);
    }
}
