use std::time::Duration;

use throttlebeam::rate_limit::SlidingWindow;

use super::{Vector, allow, check, deny, forecast, insufficient, peek};

fn ten_per_second() -> SlidingWindow {
    SlidingWindow::new(10, Duration::from_secs(1)).expect("valid")
}

/// R5: the previous window counts by its overlap with the sliding one.
pub const R5: Vector<SlidingWindow> = Vector {
    name: "sliding window R5 10 per 1000",
    strategy: ten_per_second,
    steps: &[
        check(500, 10, allow(10, 0, 2_000)),
        // 10 in this window: one unit frees when 10 * (1000 - e') <= 9000 next window.
        check(999, 1, deny(10, 0, 2_000, 101)),
        check(1_000, 1, deny(10, 0, 2_000, 100)),
        check(1_100, 1, allow(10, 0, 3_000)),
        // 10 * 500 / 1000 + 1 = 6 counted: 4 left.
        peek(1_500, allow(10, 4, 3_000)),
        check(1_500, 5, deny(10, 4, 3_000, 100)),
        forecast(2_500, 1, 9, 3_000, 3_000),
        insufficient(2_500, 11, 10),
        check(2_500, 1, allow(10, 8, 4_000)),
        // Back to 1500: the later window's state stands, with the previous one at full
        // weight, so nothing comes back.
        check(1_500, 1, allow(10, 7, 4_000)),
        peek(5_000, allow(10, 10, 5_000)),
    ],
};

pub const ALL: [Vector<SlidingWindow>; 1] = [R5];
