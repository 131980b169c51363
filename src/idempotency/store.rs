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
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::{Counters, Sweeper, TtlTable};
use tokio::time::Instant;

use crate::error::BoxError;
use crate::key::InlineKey;

/// bincode settings of encoded results: part of the format a shared store
/// keeps, so changing them orphans stored results.
const CODEC: bincode::config::Configuration = bincode::config::standard();

/// How a store wants values handed to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// The value itself; replaying it is a clone (in-process stores).
    Typed,
    /// bincode bytes, readable by another process (shared stores).
    Encoded,
}

/// A value in bincode bytes, readable by another process.
struct Encoded(Box<[u8]>);

/// A completed result with the fingerprint of the request that produced it.
/// Cloning it is two reference counts.
#[derive(Clone)]
pub(crate) struct Record {
    fingerprint: Option<Arc<str>>,
    /// The typed value, or [`Encoded`] bytes: one pointer either way, so a
    /// table entry stays within a cache line.
    value: Arc<dyn Any + Send + Sync>,
}

impl Record {
    /// Wraps `value` in the form the store takes.
    pub(crate) fn new<T>(
        form: Form,
        fingerprint: Option<Arc<str>>,
        value: T,
    ) -> Result<Self, bincode::error::EncodeError>
    where
        T: Serialize + Send + Sync + 'static,
    {
        let value: Arc<dyn Any + Send + Sync> = match form {
            Form::Typed => Arc::new(value),
            Form::Encoded => Arc::new(Encoded(
                bincode::serde::encode_to_vec(&value, CODEC)?.into_boxed_slice(),
            )),
        };
        Ok(Self { fingerprint, value })
    }

    pub(crate) fn fingerprint(&self) -> Option<&str> {
        self.fingerprint.as_deref()
    }

    /// The value as a `T`, or `None` if it was stored as another type.
    ///
    /// Encoded values are only checked to decode exactly; bincode is not
    /// self-describing, so a type of the same shape reads back silently.
    pub(crate) fn value<T>(&self) -> Option<T>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        if let Some(Encoded(bytes)) = self.value.downcast_ref::<Encoded>() {
            return match bincode::serde::decode_from_slice::<T, _>(bytes, CODEC) {
                Ok((value, read)) if read == bytes.len() => Some(value),
                _ => None,
            };
        }
        self.value.downcast_ref::<T>().cloned()
    }
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let form = if self.value.is::<Encoded>() {
            Form::Encoded
        } else {
            Form::Typed
        };
        f.debug_struct("Record")
            .field("fingerprint", &self.fingerprint)
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

/// Where completed results live for their TTL.
///
/// Keys arrive already scoped. A store never hands out an expired record,
/// whether or not it has been swept.
pub(crate) trait ResultStore: Send + Sync + 'static {
    /// The form [`Record::new`] must produce for this store.
    fn form(&self) -> Form;

    /// Runs `read` on the live record for `key` as of `now` without a
    /// round trip, if this store can: `Some(found)`, or `None` when only
    /// [`ResultStore::get`] can answer. The replay fast path.
    fn read_now(&self, key: &str, now: Instant, read: &mut dyn FnMut(&Record)) -> Option<bool> {
        let _ = (key, now, read);
        None
    }

    /// The live record for `key` as of `now`.
    fn get(&self, key: &str, now: Instant) -> Pending<'_, Result<Option<Arc<Record>>, BoxError>>;

    /// Stores `record` for `ttl`, replacing any record for `key`.
    fn put(
        &self,
        key: &str,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Pending<'_, Result<(), BoxError>>;

    /// The runtime shut down: drop what this instance alone holds (a shared
    /// store keeps its records for the other instances).
    fn close(&self);
}

/// Results in a [`TtlTable`] swept by the runtime's sweeper.
pub(crate) struct MemoryStore {
    // Records inline in the table: a replay touches the entry and the value.
    table: Arc<TtlTable<InlineKey, Record>>,
}

impl MemoryStore {
    pub(crate) fn new(counters: Arc<Counters>, sweeper: &Sweeper) -> Self {
        Self {
            table: TtlTable::with_sweeper(counters, sweeper),
        }
    }
}

impl ResultStore for MemoryStore {
    fn form(&self) -> Form {
        Form::Typed
    }

    fn read_now(&self, key: &str, now: Instant, read: &mut dyn FnMut(&Record)) -> Option<bool> {
        Some(
            self.table
                .read_at(key.as_bytes(), now, |record| read(record))
                .is_some(),
        )
    }

    fn get(&self, key: &str, now: Instant) -> Pending<'_, Result<Option<Arc<Record>>, BoxError>> {
        Pending::Ready(Ok(self.table.get_at(key.as_bytes(), now).map(Arc::new)))
    }

    fn put(
        &self,
        key: &str,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Pending<'_, Result<(), BoxError>> {
        self.table
            .insert(InlineKey::new(key), Arc::unwrap_or_clone(record), ttl);
        Pending::Ready(Ok(()))
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
        let record = Record::new(Form::Typed, Some("fp".into()), charge.clone()).unwrap();
        assert_eq!(record.fingerprint(), Some("fp"));
        assert_eq!(record.value::<Charge>(), Some(charge));
        assert_eq!(record.value::<u64>(), None);
    }

    #[test]
    fn encoded_record_round_trips_through_bincode() {
        let charge = Charge {
            id: 9,
            note: "paid".into(),
        };
        let record = Record::new(Form::Encoded, None, charge.clone()).unwrap();
        assert!(record.value.is::<Encoded>());
        assert_eq!(record.value::<Charge>(), Some(charge));
        // Trailing bytes left over mean the stored value was of another type.
        assert_eq!(record.value::<u8>(), None);
    }
}
