use std::time::Duration;

use throttlebeam::rate_limit::{LeakyBucket, ShaperReservation as Reservation};

use super::{Vector, allow, check, deny, forecast};

pub fn ten_per_second_queue_150() -> LeakyBucket {
    LeakyBucket::new(10, Duration::from_secs(1), Duration::from_millis(150)).expect("valid")
}

/// R6: reservations at one instant, as (time, cost, outcome). A cost above the two slots is an
/// error (see `R6_TOO_LARGE`).
pub const R6_RESERVATIONS: &[(u64, u32, Reservation)] = &[
    (0, 1, Reservation::Granted { delay_ms: 0 }),
    (0, 1, Reservation::Granted { delay_ms: 100 }),
    (0, 1, Reservation::QueueFull { retry_after_ms: 50 }),
    (50, 1, Reservation::Granted { delay_ms: 150 }),
    (
        50,
        1,
        Reservation::QueueFull {
            retry_after_ms: 100,
        },
    ),
];

/// R6: a reservation larger than the queue's slots can never be accepted: (time, cost,
/// capacity).
pub const R6_TOO_LARGE: (u64, u32, u64) = (50, 3, 2);

/// R6 with no queue: the shaper admits only what can start now.
pub const R6_NO_QUEUE: &[(u64, u32, Reservation)] = &[
    (0, 1, Reservation::Granted { delay_ms: 0 }),
    (
        0,
        1,
        Reservation::QueueFull {
            retry_after_ms: 100,
        },
    ),
    (100, 1, Reservation::Granted { delay_ms: 0 }),
];

/// The shaper as a plain strategy: allowed when the reservation would be accepted.
pub const R6_POLICING: Vector<LeakyBucket> = Vector {
    name: "leaky bucket as a strategy",
    strategy: ten_per_second_queue_150,
    steps: &[
        forecast(0, 1, 2, 0, 0),
        check(0, 1, allow(2, 1, 100)),
        check(0, 1, allow(2, 0, 200)),
        check(0, 1, deny(2, 0, 150, 50)),
        forecast(0, 1, 0, 50, 150),
        check(50, 1, allow(2, 0, 300)),
    ],
};

pub const ALL: [Vector<LeakyBucket>; 1] = [R6_POLICING];
