//! Orders of an epoch's samples: a shuffle keyed by (seed, epoch), held as
//! a list or computed per index ([`Permutation`]), the identity without
//! shuffling, and the smooth weighted round-robin of several parts. The
//! sampler and the mixture both draw through these.

use engine::rng::SplitMix64;

/// From this many samples on, an epoch's shuffled order is computed index by
/// index (a keyed permutation) instead of being held as a list: 8 bytes per
/// sample would otherwise grow with the data (32 MiB for a 1 GiB u16 token
/// file at T = 128). Below it the order is a Fisher–Yates shuffle, as it
/// always was, so small data sets keep their orders.
pub const LAZY_ORDER_FROM: usize = 1 << 20;

/// The sample order of one epoch.
#[derive(Debug, Clone)]
pub enum EpochOrder {
    /// A list (small data sets, or no shuffling below [`LAZY_ORDER_FROM`]).
    List(Vec<usize>),
    /// `0, 1, 2, …` (no shuffling, large data sets).
    Identity(usize),
    /// A keyed permutation of `0..n`, computed per index.
    Permuted(Permutation),
}

impl EpochOrder {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match self {
            EpochOrder::List(v) => v.len(),
            EpochOrder::Identity(n) => *n,
            EpochOrder::Permuted(p) => p.n,
        }
    }

    /// Whether the epoch has no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `i`-th sample of the epoch.
    pub fn get(&self, i: usize) -> usize {
        match self {
            EpochOrder::List(v) => v[i],
            EpochOrder::Identity(_) => i,
            EpochOrder::Permuted(p) => p.apply(i),
        }
    }
}

/// A bijection of `0..n` from a key: a 4-round balanced Feistel network on
/// the smallest even number of bits that holds `n`, walked until it lands
/// inside `0..n` (a Feistel network is a bijection of its domain, and
/// cycle-walking keeps one on the subset; the domain is < 4n, so a walk
/// takes under 4 rounds on average).
#[derive(Debug, Clone)]
pub struct Permutation {
    n: usize,
    half_bits: u32,
    keys: [u64; 4],
}

impl Permutation {
    /// The permutation of `0..n` keyed by `rng`.
    pub fn new(n: usize, rng: &mut SplitMix64) -> Self {
        let bits = usize::BITS - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        Self { n, half_bits, keys: [rng.next_u64(), rng.next_u64(), rng.next_u64(), rng.next_u64()] }
    }

    fn round(&self, x: u64, key: u64) -> u64 {
        // SplitMix64's finaliser: every input bit moves every output bit.
        let mut z = x ^ key;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Where index `i` (< n) goes.
    pub fn apply(&self, i: usize) -> usize {
        let mask = (1u64 << self.half_bits) - 1;
        let mut x = i as u64;
        loop {
            let (mut l, mut r) = (x >> self.half_bits, x & mask);
            for &k in &self.keys {
                (l, r) = (r, l ^ (self.round(r, k) & mask));
            }
            x = (l << self.half_bits) | r;
            if (x as usize) < self.n {
                return x as usize;
            }
        }
    }
}

/// The order of `epoch` over `n` samples: a permutation from (seed,
/// epoch), or the identity without shuffling; computed per index from
/// `lazy_from` samples on.
pub(crate) fn order_of(n: usize, shuffle: bool, seed: u64, epoch: u64, lazy_from: usize) -> EpochOrder {
    let mut rng = SplitMix64::derive(seed, &[0x5a3d, epoch]);
    if n >= lazy_from {
        return if shuffle { EpochOrder::Permuted(Permutation::new(n, &mut rng)) } else { EpochOrder::Identity(n) };
    }
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        rng.shuffle(&mut order);
    }
    EpochOrder::List(order)
}

/// Each of `sizes.len()` parts `sizes[i]` times, in a smooth weighted
/// round-robin: each slot goes to the part with the most credit (credit
/// grows by its size per slot and shrinks by the total when it is chosen;
/// ties to the lower index), so every prefix holds each part within one
/// slot of its share.
pub(crate) fn round_robin(sizes: &[usize]) -> Vec<usize> {
    let total: usize = sizes.iter().sum();
    let mut credit = vec![0i128; sizes.len()];
    let mut out = Vec::with_capacity(total);
    for _ in 0..total {
        for (c, &s) in credit.iter_mut().zip(sizes) {
            *c += s as i128;
        }
        let mut best = 0;
        for (i, &c) in credit.iter().enumerate() {
            if c > credit[best] {
                best = i;
            }
        }
        credit[best] -= total as i128;
        out.push(best);
    }
    out
}
