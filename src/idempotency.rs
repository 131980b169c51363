//! Idempotency: run an operation at most once per key.
//!
//! (Being implemented; see issue 2 item 6.)

use std::sync::Arc;

use throttlebeam_supervisors::{Counters, Sweeper};

pub(crate) struct State {}

impl State {
    pub(crate) fn new(_counters: Arc<Counters>, _cap: usize, _sweeper: &Sweeper) -> Self {
        Self {}
    }

    pub(crate) fn shutdown(&self) {}
}
