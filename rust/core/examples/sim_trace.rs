//! Development aid: window-by-window choices of a policy vs the oracle.
//! `cargo run --release --example sim_trace REGIME CURVE [iterations] [window]`
use specdial_core::config::AdaptiveConfig;
use specdial_core::policy::Observation;
use specdial_core::sim::curve::CostCurve;
use specdial_core::sim::run::{iteration_seconds, run_oracle, Noise, RunOptions};
use specdial_core::sim::workload::Regime;
use specdial_core::AdaptiveSpeculativeParams;
use rand::{RngExt, SeedableRng};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let regime = Regime::named(&a[1]).unwrap();
    let curve = CostCurve::named(&a[2]).unwrap();
    let n: u32 = a.get(3).map_or(16000, |x| x.parse().unwrap());
    let win: usize = a.get(4).map_or(100, |x| x.parse().unwrap());
    let w = regime.generate(n, 0);
    let opts = RunOptions { seed: 0, noise: Noise { sigma: a.get(5).map_or(0.1, |x| x.parse().unwrap()), spike_probability: 0.01, drift: 0.0, interference: 0.0 }, skip_zero_step_draft_extend: false, confidence: Default::default() };
    let (_, oracle) = run_oracle(&w, &curve, 7, &opts);
    let cfg = AdaptiveConfig::default_config();
    let mut p = AdaptiveSpeculativeParams::new(3, cfg);
    let g: Option<Vec<i64>> = curve.graph_sizes().map(|g| g.iter().map(|&x| x as i64).collect());
    p.set_cuda_graph_bs(g.as_deref()).unwrap();
    let (mut tg, mut sg, mut to, mut so) = (0.0, 0.0, 0.0, 0.0);
    let mut ks = vec![];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    let mut x = 0.0f64; let mut it = 0usize;
    while (x as usize) < w.len() {
        let i = x as usize; it += 1;
        let b = w.batch(i).len();
        let ctx = w.context(i);
        let d = p.decide(b as i64, Some(ctx as u64)).unwrap();
        let k = d.steps;
        let t = iteration_seconds(&curve, &w, i, k, 0.0, false);
        let acc: Vec<i64> = w.batch(i).iter().map(|&r| { let al = &w.requests[r as usize].alpha; let mut c = 0; for j in 0..k as usize { if rng.random::<f64>() < al[j] { c += 1 } else { break } } c }).collect();
        p.on_verify_complete_with(acc, b as i64, Observation { seconds: Some(t * (opts.noise.sigma * specdial_core::sim::workload::normal(&mut rng)).exp() * if rng.random::<f64>() < 0.01 { 2.0 } else { 1.0 }), context_tokens: Some(ctx as u64), steps: Some(k), catch_up_tokens: None }).unwrap();
        tg += w.expected_tokens(i, k); sg += t;
        let ko = oracle[i]; to += w.expected_tokens(i, ko); so += iteration_seconds(&curve, &w, i, ko, 0.0, false);
        ks.push((k, ko));
        x += w.expected_tokens(i, k) / b as f64;
        if it % win == 0 {
            let mut hg = [0; 8]; let mut ho = [0; 8];
            for &(a, b) in &ks { hg[a as usize] += 1; ho[b as usize] += 1; }
            let gd = p.goodput().unwrap().last_decision().unwrap();
            let preds: Vec<String> = gd.candidates.iter().map(|c| format!("{}:{:.1}ms/{:.2}", c.0, c.1 * 1e3, c.2)).collect();
            let truth: Vec<String> = gd.candidates.iter().map(|c| format!("{:.1}", iteration_seconds(&curve, &w, i, c.0, 0.0, false) * 1e3)).collect();
            let rates: Vec<String> = p.goodput().unwrap().acceptance_rates().iter().take(4).map(|r| format!("{r:.2}")).collect();
            let mut tr = vec![];
            for j in 0..4 { let (mut num, mut den) = (0.0, 0.0); for &r in w.batch(i) { let al = &w.requests[r as usize].alpha; let reach: f64 = al[..j].iter().product(); den += reach; num += reach * al[j]; } tr.push(format!("{:.2}", num / den)); }
            println!("    rates {} true {}", rates.join(" "), tr.join(" "));
            println!("seg {:5} b {:3} ratio {:.3} goodput {:?} oracle {:?}\n    pred {}\n    true {}", i + 1, b, (tg / sg) / (to / so), hg, ho, preds.join(" "), truth.join(" "));
            ks.clear(); tg = 0.0; sg = 0.0; to = 0.0; so = 0.0;
        }
    }
}
