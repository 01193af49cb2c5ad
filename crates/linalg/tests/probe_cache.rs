//! The probe cache: an empty `MACROBATCH_CACHE_DIR` and entries another
//! process saved meanwhile. One test: it sets environment variables.

use linalg::{backend, gemm_into, Backend, GemmDims, GemmOut, Strided};

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
    let par = p.install(|| linalg::parallelism(false));
    let call = |dst: &mut Vec<f32>| {
        p.install(|| {
            gemm_into(
                GemmDims { m, n, k },
                dst,
                GemmOut::overwrite(n),
                Strided::rows(&a, k),
                Strided::rows(&b, n),
                1.0,
                par,
            )
        })
    };
    call(&mut dst); // loads the (absent) cache, first trial
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(&path, "{\"7x7x7nn\": \"split\"}").expect("write");
    for _ in 0..3 * Backend::f32_candidates().len() {
        call(&mut dst);
    }
    let text = std::fs::read_to_string(&path).expect("cache written");
    assert!(text.contains("160x96x144nn"), "{text}");
    assert!(text.contains("7x7x7nn"), "another process's entry was dropped: {text}");

    // The cache is per thread count (the file name has it): a shape probed
    // on 2 threads is probed again on 3, and the 3-thread file does not
    // receive the 2-thread choices.
    let dir = tmp.join("threads");
    std::env::set_var("MACROBATCH_CACHE_DIR", &dir);
    let p3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
    let par3 = p3.install(|| linalg::parallelism(false));
    for _ in 0..3 * Backend::f32_candidates().len() {
        p3.install(|| {
            gemm_into(
                GemmDims { m, n, k },
                &mut dst,
                GemmOut::overwrite(n),
                Strided::rows(&a, k),
                Strided::rows(&b, n),
                1.0,
                par3,
            )
        });
    }
    let stats = backend::stats();
    let (_, s3) =
        stats.iter().find(|(key, _)| (key.m, key.k, key.n, key.threads) == (m, k, n, 3)).expect("3-thread key");
    let path3 = p3.install(backend::cache_path).expect("cache path");
    let text3 = std::fs::read_to_string(&path3).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    assert_eq!(s3.probe.len(), Backend::f32_candidates().len(), "the 3-thread key took the 2-thread choice unprobed");
    assert!(text3.contains("160x96x144nn") && !text3.contains("7x7x7nn"), "3-thread cache: {text3}");
}
