//! The encoders against the `gguf` Python package's numpy quantisers
//! (`gguf.quants.quantize`), which mirror ggml's reference row quantisers:
//! the bytes must be equal. Skipped with a note when python3 or the package
//! is missing, unless `MACROBATCH_REQUIRE_PYTHON=1`.

use gguf::{quantize, GgmlType};
use std::process::Command;

const SCRIPT: &str = r#"
import sys, numpy as np, gguf
src, dst, ty = sys.argv[1], sys.argv[2], sys.argv[3]
x = np.fromfile(src, dtype="<f4").reshape(1, -1)
q = gguf.quants.quantize(x, gguf.GGMLQuantizationType[ty])
open(dst, "wb").write(np.ascontiguousarray(q).tobytes())
"#;

fn python_has_gguf() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import numpy, gguf"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var("MACROBATCH_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "MACROBATCH_REQUIRE_PYTHON=1 but python3 cannot import numpy and gguf"
        );
        println!("skipped: python3 cannot import numpy and gguf (pip install gguf)");
    }
    ok
}

/// Values that exercise every branch of the quantisers: random normals of
/// several scales, exact ties for rounding (k + 0.5 steps), a zero block,
/// blocks whose largest magnitude is negative, repeated maxima of both
/// signs, f16-subnormal scales and bf16 halfway cases.
fn values() -> Vec<f32> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut v = Vec::new();
    for b in 0..512 {
        let scale = [1.0, 1e-2, 30.0, 1e-6, 3e-9][b % 5];
        for _ in 0..32 {
            // Box–Muller.
            let (u1, u2) = (next().max(1e-300), next());
            v.push(((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * scale) as f32);
        }
    }
    v.extend([0.0f32; 32]);
    // Q8_0 with amax 127: x/d = x exactly, so the halves k + 0.5 are ties.
    v.extend((0..32).map(|i| if i == 0 { 127.0 } else { i as f32 - 15.5 }));
    // Q4_0 with max −8: d = 1, ties at x + 8.5 and both maxima signs.
    v.extend((0..32).map(|i| [-8.0, 8.0, 2.5, -3.5, 0.5][i % 5]));
    v.extend((0..32).map(|i| if i % 2 == 0 { 5.0 } else { -5.0 }));
    // bf16 halfway cases: low 16 bits exactly 0x8000, even and odd upper halves.
    v.extend((0..32).map(|i| f32::from_bits(0x3f80_8000 + ((i as u32) << 16))));
    v
}

#[test]
fn bytes_equal_the_python_gguf_quantisers() {
    if !python_has_gguf() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("macrobatch-gguf-encode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let x = values();
    let src = dir.join("x.f32");
    std::fs::write(&src, x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    for id in gguf::encode::ENCODABLE {
        let ty = GgmlType::from_id(id).unwrap();
        let dst = dir.join(format!("{}.bin", ty.name));
        let out = Command::new("python3").args(["-c", SCRIPT]).arg(&src).arg(&dst).arg(ty.name).output().unwrap();
        assert!(out.status.success(), "python {}: {}", ty.name, String::from_utf8_lossy(&out.stderr));
        let theirs = std::fs::read(&dst).unwrap();
        let ours = quantize(ty, &x).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{}", ty.name);
        let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
        assert!(first.is_none(), "{}: first differing byte {first:?} of {}", ty.name, ours.len());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
