//! Label smoothing and z-loss in the LM head's loss: PyTorch's numbers,
//! finite differences, and plain terms giving the plain kernel's bits.

use engine::LossTerms;
use nn::loss::softmax_cross_entropy;
use nn::loss_terms::softmax_cross_entropy_with;

const V: usize = 7;
#[rustfmt::skip]
const LOGITS: [f32; 3 * V] = [
    0.5, -1.25, 2.0, 0.0, 0.75, -0.5, 1.5,
    3.0, 0.25, -2.0, 1.0, -0.75, 0.5, 0.0,
    -1.0, 1.0, 0.5, 2.5, -0.25, 0.125, -1.5,
];
/// The middle row is ignored.
const TARGETS: [i32; 3] = [2, -100, 4];
const TERMS: LossTerms = LossTerms { label_smoothing: 0.1, z_loss: 0.05 };

/// (Σ ce, Σ aux, gradient of Σ (ce + aux)).
fn run(logits: &[f32], terms: LossTerms, grad: bool) -> (f64, f64, Vec<f32>) {
    let mut l = logits.to_vec();
    let mut losses = vec![0.0f32; TARGETS.len()];
    let aux = softmax_cross_entropy_with(&mut l, &mut losses, &TARGETS, V, grad.then_some(1.0), terms);
    (losses.iter().map(|&x| x as f64).sum(), aux, l)
}

/// PyTorch in f64 on the same logits:
/// ```python
/// x = torch.tensor(LOGITS, dtype=torch.float64).view(3, 7).requires_grad_()
/// t = torch.tensor([2, -100, 4]); eps, c = 0.1, 0.05
/// ce = F.cross_entropy(x, t, reduction='sum', ignore_index=-100)
/// smooth = F.cross_entropy(x, t, reduction='sum', ignore_index=-100, label_smoothing=eps)
/// total = smooth + c * (torch.logsumexp(x, -1) ** 2 * (t != -100)).sum()
/// total.backward()  # x.grad
/// ```
#[test]
fn loss_and_logit_gradient_equal_pytorch() {
    const CE: f64 = 4.061081296890651;
    const TOTAL: f64 = 5.017971459796731;
    #[rustfmt::skip]
    const GRAD: [f64; 3 * V] = [
        0.106704382287, 0.006739211914, -0.372045720857, 0.059098488807, 0.141068644881, 0.030224054829, 0.314599466651,
        0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
        0.010713725467, 0.170436548492, 0.09775400162, 0.813582031853, -0.861361899913, 0.062717981255, 0.0008772124,
    ];
    let (ce, aux, grad) = run(&LOGITS, TERMS, true);
    // The row statistics are f64 sums of f32 exponentials (`fast_exp`,
    // ≈ 2 ulp), and the per-row results are stored in f32 (1 ulp of ~2 is
    // 2.4e-7): 1e-6 relative covers both; the gradient is stored in f32,
    // so 1e-6 absolute on values below 1.
    assert!((ce - CE).abs() <= 1e-6 * CE, "ce {ce} vs {CE}");
    assert!((ce + aux - TOTAL).abs() <= 1e-6 * TOTAL, "total {} vs {TOTAL}", ce + aux);
    for (i, (&g, &r)) in grad.iter().zip(&GRAD).enumerate() {
        assert!((g as f64 - r).abs() <= 1e-6, "gradient [{i}]: {g} vs {r}");
    }
    assert!(grad[V..2 * V].iter().all(|&g| g == 0.0), "an ignored row has no gradient");
}

#[test]
fn gradient_matches_finite_differences_for_each_term() {
    for terms in
        [LossTerms { label_smoothing: 0.2, z_loss: 0.0 }, LossTerms { label_smoothing: 0.0, z_loss: 0.1 }, TERMS]
    {
        let (_, _, grad) = run(&LOGITS, terms, true);
        // h = 1e-2 on logits of size ~1: the central difference's error is
        // O(h²·f''') ≈ 1e-4 of the curvature; f32 rounding of the f64
        // loss sums adds ~1e-7 / h = 1e-5.
        nn::fd::check_gradient(&format!("{terms:?}"), &LOGITS, &grad, (1e-2, 2e-4, 1e-3), |x| {
            let (ce, aux, _) = run(x, terms, false);
            ce + aux
        });
    }
}

#[test]
fn plain_terms_are_the_plain_kernel_bit_for_bit() {
    let (mut a, mut la) = (LOGITS.to_vec(), vec![0.0f32; 3]);
    softmax_cross_entropy(&mut a, &mut la, &TARGETS, V, Some(0.25));
    let (mut b, mut lb) = (LOGITS.to_vec(), vec![0.0f32; 3]);
    let aux = softmax_cross_entropy_with(&mut b, &mut lb, &TARGETS, V, Some(0.25), LossTerms::default());
    assert_eq!(aux, 0.0);
    assert_eq!((a, la), (b, lb));
    // With terms on, `losses` still holds plain cross-entropy.
    let (ce_on, aux_on, _) = run(&LOGITS, TERMS, true);
    let plain: f64 = la_sum();
    assert!((ce_on - plain).abs() <= 1e-6 * plain, "{ce_on} vs {plain}");
    assert!(aux_on > 0.0);
}

fn la_sum() -> f64 {
    let (mut l, mut losses) = (LOGITS.to_vec(), vec![0.0f32; 3]);
    softmax_cross_entropy(&mut l, &mut losses, &TARGETS, V, None);
    losses.iter().map(|&x| x as f64).sum()
}
