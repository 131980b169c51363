//! Values striped over cache lines: each thread writes to the stripe it was given on its
//! first use, so threads counting at once on different cores do not bounce one line between
//! them. The one striping of the crate: the runtime's counters and gauges, a limiter's
//! counters and a coalescing throttle's sleepers all go through it.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Stripes of a [`Striped`]: enough that two threads rarely share one.
pub(crate) const STRIPES: usize = 8;

/// A value on cache lines of its own (128 bytes: two lines, as adjacent-line prefetching
/// pairs them), so writes to it never evict a neighbour.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

/// [`STRIPES`] values of `T`, each padded: a thread writes to its own ([`Striped::local`]);
/// a reader sums them all ([`Striped::iter`]).
pub(crate) struct Striped<T>([Padded<T>; STRIPES]);

impl<T: Default> Default for Striped<T> {
    fn default() -> Self {
        Self(std::array::from_fn(|_| Padded::default()))
    }
}

impl<T> Striped<T> {
    /// This thread's stripe.
    #[inline]
    pub(crate) fn local(&self) -> &T {
        &self.0[stripe()].0
    }

    /// Every stripe, for a reader that adds them up.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|p| &p.0)
    }
}

/// This thread's stripe index, below [`STRIPES`]: assigned round robin on the thread's first
/// use.
#[inline]
pub(crate) fn stripe() -> usize {
    // A `const` thread-local reads with one load (no lazy-initialisation state).
    thread_local! {
        static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    let index = INDEX.get();
    if index < STRIPES {
        return index;
    }
    let index = first_stripe();
    INDEX.set(index);
    index
}

/// The stripe of a thread that asks for the first time: round robin.
#[cold]
fn first_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    #[test]
    fn threads_count_into_their_own_stripes_and_a_reader_sees_the_sum() {
        let striped: Striped<AtomicU64> = Striped::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        striped.local().fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        let sum: u64 = striped.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        assert_eq!(sum, 4000);
        assert!(stripe() < STRIPES);
        assert_eq!(stripe(), stripe(), "a thread keeps its stripe");
        assert_eq!(std::mem::align_of::<Padded<u8>>(), 128);
    }
}
