//! Packed frozen matrices: every format's values against a reference, the
//! row operations, the size accounting, and the two panel GEMMs against
//! `gemm_into` on the dequantised matrix.

mod common;
use common::*;
use linalg::packed::{decode, nf4};
use linalg::{gemm_dy_w, gemm_into, gemm_x_wt, GemmDims, GemmOut, PackError, PackFormat, PackedMatrix, Par, Strided};
use std::ops::Range;

fn h(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

fn raw(rows: usize, cols: usize, format: PackFormat, bytes: Vec<u8>) -> Vec<f32> {
    PackedMatrix::from_raw(rows, cols, format, bytes).unwrap().dequantize()
}

/// Values with a spread of magnitudes per block (a few large ones), as
/// trained weights have.
fn weights(len: usize, seed: u32) -> Vec<f32> {
    data(len, seed).iter().enumerate().map(|(i, v)| if i % 37 == 5 { v * 4.0 } else { v * 0.05 }).collect()
}

/// bitsandbytes' NF4 table (QLoRA Appendix E) as printed, in f64.
const NF4_TABLE: [f64; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236328,
    1.0,
];

/// One NF4 block at absmax 1 whose 64 codes run 0..15 four times: the
/// dequantised values are exactly the table (rounded to f32).
#[test]
fn nf4_codes_at_absmax_one_are_the_table() {
    let mut b = 1.0f32.to_le_bytes().to_vec();
    // byte j: value j (low nibble) and value j + 32 (high nibble), both j % 16.
    b.extend((0..32u8).map(|j| ((j % 16) << 4) | (j % 16)));
    let x = raw(1, 64, PackFormat::Nf4 { double_quant: false }, b);
    for (i, v) in x.iter().enumerate() {
        assert_eq!(*v, NF4_TABLE[i % 16] as f32, "value {i}");
    }
    assert_eq!(nf4::CODE.map(f64::from).map(|c| c as f32), NF4_TABLE.map(|c| c as f32));
    // Quantising the table itself (absmax 1) gives it back.
    let table: Vec<f32> = (0..64).map(|i| NF4_TABLE[i % 16] as f32).collect();
    let q = PackedMatrix::quantize(1, 64, &table, PackFormat::Nf4 { double_quant: false }).unwrap();
    assert_eq!(bits(&q.dequantize()), bits(&table));
}

/// The NF4 code and absmax of element `i` of an unquantised-absmax matrix,
/// read from its bytes.
fn nf4_parts(m: &PackedMatrix, i: usize) -> (usize, f32) {
    let row_bytes = m.format().row_bytes(m.cols()) as usize;
    let (r, c) = (i / m.cols(), i % m.cols());
    let blk = &m.bytes()[r * row_bytes + c / 64 * 36..][..36];
    let absmax = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
    let (j, hi) = (c % 64 % 32, c % 64 >= 32);
    let byte = blk[4 + j];
    (usize::from(if hi { byte >> 4 } else { byte & 15 }), absmax)
}

/// Half the widest gap between adjacent codes (between −1 and the next).
fn nf4_half_gap() -> f32 {
    nf4::CODE.windows(2).map(|w| w[1] - w[0]).fold(0.0, f32::max) / 2.0
}

/// Every dequantised value is `CODE[q] · absmax` of its stored code and
/// block absmax; the code is the nearest one, so the error is at most half
/// the widest code gap times the absmax; the absmax is the block's largest
/// magnitude.
#[test]
fn nf4_values_are_code_times_absmax() {
    let (rows, cols) = (5, 192);
    let v = weights(rows * cols, 3);
    let m = PackedMatrix::quantize(rows, cols, &v, PackFormat::Nf4 { double_quant: false }).unwrap();
    let x = m.dequantize();
    let gap = nf4_half_gap();
    for i in 0..v.len() {
        let (q, absmax) = nf4_parts(&m, i);
        assert_eq!(x[i].to_bits(), (nf4::CODE[q] * absmax).to_bits(), "element {i}");
        let blk = &v[i / 64 * 64..][..64];
        assert_eq!(absmax, blk.iter().fold(0.0f32, |a, b| a.max(b.abs())));
        assert!((x[i] - v[i]).abs() <= gap * absmax * (1.0 + 1e-6), "element {i}: {} vs {}", x[i], v[i]);
        // Nearest code: no other code is closer (to the normalised value).
        let xn = v[i] * (1.0 / absmax);
        let best = nf4::CODE.iter().map(|c| (c - xn).abs()).fold(f32::INFINITY, f32::min);
        assert!((nf4::CODE[q] - xn).abs() <= best + 1e-6, "element {i}: code {q} for {xn}");
    }
}

/// Double quantisation: the absmax of each block is `mean + scale·q` of its
/// row group, within `scale / 2` (the int8 rounding) plus one f32 rounding
/// of the true absmax, so each value is within `half gap · absmax +
/// |absmax − absmax'|` of the input (`|code| ≤ 1`). Groups of 256 blocks are
/// exercised with a 300-block row.
#[test]
fn nf4_double_quant_error_is_bounded() {
    for (rows, cols) in [(3, 576), (2, 300 * 64)] {
        let v = weights(rows * cols, 11);
        let dq = PackedMatrix::quantize(rows, cols, &v, PackFormat::Nf4 { double_quant: true }).unwrap();
        let plain = PackedMatrix::quantize(rows, cols, &v, PackFormat::Nf4 { double_quant: false }).unwrap();
        assert_eq!(dq.stored_bytes() as u128, PackFormat::Nf4 { double_quant: true }.bytes_for(rows, cols));
        assert!(dq.stored_bytes() < plain.stored_bytes());
        let x = dq.dequantize();
        let gap = nf4_half_gap();
        let blocks = cols / 64;
        let row_bytes = dq.format().row_bytes(cols) as usize;
        for r in 0..rows {
            let row = &dq.bytes()[r * row_bytes..][..row_bytes];
            for b in 0..blocks {
                let g = &row[b / 256 * 8..];
                let scale = f32::from_le_bytes([g[4], g[5], g[6], g[7]]);
                let idx = r * cols + b * 64;
                let (q, absmax) = nf4_parts(&plain, idx);
                let _ = q;
                let absmax_dq = nf4::dq_absmax(row, blocks, b);
                let err_absmax = (absmax_dq - absmax).abs();
                assert!(err_absmax <= scale / 2.0 + absmax * 2.0 * f32::EPSILON, "row {r} block {b}");
                for i in idx..idx + 64 {
                    // Same codes as without double quantisation, new absmax.
                    let (q, _) = nf4_parts(&plain, i);
                    assert_eq!(x[i].to_bits(), (nf4::CODE[q] * absmax_dq).to_bits(), "element {i}");
                    let bound = gap * absmax + err_absmax;
                    assert!((x[i] - v[i]).abs() <= bound * (1.0 + 1e-5), "element {i}: {} vs {}", x[i], v[i]);
                }
            }
        }
    }
    // Bytes: 4 + 1/8 + 1/(2·cols) bits per value (4.127 at cols ≥ 16384 in the paper).
    let f = PackFormat::Nf4 { double_quant: true };
    assert_eq!(f.bytes_for(1, 16384), 8192 + 256 + 8);
    assert_eq!(PackFormat::Nf4 { double_quant: false }.bytes_for(1, 16384), 8192 + 1024);
}

/// Q4_0, one block by hand: d = 0.5, byte j = (hi = 15 − j) << 4 | (lo = j),
/// so value j = 0.5·(j − 8) and value 16 + j = 0.5·(7 − j).
#[test]
fn q4_0_by_hand() {
    let mut b = h(0.5).to_vec();
    b.extend((0..16u8).map(|j| (15 - j) << 4 | j));
    let x = raw(1, 32, PackFormat::Q4_0, b);
    for j in 0..16 {
        assert_eq!(x[j], 0.5 * (j as f32 - 8.0));
        assert_eq!(x[16 + j], 0.5 * (7.0 - j as f32));
    }
}

/// Q4_1, two blocks in a row: d = 0.25, m = −1 then d = 2, m = 0.5.
#[test]
fn q4_1_by_hand() {
    let mut b = Vec::new();
    for (d, m) in [(0.25f32, -1.0f32), (2.0, 0.5)] {
        b.extend(h(d));
        b.extend(h(m));
        b.extend((0..16u8).map(|j| 3 << 4 | j));
    }
    let x = raw(1, 64, PackFormat::Q4_1, b);
    for j in 0..16 {
        assert_eq!(x[j], 0.25 * j as f32 - 1.0);
        assert_eq!(x[16 + j], -0.25);
        assert_eq!(x[32 + j], 2.0 * j as f32 + 0.5);
        assert_eq!(x[48 + j], 6.5);
    }
}

/// Q8_0: d = 0.125, signed bytes; and a scale f16 cannot hold exactly is
/// widened before multiplying (0.1 → 0.0999755859375).
#[test]
fn q8_0_by_hand() {
    let mut b = h(0.125).to_vec();
    b.extend((0..32).map(|j| (j as i8 - 16) as u8));
    b.extend(h(0.1));
    b.extend([3u8; 32]);
    let x = raw(1, 64, PackFormat::Q8_0, b);
    for j in 0..32 {
        assert_eq!(x[j], 0.125 * (j as f32 - 16.0));
        assert_eq!(f64::from(x[32 + j]), 0.099_975_585_937_5 * 3.0);
    }
}

/// bf16 and f16: rounding to nearest even as `half` does, decoding exact.
#[test]
fn sixteen_bit_formats_match_half() {
    let mut v = weights(256, 5);
    v.extend([0.0, -0.0, 1.0, 65504.0, 1e-7, -3.0e38, f32::INFINITY, f32::NEG_INFINITY]);
    v.extend([1.0 + f32::EPSILON, 1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8)]);
    v.resize(272, 0.5);
    let b = PackedMatrix::quantize(2, 136, &v, PackFormat::Bf16).unwrap().dequantize();
    let f = PackedMatrix::quantize(2, 136, &v, PackFormat::F16).unwrap().dequantize();
    for i in 0..v.len() {
        assert_eq!(b[i].to_bits(), half::bf16::from_f32(v[i]).to_f32().to_bits(), "bf16 {}", v[i]);
        assert_eq!(f[i].to_bits(), half::f16::from_f32(v[i]).to_f32().to_bits(), "f16 {}", v[i]);
    }
    // Known values: ties to even in bf16 (1 + 2⁻⁸ → 1, 1 + 3·2⁻⁸ → 1 + 2⁻⁶).
    assert_eq!(b[265], 1.0);
    assert_eq!(b[266], 1.015625);
    assert_eq!(decode::f16_to_f32(0x3C00), 1.0);
    assert_eq!(decode::f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(decode::bf16_to_f32(0xC2F7), -123.5);
}

/// ggml's quantisers: the error of each value is at most half a step of
/// its block (Q8_0 and Q4_1) or a step (Q4_0, whose step is set by the
/// signed extreme), and a block of multiples of an f16-exact step round
/// trips exactly through Q8_0.
#[test]
fn ggml_quantisers_are_within_a_step() {
    let v = weights(4 * 96, 9);
    for (format, steps) in [(PackFormat::Q8_0, 0.5f32), (PackFormat::Q4_0, 1.0), (PackFormat::Q4_1, 0.5)] {
        let x = PackedMatrix::quantize(4, 96, &v, format).unwrap().dequantize();
        for (b, (xs, vs)) in x.chunks(32).zip(v.chunks(32)).enumerate() {
            let (lo, hi) = vs.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            let amax = lo.abs().max(hi.abs());
            let step = match format {
                PackFormat::Q8_0 => amax / 127.0,
                PackFormat::Q4_0 => amax / 8.0,
                _ => (hi - lo) / 15.0,
            };
            for (x, v) in xs.iter().zip(vs) {
                // The f16 rounding of the scale adds at most 2⁻¹¹ relative per step count.
                let bound = step * steps + amax * 2.0 * 2f32.powi(-11) + 1e-7;
                assert!((x - v).abs() <= bound, "{format} block {b}: {x} vs {v} (bound {bound})");
            }
        }
    }
    // amax = 127 · 0.125, so d = 0.125 exactly and every q·d is a value.
    let exact: Vec<f32> = (0..32).map(|j| if j == 31 { 127.0 } else { j as f32 * 3.0 - 50.0 } * 0.125).collect();
    let x = PackedMatrix::quantize(1, 32, &exact, PackFormat::Q8_0).unwrap().dequantize();
    assert_eq!(bits(&x), bits(&exact));
}

fn shared_across_threads<T: Send + Sync>() {}

/// Sizes: `bytes_for` is what is stored, per format; shape errors are named.
#[test]
fn sizes_and_errors() {
    shared_across_threads::<PackedMatrix>();
    for format in PackFormat::ALL {
        for (rows, cols) in [(3, 64), (7, 576), (1, 1536)] {
            let m = PackedMatrix::quantize(rows, cols, &weights(rows * cols, 1), format).unwrap();
            assert_eq!(m.stored_bytes() as u128, format.bytes_for(rows, cols), "{format} {rows}×{cols}");
            assert_eq!((m.rows(), m.cols(), m.format()), (rows, cols, format));
        }
        assert_eq!(PackFormat::from_name(format.name()), Some(format));
    }
    assert_eq!(PackFormat::Q4_1.bytes_for(576, 576), 576 * 18 * 20);
    assert_eq!(PackFormat::Bf16.bytes_for(3, 5), 30);
    assert!(matches!(
        PackedMatrix::quantize(1, 48, &[0.0; 48], PackFormat::Nf4 { double_quant: false }),
        Err(PackError::NotBlockMultiple { block: 64, cols: 48, .. })
    ));
    assert!(matches!(
        PackedMatrix::quantize(2, 32, &[0.0; 63], PackFormat::Q8_0),
        Err(PackError::LengthMismatch { expected: 64, got: 63, .. })
    ));
    let mut nan = vec![0.0; 64];
    nan[9] = f32::NAN;
    assert!(matches!(
        PackedMatrix::quantize(1, 64, &nan, PackFormat::Nf4 { double_quant: true }),
        Err(PackError::NonFinite { index: 9, .. })
    ));
    assert!(PackedMatrix::quantize(1, 64, &nan, PackFormat::Bf16).is_ok(), "16-bit formats keep NaN");
    let e = PackedMatrix::from_raw(2, 32, PackFormat::Q4_1, vec![0; 39]).unwrap_err();
    assert!(matches!(e, PackError::LengthMismatch { expected: 40, got: 39, .. }), "{e}");
    assert!(PackedMatrix::from_raw(2, 32, PackFormat::Q4_1, vec![0; 41]).is_err());
    assert!(PackedMatrix::from_raw(2, 32, PackFormat::Q4_1, vec![0; 40]).is_ok());
    assert!(matches!(
        PackedMatrix::from_raw(1, 30, PackFormat::Q4_0, vec![0; 18]),
        Err(PackError::NotBlockMultiple { .. })
    ));
}

/// Stacking and reordering rows move whole rows, any format.
#[test]
fn concat_and_permute_rows() {
    for format in PackFormat::ALL {
        let cols = 128;
        let parts: Vec<PackedMatrix> = [2, 3, 1]
            .iter()
            .enumerate()
            .map(|(s, &r)| PackedMatrix::quantize(r, cols, &weights(r * cols, s as u32 + 20), format).unwrap())
            .collect();
        let whole: Vec<f32> = parts.iter().flat_map(|p| p.dequantize()).collect();
        let stacked = PackedMatrix::concat_rows(parts.clone()).unwrap();
        assert_eq!(stacked.rows(), 6);
        assert_eq!(bits(&stacked.dequantize()), bits(&whole), "{format}");
        let order = [3, 0, 5, 1, 4, 2];
        let p = stacked.permute_rows(&order).unwrap();
        let got = p.dequantize();
        for (i, &r) in order.iter().enumerate() {
            assert_eq!(bits(&got[i * cols..][..cols]), bits(&whole[r * cols..][..cols]), "{format} row {i}");
        }
        let mut rows = vec![0.0; 2 * cols];
        p.dequantize_rows(2..4, &mut rows);
        assert_eq!(bits(&rows), bits(&got[2 * cols..4 * cols]));
        assert!(matches!(stacked.permute_rows(&[0, 1, 2, 3, 4, 4]), Err(PackError::NotAPermutation { .. })));
        assert!(matches!(stacked.permute_rows(&[0, 1, 2]), Err(PackError::NotAPermutation { .. })));
        assert!(stacked.permute_rows(&[0, 1, 2, 3, 4, 6]).is_err());
    }
    let a = PackedMatrix::quantize(1, 64, &[0.5; 64], PackFormat::Q8_0).unwrap();
    let b = PackedMatrix::quantize(1, 64, &[0.5; 64], PackFormat::Q4_0).unwrap();
    let c = PackedMatrix::quantize(1, 32, &[0.5; 32], PackFormat::Q8_0).unwrap();
    assert!(matches!(PackedMatrix::concat_rows(vec![a.clone(), b]), Err(PackError::Mismatch { .. })));
    assert!(matches!(PackedMatrix::concat_rows(vec![a, c]), Err(PackError::Mismatch { .. })));
    assert!(matches!(PackedMatrix::concat_rows(vec![]), Err(PackError::Empty)));
}

/// A column block of a row range equals that block of the whole matrix.
#[test]
fn dequantize_block_is_a_window() {
    for format in PackFormat::ALL {
        let (rows, cols) = (4, 320);
        let m = PackedMatrix::quantize(rows, cols, &weights(rows * cols, 4), format).unwrap();
        let whole = m.dequantize();
        let c = 64..256;
        let mut out = vec![0.0; 2 * c.len()];
        m.dequantize_block(1..3, c.clone(), &mut out);
        for r in 0..2 {
            assert_eq!(bits(&out[r * c.len()..][..c.len()]), bits(&whole[(r + 1) * cols + c.start..][..c.len()]));
        }
    }
}

/// `gemm_into` on the dequantised rows `w_rows` (the reference).
#[allow(clippy::too_many_arguments)]
fn reference(
    n: usize,
    x: &[f32],
    deq: &[f32],
    cols: usize,
    w_rows: Range<usize>,
    forward: bool,
    o: GemmOut,
    dst: &mut [f32],
    alpha: f32,
    par: Par,
) {
    let out = w_rows.len();
    let w = &deq[w_rows.start * cols..w_rows.end * cols];
    if forward {
        gemm_into(
            GemmDims { m: n, n: out, k: cols },
            dst,
            o,
            Strided::rows(x, cols),
            Strided::transposed(w, cols),
            alpha,
            par,
        );
    } else {
        gemm_into(
            GemmDims { m: n, n: cols, k: out },
            dst,
            o,
            Strided::rows(x, out),
            Strided::rows(w, cols),
            alpha,
            par,
        );
    }
}

/// Both panel GEMMs give the bits of `gemm_into` on the dequantised matrix,
/// on one thread and on pools of 1, 2 and 3 threads, overwriting and
/// accumulating with a scale, on whole matrices and sub-ranges of rows, for
/// odd shapes (n = 1, 3, 130; sides that are not multiples of 128, and
/// sides above 128 that split into several panels).
#[test]
fn panel_gemms_match_gemm_into_bit_for_bit() {
    let shapes = [(200usize, 192usize), (96, 320), (448, 576), (130, 64), (384, 1536)];
    for format in PackFormat::ALL {
        for &(rows, cols) in &shapes {
            if !cols.is_multiple_of(format.block()) {
                continue;
            }
            let m = PackedMatrix::quantize(rows, cols, &weights(rows * cols, rows as u32), format).unwrap();
            let deq = m.dequantize();
            for n in [1usize, 3, 130] {
                for w_rows in [0..rows, 16..rows - 16] {
                    for forward in [true, false] {
                        let (xin, width) = if forward { (cols, w_rows.len()) } else { (w_rows.len(), cols) };
                        let x = data(n * xin, 7);
                        // Destination with a wider row stride and an offset.
                        let o = GemmOut { offset: 3, rs: width + 5, accumulate: false };
                        let init = data(3 + n * (width + 5), 8);
                        for (alpha, accumulate) in [(1.0f32, false), (0.75, true)] {
                            let o = GemmOut { accumulate, ..o };
                            for threads in [0usize, 1, 2, 3] {
                                let run = |f: &(dyn Fn(&mut [f32], Par) + Sync)| {
                                    let mut d = init.clone();
                                    if threads == 0 {
                                        f(&mut d, Par::ONE);
                                    } else {
                                        pool(threads).install(|| f(&mut d, Par { pool: true, ..Par::ONE }));
                                    }
                                    d
                                };
                                let want = run(&|d, par| {
                                    reference(n, &x, &deq, cols, w_rows.clone(), forward, o, d, alpha, par)
                                });
                                let got = run(&|d, par| {
                                    if forward {
                                        gemm_x_wt(n, d, o, Strided::rows(&x, xin), &m, w_rows.clone(), alpha, par)
                                    } else {
                                        gemm_dy_w(n, d, o, Strided::rows(&x, xin), &m, w_rows.clone(), alpha, par)
                                    }
                                });
                                let what = format!(
                                    "{format} {rows}×{cols} n={n} rows {w_rows:?} forward={forward} alpha={alpha} threads={threads}"
                                );
                                if cfg!(feature = "openblas") && threads > 0 {
                                    // The pool-wide reference may run on OpenBLAS, which sums
                                    // in its own order: the same products within f32 rounding
                                    // of sums of up to 1536 terms of order one (1e-4 absolute).
                                    let err = got.iter().zip(&want).fold(0.0f32, |e, (a, b)| e.max((a - b).abs()));
                                    assert!(err < 1e-4, "{what}: differs by {err}");
                                } else {
                                    assert_eq!(bits(&got), bits(&want), "{what}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Destination views past the slice, and overlapping rows, are refused.
#[test]
fn panel_gemm_checks_its_destination() {
    let m = PackedMatrix::quantize(4, 32, &weights(128, 2), PackFormat::Q8_0).unwrap();
    let x = data(2 * 32, 1);
    let r = std::panic::catch_unwind(|| {
        let mut d = vec![0.0; 7];
        gemm_x_wt(2, &mut d, GemmOut::overwrite(4), Strided::rows(&x, 32), &m, 0..4, 1.0, Par::ONE);
    });
    assert!(r.is_err(), "8 outputs into 7");
    let r = std::panic::catch_unwind(|| {
        let mut d = vec![0.0; 64];
        gemm_x_wt(2, &mut d, GemmOut::overwrite(3), Strided::rows(&x, 32), &m, 0..4, 1.0, Par::ONE);
    });
    assert!(r.is_err(), "rows of 4 with a stride of 3 overlap");
    let r = std::panic::catch_unwind(|| {
        let mut d = vec![0.0; 64];
        gemm_x_wt(2, &mut d, GemmOut::overwrite(5), Strided::rows(&x, 32), &m, 2..5, 1.0, Par::ONE);
    });
    assert!(r.is_err(), "rows 2..5 of 4");
}

/// With bf16 operands (AVX512-BF16) the panels give the bits of the bf16
/// kernel on the whole dequantised matrix: that kernel computes every
/// element by the same instruction sequence whatever the split.
#[test]
fn panel_gemms_with_bf16_operands_match_gemm_into() {
    if linalg::bf16::skip_without_bf16("panel_gemms_with_bf16_operands_match_gemm_into") {
        return;
    }
    let (rows, cols, n) = (448, 576, 130);
    let m = PackedMatrix::quantize(rows, cols, &weights(rows * cols, 2), PackFormat::Q4_1).unwrap();
    let deq = m.dequantize();
    for forward in [true, false] {
        let (xin, width) = if forward { (cols, rows) } else { (rows, cols) };
        let x = data(n * xin, 3);
        for par in [Par::ONE, Par { pool: true, ..Par::ONE }] {
            let par = par.with(linalg::Operands::Bf16);
            let o = GemmOut::overwrite(width);
            let (mut want, mut got) = (vec![0.0; n * width], vec![0.0; n * width]);
            reference(n, &x, &deq, cols, 0..rows, forward, o, &mut want, 0.5, par);
            if forward {
                gemm_x_wt(n, &mut got, o, Strided::rows(&x, xin), &m, 0..rows, 0.5, par);
            } else {
                gemm_dy_w(n, &mut got, o, Strided::rows(&x, xin), &m, 0..rows, 0.5, par);
            }
            assert_eq!(bits(&got), bits(&want), "forward={forward} {par:?}");
        }
    }
}
