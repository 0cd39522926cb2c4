// temporary probe (not committed)
use specdial_core::sim::workload::Regime;
use specdial_core::sim::{default_policies_with_per_request, run_all, SimSpec, PER_REQUEST};

#[test]
#[ignore]
fn probe() {
    let regs = std::env::var("REGIMES").unwrap_or("context-growth".into());
    let regs: Vec<&str> = regs.split(',').collect();
    let mut spec = SimSpec::standard();
    spec.regimes = Regime::every().filter(|r| regs.contains(&r.name)).collect();
    if let Ok(c) = std::env::var("CURVES") {
        let c: Vec<String> = c.split(',').map(String::from).collect();
        spec.curves.retain(|(n, _)| c.contains(n));
    }
    spec.segments = 6000;
    spec.policies = default_policies_with_per_request().into_iter().filter(|(n, _)| n == "goodput" || n == PER_REQUEST).collect();
    for c in run_all(&spec) {
        let p = c.get(PER_REQUEST).unwrap();
        println!("  per-request steps {:?} verify {:?} probes {}", p.steps_histogram, p.verify_histogram, p.probes);
        let pr = c.get(PER_REQUEST).unwrap().goodput;
        let bl = c.get("goodput").unwrap().goodput;
        println!(
            "{:15} {:16} pr/batch {:.3} pr/oracle-pr {:.3} pr/best {:.3} batch/best {:.3} batch/oracle {:.3} oracle-pr/oracle {:.3} oracle-conf/oracle {:.3}",
            c.regime, c.curve, pr / bl, pr / c.oracle_per_request.as_ref().unwrap().goodput, pr / c.best_fixed().goodput, bl / c.best_fixed().goodput, bl / c.oracle.goodput,
            c.oracle_per_request.as_ref().unwrap().goodput / c.oracle.goodput, c.oracle_confidence.as_ref().unwrap().goodput / c.oracle.goodput
        );
    }
}

use specdial_core::sim::curve::{CostCurve, Shape};
use specdial_core::sim::run::{walk_choices, Choice, RunOptions};
use specdial_core::sim::workload::Workload;

fn padded(curve: &CostCurve, b: u32) -> u32 {
    match curve.graph_sizes() {
        Some(g) => g.get(g.partition_point(|&s| s < b)).copied().unwrap_or(b),
        None => b,
    }
}

/// ranks draft positions by cumulative q, chooses the depth and count clairvoyantly (true pi)
fn q_oracle(w: &Workload, curve: &CostCurve, opts: &RunOptions, all_draft: bool) -> f64 {
    let r = walk_choices(w, curve, "q-oracle", opts, |i| {
        let conf = opts.confidence.draw(w, i, opts.seed);
        let b = w.batch(i).len();
        let (bp, ctx) = (padded(curve, b as u32), w.context(i));
        let mut best = (b as f64 / curve.seconds_shape(bp, 0, Shape::uniform(bp as f64, 0), ctx, 0.0), Choice::uniform(0));
        for d in 1..=7usize {
            let mut order: Vec<(f64, f64, usize)> = Vec::new();
            for r in 0..b {
                let (mut c, mut s) = (1.0, 1.0);
                for j in 0..d {
                    c *= conf.q[r][j];
                    s *= conf.pi[r][j];
                    order.push((c, s, r));
                }
            }
            order.sort_unstable_by(|x, y| y.0.total_cmp(&x.0));
            let mut tokens = b as f64;
            let mut bestn = (tokens / curve.seconds_shape(bp, d as u32, Shape { verified: 0.0, drafting: b as f64 }, ctx, 0.0), 0usize);
            for (n, o) in order.iter().enumerate() {
                tokens += o.1;
                let g = tokens / curve.seconds_shape(bp, d as u32, Shape { verified: (n + 1) as f64, drafting: b as f64 }, ctx, 0.0);
                if g > bestn.0 {
                    bestn = (g, n + 1);
                }
            }
            if bestn.0 > best.0 {
                let mut l = vec![0u32; b];
                for o in &order[..bestn.1] {
                    l[o.2] += 1;
                }
                let mut c = Choice::lengths(d as u32, l);
                if all_draft {
                    // stop semantics: every request drafts d; tiny threshold keeps lengths as chosen
                    c.min_survival = Some(0.0);
                }
                best = (bestn.0, c);
            }
        }
        best.1
    });
    println!("  q-oracle all_draft={all_draft} steps {:?} verify {:?}", r.steps_histogram, r.verify_histogram);
    r.goodput
}

#[test]
#[ignore]
fn qprobe() {
    let regs = std::env::var("REGIMES").unwrap_or("mixed-64".into());
    let regs: Vec<&str> = regs.split(',').collect();
    let spec = SimSpec::standard();
    let opts = RunOptions { seed: 0, noise: spec.noise, skip_zero_step_draft_extend: false, confidence: spec.confidence };
    for r in Regime::every().filter(|r| regs.contains(&r.name)) {
        let w = r.generate(6000, 0);
        for (name, curve) in &spec.curves {
            if name == "cpu-like" { continue; }
            let (oracle, _) = specdial_core::sim::run::run_oracle(&w, curve, 7, &opts);
            let conf = specdial_core::sim::oracle::run_oracle_confidence(&w, curve, 7, &opts);
            let q = q_oracle(&w, curve, &opts, false);
            let qa = q_oracle(&w, curve, &opts, true);
            println!("{:15} {:16} q-oracle/oracle {:.3} q-oracle-all-draft/oracle {:.3} oracle-conf/oracle {:.3}", r.name, name, q / oracle.goodput, qa / oracle.goodput, conf.goodput / oracle.goodput);
        }
    }
}
