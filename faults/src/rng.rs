//! A small seeded generator (splitmix64): every schedule of the harness comes from it, so a
//! seed replays the same plan.

/// splitmix64: fast, statistically decent, and trivially reproducible.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A generator of its own for `name` under `seed`: the plan of one fault kind does not
    /// depend on which other kinds run.
    pub(crate) fn derive(seed: u64, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let mut rng = Self(seed ^ h);
        rng.next_u64();
        rng
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        // 53 random bits as a fraction in [0, 1).
        #[allow(clippy::cast_precision_loss)]
        let x = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        x < p
    }

    /// An index below `n` (n > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        #[allow(clippy::cast_possible_truncation)]
        let i = (self.next_u64() % n.max(1) as u64) as usize;
        i
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn a_seed_replays_and_names_separate() {
        let a: Vec<u64> = (0..4).map(|_| Rng::derive(7, "oom").next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            Rng::derive(7, "oom").next_u64(),
            Rng::derive(7, "acl").next_u64()
        );
        let mut r = Rng::new(1);
        assert!((0..1000).all(|_| (3..=9).contains(&r.range(3, 9))));
    }
}
