//! Prints the policy simulator's table (development aid): `cargo run --release --example simulate [iterations] [regime]`.
use specdial_core::sim::{run_all, workload::Regime, SimSpec};

fn main() {
    let mut spec = SimSpec::standard();
    let args: Vec<String> = std::env::args().collect();
    if let Some(n) = args.get(1) {
        spec.segments = n.parse().expect("segments");
    }
    if let Some(x) = args.get(3) {
        spec.noise.sigma = x.parse().expect("sigma");
    }
    if let Some(x) = args.get(4) {
        spec.seed = x.parse().expect("seed");
    }
    if let Ok(x) = std::env::var("DRIFT") {
        spec.noise.drift = x.parse().expect("drift");
    }
    if let Ok(x) = std::env::var("INTERFERENCE") {
        spec.noise.interference = x.parse().expect("interference");
    }
    if let Some(j) = args.get(5) {
        spec.policies[0].1 = specdial_core::AdaptiveConfig::from_json(j).expect("config");
        spec.policies.truncate(1);
    }
    if let Some(r) = args.get(2).filter(|r| *r != "all") {
        spec.regimes = r.split(',').map(|x| Regime::named(x).expect("regime")).collect();
    }
    let t = std::time::Instant::now();
    let cases = run_all(&spec);
    println!("{:16} {:16} {:>7} {:>7} {:>7} {:>7} {:>9} {:>6} {:>6}", "regime", "curve", "goodput", "ema", "t_aware", "bestfix", "bestfix", "chg", "probes");
    let mut sum = 0.0;
    for c in &cases {
        let g = c.get("goodput").unwrap();
        println!(
            "{:16} {:16} {:7.3} {:7.3} {:7.3} {:7.3} {:>9} {:6} {:6}  hist {:?} oracle {:?}",
            c.regime, c.curve, c.ratio("goodput"), c.ratio("ema").max(0.0), c.ratio("throughput_aware").max(0.0),
            c.best_fixed().goodput / c.oracle.goodput, c.best_fixed().name, g.steps_changes, g.probes, g.steps_histogram, c.oracle.steps_histogram
        );
        sum += c.ratio("goodput");
    }
    println!("mean goodput/oracle {:.4}  ({:.1}s)", sum / cases.len() as f64, t.elapsed().as_secs_f64());
}
