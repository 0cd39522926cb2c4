use specdial_core::sim::{per_request_config, curve::CostCurve, workload::Regime};
use specdial_core::{AdaptiveSpeculativeParams, Observation, AdaptiveConfig, VerifyShape};
use specdial_core::strategies::RequestVerify;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let regime = Regime::named(&args[1]).unwrap();
    let curve = CostCurve::named(&args[2]).unwrap();
    let per = args[3] == "pr";
    let w = regime.generate(3000, 0);
    let cfg: AdaptiveConfig = if per { per_request_config() } else { AdaptiveConfig::default_config() };
    let mut p = AdaptiveSpeculativeParams::new(3, cfg);
    let g: Vec<i64> = curve.graph_sizes().unwrap_or_default().iter().map(|&x| x as i64).collect();
    if !g.is_empty() { p.set_cuda_graph_bs(Some(&g)).unwrap(); }
    let mut x = 0.0f64; let mut it = 0;
    let mut rng = 12345u64;
    let mut rnd = || { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; (rng >> 11) as f64 / (1u64 << 53) as f64 };
    while (x as usize) < w.len() {
        let i = x as usize; it += 1;
        let ids: Vec<u64> = w.batch(i).iter().map(|&r| r as u64).collect();
        let d = p.decide_requests(ids.len() as i64, Some(w.context(i) as u64), None, Some(&ids)).unwrap();
        let lengths: Vec<u32> = match &d.verify { VerifyShape::PerRequest(l) => l.clone(), _ => vec![d.steps; ids.len()] };
        let shape = specdial_core::sim::curve::Shape::of(&lengths);
        let bp = d.graph_bs.unwrap_or(ids.len() as u32);
        let t = curve.seconds_shape(bp, d.steps, shape, w.context(i), 0.0);
        let acc: Vec<i64> = ids.iter().zip(&lengths).map(|(&r, &v)| { let a = w.requests[r as usize].alpha_at(i as u32); (0..v as usize).take_while(|&j| rnd() < a[j]).count() as i64 }).collect();
        let e: f64 = ids.iter().zip(&lengths).map(|(&r, &v)| w.requests[r as usize].expected_at(i as u32)[v as usize]).sum();
        if it % 100 == 1 {
            let gp = p.goodput().unwrap();
            let ld = gp.last_decision().unwrap();
            eprintln!("it {it} seg {i} D {} v {:?} t {:.5} e {:.2} rows {:?}", d.steps, &lengths[..lengths.len().min(8)], t, e, ld.candidates.iter().map(|c| (c.0, (c.1*1e5).round()/1e5, (c.2*100.0).round()/100.0)).collect::<Vec<_>>());
            let a = w.requests[ids[0] as usize].alpha_at(i as u32);
            eprintln!("   true alpha0 {:.2} shared {:?}", a[0], gp.acceptance_rates().iter().map(|x| (x*100.0).round()/100.0).collect::<Vec<_>>());
        }
        let obs = Observation { seconds: Some(t), context_tokens: Some(w.context(i) as u64), steps: Some(d.steps), catch_up_tokens: None };
        if per {
            let req: Vec<RequestVerify> = ids.iter().zip(&lengths).zip(&acc).map(|((&id, &v), &a)| RequestVerify { id, steps: v, accepted: a, draft_probs: None }).collect();
            p.on_verify_complete_requests(&req, obs).unwrap();
        } else {
            p.on_verify_complete_with(acc.clone(), ids.len() as i64, obs).unwrap();
        }
        x += e / ids.len() as f64;
    }
}
