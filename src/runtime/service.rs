//! How a primitive plugs into a runtime: one small interface.
//!
//! The runtime knows no primitive. A primitive keeps its state in a type
//! implementing [`Service`]; the runtime creates one per runtime on first
//! use (a type map keyed by the service's type) or is handed one per
//! instance, and tells each about shutdown, restarts and stats. Expiring
//! maps register with the runtime's sweeper (the tree's) on their own, so
//! sweeping needs nothing here.

use std::any::{Any, TypeId};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock, Weak};

use tokio::time::Instant;

use super::ShutdownPolicy;
use crate::stats::Stats;

/// What [`Service::shutdown`] returns.
pub(crate) type ServiceFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// A primitive's state inside one runtime.
pub(crate) trait Service: Send + Sync + 'static {
    /// Shutdown began (calls are already refused): run or drop pending work
    /// as `policy` says. Must return by `deadline`; work per key must be
    /// constant and may carry on in the background past it.
    fn shutdown(&self, deadline: Instant, policy: ShutdownPolicy) -> ServiceFuture<'_> {
        let _ = (deadline, policy);
        Box::pin(std::future::ready(()))
    }

    /// The runtime's processes have ended or its deadline passed: release
    /// whatever is still tracked.
    fn stopped(&self) {}

    /// The runtime restarts after its root failed: forget in-memory state,
    /// failing whoever waits on it with a typed error.
    fn reset(&self) {}

    /// Adds this service's figures to `stats`.
    fn stats(&self, stats: &mut Stats) {
        let _ = stats;
    }
}

enum Entry {
    /// One per runtime, found by type.
    Owned {
        type_id: TypeId,
        any: Arc<dyn Any + Send + Sync>,
        service: Arc<dyn Service>,
    },
    /// Lives as long as its owner keeps it.
    Attached(Weak<dyn Service>),
}

/// The services of one runtime.
#[derive(Default)]
pub(super) struct Services {
    entries: RwLock<Vec<Entry>>,
}

impl Services {
    fn find<S: Service>(entries: &[Entry]) -> Option<Arc<S>> {
        entries.iter().find_map(|e| match e {
            Entry::Owned { type_id, any, .. } if *type_id == TypeId::of::<S>() => {
                Arc::clone(any).downcast::<S>().ok()
            }
            _ => None,
        })
    }

    /// The service of type `S`, made by `make` if there is none yet. `make`
    /// runs outside the lock; of two racing makers one wins.
    pub(super) fn get_or_insert<S: Service>(&self, make: impl FnOnce() -> S) -> Arc<S> {
        if let Some(found) =
            Self::find::<S>(&self.entries.read().unwrap_or_else(PoisonError::into_inner))
        {
            return found;
        }
        let made = Arc::new(make());
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = Self::find::<S>(&entries) {
            return found;
        }
        entries.push(Entry::Owned {
            type_id: TypeId::of::<S>(),
            any: Arc::clone(&made) as Arc<dyn Any + Send + Sync>,
            service: Arc::clone(&made) as Arc<dyn Service>,
        });
        made
    }

    pub(super) fn attach(&self, service: Weak<dyn Service>) {
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        entries.retain(|e| match e {
            Entry::Attached(weak) => weak.strong_count() > 0,
            Entry::Owned { .. } => true,
        });
        entries.push(Entry::Attached(service));
    }

    /// Every live service, in the order they joined.
    pub(super) fn all(&self) -> Vec<Arc<dyn Service>> {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(|e| match e {
                Entry::Owned { service, .. } => Some(Arc::clone(service)),
                Entry::Attached(weak) => weak.upgrade(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Default)]
    struct Counting(AtomicUsize);

    impl Service for Counting {
        fn reset(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Other;

    impl Service for Other {}

    #[test]
    fn one_service_per_type_made_once() {
        let services = Services::default();
        let made = AtomicUsize::new(0);
        let make = || {
            made.fetch_add(1, Ordering::SeqCst);
            Counting::default()
        };
        let first = services.get_or_insert(make);
        let again = services.get_or_insert(|| unreachable!("made once"));
        assert!(Arc::ptr_eq(&first, &again));
        let _other = services.get_or_insert(|| Other);
        assert_eq!(made.load(Ordering::SeqCst), 1);
        assert_eq!(services.all().len(), 2);
        for service in services.all() {
            service.reset();
        }
        assert_eq!(first.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn attached_services_are_forgotten_once_dropped() {
        let services = Services::default();
        let attached: Arc<dyn Service> = Arc::new(Counting::default());
        services.attach(Arc::downgrade(&attached));
        assert_eq!(services.all().len(), 1);
        drop(attached);
        assert_eq!(services.all().len(), 0);
        // Dead entries are pruned on the next attach.
        let kept: Arc<dyn Service> = Arc::new(Other);
        services.attach(Arc::downgrade(&kept));
        assert_eq!(services.entries.read().unwrap().len(), 1);
    }
}
