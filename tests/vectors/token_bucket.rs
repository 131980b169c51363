use std::time::Duration;

use throttlebeam::rate_limit::TokenBucket;

use super::{Vector, allow, check, deny, forecast, insufficient, peek};

fn five_refilling_ten_per_second() -> TokenBucket {
    TokenBucket::new(5, 10, Duration::from_secs(1)).expect("valid")
}

/// R4: starts full; one token back every 100 ms.
pub const R4: Vector<TokenBucket> = Vector {
    name: "token bucket R4 capacity 5, 10/s",
    strategy: five_refilling_ten_per_second,
    steps: &[
        check(0, 1, allow(5, 4, 100)),
        check(0, 1, allow(5, 3, 200)),
        check(0, 1, allow(5, 2, 300)),
        check(0, 1, allow(5, 1, 400)),
        check(0, 1, allow(5, 0, 500)),
        check(0, 1, deny(5, 0, 500, 100)),
        // Denials never consume: the same answer again.
        check(0, 1, deny(5, 0, 500, 100)),
        check(50, 1, deny(5, 0, 500, 50)),
        check(100, 1, allow(5, 0, 600)),
        insufficient(100, 6, 5),
        // A long idle caps at capacity.
        peek(100_000, allow(5, 5, 100_000)),
        check(100_000, 1, allow(5, 4, 100_100)),
    ],
};

/// R3 and R7 for the bucket: costs, backwards time, forecasts.
pub const COST_AND_FORECAST: Vector<TokenBucket> = Vector {
    name: "token bucket cost, backwards clock, forecast",
    strategy: five_refilling_ten_per_second,
    steps: &[
        forecast(1_000, 2, 2, 1_000, 1_000),
        check(1_000, 3, allow(5, 2, 1_300)),
        forecast(1_000, 1, 2, 1_100, 1_300),
        forecast(1_050, 1, 2, 1_100, 1_300),
        // Back to 900: no refill until time passes 1000 again.
        check(900, 2, allow(5, 0, 1_500)),
        check(900, 1, deny(5, 0, 1_500, 200)),
        peek(1_100, allow(5, 1, 1_500)),
    ],
};

pub const ALL: [Vector<TokenBucket>; 2] = [R4, COST_AND_FORECAST];
