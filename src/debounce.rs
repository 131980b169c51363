//! Debounce: run once a key has been quiet for a delay.

use std::sync::Arc;

use throttlebeam_supervisors::Counters;

use crate::runtime::ShutdownPolicy;

pub(crate) struct State {}

impl State {
    pub(crate) fn new(_counters: Arc<Counters>, _cap: usize) -> Self {
        Self {}
    }

    pub(crate) fn shutdown(&self, _policy: ShutdownPolicy) {}
}
