//! A llama.cpp file as a family on the Llama block: the inverse of
//! [`crate::export`]. The hyperparameters every relative of Llama writes
//! under `{arch}.` give the shape ([`gguf::llama::LlamaGguf::read`]); the
//! options a family fixes (q/k/v biases, q/k norms, Gemma's block) come
//! from its presets, Gemma 2's caps and window from its keys; the tensor
//! names are the ones `export::tensor_names` writes for that shape.
//! The shape is then read back through the family's own `config.json`
//! reader, so a file loads as exactly what the family's folder would.

use crate::export::{gemma_scalar, tensor_names};
use crate::{Dialect, GemmaBlock, Llama, LlamaConfig, LlamaError, RopeScaling};
use engine::Model;
use family::Result;
use gguf::llama::LlamaGguf;
use gguf::GgufFile;

/// The shape and the named tensors of `file`, a GGUF file `dialect` loads
/// (its [`Dialect::gguf_arch`]); a `llama` file's `rope_freqs` become its
/// Llama 3 scaling ([`rope_scaling_from_freqs`]). Errors name the file and
/// what does not fit: another architecture, a missing key, RoPE scaling
/// other than Llama 3's, a tensor this shape does not have.
pub fn open(dialect: &dyn Dialect, file: GgufFile) -> Result<(LlamaConfig, LlamaGguf)> {
    let arch = dialect.gguf_arch().ok_or_else(|| format!("{} models are not read from GGUF files", dialect.name()))?;
    let path = file.path().to_path_buf();
    let in_file = |e: String| format!("{}: {e}", path.display());
    let gguf_err = |e: gguf::GgufError| LlamaError::from(e);
    let model = LlamaGguf::read(file, arch.name).map_err(gguf_err)?;
    let shape = LlamaConfig::from_hf_json(model.config()).map_err(|e| in_file(e.to_string()))?;
    let fixed = dialect.preset("tiny")?;
    let key = |k: &str| format!("{}.{k}", arch.name);
    let f = model.file();
    let sliding_window = match f.get_u64_opt(&key("attention.sliding_window")).map_err(gguf_err)? {
        Some(w) if arch.sliding_window => Some(w as usize),
        _ => None,
    };
    let gemma = match fixed.gemma {
        None => None,
        Some(_) => Some(GemmaBlock {
            query_pre_attn_scalar: gemma_scalar(&shape) as f64,
            attn_softcap: f.get_f64_opt(&key("attn_logit_softcapping")).map_err(gguf_err)?,
            final_softcap: f.get_f64_opt(&key("final_logit_softcapping")).map_err(gguf_err)?,
        }),
    };
    // llama.cpp's gemma2 windows the even layers; every other family all or none.
    let sliding_layers =
        (gemma.is_some() && sliding_window.is_some()).then(|| (0..shape.n_layer).map(|i| i % 2 == 0).collect());
    let rope_scaling = match model.rope_freqs() {
        None => shape.rope_scaling,
        Some(_) if arch.name != "llama" => {
            return Err(in_file(format!(
                "`{}` in a `{}` file: only llama.cpp's `llama` architecture scales RoPE by it",
                gguf::llama::ROPE_FREQS,
                arch.name
            ))
            .into())
        }
        Some(freqs) => {
            let old = f.get_u64_opt(&key("rope.scaling.original_context_length")).map_err(gguf_err)?;
            rope_scaling_from_freqs(freqs, shape.head_dim, shape.rope_theta, old.map(|o| o as usize))
                .map_err(|e| in_file(e.to_string()))?
        }
    };
    let cfg = LlamaConfig {
        rope_scaling,
        attention_bias: fixed.attention_bias,
        qk_norm: fixed.qk_norm,
        sliding_window,
        sliding_layers,
        gemma,
        ..shape
    };
    // Through the family's own reader: its checks, its defaults.
    let cfg = dialect.parse_hf_json(&dialect.hf_json(&cfg)).map_err(|e| in_file(e.to_string()))?;
    let layout = Llama::new(cfg.clone())?.layout().clone();
    let names = tensor_names((arch, cfg.fused_weights()), &cfg, &layout)?.into_iter().map(|(_, t)| t).collect();
    Ok((cfg, model.with_names(names).map_err(gguf_err)?))
}

/// How far a file's `rope_freqs` may sit from the divisors a scaling gives
/// and still be that scaling (relative): llama.cpp's converter computes each
/// from torch's f32 frequencies and stores it in f32 (the test below
/// computes it both in f32 and in f64), ours divides two f32
/// frequencies (within 1e-6 of transformers', `export`'s test). A pair on
/// the wrong side of a band edge moves by ×2.4 or more.
const FREQS_REL: f64 = 4e-6;

/// Llama 3's scaling that llama.cpp's `rope_freqs` divisors `freqs` hold
/// ([`crate::export::rope_freqs`] is the inverse), for heads `head_dim` wide
/// at base `theta`; `None` where every divisor is 1.
///
/// The divisors fix `factor` (the lowest frequencies') and, in the band
/// between, the line `s = (old/λ − low)/(high − low)` in `1/λ` — so `low`,
/// `high` and `old` only up to one common scale, which `old` sets: the
/// file's `rope.scaling.original_context_length` where written (our export
/// writes it), else Llama 3's 8192. Llama 3's low and high factors (1 and
/// 4) are tried first, then the line through the pairs between the bands
/// (rounded to 1/1024 where that still reproduces them). Errors when no
/// scaling gives the divisors.
pub fn rope_scaling_from_freqs(
    freqs: &[f32],
    head_dim: usize,
    theta: f64,
    old: Option<usize>,
) -> Result<Option<RopeScaling>, LlamaError> {
    let unsupported = |what: String| {
        LlamaError::unsupported(what, "convert the model from its Hugging Face folder, whose rope_scaling we read")
    };
    let half = head_dim / 2;
    if freqs.len() != half {
        return Err(unsupported(format!(
            "rope_freqs holds {} divisors for heads {head_dim} wide ({half} pairs)",
            freqs.len()
        )));
    }
    if freqs.iter().all(|&r| r == 1.0) {
        return Ok(None);
    }
    let old = old.unwrap_or(8192);
    let plain = nn::rope::inv_freq(head_dim, theta, None);
    let reproduces = |s: &RopeScaling| {
        if s.validate().is_err() {
            return false;
        }
        let got = nn::rope::divisors(head_dim, theta, &s.kernel());
        got.iter().zip(freqs).all(|(&g, &w)| (g as f64 - w as f64).abs() <= FREQS_REL * w as f64)
    };
    let nice = |x: f64| (x * 1024.0).round() / 1024.0;
    let top = freqs.iter().copied().fold(1.0f32, f32::max) as f64;
    let mut tries = Vec::new();
    for factor in [nice(top), top] {
        let llama3 =
            RopeScaling { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: old };
        tries.push(llama3);
        // The pairs strictly between the bands: s = a·(1/λ) + b by least squares.
        let between: Vec<(f64, f64)> = freqs
            .iter()
            .zip(&plain)
            .filter(|(&r, _)| (r as f64) > 1.0 + 1e-5 && (r as f64) < factor * (1.0 - 1e-5))
            .map(|(&r, &p)| {
                (p as f64 / (2.0 * std::f64::consts::PI), (1.0 / r as f64 - 1.0 / factor) / (1.0 - 1.0 / factor))
            })
            .collect();
        let n = between.len() as f64;
        let (mx, ms) = (between.iter().map(|p| p.0).sum::<f64>() / n, between.iter().map(|p| p.1).sum::<f64>() / n);
        let var: f64 = between.iter().map(|p| (p.0 - mx).powi(2)).sum();
        if between.len() >= 2 && var > 0.0 {
            let a = between.iter().map(|p| (p.0 - mx) * (p.1 - ms)).sum::<f64>() / var;
            let b = ms - a * mx;
            let span = old as f64 / a;
            let (low, high) = (-b * span, -b * span + span);
            for (low, high) in [(nice(low), nice(high)), (low, high)] {
                tries.push(RopeScaling { low_freq_factor: low, high_freq_factor: high, ..llama3 });
            }
        }
    }
    match tries.into_iter().find(reproduces) {
        Some(s) => Ok(Some(s)),
        None => Err(unsupported(format!(
            "rope_freqs {freqs:?} is no Llama 3 RoPE scaling at θ = {theta} (none found that gives these divisors within {FREQS_REL:e})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3(factor: f64, low: f64, high: f64, old: usize) -> RopeScaling {
        RopeScaling { factor, low_freq_factor: low, high_freq_factor: high, original_max_position_embeddings: old }
    }

    /// llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.generate_extra_tensors`)
    /// from the f32 frequencies torch gives, stored as f32; each `freq` is
    /// a 0-d f32 tensor, so the arithmetic runs in f32 where Python floats
    /// meet it — computed here both in f32 and in f64:
    ///
    /// ```python
    /// freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    /// for freq in freqs:
    ///     wavelen = 2 * math.pi / freq
    ///     if wavelen < high_freq_wavelen: rope_factors.append(1)
    ///     elif wavelen > low_freq_wavelen: rope_factors.append(factor)
    ///     else:
    ///         smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ///         rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    /// ```
    fn converter(head_dim: usize, theta: f64, s: &RopeScaling) -> [Vec<f32>; 2] {
        let old = s.original_max_position_embeddings as f64;
        let (low, high, factor) = (s.low_freq_factor, s.high_freq_factor, s.factor);
        let (low_wavelen, high_wavelen) = (old / low, old / high);
        let freqs = nn::rope::inv_freq(head_dim, theta, None);
        let in_f64 = freqs.iter().map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f as f64;
            match wavelen {
                w if w < high_wavelen => 1.0,
                w if w > low_wavelen => factor as f32,
                w => {
                    let smooth = (old / w - low) / (high - low);
                    (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
                }
            }
        });
        let in_f32 = freqs.iter().map(|&f| {
            let wavelen = (2.0 * std::f64::consts::PI) as f32 / f;
            match wavelen {
                w if w < high_wavelen as f32 => 1.0,
                w if w > low_wavelen as f32 => factor as f32,
                w => {
                    let smooth = (old as f32 / w - low as f32) / (high - low) as f32;
                    1.0 / ((1.0 - smooth) / factor as f32 + smooth)
                }
            }
        });
        [in_f64.collect(), in_f32.collect()]
    }

    /// Llama 3.1 (head 128, θ 5·10⁵, factor 8) and 3.2 (factor 32) come
    /// back exactly from the converter's divisors and from ours, with and
    /// without the original context in the file; so does a scaling with
    /// other low and high factors when the file gives the original context
    /// (the fitted line, rounded). Without it the fit is the same scaling
    /// at 8192 (low and high ×2 for 4096): the same divisors.
    #[test]
    fn the_divisors_give_back_their_scaling() {
        for s in [llama3(8.0, 1.0, 4.0, 8192), llama3(32.0, 1.0, 4.0, 8192), llama3(16.0, 1.5, 12.0, 4096)] {
            let ours = nn::rope::divisors(128, 5e5, &s.kernel());
            let [by_f64, by_f32] = converter(128, 5e5, &s);
            for freqs in [by_f64, by_f32, ours.clone()] {
                let got = rope_scaling_from_freqs(&freqs, 128, 5e5, Some(s.original_max_position_embeddings)).unwrap();
                assert_eq!(got, Some(s));
            }
            let guessed = rope_scaling_from_freqs(&ours, 128, 5e5, None).unwrap().unwrap();
            let again = nn::rope::divisors(128, 5e5, &guessed.kernel());
            assert!(again.iter().zip(&ours).all(|(a, b)| (a - b).abs() <= 4e-6 * b), "{guessed:?}");
            if s.original_max_position_embeddings == 8192 {
                assert_eq!(guessed, s);
            } else {
                assert_eq!((guessed.low_freq_factor, guessed.high_freq_factor), (3.0, 24.0));
            }
        }
    }

    /// All ones is plain RoPE; a wrong count, divisors that fall where a
    /// Llama 3 scaling's rise, and one pair moved off the line are refused,
    /// naming rope_freqs.
    #[test]
    fn other_divisors_are_refused() {
        assert_eq!(rope_scaling_from_freqs(&[1.0; 64], 128, 5e5, None).unwrap(), None);
        let wrong = |freqs: &[f32]| rope_scaling_from_freqs(freqs, 128, 5e5, Some(8192)).unwrap_err().to_string();
        assert!(wrong(&[1.0; 8]).contains("8 divisors"));
        let mut falling = vec![8.0f32; 64];
        falling[63] = 1.0;
        assert!(wrong(&falling).contains("rope_freqs"));
        let mut bent = nn::rope::divisors(128, 5e5, &llama3(8.0, 1.0, 4.0, 8192).kernel());
        let mid = bent.iter().position(|&r| r > 1.5 && r < 7.0).unwrap();
        bent[mid] *= 1.001;
        assert!(wrong(&bent).contains("no Llama 3 RoPE scaling"));
    }
}
