//! Unit tests of the prefix cache's scheduler rules (`cache.rs`).

use super::*;

use super::tests::{fixed, tok};

/// The scheduler tests' config with the cache on, pages of 4 tokens, a 48-token context.
fn config(num_pages: u32) -> SchedulerConfig {
    SchedulerConfig {
        context_length: 48,
        enable_prefix_caching: true,
        ..super::tests::config(num_pages, 4)
    }
}

/// One iteration of the fake model; decode accepts `accept` drafts (capped by the plan).
fn step(s: &mut Scheduler, accept: i64) -> Option<(Plan, ReportOutcome)> {
    let plan = s.schedule().unwrap()?;
    let (mut tokens, mut offsets, mut accepted) = (vec![], vec![0i64], vec![]);
    for b in 0..plan.batch_size() {
        let id = plan.request_ids[b];
        if plan.kind == PlanKind::Prefill {
            if plan.sample_first[b] == 1 {
                tokens.push(tok(id, plan.kv_lens[b]));
            }
        } else {
            let a = accept.min(plan.steps_per_request[b]);
            let l = plan.positions[b];
            tokens.extend((l + 1..=l + a + 1).map(|p| tok(id, p)));
            accepted.push(a);
        }
        offsets.push(tokens.len() as i64);
    }
    let acc = (plan.kind == PlanKind::Decode).then_some(&accepted[..]);
    let out = s.report(&tokens, &offsets, acc).unwrap();
    s.check_invariants().unwrap();
    Some((plan, out))
}

fn run_all(s: &mut Scheduler, accept: i64) -> Vec<Finished> {
    let mut finished = vec![];
    while let Some((_, out)) = step(s, accept) {
        finished.extend(out.finished);
    }
    assert!(!s.has_unfinished());
    finished
}

fn prompt(n: usize, tail: i64) -> Vec<i64> {
    let mut p: Vec<i64> = (0..n as i64).map(|i| 200 + i).collect();
    *p.last_mut().unwrap() = tail;
    p
}

#[test]
fn a_later_request_takes_the_cached_prefix_pages() {
    let mut s = fixed(config(32), 2);
    let a = s.add_request(prompt(10, 1), 3, vec![], false).unwrap();
    run_all(&mut s, 2);
    // a's 10 prompt tokens and 2 outputs with KV: 12 positions = 3 full pages
    assert_eq!(s.cached_pages(), 3);
    let b = s.add_request(prompt(10, 2), 3, vec![], false).unwrap();
    let (plan, _) = step(&mut s, 0).unwrap();
    // 2 pages match (the third differs in token 9); b prefills positions 8 and 9 only
    assert_eq!(plan.cached_lens, vec![8]);
    assert_eq!(plan.qo_lens, vec![2]);
    assert_eq!(plan.cached_ids, prompt(10, 2)[..8].to_vec());
    assert_eq!(plan.cached_kv_indices, (0..8).collect::<Vec<i64>>()); // a's pages 0 and 1
    assert_eq!(&s.pool().pages(b).unwrap()[..2], &[0, 1]);
    let fin = run_all(&mut s, 2);
    assert_eq!(fin[0].cached_tokens, 8);
    let st = s.stats();
    assert_eq!((st.prompt_tokens, st.cached_tokens), (20, 8));
    assert_eq!(st.prefill_tokens, 12);
    assert!(a != b);
}

#[test]
fn a_full_hit_still_prefills_the_last_token() {
    let mut s = fixed(config(32), 0);
    s.add_request(prompt(8, 1), 1, vec![], false).unwrap();
    run_all(&mut s, 0);
    s.add_request(prompt(8, 1), 1, vec![], false).unwrap();
    let (plan, _) = step(&mut s, 0).unwrap();
    assert_eq!((plan.cached_lens[0], plan.qo_lens[0]), (4, 4));
}

#[test]
fn one_context_several_continuations_prefills_the_context_once() {
    // lm-eval's loglikelihood pattern: all submitted together
    let mut s = fixed(config(64), 0);
    for tail in 1..=3 {
        s.add_request(prompt(13, tail), 1, vec![], false).unwrap();
    }
    let (first, _) = step(&mut s, 0).unwrap();
    assert_eq!(first.batch_size(), 1, "the others wait for its pages");
    let (second, _) = step(&mut s, 0).unwrap();
    assert_eq!(second.cached_lens, vec![12, 12]);
    run_all(&mut s, 0);
    let st = s.stats();
    assert_eq!((st.prompt_tokens, st.cached_tokens, st.prefill_tokens), (39, 24, 15));
}

#[test]
fn rejected_drafts_are_never_cached() {
    let mut s = fixed(config(32), 5);
    let id = s.add_request(prompt(3, 1), 20, vec![], false).unwrap();
    step(&mut s, 0).unwrap(); // prefill: 3 positions
    step(&mut s, 0).unwrap(); // verify writes 3..=8, keeps 3 only (kv 4: page 0 full)
    assert_eq!(s.pool().len(id), Ok(4));
    assert_eq!(s.cached_pages(), 1);
    step(&mut s, 1).unwrap(); // keeps 4..=5
    assert_eq!(s.cached_pages(), 1);
    let pages = s.pool().pages(id).unwrap().to_vec();
    assert_eq!(s.pool().holders(pages[0]), Some(2));
    assert_eq!(s.pool().holders(pages[1]), None);
}

#[test]
fn pages_the_drafter_has_not_covered_are_cached_unmarked_then_marked() {
    let mut s = fixed(config(32), 0);
    let a = s.add_request(prompt(3, 1), 30, vec![], false).unwrap();
    step(&mut s, 0).unwrap(); // prefill with the drafter
    for _ in 0..6 {
        step(&mut s, 0).unwrap(); // steps 0: the drafter falls behind
    }
    assert_eq!(s.pool().len(a), Ok(9));
    assert_eq!(s.requests[&(a)].draft_lag, 6);
    // the target's KV of positions 0..8 is committed: 2 pages cached, without the drafter's
    assert_eq!(s.cached_pages(), 2);
    assert_eq!(s.requests[&(a)].cache_drafter_pages, 0, "positions 3.. have no drafter KV yet");
    s.set_fixed_steps(Some(2)).unwrap();
    step(&mut s, 2).unwrap(); // drafting catches up: 12 committed, all drafter-covered
    assert_eq!(s.cached_pages(), 3);
    assert_eq!(s.requests[&(a)].cache_drafter_pages, 3);
}

/// The adaptive engine's missing prefix hits: a request prefilled while decoding ran steps 0
/// (its drafter prefill deferred) that decodes at steps 0 to its end never had a drafter pass,
/// yet its committed prompt and output pages are cached when it finishes; a request hitting
/// them is told none carries the drafter's KV, and once its drafter has caught up over them
/// the next hit is told they all do.
#[test]
fn a_request_finishing_behind_its_drafter_leaves_its_pages_cached() {
    let mut s = fixed(config(32), 0);
    s.add_request(prompt(3, 2), 2, vec![], false).unwrap();
    run_all(&mut s, 0); // the last decode ran steps 0
    let before = s.cached_pages();
    s.add_request(prompt(13, 1), 6, vec![], false).unwrap();
    let (plan, _) = step(&mut s, 0).unwrap();
    assert!(!plan.draft_prefill, "the drafter prefill is deferred");
    run_all(&mut s, 0); // plain decodes to the end: the drafter never ran
    // committed: 13 prompt + 5 outputs = 18 positions, 4 full pages
    assert_eq!(s.cached_pages() - before, 4);
    let c = s.add_request(prompt(13, 1), 6, vec![], false).unwrap();
    let (plan, _) = step(&mut s, 0).unwrap();
    assert_eq!((plan.cached_lens.clone(), plan.cached_draft_lens.clone()), (vec![12], vec![0]));
    assert_eq!(s.requests[&c].draft_lag, 13, "the hit and the deferred prefill");
    s.set_fixed_steps(Some(2)).unwrap();
    step(&mut s, 1).unwrap(); // a drafting iteration catches c's drafter up over the hit
    assert_eq!(s.requests[&c].cache_drafter_pages, 3);
    run_all(&mut s, 1);
    s.add_request(prompt(13, 1), 6, vec![], false).unwrap();
    let (plan, _) = step(&mut s, 0).unwrap();
    assert!(plan.draft_prefill);
    assert_eq!((plan.cached_lens.clone(), plan.cached_draft_lens.clone()), (vec![12], vec![12]));
}

#[test]
fn max_cached_tokens_caps_the_hit() {
    let mut s = fixed(config(32), 0);
    s.add_request(prompt(13, 1), 1, vec![], false).unwrap();
    run_all(&mut s, 0);
    s.add_request_limited(prompt(13, 1), 1, vec![], false, Some(7)).unwrap();
    let (plan, _) = step(&mut s, 0).unwrap();
    assert_eq!(plan.cached_lens, vec![4]);
}

#[test]
fn eviction_comes_before_preemption() {
    // 12 pages of 4: each request holds up to 3 pages and leaves 2 full ones to the cache
    let mut s = fixed(config(12), 1);
    for tail in 0..7 {
        let mut p = prompt(9, 1);
        p[0] = 300 + tail; // nothing shared
        s.add_request(p, 2, vec![], false).unwrap();
        run_all(&mut s, 1);
    }
    let st = s.stats();
    assert_eq!(st.preemptions, 0);
    assert!(st.evicted_pages > 0, "{st:?}");
    assert!(st.cached_pages <= 12);
    assert_eq!(s.pool().num_held_pages(), 0);
}

#[test]
fn preempted_requests_resume_from_their_own_cached_pages() {
    let mut s = fixed(config(12), 3);
    for i in 0..4 {
        let mut p = prompt(5, 1);
        p[0] = 400 + i;
        s.add_request(p, 30, vec![], false).unwrap();
    }
    let fin = run_all(&mut s, 3);
    assert_eq!(fin.len(), 4);
    for f in &fin {
        assert_eq!(f.output_len, 30);
    }
    assert!(s.stats().preemptions > 0);
}

#[test]
fn flush_frees_every_cached_page_once_idle() {
    let mut s = fixed(config(32), 0);
    s.add_request(prompt(9, 1), 2, vec![], false).unwrap();
    run_all(&mut s, 0);
    assert_eq!(s.cached_pages(), 2);
    s.add_request(prompt(9, 1), 2, vec![], false).unwrap();
    assert!(!s.flush_cache());
    assert_eq!(s.cached_pages(), 2);
    run_all(&mut s, 0);
    assert!(s.flush_cache());
    assert_eq!((s.cached_pages(), s.pool().num_used_pages()), (0, 0));
    s.check_invariants().unwrap();
}

#[test]
fn off_caches_nothing() {
    let mut s = fixed(SchedulerConfig { enable_prefix_caching: false, ..config(32) }, 0);
    for _ in 0..2 {
        s.add_request(prompt(9, 1), 2, vec![], false).unwrap();
    }
    run_all(&mut s, 0);
    let st = s.stats();
    assert_eq!((st.cached_pages, st.cached_tokens, st.prefill_tokens), (0, 0, 18));
    assert_eq!(s.pool().num_used_pages(), 0);
}

#[test]
fn longest_cached_prefix_is_admitted_first() {
    // room for one request per prefill plan: the order is visible
    let mut s = fixed(SchedulerConfig { max_prefill_tokens: 12, ..config(64) }, 0);
    s.add_request(prompt(13, 1), 1, vec![], false).unwrap();
    run_all(&mut s, 0);
    let mut other = prompt(13, 1);
    other[0] = 999;
    let miss = s.add_request(other, 1, vec![], false).unwrap();
    let partial = s.add_request(prompt(6, 1), 1, vec![], false).unwrap(); // 1 page cached
    let hit = s.add_request(prompt(13, 2), 1, vec![], false).unwrap(); // 3 pages cached
    let mut order = vec![];
    while let Some((plan, _)) = step(&mut s, 0) {
        for &i in &plan.request_ids {
            if !order.contains(&(i as u64)) {
                order.push(i as u64);
            }
        }
    }
    assert_eq!(order, vec![hit, partial, miss]);
}
