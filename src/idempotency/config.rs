//! Idempotency's settings, which the runtime carries for it: the builder
//! methods below are [`RuntimeBuilder`]'s, defined here so that the runtime
//! knows no primitive.

use std::sync::Arc;

use super::{DEFAULT_MAX_IDEMPOTENCY_BYTES, DEFAULT_MAX_IDEMPOTENCY_RESULTS, IdempotencyStore};
use crate::error::Error;
use crate::runtime::{Core, RuntimeBuilder, Setting};

/// What a runtime's builder was told about idempotency.
#[derive(Clone)]
pub(super) struct IdempotencyConfig {
    /// The cap on completed results kept.
    pub(super) max_results: usize,
    /// The byte budget of completed results kept.
    pub(super) max_bytes: usize,
    /// Where claims and results are shared, if the builder named a store.
    pub(super) store: Option<Arc<dyn IdempotencyStore>>,
    /// That store, when it is PostgreSQL: its figures go in the runtime's stats.
    #[cfg(feature = "postgres")]
    pub(super) postgres: Option<crate::idempotency::postgres::PostgresStore>,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            max_results: DEFAULT_MAX_IDEMPOTENCY_RESULTS,
            max_bytes: DEFAULT_MAX_IDEMPOTENCY_BYTES,
            store: None,
            #[cfg(feature = "postgres")]
            postgres: None,
        }
    }
}

impl Setting for IdempotencyConfig {
    fn check(&self) -> Result<(), Error> {
        if self.max_results == 0 {
            return Err(Error::InvalidConfig {
                what: "max idempotency results",
                reason: "must be greater than zero",
            });
        }
        if self.max_bytes == 0 {
            return Err(Error::InvalidConfig {
                what: "max idempotency bytes",
                reason: "must be greater than zero",
            });
        }
        Ok(())
    }
}

impl IdempotencyConfig {
    /// The settings of `core`'s runtime.
    pub(super) fn of(core: &Core) -> Self {
        core.settings.get::<Self>().cloned().unwrap_or_default()
    }

    /// Where claims and results are shared: the store the builder named,
    /// else the runtime's Redis (failing closed until it connects), else
    /// nowhere.
    pub(super) fn shared_store(&self, core: &Core) -> Option<Arc<dyn IdempotencyStore>> {
        if let Some(store) = &self.store {
            return Some(Arc::clone(store));
        }
        #[cfg(feature = "redis")]
        if let Some(backend) = core.backend() {
            return Some(match backend.get() {
                Some(redis) => Arc::new(redis.clone()),
                None => Arc::new(super::backend::BackendStore(backend.clone())),
            });
        }
        let _ = core;
        None
    }
}

impl RuntimeBuilder {
    /// Caps the completed idempotency results kept (default
    /// [`DEFAULT_MAX_IDEMPOTENCY_RESULTS`]):
    /// past it the oldest are evicted first, an early expiry that is
    /// counted in [`IdempotencyStats::evictions`](crate::idempotency::IdempotencyStats)
    /// and logged at warn at most once a minute. Keys in flight are capped
    /// by [`with_max_keys`](Self::with_max_keys) instead. The results' bytes
    /// have a budget too ([`with_max_idempotency_bytes`](Self::with_max_idempotency_bytes)).
    pub fn with_max_idempotency_results(mut self, max_results: usize) -> Self {
        self.settings.get_mut::<IdempotencyConfig>().max_results = max_results;
        self
    }

    /// Caps the bytes the completed idempotency results kept may weigh
    /// (default [`DEFAULT_MAX_IDEMPOTENCY_BYTES`],
    /// 256 MiB): past it the oldest are evicted first, as past
    /// [`with_max_idempotency_results`](Self::with_max_idempotency_results)
    /// (counted in [`IdempotencyStats::evictions`](crate::idempotency::IdempotencyStats),
    /// logged at warn at most once a minute), so large results cannot
    /// exhaust memory however few they are. A result weighs its key, its
    /// value's encoded size, as a shared store would keep it (MessagePack:
    /// the measure of a value's size that works for every type) and about 200 bytes for its entry; a result
    /// heavier than the whole budget is not kept (a retry runs again). What
    /// the results weigh now is [`IdempotencyStats::stored_bytes`](crate::idempotency::IdempotencyStats).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::Runtime;
    ///
    /// let runtime = Runtime::builder()
    ///     .with_max_idempotency_results(10_000)
    ///     .with_max_idempotency_bytes(64 << 20)
    ///     .start()
    ///     .await?;
    /// let idempotency = runtime.idempotency();
    /// let _ = idempotency.run("report:1", || async { Ok::<_, std::io::Error>(vec![0u8; 1000]) }).await?;
    /// assert!(idempotency.stats().stored_bytes > 1000);
    /// # Ok(()) }
    /// ```
    pub fn with_max_idempotency_bytes(mut self, max_bytes: usize) -> Self {
        self.settings.get_mut::<IdempotencyConfig>().max_bytes = max_bytes;
        self
    }

    /// Keeps idempotency claims and results in `store`, shared with every
    /// runtime given the same store: one execution per key across all of
    /// them (see [`IdempotencyStore`]). Callers on
    /// this runtime still join one local claim per key, so a key costs one
    /// claim round trip per runtime, not per caller. Results travel encoded
    /// (MessagePack, in the versioned envelope) with their type name. Without a shared store (the
    /// default) results stay in this runtime's own table as typed values.
    ///
    /// # Examples
    ///
    /// ```
    /// use throttlebeam::{idempotency::MemoryIdempotencyStore, Runtime};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// let shared = MemoryIdempotencyStore::new();
    /// let a = Runtime::builder().with_idempotency_store(shared.clone()).start().await?;
    /// let b = Runtime::builder().with_idempotency_store(shared).start().await?;
    /// let first = a.idempotency().run("pay:1", || async { Ok::<_, std::io::Error>(7u32) }).await?;
    /// let again = b.idempotency().run("pay:1", || async { Ok::<_, std::io::Error>(8u32) }).await?;
    /// assert!(first.is_fresh() && again.is_replay());
    /// assert_eq!(again.into_inner(), 7);
    /// # Ok(()) }
    /// ```
    pub fn with_idempotency_store(mut self, store: impl IdempotencyStore) -> Self {
        let config = self.settings.get_mut::<IdempotencyConfig>();
        config.store = Some(Arc::new(store));
        #[cfg(feature = "postgres")]
        {
            config.postgres = None;
        }
        self
    }

    /// Shares this runtime's idempotency keys with every other runtime using
    /// the same PostgreSQL table: one execution per key across all
    /// instances, results replayed from the table (see
    /// [`postgres`](crate::idempotency::postgres) for the table and the guarantees).
    /// While the database is unreachable idempotent calls fail with
    /// [`Error::StoreUnavailable`] (fail closed). The same as
    /// [`with_idempotency_store`](Self::with_idempotency_store) with the
    /// store; with Redis configured too, idempotency goes to PostgreSQL and
    /// the throttles and debounce to Redis.
    ///
    /// The default runtime picks PostgreSQL up from
    /// [`POSTGRES_URL_ENV`](crate::idempotency::postgres::POSTGRES_URL_ENV), connecting
    /// and migrating in the background.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use throttlebeam::Runtime;
    /// use throttlebeam::idempotency::postgres::PostgresStore;
    ///
    /// let store = PostgresStore::builder("postgres://app@127.0.0.1/app").connect().await?;
    /// store.migrate().await?;
    /// let runtime = Runtime::builder().with_postgres(store).start().await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn with_postgres(mut self, store: crate::idempotency::postgres::PostgresStore) -> Self {
        self.settings.get_mut::<IdempotencyConfig>().postgres = Some(store.clone());
        self.with_idempotency_store(store)
    }
}
