//! The primitives' own settings, which a runtime carries for them without
//! knowing them: each primitive defines its setting type, changes it through
//! the builder and reads it back from the runtime.

use std::any::Any;
use std::sync::Arc;

use crate::error::Error;

/// A primitive's setting, checked when the runtime starts.
pub(crate) trait Setting: Any + Send + Sync {
    /// Whether the setting can work.
    fn check(&self) -> Result<(), Error>;
}

/// The settings of one runtime, one per type.
#[derive(Clone, Default)]
pub(crate) struct Settings(Vec<Arc<dyn Setting>>);

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Settings({})", self.0.len())
    }
}

impl Settings {
    /// The setting of type `T`, if one was given.
    pub(crate) fn get<T: Setting>(&self) -> Option<&T> {
        self.0
            .iter()
            .find_map(|s| (&**s as &dyn Any).downcast_ref::<T>())
    }

    /// The setting of type `T` to change, its default first.
    pub(crate) fn get_mut<T: Setting + Clone + Default>(&mut self) -> &mut T {
        let at = match self
            .0
            .iter()
            .position(|s| (&**s as &dyn Any).downcast_ref::<T>().is_some())
        {
            Some(at) => at,
            None => {
                self.0.push(Arc::new(T::default()));
                self.0.len() - 1
            }
        };
        let arc = &mut self.0[at];
        if Arc::get_mut(arc).is_none() {
            let copy: T = (&**arc as &dyn Any)
                .downcast_ref::<T>()
                .cloned()
                .unwrap_or_default();
            *arc = Arc::new(copy);
        }
        let only = Arc::get_mut(arc).expect("a setting just made unique");
        (only as &mut dyn Any)
            .downcast_mut::<T>()
            .expect("the setting of this type")
    }

    /// Checks every setting.
    pub(crate) fn check(&self) -> Result<(), Error> {
        self.0.iter().try_for_each(|s| s.check())
    }
}
