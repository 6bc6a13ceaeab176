//! BLAKE3 chaining values of several blocks at once. A decode step registers about one block in
//! `block_size` of its sequences, each a keyed hash of the block's tokens under its parent's
//! chaining value, so their compressions are independent. With 16-token blocks (one 64-byte
//! BLAKE3 block: one compression each) on x86-64 with AVX2, eight of them run on the lanes of
//! one set of vector registers, about 5x the throughput of one at a time (which is bound by
//! the compression's latency); elsewhere they go one at a time through the `blake3` crate.
//! Either way each result is exactly `blake3::keyed_hash(parent, tokens as little-endian
//! bytes)`, the chaining value [`crate::prefix`] publishes.

use crate::prefix::Chain;
use crate::Token;

/// Blocks hashed together.
pub(crate) const LANES: usize = 8;

/// Tokens of a block that is one BLAKE3 block (64 bytes).
pub(crate) const LANE_TOKENS: usize = 16;

/// Whether this CPU hashes [`LANES`] blocks together.
pub(crate) fn available() -> bool {
    crate::simd::has_avx2()
}

/// The keyed BLAKE3 hash of each of the first `n` blocks under its parent's chaining value
/// (on the lanes from two blocks on; a block alone goes one at a time).
pub(crate) fn chains(
    parents: &[Chain; LANES],
    blocks: &[[Token; LANE_TOKENS]; LANES],
    n: usize,
) -> [Chain; LANES] {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    if n > 1 && available() {
        #[allow(unsafe_code)]
        // SAFETY: the CPU has AVX2, the only target feature `avx2::chains` needs.
        return unsafe { avx2::chains(parents, blocks) };
    }
    std::array::from_fn(|i| {
        if i < n {
            one(&parents[i], &blocks[i])
        } else {
            [0; 32]
        }
    })
}

/// One block's chaining value, through the `blake3` crate.
fn one(parent: &Chain, block: &[Token; LANE_TOKENS]) -> Chain {
    let mut bytes = [0u8; 4 * LANE_TOKENS];
    for (dst, t) in bytes.chunks_exact_mut(4).zip(block) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    *blake3::keyed_hash(parent, &bytes).as_bytes()
}

/// The BLAKE3 compression function (see the BLAKE3 specification, section 2.2) on eight lanes:
/// vector `i` of the state holds word `i` of every lane's state.
#[cfg(all(target_arch = "x86_64", not(loom)))]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi32, _mm256_broadcastsi128_si256, _mm256_loadu_si256,
        _mm256_or_si256, _mm256_permute2x128_si256, _mm256_set1_epi32, _mm256_shuffle_epi8,
        _mm256_slli_epi32, _mm256_srli_epi32, _mm256_storeu_si256, _mm256_unpackhi_epi32,
        _mm256_unpackhi_epi64, _mm256_unpacklo_epi32, _mm256_unpacklo_epi64, _mm256_xor_si256,
        _mm_setr_epi8,
    };

    use super::{Chain, Token, LANES, LANE_TOKENS};

    type Lanes = __m256i;

    const IV: [u32; 8] = [
        0x6A09_E667,
        0xBB67_AE85,
        0x3C6E_F372,
        0xA54F_F53A,
        0x510E_527F,
        0x9B05_688C,
        0x1F83_D9AB,
        0x5BE0_CD19,
    ];

    /// The flags of a keyed hash's only block: CHUNK_START | CHUNK_END | ROOT | KEYED_HASH.
    const FLAGS: u32 = 1 | 2 | 8 | 16;

    /// The message word each round reads in each position: the identity, then the spec's
    /// permutation applied once more each round.
    const SCHEDULE: [[usize; 16]; 7] = {
        const PERMUTATION: [usize; 16] = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];
        let mut schedule = [[0; 16]; 7];
        let mut i = 0;
        while i < 16 {
            schedule[0][i] = i;
            i += 1;
        }
        let mut round = 1;
        while round < 7 {
            let mut i = 0;
            while i < 16 {
                schedule[round][i] = schedule[round - 1][PERMUTATION[i]];
                i += 1;
            }
            round += 1;
        }
        schedule
    };

    /// The eight blocks' chaining values.
    #[target_feature(enable = "avx2")]
    pub(super) fn chains(
        parents: &[Chain; LANES],
        blocks: &[[Token; LANE_TOKENS]; LANES],
    ) -> [Chain; LANES] {
        // Lane-major rows in, word-major vectors out: word `w` of every lane in vector `w`.
        let keys = transpose(std::array::from_fn(|lane| load(&parents[lane])));
        let low = transpose(std::array::from_fn(|lane| load(&blocks[lane][..8])));
        let high = transpose(std::array::from_fn(|lane| load(&blocks[lane][8..])));
        let message: [Lanes; 16] =
            std::array::from_fn(|w| if w < 8 { low[w] } else { high[w - 8] });
        let mut state: [Lanes; 16] = std::array::from_fn(|i| match i {
            0..8 => keys[i],
            8..12 => splat(IV[i - 8]),
            14 => splat(4 * LANE_TOKENS as u32), // the block's length in bytes
            15 => splat(FLAGS),
            _ => splat(0), // the counter: the first chunk
        });
        // Unrolled, so that every round's message schedule is constant.
        round::<0>(&mut state, &message);
        round::<1>(&mut state, &message);
        round::<2>(&mut state, &message);
        round::<3>(&mut state, &message);
        round::<4>(&mut state, &message);
        round::<5>(&mut state, &message);
        round::<6>(&mut state, &message);
        let words = std::array::from_fn(|w| _mm256_xor_si256(state[w], state[w + 8]));
        let mut out = [[0u8; 32]; LANES];
        for (chain, lane) in out.iter_mut().zip(transpose(words)) {
            store(chain, lane);
        }
        out
    }

    /// 32 bytes (eight little-endian words) as one vector.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn load<T>(bytes: &[T]) -> Lanes {
        assert_eq!(size_of_val(bytes), 32, "a vector's bytes");
        #[allow(unsafe_code)]
        // SAFETY: reads the 32 bytes of `bytes` (checked above); the load may be unaligned.
        unsafe {
            _mm256_loadu_si256(bytes.as_ptr().cast())
        }
    }

    /// Writes a vector's eight words into `chain`, little-endian.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn store(chain: &mut Chain, words: Lanes) {
        #[allow(unsafe_code)]
        // SAFETY: writes the 32 bytes of `chain`; the store may be unaligned.
        unsafe {
            _mm256_storeu_si256(chain.as_mut_ptr().cast(), words)
        }
    }

    /// The 8x8 matrix of words whose rows are `r`, transposed: word `j` of row `i` becomes
    /// word `i` of row `j`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn transpose(r: [Lanes; 8]) -> [Lanes; 8] {
        // Words (0, 1) and (2, 3) of each half of two rows, interleaved...
        let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
        let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
        let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
        let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
        let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
        let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
        // ... then word k and word k + 4 of four rows ...
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let u4 = _mm256_unpacklo_epi64(t4, t6);
        let u5 = _mm256_unpackhi_epi64(t4, t6);
        let u6 = _mm256_unpacklo_epi64(t5, t7);
        let u7 = _mm256_unpackhi_epi64(t5, t7);
        // ... and word k of all eight rows.
        [
            _mm256_permute2x128_si256::<0x20>(u0, u4),
            _mm256_permute2x128_si256::<0x20>(u1, u5),
            _mm256_permute2x128_si256::<0x20>(u2, u6),
            _mm256_permute2x128_si256::<0x20>(u3, u7),
            _mm256_permute2x128_si256::<0x31>(u0, u4),
            _mm256_permute2x128_si256::<0x31>(u1, u5),
            _mm256_permute2x128_si256::<0x31>(u2, u6),
            _mm256_permute2x128_si256::<0x31>(u3, u7),
        ]
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn splat(value: u32) -> Lanes {
        _mm256_set1_epi32(value as i32)
    }

    /// Round `R`: the G function on the columns, then on the diagonals.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn round<const R: usize>(s: &mut [Lanes; 16], m: &[Lanes; 16]) {
        let w = |i: usize| m[SCHEDULE[R][i]];
        g(s, [0, 4, 8, 12], w(0), w(1));
        g(s, [1, 5, 9, 13], w(2), w(3));
        g(s, [2, 6, 10, 14], w(4), w(5));
        g(s, [3, 7, 11, 15], w(6), w(7));
        g(s, [0, 5, 10, 15], w(8), w(9));
        g(s, [1, 6, 11, 12], w(10), w(11));
        g(s, [2, 7, 8, 13], w(12), w(13));
        g(s, [3, 4, 9, 14], w(14), w(15));
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn g(s: &mut [Lanes; 16], [a, b, c, d]: [usize; 4], x: Lanes, y: Lanes) {
        s[a] = _mm256_add_epi32(_mm256_add_epi32(s[a], s[b]), x);
        s[d] = rotate_bytes(_mm256_xor_si256(s[d], s[a]), ROTATE_16);
        s[c] = _mm256_add_epi32(s[c], s[d]);
        s[b] = rotate::<12, 20>(_mm256_xor_si256(s[b], s[c]));
        s[a] = _mm256_add_epi32(_mm256_add_epi32(s[a], s[b]), y);
        s[d] = rotate_bytes(_mm256_xor_si256(s[d], s[a]), ROTATE_8);
        s[c] = _mm256_add_epi32(s[c], s[d]);
        s[b] = rotate::<7, 25>(_mm256_xor_si256(s[b], s[c]));
    }

    /// Each 32-bit word rotated right by `R` bits (`L = 32 - R`).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn rotate<const R: i32, const L: i32>(x: Lanes) -> Lanes {
        _mm256_or_si256(_mm256_srli_epi32::<R>(x), _mm256_slli_epi32::<L>(x))
    }

    /// Each word rotated right by 16 bits: a byte shuffle.
    const ROTATE_16: [i8; 16] = [2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13];

    /// Each word rotated right by 8 bits: a byte shuffle.
    const ROTATE_8: [i8; 16] = [1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12];

    /// Each word rotated by whole bytes: the bytes of each 16-byte half taken in `order`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn rotate_bytes(x: Lanes, order: [i8; 16]) -> Lanes {
        let o = order;
        let half = _mm_setr_epi8(
            o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10], o[11], o[12], o[13],
            o[14], o[15],
        );
        _mm256_shuffle_epi8(x, _mm256_broadcastsi128_si256(half))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Deterministic pseudo-random bytes.
    fn noise(seed: u64) -> impl Iterator<Item = u64> {
        let mut x = seed;
        std::iter::repeat_with(move || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z ^ (z >> 27)
        })
    }

    /// Every lane, for any number of blocks, equals the `blake3` crate's keyed hash.
    #[test]
    fn lanes_hash_as_blake3_does() {
        let mut rng = noise(7);
        for n in 0..=LANES {
            let parents: [Chain; LANES] =
                std::array::from_fn(|_| std::array::from_fn(|_| rng.next().unwrap() as u8));
            let blocks: [[Token; LANE_TOKENS]; LANES] =
                std::array::from_fn(|_| std::array::from_fn(|_| rng.next().unwrap() as Token));
            let got = chains(&parents, &blocks, n);
            for i in 0..n {
                assert_eq!(got[i], one(&parents[i], &blocks[i]), "{n} blocks, lane {i}");
            }
        }
        // Extreme words: all zero, all ones.
        let got = chains(&[[0; 32]; LANES], &[[u32::MAX; LANE_TOKENS]; LANES], LANES);
        assert_eq!(got[3], one(&[0; 32], &[u32::MAX; LANE_TOKENS]));
    }
}
