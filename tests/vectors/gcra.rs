use std::num::NonZeroU32;
use std::time::Duration;

use throttlebeam::rate_limit::Gcra;

use super::{Vector, allow, check, deny, forecast, insufficient, peek, reset};

fn two_per_second() -> Gcra {
    Gcra::new(2, Duration::from_secs(1)).expect("valid")
}

fn hundred_per_minute_burst_five() -> Gcra {
    Gcra::new(100, Duration::from_secs(60))
        .expect("valid")
        .with_burst(NonZeroU32::new(5).expect("non-zero"))
}

/// R1: emission interval 500, burst 2.
pub const R1: Vector<Gcra> = Vector {
    name: "gcra R1 2 per 1000",
    strategy: two_per_second,
    steps: &[
        check(0, 1, allow(2, 1, 500)),
        check(0, 1, allow(2, 0, 1_000)),
        check(0, 1, deny(2, 0, 1_000, 500)),
        check(499, 1, deny(2, 0, 1_000, 1)),
        check(500, 1, allow(2, 0, 1_500)),
        check(500, 1, deny(2, 0, 1_500, 500)),
    ],
};

/// R2: interval 600, burst 5.
pub const R2: Vector<Gcra> = Vector {
    name: "gcra R2 100 per 60 s burst 5",
    strategy: hundred_per_minute_burst_five,
    steps: &[
        check(0, 1, allow(5, 4, 600)),
        check(0, 1, allow(5, 3, 1_200)),
        check(0, 1, allow(5, 2, 1_800)),
        check(0, 1, allow(5, 1, 2_400)),
        check(0, 1, allow(5, 0, 3_000)),
        check(0, 1, deny(5, 0, 3_000, 600)),
        check(599, 1, deny(5, 0, 3_000, 1)),
        check(600, 1, allow(5, 0, 3_600)),
    ],
};

/// R3: costs, a cost above the burst, and a clock that goes backwards.
pub const R3: Vector<Gcra> = Vector {
    name: "gcra R3 cost and backwards clock",
    strategy: two_per_second,
    steps: &[
        insufficient(0, 3, 2),
        check(1_000, 2, allow(2, 0, 2_000)),
        insufficient(1_000, 3, 2),
        // Back to 500: the TAT stays at 2000, so the wait grows instead of shrinking.
        peek(500, deny(2, 0, 2_000, 1_000)),
        check(500, 1, deny(2, 0, 2_000, 1_000)),
        check(1_500, 1, allow(2, 0, 2_500)),
    ],
};

/// R7: peek and forecast.
pub const R7: Vector<Gcra> = Vector {
    name: "gcra R7 peek and forecast",
    strategy: two_per_second,
    steps: &[
        peek(0, allow(2, 2, 0)),
        forecast(0, 1, 2, 0, 0),
        forecast(0, 2, 1, 0, 0),
        check(0, 1, allow(2, 1, 500)),
        peek(0, allow(2, 1, 500)),
        forecast(0, 1, 1, 500, 500),
        check(100, 1, allow(2, 0, 1_000)),
        forecast(100, 1, 0, 500, 1_000),
        peek(100, deny(2, 0, 1_000, 400)),
        forecast(500, 1, 1, 1_000, 1_000),
        forecast(1_000, 1, 2, 1_000, 1_000),
        // A reset forgets a spent key: full again at once.
        check(1_000, 2, allow(2, 0, 2_000)),
        reset(1_000),
        peek(1_000, allow(2, 2, 1_000)),
    ],
};

pub const ALL: [Vector<Gcra>; 6] = [R1, R2, R3, R7, HIGH_RATE, FRACTIONAL_RATE];

fn five_thousand_per_second() -> Gcra {
    Gcra::new(5_000, Duration::from_secs(1)).expect("valid")
}

/// R3: 5,000 per second keeps its rate (a 200 µs interval, 5 per millisecond).
pub const HIGH_RATE: Vector<Gcra> = Vector {
    name: "gcra 5000 per second",
    strategy: five_thousand_per_second,
    steps: &[
        check(0, 5_000, allow(5_000, 0, 1_000)),
        check(0, 1, deny(5_000, 0, 1_000, 1)),
        check(1, 5, allow(5_000, 0, 1_001)),
        check(1, 1, deny(5_000, 0, 1_001, 1)),
        // The eleventh unit frees at 3.2 ms, reported rounded up.
        forecast(3, 1, 10, 4, 1_001),
        check(3, 10, allow(5_000, 0, 1_003)),
        insufficient(3, 5_001, 5_000),
    ],
};

fn seven_hundred_thousand_per_second() -> Gcra {
    Gcra::new(700_000, Duration::from_secs(1)).expect("valid")
}

/// R3: an interval that is not a whole number of microseconds (1.428571 µs) stays exact:
/// 700 per millisecond, not 500 (2 µs) or 1,000 (1 µs).
pub const FRACTIONAL_RATE: Vector<Gcra> = Vector {
    name: "gcra 700000 per second",
    strategy: seven_hundred_thousand_per_second,
    steps: &[
        check(0, 700_000, allow(700_000, 0, 1_000)),
        check(1, 700, allow(700_000, 0, 1_001)),
        check(1, 1, deny(700_000, 0, 1_001, 1)),
        check(8, 4_900, allow(700_000, 0, 1_008)),
        check(8, 1, deny(700_000, 0, 1_008, 1)),
    ],
};
