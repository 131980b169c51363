use std::time::Duration;

use throttlebeam::rate_limit::FixedWindow;

use super::{Vector, allow, check, deny, forecast, insufficient, peek};

fn three_per_second() -> FixedWindow {
    FixedWindow::new(3, Duration::from_secs(1)).expect("valid")
}

/// R5: windows aligned to the epoch, quota 3.
pub const R5: Vector<FixedWindow> = Vector {
    name: "fixed window R5 3 per 1000",
    strategy: three_per_second,
    steps: &[
        peek(100, allow(3, 3, 100)),
        check(100, 1, allow(3, 2, 1_000)),
        check(100, 1, allow(3, 1, 1_000)),
        forecast(100, 1, 1, 1_000, 1_000),
        check(100, 1, allow(3, 0, 1_000)),
        check(100, 1, deny(3, 0, 1_000, 900)),
        check(999, 1, deny(3, 0, 1_000, 1)),
        check(1_000, 1, allow(3, 2, 2_000)),
        insufficient(1_000, 4, 3),
        // Back into the earlier window: still counted against the later one.
        check(500, 2, allow(3, 0, 2_000)),
        check(500, 1, deny(3, 0, 2_000, 1_500)),
        forecast(1_500, 1, 0, 2_000, 2_000),
    ],
};

pub const ALL: [Vector<FixedWindow>; 1] = [R5];
