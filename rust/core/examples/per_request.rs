//! Issue 28's simulator table (development aid): per-request vs batch-level `goodput`, the
//! per-request oracle, best fixed and `ema`, per (regime, curve):
//! `cargo run --release --example per_request [segments] [regimes|all|mixed] [curves]`.
use specdial_core::sim::{default_policies_with_per_request, run_all, workload::Regime, SimSpec, PER_REQUEST};

fn main() {
    let mut spec = SimSpec::standard();
    let args: Vec<String> = std::env::args().collect();
    if let Some(n) = args.get(1) {
        spec.segments = n.parse().expect("segments");
    }
    spec.regimes = match args.get(2).map(String::as_str) {
        None | Some("mixed") => Regime::MIXED.to_vec(),
        Some("all") => Regime::every().collect(),
        Some(r) => r.split(',').map(|x| Regime::named(x).expect("regime")).collect(),
    };
    if let Some(c) = args.get(3) {
        spec.curves.retain(|(n, _)| c.split(',').any(|x| x == n));
    }
    spec.policies = default_policies_with_per_request().into_iter().filter(|(n, _)| n != "throughput_aware").collect();
    let t = std::time::Instant::now();
    let cases = run_all(&spec);
    println!("{:14} {:16} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}", "regime", "curve", "pr/bat", "pr/orPR", "bat/orB", "pr/fix", "ema/bat", "orPR/orB");
    for c in &cases {
        let pr = c.get(PER_REQUEST).unwrap();
        let bat = c.get("goodput").unwrap();
        println!(
            "{:14} {:16} {:7.3} {:7.3} {:7.3} {:7.3} {:7.3} {:7.3}  vh {:?}",
            c.regime,
            c.curve,
            pr.goodput / bat.goodput,
            pr.goodput / c.oracle_per_request.as_ref().unwrap().goodput,
            bat.goodput / c.oracle.goodput,
            pr.goodput / c.best_fixed().goodput,
            c.get("ema").unwrap().goodput / bat.goodput,
            c.oracle_per_request.as_ref().unwrap().goodput / c.oracle.goodput,
            pr.verify_histogram,
        );
    }
    println!("({:.1}s)", t.elapsed().as_secs_f64());
}
