//! Draft confidence in the simulator (issue 28): for every draft position of every iteration, the
//! position's acceptance probability `pi` this iteration and the drafter's reported probability
//! `q` of the drafted token.
//!
//! A request's true conditional rate `alpha_j` ([`super::workload`]) is its *average*; a given
//! iteration's draft is easier or harder than that, and the drafter partly knows it. The model:
//!
//! - `pi_j ~ Beta(kappa alpha_j, kappa (1 - alpha_j))`: mean `alpha_j` (so every rate, expected
//!   token count and oracle of the rate model is unchanged), spread by the concentration `kappa`.
//!   Small `kappa` puts `pi` near 0 or 1: draft-token probabilities are strongly bimodal (most
//!   drafted tokens near-certain, a tail of doubtful ones), which is why EAGLE-2 (Li et al. 2024)
//!   can rank draft-tree nodes by confidence and DSpark admits positions by it.
//! - `logit q_j = logit pi_j + sigma z`: the drafter reads `pi` with noise `sigma` (its own
//!   probability is not the target's; SpecDec++ trains an acceptance head because draft
//!   probability alone is an imperfect predictor). `q` is calibrated on average only roughly (the
//!   logit noise pulls extreme values inward on average): the policy calibrates it online.
//! - The position is accepted iff the iteration's uniform `u_j < pi_j` (positions in sequence,
//!   stopping at the first rejection), so `P(accepted | pi) = pi` and marginally `alpha_j`.
//!
//! Defaults `kappa = 2`, `sigma = 0.5` ([`DraftConfidence::default`]): with these, `q` ranks an
//! accepted against a rejected draft correctly about 3 times in 4 (the test reads the AUC), a
//! strong but imperfect predictor. `kappa -> infinity` removes the signal (confidence says
//! nothing beyond the rate); `kappa -> 0` with `sigma = 0` makes it an oracle.

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use super::workload::{normal, Workload, MAX_STEPS};

/// The draft-confidence model's knobs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftConfidence {
    /// Beta concentration `kappa` of `pi` around the rate (> 0).
    pub concentration: f64,
    /// Standard deviation `sigma` of the logit noise of the reported probability (>= 0).
    pub report_noise: f64,
}

impl Default for DraftConfidence {
    fn default() -> Self {
        DraftConfidence {
            concentration: 2.0,
            report_noise: 0.5,
        }
    }
}

/// One iteration's draws: per request of the batch, `pi` and `q` per position.
#[derive(Debug, Clone, PartialEq)]
pub struct Confidences {
    pub pi: Vec<[f64; MAX_STEPS]>,
    pub q: Vec<[f64; MAX_STEPS]>,
}

/// A Gamma(shape, 1) draw (Marsaglia and Tsang; shapes below 1 boosted by `U^(1/shape)`).
fn gamma(rng: &mut SmallRng, shape: f64) -> f64 {
    if shape < 1.0 {
        let u: f64 = rng.random::<f64>().max(1e-300);
        return gamma(rng, shape + 1.0) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u: f64 = rng.random();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// A Beta(mean `m`, concentration `k`) draw.
fn beta(rng: &mut SmallRng, m: f64, k: f64) -> f64 {
    let m = m.clamp(1e-4, 1.0 - 1e-4);
    let (a, b) = (gamma(rng, k * m), gamma(rng, k * (1.0 - m)));
    if a + b > 0.0 {
        a / (a + b)
    } else {
        m
    }
}

impl DraftConfidence {
    /// The draws of segment `i` for its batch, deterministic in `(seed, i)` and the same for every
    /// contender (common random numbers).
    pub fn draw(&self, w: &Workload, i: usize, seed: u64) -> Confidences {
        let mut rng = SmallRng::seed_from_u64(
            seed.wrapping_mul(0xA24B_AED4_963E_E407)
                ^ (i as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25)
                ^ 0xC0F1,
        );
        let batch = w.batch(i);
        let mut pi = Vec::with_capacity(batch.len());
        let mut q = Vec::with_capacity(batch.len());
        for &r in batch {
            let alpha = w.requests[r as usize].alpha_at(i as u32);
            let mut p = [0.0; MAX_STEPS];
            let mut s = [0.0; MAX_STEPS];
            for j in 0..MAX_STEPS {
                p[j] = beta(&mut rng, alpha[j], self.concentration).clamp(1e-6, 1.0 - 1e-6);
                let logit = (p[j] / (1.0 - p[j])).ln() + self.report_noise * normal(&mut rng);
                s[j] = 1.0 / (1.0 + (-logit).exp());
            }
            pi.push(p);
            q.push(s);
        }
        Confidences { pi, q }
    }
}

/// Verify lengths after the confidence stop: request `r` verifies `min(budget_r, leading
/// positions whose cumulative `q` is >= min_survival)`.
pub fn apply_stop(budgets: &[u32], q: &[[f64; MAX_STEPS]], min_survival: f64) -> Vec<u32> {
    budgets
        .iter()
        .zip(q)
        .map(|(&v, q)| {
            let mut c = 1.0;
            let mut n = 0;
            for &p in q.iter().take((v as usize).min(MAX_STEPS)) {
                c *= p;
                if c < min_survival {
                    break;
                }
                n += 1;
            }
            n
        })
        .collect()
}

/// Expected tokens of a request verifying `v` drafts given this iteration's `pi`.
#[inline]
pub fn tokens_given(pi: &[f64; MAX_STEPS], v: u32) -> f64 {
    let (mut total, mut s) = (1.0, 1.0);
    for &p in pi.iter().take((v as usize).min(MAX_STEPS)) {
        s *= p;
        total += s;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::workload::Regime;

    /// The defaults keep every rate (mean of `pi` = alpha) and give `q` an AUC of about 0.75 for
    /// telling accepted from rejected position-1 drafts.
    #[test]
    fn confidence_keeps_the_rates_and_is_informative_but_not_an_oracle() {
        let w = Regime::named("mixed-64").unwrap().generate(400, 5);
        let m = DraftConfidence::default();
        let (mut sum_pi, mut sum_alpha, mut n) = (0.0, 0.0, 0.0);
        let mut scored: Vec<(f64, bool)> = Vec::new();
        let mut rng = SmallRng::seed_from_u64(9);
        for i in 0..400 {
            let c = m.draw(&w, i, 1);
            for (k, &r) in w.batch(i).iter().enumerate() {
                sum_pi += c.pi[k][0];
                sum_alpha += w.requests[r as usize].alpha_at(i as u32)[0];
                n += 1.0;
                scored.push((c.q[k][0], rng.random::<f64>() < c.pi[k][0]));
            }
        }
        assert!(
            (sum_pi / n - sum_alpha / n).abs() < 0.01,
            "{} vs {}",
            sum_pi / n,
            sum_alpha / n
        );
        // AUC by ranks
        scored.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut rank_sum, mut pos) = (0.0, 0.0);
        for (r, &(_, ok)) in scored.iter().enumerate() {
            if ok {
                rank_sum += r as f64 + 1.0;
                pos += 1.0;
            }
        }
        let neg = scored.len() as f64 - pos;
        let auc = (rank_sum - pos * (pos + 1.0) / 2.0) / (pos * neg);
        assert!((0.65..0.88).contains(&auc), "AUC {auc}");
        assert_eq!(
            apply_stop(
                &[3, 3, 0],
                &[[0.9; MAX_STEPS], [0.5; MAX_STEPS], [0.9; MAX_STEPS]],
                0.6
            ),
            vec![3, 0, 0]
        );
        assert!((tokens_given(&[0.5; MAX_STEPS], 2) - 1.75).abs() < 1e-12);
    }
}
