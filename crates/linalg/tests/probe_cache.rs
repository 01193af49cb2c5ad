//! The probe cache: an empty `MACROBATCH_CACHE_DIR` and entries another
//! process saved meanwhile. One test: it sets environment variables.

use linalg::{backend, gemm_into, Backend, GemmDims, GemmOut, Strided};

/// `dst = a · b` (`m × k` by `k × n`, row-major) on `pool`, through the
/// pool-wide GEMM path (probed and cached per shape).
fn gemm_on(pool: &rayon::ThreadPool, (m, k, n): (usize, usize, usize), a: &[f32], b: &[f32], dst: &mut [f32]) {
    pool.install(|| {
        let par = linalg::parallelism(false);
        gemm_into(GemmDims { m, n, k }, dst, GemmOut::overwrite(n), Strided::rows(a, k), Strided::rows(b, n), 1.0, par)
    })
}

#[test]
fn cache_path_and_concurrent_writers() {
    let tmp = std::env::temp_dir().join(format!("linalg-review-cache-{}", std::process::id()));
    // An empty MACROBATCH_CACHE_DIR is unset, not the current directory
    // (a relative `gemm-….json` written wherever the program runs).
    std::env::set_var("MACROBATCH_CACHE_DIR", "");
    std::env::set_var("XDG_CACHE_HOME", &tmp);
    let path = backend::cache_path().expect("cache path");
    assert!(path.starts_with(&tmp), "empty MACROBATCH_CACHE_DIR gave {}", path.display());

    // Another process saves its probe of another shape after this one read
    // the cache: this process's save must not drop that entry (the next
    // run would probe that shape again and may choose otherwise).
    let dir = tmp.join("explicit");
    std::env::set_var("MACROBATCH_CACHE_DIR", &dir);
    let path = backend::cache_path().expect("cache path");
    let p = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
    let (m, k, n) = (160, 96, 144);
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut dst = vec![0.0f32; m * n];
    let call = |dst: &mut Vec<f32>| gemm_on(&p, (m, k, n), &a, &b, dst);
    call(&mut dst); // loads the (absent) cache, first trial
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(&path, "{\"7x7x7nn\": \"split\"}").expect("write");
    for _ in 0..3 * Backend::f32_candidates().len() {
        call(&mut dst);
    }
    let text = std::fs::read_to_string(&path).expect("cache written");
    // Stored under its bucket (Key::bucket: 144 rounds up to 160).
    assert!(text.contains("160x96x160nn") && !text.contains("x144"), "{text}");
    assert!(text.contains("7x7x7nn"), "another process's entry was dropped: {text}");

    // The cache is per thread count (the file name has it): a shape probed
    // on 2 threads is probed again on 3, and the 3-thread file does not
    // receive the 2-thread choices.
    let dir = tmp.join("threads");
    std::env::set_var("MACROBATCH_CACHE_DIR", &dir);
    let p3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
    for _ in 0..3 * Backend::f32_candidates().len() {
        gemm_on(&p3, (m, k, n), &a, &b, &mut dst);
    }
    let stats = backend::stats();
    let (_, s3) =
        stats.iter().find(|(key, _)| (key.m, key.k, key.n, key.threads) == (m, k, n, 3)).expect("3-thread key");
    let path3 = p3.install(backend::cache_path).expect("cache path");
    let text3 = std::fs::read_to_string(&path3).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    assert_eq!(s3.probe.len(), Backend::f32_candidates().len(), "the 3-thread key took the 2-thread choice unprobed");
    assert!(text3.contains("160x96x160nn") && !text3.contains("7x7x7nn"), "3-thread cache: {text3}");

    // A cached choice one probe made (a bare name, as earlier versions
    // wrote; or agreement 1) is re-checked by the next process: the shape
    // is probed again, and the entry records the decision with its
    // agreement count. A final one (two agreeing processes) is used as is.
    let dir = tmp.join("recheck");
    std::env::set_var("MACROBATCH_CACHE_DIR", &dir);
    let p4 = rayon::ThreadPoolBuilder::new().num_threads(4).build().expect("pool");
    let path4 = p4.install(backend::cache_path).expect("cache path");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let (m2, k2, n2) = (96, 64, 80);
    std::fs::write(&path4, r#"{"160x96x160nn": "split", "96x64x80nn": {"backend": "split", "agreed": 2}}"#)
        .expect("write");
    let a2 = vec![0.5f32; m2 * k2];
    let b2 = vec![0.25f32; k2 * n2];
    let mut dst2 = vec![0.0f32; m2 * n2];
    for _ in 0..3 * Backend::f32_candidates().len() {
        gemm_on(&p4, (m, k, n), &a, &b, &mut dst);
        gemm_on(&p4, (m2, k2, n2), &a2, &b2, &mut dst2);
    }
    let stats = backend::stats();
    let find = |mm, kk, nn| {
        stats
            .iter()
            .find(|(key, _)| (key.m, key.k, key.n, key.threads) == (mm, kk, nn, 4))
            .expect("4-thread key")
            .1
            .clone()
    };
    let (provisional, fin) = (find(m, k, n), find(m2, k2, n2));
    let text4 = std::fs::read_to_string(&path4).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    assert_eq!(provisional.rechecked, Some(Backend::Split), "the provisional entry was not re-checked");
    assert_eq!(provisional.probe.len(), Backend::f32_candidates().len(), "re-checked by a probe");
    // Kept (split within the margin: agreement 2) or replaced (agreement 1).
    let want = if provisional.backend == Some(Backend::Split) { 2 } else { 1 };
    assert_eq!(provisional.agreed, want, "{provisional:?}");
    assert!(
        text4.contains(&format!("\"agreed\": {want}")) && text4.contains("\"backend\""),
        "the decision is recorded with its agreement: {text4}"
    );
    assert!(fin.probe.is_empty() && fin.rechecked.is_none(), "a final choice is not probed again: {fin:?}");
    assert_eq!((fin.backend, fin.agreed), (Some(Backend::Split), 2));

    // Micro-batches of every length from 65 to 128 tokens (one chat each):
    // 64 exact keys, 4 buckets (80, 96, 112, 128). The trial calls of all
    // lengths count towards their bucket's probe, so at most 4 probes are
    // made and at most 4 · TRIALS · candidates calls are trials; every
    // length then runs its bucket's choice.
    let dir = tmp.join("buckets");
    std::env::set_var("MACROBATCH_CACHE_DIR", &dir);
    let p5 = rayon::ThreadPoolBuilder::new().num_threads(5).build().expect("pool");
    let (k5, n5) = (64, 48);
    let b5 = vec![0.25f32; k5 * n5];
    for round in 0..3 {
        for m5 in 65..=128 {
            let a5 = vec![0.5f32; m5 * k5];
            let mut d5 = vec![0.0f32; m5 * n5];
            gemm_on(&p5, (m5, k5, n5), &a5, &b5, &mut d5);
            if round == 2 {
                assert!(d5.iter().all(|&x| x == 0.125 * k5 as f32), "m = {m5}: wrong product");
            }
        }
    }
    let stats = backend::stats();
    let keys: Vec<_> = stats.iter().filter(|(key, _)| key.threads == 5).collect();
    assert_eq!(keys.len(), 64, "one exact key per length");
    let probed = keys.iter().filter(|(_, s)| !s.probe.is_empty()).count();
    assert!((1..=4).contains(&probed), "{probed} probes for 4 buckets");
    let unchosen: Vec<usize> = keys.iter().filter(|(_, s)| s.backend.is_none()).map(|(k, _)| k.m).collect();
    assert!(unchosen.is_empty(), "lengths still on trial after their bucket decided: {unchosen:?}");
    let text5 = std::fs::read_to_string(p5.install(backend::cache_path).expect("cache path")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    let entries = text5.matches("\"backend\"").count();
    assert!((1..=4).contains(&entries), "one cache entry per bucket: {text5}");
}
