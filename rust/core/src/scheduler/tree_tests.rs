//! Tests of draft trees in the scheduler (issue 29, `scheduler/tree.rs`): the configuration's
//! checks, the tree plan's fields, and that scratch KV slots are counted, reserved and given
//! back across reports, aborts, abandoned plans and preemptions.

use super::tests::{config, fixed, full, run_all, step, tok};
use super::*;
use crate::decision::TreeShape;

/// Fixed `steps` with the tree `(topk, num_draft_tokens)` in SGLang's counting.
fn tree(cfg: SchedulerConfig, steps: u32, topk: u32, m: u32) -> Scheduler {
    let mut s = fixed(cfg, steps);
    s.set_draft_tree(topk, Some(m)).unwrap();
    s
}

fn field_of(e: SchedulerError) -> &'static str {
    match e {
        SchedulerError::InvalidConfig { field, .. } => field,
        other => panic!("not a config error: {other:?}"),
    }
}

#[test]
fn tree_checks_name_the_field_and_count_the_root_as_sglang() {
    // SGLang's counting: 9 verified tokens at top-k 4 = the root plus 8 nodes.
    let t = validate_tree(3, 4, Some(9)).unwrap().unwrap();
    assert_eq!((t.topk, t.num_draft_tokens), (4, 8));
    // A chain: top-k 1 with steps + 1 (or nothing) is no tree; anything else is refused.
    assert_eq!(validate_tree(3, 1, Some(4)).unwrap(), None);
    assert_eq!(validate_tree(3, 1, None).unwrap(), None);
    assert_eq!(validate_tree(0, 1, Some(1)).unwrap(), None);
    let e = validate_tree(3, 1, Some(3)).unwrap_err();
    assert!(
        e.to_string().contains("speculative_num_steps + 1 = 4"),
        "{e}"
    );
    assert_eq!(field_of(e), "speculative_num_draft_tokens");
    for (steps, topk, m, field) in [
        (3, 0, Some(4), "speculative_eagle_topk"),
        (3, 65, Some(9), "speculative_eagle_topk"),
        (0, 2, Some(2), "speculative_eagle_topk"),
        (3, 2, None, "speculative_num_draft_tokens"),
        (3, 2, Some(3), "speculative_num_draft_tokens"), // 2 nodes < depth 3
        (3, 2, Some(12), "speculative_num_draft_tokens"), // 11 > 2 + 2 * 4 = 10 candidates
        (7, 8, Some(66), "speculative_num_draft_tokens"), // 65 nodes > 64
    ] {
        let e = validate_tree(steps, topk, m).unwrap_err();
        assert_eq!(field_of(e.clone()), field, "{steps} {topk} {m:?}: {e}");
    }
    // The bounds themselves are accepted.
    assert!(validate_tree(3, 2, Some(4)).unwrap().is_some());
    assert!(validate_tree(3, 2, Some(11)).unwrap().is_some());
    assert!(validate_tree(7, 8, Some(65)).unwrap().is_some());
    assert_eq!(
        [
            max_tree_nodes(1, 4),
            max_tree_nodes(3, 2),
            max_tree_nodes(5, 1)
        ],
        [4, 10, 5]
    );
    // One request of context_length 64 (16 pages of 4) and 8 scratch slots need 18 pages.
    let mut small = fixed(
        SchedulerConfig {
            context_length: 64,
            ..config(17, 4)
        },
        3,
    );
    let e = small.set_draft_tree(4, Some(9)).unwrap_err();
    assert!(e.to_string().contains("more than num_pages = 17"), "{e}");
    // 4 nodes but top-k 4 at depth 3 feeds the drafter 4 * 2 = 8 frontier nodes: the scratch
    // is max(N, K (D - 1)) = 8 slots, two pages, so it does not fit either.
    let e = small.set_draft_tree(4, Some(5)).unwrap_err();
    assert!(e.to_string().contains("more than num_pages = 17"), "{e}");
    small.set_draft_tree(2, Some(5)).unwrap(); // max(4, 2 * 2) = 4 slots: one page
    // Deeper steps feed the drafter more frontier nodes: at depth 4, 2 * 3 = 6 slots, two
    // pages, beside the request's 16 do not fit 17 (found by scheduler_props: the admission
    // then waited for pages forever); refused naming the tree, the steps unchanged.
    let e = small.set_fixed_steps(Some(4)).unwrap_err();
    assert!(e.to_string().contains("at depth 4") && e.to_string().contains("num_pages = 17"), "{e}");
    assert_eq!(field_of(e), "speculative_num_draft_tokens");
    assert_eq!(small.max_steps(), 3);
    small.set_fixed_steps(Some(2)).unwrap(); // shallower always fits
    assert_eq!(scratch_per_request(3, 4, 4), 8);
    assert_eq!(scratch_per_request(3, 2, 6), 6);
    // The scheduler refuses and stays unchanged.
    let mut s = fixed(config(64, 4), 3);
    assert!(s.set_draft_tree(2, Some(3)).is_err());
    assert_eq!((s.draft_tree(), s.draft_tree_flags()), (None, (1, 4)));
}

#[test]
fn fixed_tree_plans_carry_topk_nodes_and_scratch_slots() {
    let mut s = tree(config(64, 4), 3, 4, 9);
    s.set_plan_kv_layout(true);
    assert_eq!(s.draft_tree_flags(), (4, 9));
    s.add_request(vec![7; 5], 20, vec![], false).unwrap();
    s.add_request(vec![8; 2], 20, vec![], false).unwrap();
    let (prefill, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (
            prefill.tree_topk,
            prefill.num_draft_tokens,
            prefill.scratch_loc.len()
        ),
        (1, 0, 0)
    );
    let used_before = s.pool().num_used_pages();
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(
        (plan.steps, plan.tree_topk, plan.num_draft_tokens),
        (3, 4, 8)
    );
    assert_eq!(plan.graph_key(), GraphKey::Tree(3, 4, 8, 2));
    // KV as a chain of 3 steps (as without a tree) ...
    assert_eq!((plan.qo_lens.clone(), plan.out_loc.len()), (vec![4, 4], 8));
    assert_eq!(plan.steps_per_request, vec![3, 3]);
    // ... plus 8 scratch slots per request: real pool slots, disjoint from every request's KV.
    assert_eq!(plan.scratch_loc.len(), 16);
    let mut all: Vec<i64> = plan
        .scratch_loc
        .iter()
        .chain(&plan.kv_indices)
        .copied()
        .collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 16 + plan.kv_indices.len());
    assert!(all
        .iter()
        .all(|&x| x >= 0 && (x as u64) < s.pool().num_kv_slots()));
    // 2 * 8 scratch slots = 4 pages of 4, besides the chains' new pages.
    let chain_pages: u64 = 2; // request 0: 5 + 4 = 9 tokens (3 pages, had 2); 1: 2 + 4 = 6 (2, had 1)
    assert_eq!(
        u64::from(s.pool().num_used_pages() - used_before),
        chain_pages + 4
    );
    s.check_invariants().unwrap();
    // The report frees the scratch run: what is left is the chains' KV.
    let tokens: Vec<i64> = (0..2)
        .map(|b| tok(b, plan.positions[b as usize] + 1))
        .collect();
    s.report(&tokens, &[0, 1, 2], Some(&[0, 0])).unwrap();
    s.check_invariants().unwrap();
    assert!(!s.pool().has_request(tree::SCRATCH_OWNER));
    let finished = run_all(&mut s, &mut full);
    assert_eq!(finished.len(), 2);
}

#[test]
fn steps_zero_and_top_k_one_plan_chains_without_scratch() {
    let mut s = tree(config(64, 4), 3, 2, 5);
    s.set_fixed_steps(Some(0)).unwrap();
    s.add_request(vec![7; 5], 6, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (plan.steps, plan.tree_topk, plan.num_draft_tokens),
        (0, 1, 0)
    );
    assert_eq!(
        (plan.scratch_loc.len(), plan.graph_key()),
        (0, GraphKey::Chain(0, 1))
    );
    // Back at 2 steps: a tree of depth 2 with the configured 4 nodes.
    s.set_fixed_steps(Some(2)).unwrap();
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (
            plan.steps,
            plan.tree_topk,
            plan.num_draft_tokens,
            plan.scratch_loc.len()
        ),
        (2, 2, 4, 4)
    );
    // Depth 5 cannot hold 4 nodes: refused, naming the node count; the steps stay.
    let e = s.set_fixed_steps(Some(5)).unwrap_err();
    assert_eq!(field_of(e), "speculative_num_draft_tokens");
    assert_eq!(s.fixed_steps(), Some(2));
    // Top-k 1 clears the tree: chains, `num_draft_tokens` = steps.
    s.set_draft_tree(1, Some(3)).unwrap();
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (
            plan.tree_topk,
            plan.num_draft_tokens,
            plan.scratch_loc.len()
        ),
        (1, 2, 0)
    );
    run_all(&mut s, &mut full);
}

#[test]
fn admission_reserves_scratch_pages_for_every_decoding_request() {
    // 16 pages of 4; 7-token requests (3-token prompts + the first decode at steps 3) take 2
    // pages each: 8 fit as chains, 4 with 8 scratch slots (2 pages) each.
    let admitted = |topk: u32, m: u32| {
        let mut s = tree(
            SchedulerConfig {
                context_length: 32,
                ..config(16, 4)
            },
            3,
            topk,
            m,
        );
        for i in 0..8 {
            s.add_request(vec![i + 1; 3], 30, vec![], false).unwrap();
        }
        let (plan, _) = step(&mut s, &mut full).unwrap();
        assert_eq!(plan.kind, PlanKind::Prefill);
        let n = plan.batch_size();
        // The decode after the admission never preempts what was just prefilled.
        let (plan, _) = step(&mut s, &mut full).unwrap();
        assert_eq!(
            (plan.kind, plan.batch_size(), plan.preempted.len()),
            (PlanKind::Decode, n, 0)
        );
        assert_eq!(
            plan.scratch_loc.len(),
            n * (m as usize - 1) * usize::from(topk > 1)
        );
        run_all(&mut s, &mut full);
        n
    };
    assert_eq!(admitted(1, 4), 8);
    assert_eq!(admitted(4, 9), 4);
}

#[test]
fn aborts_and_abandoned_plans_give_scratch_slots_back() {
    let mut s = tree(config(64, 4), 3, 3, 7);
    for i in 0..3 {
        s.add_request(vec![i + 1; 6], 20, vec![], false).unwrap();
    }
    step(&mut s, &mut full).unwrap();
    // Aborted while the tree plan is in flight: its pages go now, the scratch run at the report.
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.scratch_loc.len(), 18);
    s.abort(1).unwrap();
    s.check_invariants().unwrap();
    let tokens: Vec<i64> = (0..3)
        .map(|b| tok(b, plan.positions[b as usize] + 1))
        .collect();
    let out = s.report(&tokens, &[0, 1, 2, 3], None).unwrap();
    assert_eq!(out.new_offsets, vec![0, 1, 1, 2]);
    s.check_invariants().unwrap();
    // An abandoned plan frees its scratch run with its requests.
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.scratch_loc.len(), 12);
    assert_eq!(s.abandon_plan().unwrap().len(), 2);
    s.check_invariants().unwrap();
    assert_eq!(s.pool().num_used_pages(), 0);
}

#[test]
fn preemption_with_trees_loses_no_page_and_keeps_outputs() {
    // 10 pages of 4; 3 requests of 7-token prompts grow until the pool is short.
    let cfg = SchedulerConfig {
        context_length: 24,
        ..config(10, 4)
    };
    let mut reference = fixed(
        SchedulerConfig {
            num_pages: 64,
            ..cfg.clone()
        },
        2,
    );
    let mut s = tree(cfg, 2, 2, 4);
    for sched in [&mut s, &mut reference] {
        for i in 0..3 {
            sched
                .add_request(vec![i + 1; 7], 12, vec![], false)
                .unwrap();
        }
    }
    let mut trees = 0;
    let mut finished = vec![];
    while let Some((plan, out)) = step(&mut s, &mut full) {
        trees += usize::from(plan.tree_topk == 2);
        assert_eq!(
            plan.scratch_loc.len(),
            plan.batch_size() * 3 * usize::from(plan.tree_topk == 2)
        );
        finished.extend(out.finished);
    }
    assert!(trees > 0);
    assert!(
        s.stats().preemptions >= 1,
        "the pool was meant to run short"
    );
    assert_eq!(s.pool().num_used_pages(), 0);
    let reference = run_all(&mut reference, &mut full);
    let ids = |f: &[Finished]| {
        let mut v: Vec<(u64, u64)> = f.iter().map(|f| (f.request_id, f.output_len)).collect();
        v.sort_unstable();
        v
    };
    assert_eq!(ids(&finished), ids(&reference));
}

#[test]
fn prefix_cache_and_trees_share_the_pool() {
    let cfg = SchedulerConfig {
        enable_prefix_caching: true,
        ..config(32, 4)
    };
    let mut s = tree(cfg, 3, 2, 6);
    for i in 0..6 {
        s.add_request(vec![5, 5, 5, 5, 5, 5, 5, 5, i + 1], 10, vec![], false)
            .unwrap();
    }
    let mut partial = |id: i64, steps_r: i64| (id + steps_r) % (steps_r + 1);
    let mut trees = 0;
    while let Some((plan, _)) = step(&mut s, &mut partial) {
        trees +=
            usize::from(plan.scratch_loc.len() == plan.batch_size() * 5 && plan.tree_topk == 2);
    }
    assert!(trees > 0 && !s.has_unfinished());
    // Only the cache holds pages now: no scratch slot stayed behind.
    assert!(s.stats().cached_tokens > 0);
    assert_eq!(s.pool().num_used_pages(), s.pool().num_cache_only_pages());
}

#[test]
fn a_tree_decision_reaches_the_plan_as_a_tree() {
    // What a tree strategy returns (H4's entry): the scheduler builds the plan from it.
    let shape = TreeShape {
        depth: 3,
        topk: 4,
        num_draft_tokens: 8,
    };
    let c = validate_tree(3, 4, Some(9)).unwrap().unwrap();
    assert_eq!(c.at_depth(3), Some(shape));
    assert_eq!(c.at_depth(0), None);
}

#[test]
fn the_trace_records_the_tree_shape_of_tree_iterations_only() {
    // A fixed tree (depth 3, topk 4, 8 nodes), then the same scheduler's chain (steps 0 makes
    // no tree): the trace line of a tree iteration carries (topk, N), a chain's does not.
    let cfg = SchedulerConfig { record_trace: true, ..config(64, 4) };
    let mut s = tree(cfg, 3, 4, 9);
    s.add_request(vec![7; 5], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap(); // prefill
    let (plan, _) = step(&mut s, &mut |_, _| 2).unwrap();
    assert_eq!((plan.tree_topk, plan.num_draft_tokens), (4, 8));
    let trace = s.drain_trace();
    assert_eq!(trace.len(), 1);
    assert_eq!(trace[0].tree, Some((4, 8)));
    assert_eq!(
        trace[0].to_json(),
        r#"{"accepted":[2],"batch_size":1,"context_tokens":5,"steps":3,"tree_nodes":8,"tree_topk":4}"#
    );
    s.set_fixed_steps(Some(0)).unwrap();
    step(&mut s, &mut full).unwrap();
    let trace = s.drain_trace();
    assert_eq!(trace.len(), 1);
    assert_eq!((trace[0].steps, trace[0].tree), (0, None));
    assert!(!trace[0].to_json().contains("tree"));
}

#[test]
fn a_tree_reports_kept_node_counts_up_to_its_nodes() {
    // Per-request node budgets (issue 29 item 5): a tree iteration's `verified` are the nodes
    // each request kept, up to N (8 here), above the depth (3); above N is refused by name.
    let mut s = tree(config(64, 4), 3, 4, 9);
    s.add_request(vec![7; 5], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap(); // prefill
    let report = |s: &mut Scheduler, verified: &[i64]| {
        let plan = s.schedule().unwrap().unwrap();
        let (id, l) = (plan.request_ids[0], plan.positions[0]);
        let tokens: Vec<i64> = (l + 1..=l + 3).map(|p| tok(id, p)).collect();
        let extras = ReportExtras { verified: Some(verified), ..Default::default() };
        s.report_with(&tokens, &[0, 3], Some(&[2]), extras)
    };
    report(&mut s, &[6]).unwrap();
    s.check_invariants().unwrap();
    let e = report(&mut s, &[9]).unwrap_err();
    assert!(matches!(e, SchedulerError::InvalidReport { field: "verified", .. }), "{e:?}");
}

#[test]
fn a_tree_report_without_kept_counts_verified_all_its_nodes() {
    // A tree whose report carries no `verified` (no node budget) verified its N nodes (8), not
    // its depth (3): the draft-token counter (and the policy's report) count 8, and the
    // per-position acceptance counts depths (3 positions), never nodes.
    let mut s = tree(config(64, 4), 3, 4, 9);
    s.add_request(vec![7; 5], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap(); // prefill
    let plan = s.schedule().unwrap().unwrap();
    let (id, l) = (plan.request_ids[0], plan.positions[0]);
    let tokens: Vec<i64> = (l + 1..=l + 3).map(|p| tok(id, p)).collect();
    s.report(&tokens, &[0, 3], Some(&[2])).unwrap();
    let st = s.stats();
    assert_eq!((st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens), (1, 8, 2));
    assert_eq!(st.spec_accepted_per_pos, vec![1, 1, 0]);
    // with kept counts: those nodes
    let plan = s.schedule().unwrap().unwrap();
    let (id, l) = (plan.request_ids[0], plan.positions[0]);
    let tokens: Vec<i64> = (l + 1..=l + 2).map(|p| tok(id, p)).collect();
    let extras = ReportExtras { verified: Some(&[5]), ..Default::default() };
    s.report_with(&tokens, &[0, 2], Some(&[1]), extras).unwrap();
    let st = s.stats();
    assert_eq!((st.spec_num_draft_tokens, st.spec_accepted_per_pos.clone()), (13, vec![2, 1, 0]));
    s.check_invariants().unwrap();
}

#[test]
fn a_tree_reports_one_path_confidence_per_verified_node() {
    // draft_probs of a tree: sum(verified) values (N = 8 each without verified), checked by
    // name against that count, not the chain's sum(steps_per_request) (3 here).
    let mut s = tree(config(64, 4), 3, 4, 9);
    s.add_request(vec![7; 5], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap(); // prefill
    let report = |s: &mut Scheduler, probs: &[f64], verified: Option<&[i64]>| {
        let plan = s.schedule().unwrap().unwrap();
        let (id, l) = (plan.request_ids[0], plan.positions[0]);
        let tokens: Vec<i64> = (l + 1..=l + 2).map(|p| tok(id, p)).collect();
        let extras = ReportExtras { draft_probs: Some(probs), verified, ..Default::default() };
        let out = s.report_with(&tokens, &[0, 2], Some(&[1]), extras);
        if out.is_err() {
            // refused: the plan stays in flight, unchanged; a valid report clears it
            s.report(&tokens, &[0, 2], Some(&[1])).unwrap();
        }
        out
    };
    report(&mut s, &[0.9, 0.5, 0.4, 0.3, 0.2], Some(&[5])).unwrap();
    report(&mut s, &[0.5; 8], None).unwrap();
    let e = report(&mut s, &[0.9, 0.5, 0.4], None).unwrap_err();
    assert!(matches!(&e, SchedulerError::InvalidReport { field: "draft_probs", message } if message.contains("sum(verified) = 8")), "{e:?}");
    let e = report(&mut s, &[0.9, 0.5, 0.4], Some(&[5])).unwrap_err();
    assert!(matches!(&e, SchedulerError::InvalidReport { field: "draft_probs", message } if message.contains("= 5")), "{e:?}");
    let e = report(&mut s, &[0.9, 1.5, 0.4, 0.3, 0.2], Some(&[5])).unwrap_err();
    assert!(matches!(&e, SchedulerError::InvalidReport { field: "draft_probs", .. }), "{e:?}");
    s.check_invariants().unwrap();
}
